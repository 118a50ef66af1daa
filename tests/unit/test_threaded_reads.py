"""Loads read on several threads (``checkpoint/io/threaded_reads.py``), in one process:
the same bytes as on one thread, every data file opened and validated once and read
through that descriptor by every thread, an error that names exactly what the threads
restored and is the same whatever their timing, and the thread count's rules."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe import CheckpointCorruptError
from shardsafe.checkpoint import LoadOptions, loading
from shardsafe.checkpoint.io import reader as reader_module
from shardsafe.checkpoint.io import threaded_reads
from shardsafe.checkpoint.io.reader import MAX_OPEN_FILES, CheckpointReader
from shardsafe.checkpoint.storage.locations import open_storage
from shardsafe.checkpoint.storage.spool import Spool

from .attacks.common import opens_with_flags
from .load_helpers import between_passes, flip, tensors

MODES = ["first", "inline"]
LAYERS = 8


def trained(seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(LAYERS)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 64)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (``torch.equal`` would call -0.0 and 0.0 equal)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bool((a.view(-1).view(torch.uint8) == b.view(-1).view(torch.uint8)).all())
    )


def pair(tied: bool) -> nn.Module:
    """Two bias-free 512x512 layers, the second's weight the first's if ``tied``."""
    model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.Linear(512, 512, bias=False))
    if tied:
        model[1].weight = model[0].weight
    return model


def save_untied_pair(path: Path) -> None:
    """An untied pair whose two weights differ (1.0 and 2.0), saved consolidated."""
    untied = pair(tied=False)
    with torch.no_grad():
        untied[0].weight.fill_(1.0)
        untied[1].weight.fill_(2.0)
    shardsafe.save(path, {"model": untied}, layout="consolidated")


UNTIED = "the checkpoint holds different values for them \\(it was saved untied\\)"
"""``strict=False``'s warning about tied keys saved untied (a strict load refuses them)."""


def load_untied(path: Path, state: dict[str, nn.Module], threads: int) -> None:
    """Load ``path`` (which holds tied keys untied) into ``state`` (tied) anyway."""
    with pytest.warns(UserWarning, match=UNTIED):
        shardsafe.load(path, state, verify="inline", read_threads=threads, strict=False)


@pytest.fixture
def reading_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, set[str]]]:
    """The names of the threads that ran each reader call during the test."""
    seen: dict[str, set[str]] = {"read": set(), "check": set(), "read_into": set()}
    for name in seen:
        original = getattr(CheckpointReader, name)

        def spy(
            self: CheckpointReader, *args: Any, _name: str = name, _f: Any = original, **kw: Any
        ) -> Any:
            seen[_name].add(threading.current_thread().name)
            return _f(self, *args, **kw)

        monkeypatch.setattr(CheckpointReader, name, spy)
    yield seen


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_threads_restore_the_same_bits_as_one(
    tmp_path: Path, mode: str, threads: int, reading_threads: dict[str, set[str]]
) -> None:
    model, opt = trained(0, 2)
    saved = tensors(model, opt)
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt}, layout="consolidated")
    stepped, stepped_opt = trained(1, 1)  # optimizer state exists: read in place
    fresh, fresh_opt = trained(2, 0)  # no optimizer state yet: read into new tensors
    for m, o in ((stepped, stepped_opt), (fresh, fresh_opt)):
        shardsafe.load(
            tmp_path / "c", {"model": m, "optimizer": o}, verify=mode, read_threads=threads
        )
        got = tensors(m, o)
        assert got.keys() == saved.keys()
        assert all(same(got[k], v) for k, v in saved.items())
    helpers = {name for names in reading_threads.values() for name in names} - {"MainThread"}
    passes = ["read", "read_into"] + (["check"] if mode == "first" else [])
    for name in passes:  # every pass ran on the calling thread, and on helpers if asked
        assert "MainThread" in reading_threads[name], name
        assert any(n.startswith("shardsafe-read") for n in reading_threads[name]) == (threads > 1)
    assert len(helpers) <= threads - 1


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_data_file_is_opened_once_and_read_by_every_thread(
    tmp_path: Path, threads: int
) -> None:
    model, opt = trained(0, 2)
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt}, layout="consolidated")
    files = sorted(p.name for p in (tmp_path / "c").glob("*.safetensors"))
    assert files == ["model.safetensors", "optimizer.safetensors"]
    fresh, fresh_opt = trained(1, 1)
    with opens_with_flags() as opened:
        shardsafe.load(
            tmp_path / "c", {"model": fresh, "optimizer": fresh_opt}, read_threads=threads
        )
    names = [os.path.basename(path) for path, _ in opened]
    assert {name: names.count(name) for name in files} == {name: 1 for name in files}


def rename_a_decoy_over(path: Path, unlink_first: bool = False, header: bool = False) -> None:
    """Replace the data file by a corrupted copy (a rename over it); with ``unlink_first``
    the original is unlinked first, which frees its inode number for the decoy; with
    ``header`` the decoy's header differs too."""
    data = path / "model.safetensors"
    raw = bytearray(data.read_bytes())
    for i in range(len(raw) // 2, len(raw)):
        raw[i] ^= 0xFF
    if header:
        raw[20] ^= 0x01
    if unlink_first:
        data.unlink()
    decoy = path / "decoy"
    decoy.write_bytes(bytes(raw))
    os.replace(decoy, data)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_file_renamed_over_between_the_passes_is_never_read(tmp_path: Path, threads: int) -> None:
    """Every thread reads the descriptor validated in the first pass: a decoy renamed
    over the file afterwards is not opened, and the load restores the checkpoint's bits."""
    path = tmp_path / "c"
    model, _ = trained(0, 0)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    shardsafe.save(path, {"model": model, "swap": between_passes(path)}, layout="consolidated")
    fresh, _ = trained(1, 0)
    swap = between_passes(path, rename_a_decoy_over)
    shardsafe.load(path, {"model": fresh, "swap": swap}, read_threads=threads)
    assert all(same(fresh.state_dict()[k], v) for k, v in saved.items())


@pytest.mark.parametrize(
    "bad",
    [
        "model/1.weight",  # early in file order: in the calling thread's run
        "optimizer/7.weight/exp_avg_sq",  # the last: in the other thread's run
    ],
)
def test_inline_error_says_exactly_what_the_threads_restored(tmp_path: Path, bad: str) -> None:
    model, opt = trained(0, 2)
    saved = tensors(model, opt)
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt}, layout="consolidated")
    flip(tmp_path / "c", bad)
    fresh, fresh_opt = trained(1, 1)
    before = tensors(fresh, fresh_opt)
    with pytest.raises(CheckpointCorruptError) as info:
        shardsafe.load(
            tmp_path / "c",
            {"model": fresh, "optimizer": fresh_opt},
            verify="inline",
            read_threads=2,
        )
    message = str(info.value)
    after = tensors(fresh, fresh_opt)
    restored = [k for k in after if k != bad and same(after[k], saved[k])]
    untouched = [k for k in after if k != bad and same(after[k], before[k])]
    assert sorted(restored + untouched + [bad]) == sorted(after)  # every other tensor is one
    assert not same(after[bad], saved[bad]) and not same(after[bad], before[bad])
    counts = re.search(r"On rank 0, (\d+) of the (\d+) tensors loaded in place hold", message)
    assert counts is not None, message
    assert (int(counts[1]), int(counts[2])) == (len(restored), len(after))
    assert f"'{bad}' is partly overwritten" in message
    assert f"the other {len(untouched)} keep their previous values" in message
    assert "checksum mismatch" in message and bad in message


@pytest.mark.parametrize("threads", [2, 4])
def test_the_earliest_bad_tensor_is_reported_whatever_the_timing(
    tmp_path: Path, threads: int
) -> None:
    model, opt = trained(0, 2)
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt}, layout="consolidated")
    flip(tmp_path / "c", "model/0.weight")  # the first run's
    flip(tmp_path / "c", "model/7.weight")  # the last run's
    for _ in range(5):
        fresh, fresh_opt = trained(1, 1)
        before = tensors(fresh, fresh_opt)
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as info:
            shardsafe.load(
                tmp_path / "c", {"model": fresh, "optimizer": fresh_opt}, read_threads=threads
            )
        assert "'model/0.weight'" in str(info.value) and "model/7.weight" not in str(info.value)
        after = tensors(fresh, fresh_opt)  # verify='first': nothing was restored
        assert all(same(after[k], v) for k, v in before.items())


def test_each_thread_keeps_within_the_buffer_budget(tmp_path: Path) -> None:
    """The pieces of 4 threads fit in half of the smallest buffer_bytes (1 MiB)."""
    model, opt = trained(0, 1)
    saved = tensors(model, opt)
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt})
    fresh, fresh_opt = trained(1, 1)
    pieces: list[int] = []
    original = CheckpointReader.fork

    def fork(self: CheckpointReader) -> CheckpointReader:
        pieces.append(self.piece_bytes)
        return original(self)

    CheckpointReader.fork = fork  # type: ignore[method-assign]
    try:
        shardsafe.load(
            tmp_path / "c",
            {"model": fresh, "optimizer": fresh_opt},
            buffer_bytes=1 << 20,
            read_threads=4,
        )
    finally:
        CheckpointReader.fork = original  # type: ignore[method-assign]
    assert pieces and all(4 * p <= 1 << 19 for p in pieces)
    assert all(same(tensors(fresh, fresh_opt)[k], v) for k, v in saved.items())


def test_default_threads_are_this_ranks_share_of_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert threaded_reads.default_threads(1) == threaded_reads.MAX_THREADS == 4
    assert threaded_reads.default_threads(8) == 2  # no LOCAL_WORLD_SIZE: the world is local
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun: 8 processes on this node
    assert threaded_reads.default_threads(64) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")  # more processes than CPUs: one thread
    assert threaded_reads.default_threads(64) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert threaded_reads.default_threads(3) == 4 and threaded_reads.default_threads(16) == 1


def test_runs_are_contiguous_and_about_equal_in_bytes() -> None:
    sizes = [10, 10, 10, 10, 40, 10, 10]
    runs = threaded_reads._runs(list(range(7)), sizes, 3)
    assert [i for run in runs for i in run] == list(range(7)) and len(runs) == 3
    assert [sum(sizes[i] for i in run) for run in runs] == [40, 40, 20]
    assert threaded_reads._runs([4], sizes, 3) == [[4]]
    assert threaded_reads._runs([], sizes, 3) == [[]]


def test_one_thread_for_object_stores_spools_and_more_files_than_stay_open() -> None:
    class Local:
        cheap_rereads = True

    class Remote:
        cheap_rereads = False

    opts = LoadOptions(read_threads=3)
    local: Any = Local()

    def never() -> int:
        raise AssertionError("files counted although one thread was certain")

    assert loading._threads(local, opts, None, 1, lambda: MAX_OPEN_FILES) == 3
    assert loading._threads(local, opts, None, 1, lambda: MAX_OPEN_FILES + 1) == 1
    assert loading._threads(Remote(), opts, None, 1, never) == 1  # type: ignore[arg-type]
    assert loading._threads(local, opts, Spool(), 1, never) == 1
    assert loading._threads(local, LoadOptions(read_threads=1), None, 1, never) == 1


def test_a_reader_that_records_into_a_spool_is_not_forked(tmp_path: Path) -> None:
    model, _ = trained(0, 0)
    shardsafe.save(tmp_path / "c", {"model": model})
    storage = open_storage(str(tmp_path / "c"))
    manifest = loading.read_manifest_from(storage)
    with (
        storage,
        CheckpointReader(storage, manifest, spool=Spool()) as reader,
        pytest.raises(ValueError, match="records into a spool reads on one thread"),
    ):
        reader.fork()


def test_read_threads_option_names_what_it_accepts() -> None:
    for bad in (0, 65, True, 2.0, "2"):
        with pytest.raises(
            ValueError,
            match=re.escape(f"read_threads={bad!r} must be a number of threads from 1 to 64"),
        ):
            LoadOptions(read_threads=bad)  # type: ignore[arg-type]
    assert LoadOptions().read_threads is None and LoadOptions(read_threads=64).read_threads == 64


@pytest.mark.parametrize("mode", MODES)
def test_tied_targets_are_filled_in_order_the_last_winning_as_in_load_state_dict(
    tmp_path: Path, mode: str
) -> None:
    """An untied checkpoint loaded into a tied model: both keys' bytes go into the same
    memory, one after the other, never by two threads at once (a torn mix, or a
    checksum computed over bytes another thread was writing)."""

    save_untied_pair(tmp_path / "c")
    for _ in range(5):
        tied = pair(tied=True)
        with pytest.warns(UserWarning, match=UNTIED):
            shardsafe.load(
                tmp_path / "c", {"model": tied}, verify=mode, read_threads=2, strict=False
            )
        assert bool((tied[0].weight == 2.0).all()) and tied[1].weight is tied[0].weight


def test_a_file_refused_before_any_byte_is_written_leaves_its_tensors_untouched(
    tmp_path: Path,
) -> None:
    """verify='inline' and a damaged header in the optimizer's file: its tensors are
    refused before anything is written into them, so none is called partly overwritten,
    and every tensor before them in file order is restored, whatever the threads."""
    model, opt = trained(0, 2)
    saved = tensors(model, opt)
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt}, layout="consolidated")
    data = tmp_path / "c" / "optimizer.safetensors"
    raw = bytearray(data.read_bytes())
    raw[20] ^= 0x01  # inside the JSON header: its CRC32 no longer matches the manifest's
    data.write_bytes(bytes(raw))
    for threads in (1, 2, 4):
        fresh, fresh_opt = trained(1, 1)
        before = tensors(fresh, fresh_opt)
        with pytest.raises(CheckpointCorruptError, match="damaged safetensors header") as info:
            shardsafe.load(
                tmp_path / "c",
                {"model": fresh, "optimizer": fresh_opt},
                verify="inline",
                read_threads=threads,
            )
        after = tensors(fresh, fresh_opt)
        models = [k for k in after if k.startswith("model/")]
        assert all(same(after[k], saved[k]) for k in models), threads
        assert all(same(after[k], before[k]) for k in after if k not in models), threads
        assert (
            f"On rank 0, {len(models)} of the {len(after)} tensors loaded in place hold the "
            "checkpoint's values"
        ) in str(info.value)
        assert (
            f"none is partly overwritten, and the other {len(after) - len(models)} keep their "
            "previous values"
        ) in str(info.value)


@pytest.mark.parametrize("header", [False, True])
@pytest.mark.parametrize("unlink_first", [False, True])
def test_a_file_closed_to_make_room_then_replaced_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unlink_first: bool, header: bool
) -> None:
    """With more data files than stay open (here 1 for 2), a file closed after the
    checking pass is opened again for the restoring pass: a decoy renamed over it
    meanwhile is refused by its identity before a byte is read (not even its header,
    which would be refused as damaged), even when the original was unlinked first so
    that the decoy may get its inode number (ext4 reuses it)."""
    monkeypatch.setattr(reader_module, "MAX_OPEN_FILES", 1)  # so the load reads on one thread
    path = tmp_path / "c"
    model, opt = trained(0, 1)
    saved = tensors(model, opt)
    state = {"model": model, "optimizer": opt, "swap": between_passes(path)}
    shardsafe.save(path, state, layout="consolidated")
    fresh, fresh_opt = trained(1, 1)
    before = tensors(fresh, fresh_opt)
    with pytest.raises(CheckpointCorruptError, match="was replaced during the load") as info:
        swap = between_passes(path, lambda p: rename_a_decoy_over(p, unlink_first, header))
        shardsafe.load(path, {"model": fresh, "optimizer": fresh_opt, "swap": swap})
    assert "model.safetensors" in str(info.value) and "nothing was read from the new one" in str(
        info.value
    )
    after = tensors(fresh, fresh_opt)
    for key, value in after.items():  # every tensor: untouched, or the checkpoint's
        assert same(value, before[key]) or same(value, saved[key]), key
    assert all(same(after[k], before[k]) for k in after if k.startswith("model/"))


def test_inference_tensors_are_filled_by_helper_threads_too(tmp_path: Path) -> None:
    """torch keeps inference mode per thread: the helpers run in the caller's, or copying
    into an inference tensor (a non-contiguous one goes through copy_) is refused."""

    class Buffers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i in range(8):
                self.register_buffer(f"b{i}", torch.zeros(128, 128).t())

    source = Buffers()
    for i in range(8):
        getattr(source, f"b{i}").fill_(i + 1)
    shardsafe.save(tmp_path / "c", {"model": source})
    with torch.inference_mode():
        target = Buffers()
        shardsafe.load(tmp_path / "c", {"model": target}, read_threads=2)
    assert all(bool((getattr(target, f"b{i}") == i + 1).all()) for i in range(8))


def test_tensors_with_rows_wider_than_a_piece_are_read_on_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each such read holds a buffer of a row: on one thread at a time, so threads never
    multiply it; and the checking pass streams them in pieces, whatever a row's size."""

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i in range(4):  # rows of 512 KiB, twice a 256 KiB read piece
                self.register_buffer(f"wide{i}", torch.zeros(2, 128 << 10).t().contiguous().t())
                self.register_buffer(f"narrow{i}", torch.zeros(256, 256))

    source = Wide()
    for i, buf in enumerate(source.buffers()):
        buf.fill_(i + 1)
    shardsafe.save(tmp_path / "c", {"model": source})
    pieces: dict[str, int] = {}
    original = CheckpointReader._piece

    def piece(self: CheckpointReader, nbytes: int) -> torch.Tensor:
        name = threading.current_thread().name
        pieces[name] = max(pieces.get(name, 0), nbytes)
        return original(self, nbytes)

    monkeypatch.setattr(CheckpointReader, "_piece", piece)
    target = Wide()
    shardsafe.load(tmp_path / "c", {"model": target}, read_threads=2)
    assert all(bool((buf == i + 1).all()) for i, buf in enumerate(target.buffers()))
    helpers = {name: n for name, n in pieces.items() if name != "MainThread"}
    assert helpers and max(helpers.values()) <= 256 << 10, pieces
    assert pieces["MainThread"] == 512 << 10  # one row of a wide tensor, on this thread only


class Items:
    """A stand-in for a reader in :func:`threaded_reads.run`'s own tests: forks are itself."""

    def fork(self) -> Items:
        return self

    def __enter__(self) -> Items:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("interrupted_on", ["calling", "helper"])
def test_an_interrupt_is_never_swallowed_by_an_earlier_items_error(interrupted_on: str) -> None:
    """A checksum error at item 1 and Ctrl-C at item 5: the interrupt propagates."""
    where = 5

    def work(_: Any, i: int) -> int:
        if i == 1:
            time.sleep(0.01)  # item 5 has started by now
            raise CheckpointCorruptError("checksum mismatch at item 1")
        if i == where:
            time.sleep(0.05)  # item 1's error is in by now
            raise KeyboardInterrupt
        return i

    home = (lambda i: i == where) if interrupted_on == "calling" else (lambda i: False)
    with pytest.raises(KeyboardInterrupt):
        threaded_reads.run(Items(), list(range(6)), work, threads=2, sizes=[1] * 6, home=home)  # type: ignore[arg-type]


def test_every_item_runs_once_and_an_error_stops_only_later_items() -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def work(_: Any, i: int) -> int:
        with lock:
            seen.append(i)
        if i == 7:
            raise CheckpointCorruptError("bad item 7")
        return i * i

    clean = threaded_reads.run(
        Items(), list(range(20)), lambda _, i: i * i, threads=4, sizes=[1] * 20
    )  # type: ignore[arg-type]
    assert clean.results == {i: i * i for i in range(20)} and not clean.failures
    outcome = threaded_reads.run(Items(), list(range(20)), work, threads=4, sizes=[1] * 20)  # type: ignore[arg-type]
    assert sorted(set(seen)) == sorted(seen) and set(range(8)) <= set(seen)  # once each
    assert set(outcome.failures) == {7} and set(outcome.results) == set(seen) - {7}
    with pytest.raises(CheckpointCorruptError, match="bad item 7"):
        outcome.raise_first()


def test_an_odd_local_world_size_falls_back_to_the_world_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "\N{SUPERSCRIPT TWO}")  # isdigit(), but not int()
    assert threaded_reads.default_threads(1) == 3 and threaded_reads.default_threads(3) == 1


def test_tied_weights_saved_tied_leave_the_other_tensors_threaded(
    tmp_path: Path, reading_threads: dict[str, set[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An embedding tied to the head, saved as itself (both keys, equal bytes): the two
    tied targets are filled by the calling thread, every other target still threaded."""
    model = nn.Sequential(nn.Embedding(256, 64), *[nn.Linear(64, 64) for _ in range(6)])
    head = nn.Linear(64, 256, bias=False)
    head.weight = model[0].weight
    state = {"model": nn.ModuleDict({"body": model, "head": head})}
    saved = {k: v.clone() for k, v in state["model"].state_dict().items()}
    shardsafe.save(tmp_path / "c", state)
    fresh_body = nn.Sequential(nn.Embedding(256, 64), *[nn.Linear(64, 64) for _ in range(6)])
    fresh_head = nn.Linear(64, 256, bias=False)
    fresh_head.weight = fresh_body[0].weight
    fresh = nn.ModuleDict({"body": fresh_body, "head": fresh_head})
    by_key: dict[str, set[str]] = {}
    original = CheckpointReader.read_into

    def spy(self: CheckpointReader, key: str, *args: Any, **kw: Any) -> None:
        by_key.setdefault(key, set()).add(threading.current_thread().name)
        original(self, key, *args, **kw)

    monkeypatch.setattr(CheckpointReader, "read_into", spy)
    shardsafe.load(tmp_path / "c", {"model": fresh}, read_threads=2)
    assert all(same(fresh.state_dict()[k], v) for k, v in saved.items())
    assert by_key["model/body.0.weight"] == by_key["model/head.weight"] == {"MainThread"}
    helpers = {key for key, names in by_key.items() if names != {"MainThread"}}
    assert helpers, by_key  # the untied targets were spread over the threads


@pytest.mark.parametrize("threads", [1, 2])
def test_a_tied_target_filled_before_its_twin_failed_is_called_partly_overwritten(
    tmp_path: Path, threads: int
) -> None:
    """Both keys of a tied weight go into the same memory: when the second fails its
    checksum part-way, the first (finished) no longer holds its own values either."""

    save_untied_pair(tmp_path / "c")
    flip(tmp_path / "c", "model/1.weight")
    tied = pair(tied=True)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as info:
        load_untied(tmp_path / "c", {"model": tied}, threads)
    assert (
        "On rank 0, 0 of the 2 tensors loaded in place hold the checkpoint's values, "
        "'model/0.weight', 'model/1.weight' are partly overwritten, and the other 0 keep"
    ) in str(info.value)


def test_wrapper_subclass_targets_load_on_threads(tmp_path: Path) -> None:
    """A wrapper tensor subclass (as torchao's and float8's are built) has no storage of
    its own: its memory is that of the tensors it wraps (``__tensor_flatten__``), and
    transposed, it is written through its own copy_."""
    from torch.testing._internal.two_tensor import TwoTensor

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i in range(4):
                self.register_buffer(f"b{i}", torch.full((64, 64), float(i + 1)))

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i in range(4):
                zeros = torch.zeros(64, 64)
                self.register_buffer(f"b{i}", TwoTensor(zeros, zeros.clone()).t())

    shardsafe.save(tmp_path / "c", {"model": Plain()})
    target = Wrapped()
    shardsafe.load(tmp_path / "c", {"model": target}, read_threads=2)
    for i in range(4):
        buf = getattr(target, f"b{i}")
        assert bool((buf.a == i + 1).all()) and bool((buf.b == i + 1).all())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_tied_twin_never_started_after_the_first_failed_is_not_called_untouched(
    tmp_path: Path, threads: int
) -> None:
    """The first key of a tied pair fails part-way; the second (same memory) never
    starts, yet its memory no longer holds its previous values."""
    save_untied_pair(tmp_path / "c")
    flip(tmp_path / "c", "model/0.weight")
    tied = pair(tied=True)
    with pytest.raises(CheckpointCorruptError) as info:
        load_untied(tmp_path / "c", {"model": tied}, threads)
    assert (
        "0 of the 2 tensors loaded in place hold the checkpoint's values, 'model/0.weight', "
        "'model/1.weight' are partly overwritten, and the other 0 keep"
    ) in str(info.value)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_refused_target_whose_twin_was_restored_is_not_called_untouched(
    tmp_path: Path, threads: int
) -> None:
    """m2's file is refused before a byte is written into m2, but m2 is tied to m1,
    which was restored: m2's memory holds m1's values, not its own previous ones."""
    shardsafe.save(
        tmp_path / "c",
        {"m1": nn.Linear(64, 64, bias=False), "m2": nn.Linear(64, 64, bias=False)},
        layout="consolidated",
    )
    data = tmp_path / "c" / "m2.safetensors"
    raw = bytearray(data.read_bytes())
    raw[20] ^= 0x01  # inside the JSON header
    data.write_bytes(bytes(raw))
    m1, m2 = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)
    m2.weight = m1.weight
    with pytest.raises(CheckpointCorruptError, match="damaged safetensors header") as info:
        load_untied(tmp_path / "c", {"m1": m1, "m2": m2}, threads)
    assert (
        "1 of the 2 tensors loaded in place hold the checkpoint's values ('m1/weight'), "
        "'m2/weight' is partly overwritten, and the other 0 keep their previous values"
    ) in str(info.value)


def bad_checkpoint(path: Path) -> None:
    """Three data files (model, optimizer, small pieces), with a byte flipped in two
    tensors of the first two."""
    model, opt = trained(0, 1)
    shardsafe.save(path, {"model": model, "optimizer": opt}, layout="consolidated")
    flip(path, "model/3.weight")
    flip(path, "optimizer/5.weight/exp_avg_sq")


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_verify_on_threads_finds_the_same_problems_in_the_same_order_as_one(
    tmp_path: Path, threads: int
) -> None:
    bad_checkpoint(tmp_path / "c")
    storage = open_storage(str(tmp_path / "c"))
    manifest = loading.read_manifest_from(storage)
    with storage:
        with CheckpointReader(storage, manifest) as one:
            alone = one.verify_all(threads=1)
        with CheckpointReader(storage, manifest) as many, opens_with_flags() as opened:
            together = many.verify_all(threads=threads)
    assert len(alone) == 2 and "model/3.weight" in alone[0] and "exp_avg_sq" in alone[1]
    assert together == alone
    names = [Path(p).name for p, _ in opened if p.endswith(".safetensors")]
    assert sorted(names) == sorted(manifest.files)  # each data file opened once


def test_shardsafe_verify_reads_on_this_processs_share_of_the_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shardsafe.verify`` (and the CLI's) checks local files on threads, as a
    one-process load reads; the report is the one a single thread gives."""
    bad_checkpoint(tmp_path / "c")
    seen: set[str] = set()
    original = CheckpointReader._problem_in

    def spy(self: CheckpointReader, item: Any) -> Any:
        seen.add(threading.current_thread().name)
        return original(self, item)

    monkeypatch.setattr(CheckpointReader, "_problem_in", spy)
    monkeypatch.setattr(threaded_reads, "default_threads", lambda world: 2)
    threaded = shardsafe.verify(tmp_path / "c")
    assert seen == {"MainThread", "shardsafe-read_0"}
    monkeypatch.setattr(threaded_reads, "default_threads", lambda world: 1)
    assert shardsafe.verify(tmp_path / "c") == threaded
    assert len(threaded.problems) == 2 and not threaded.ok
