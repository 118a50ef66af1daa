"""Attacks on the hardening of shardsafe's readers, one section per class of attack.

Each section attacks one promise from several sides with real files: symlinks out of the
checkpoint, FIFOs (``os.mkfifo``), device nodes (``os.mknod``), sparse files, forged
manifests whose checksums are recomputed (``tests/forge.py``), and races in which a
thread keeps swapping a name (``os.replace``) while the code under attack runs. The
swapping threads never ``open`` anything themselves (they link, symlink and rename), so
the audit hook of ``tests/opens.py`` records only what shardsafe opens. Whether anyone
opened a FIFO for reading is probed from a separate process (``fifo_reader_probe``),
which also unblocks such a reader, so a regression fails a test instead of hanging it.

Tests marked ``xfail(strict=True, reason="BUG: ...")`` are real bugs: each checks what the
README (or the module docstrings) promise and fails today.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import re
import resource
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import tracemalloc
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import shardsafe
from shardsafe import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    cli,
)
from shardsafe.checkpoint.loading import read_manifest
from shardsafe.checkpoint.manager import step_of
from shardsafe.checkpoint.manifest import parse
from shardsafe.checkpoint.storage import LocalStorage
from shardsafe.checkpoint.verifying import find_problems
from tests import forge
from tests.opens import outside, recorded_opens

pytestmark = pytest.mark.timeout(60)

LAYOUTS = ("sharded", "consolidated")
SHARD = "shard-00000-of-00001.safetensors"
X = torch.arange(4096, dtype=torch.float32)  # a plain tensor value, 16 KiB
MASK = torch.arange(10, dtype=torch.uint8)  # a uint8 tensor of the wrong size for an RNG
CFG = {"lr": 0.001, "step": 5, "name": "run"}
HEADROOM = 512 << 20
RACE_SECONDS = 1.2


# ------------------------------------------------------------------------------ helpers


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.001)


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model(seed)
    opt = make_optimizer(model)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {
        f"{index}/{name}": v.detach().clone()
        for index, state in opt.state_dict()["state"].items()
        for name, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        got = actual[key]
        assert (got.dtype, tuple(got.shape)) == (value.dtype, tuple(value.shape)), key
        assert bits(got) == bits(value), key


def global_rng() -> tuple[bytes, Any, bytes]:
    algorithm, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    numpy_state = (algorithm, keys.tobytes(), pos, has_gauss, cached)
    return bits(torch.get_rng_state()), random.getstate(), repr(numpy_state).encode()


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    """Loads of RNGState restore the global generators; give them back after each test."""
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    numpy_state = np.random.get_state()
    yield
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    np.random.set_state(numpy_state)


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(args))
    return rc, out.getvalue(), err.getvalue()


def assert_clean_failure(rc: int, out: str, err: str) -> None:
    """What `inspect`/`verify` print when they refuse a checkpoint: one error line."""
    assert rc == 1, (rc, out, err)
    assert err.startswith("shardsafe: error: "), err
    assert "unexpectedly" not in err, err  # the line for a bug in shardsafe
    assert err.count("\n") == 1, err


def strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def terminal_safe_output(text: str) -> bool:
    return all(ch.isprintable() or ch == "\n" for ch in text)


def manifest_doc(ckpt: Path) -> dict[str, Any]:
    return forge.read_manifest(ckpt)


def header_span(path: Path) -> int:
    """Length of a data file's 8-byte prefix and JSON header."""
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + n


def listing(directory: Path) -> dict[str, Any]:
    """Every entry below ``directory`` (links not followed): its kind and content."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, directory)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(mode):
                out[rel] = ("file", Path(path).read_bytes())
            else:
                out[rel] = ("other", stat.S_IFMT(mode))
    return out


def private_copy(path: str) -> bool:
    """A path inside verify's private temporary directory (the safetensors cross-check)."""
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(tempfile.gettempdir()))
    return rel.split(os.sep)[0].startswith("shardsafe-verify-")


def outside_but_private(opened: list[str], directory: Path) -> list[str]:
    return [p for p in outside(opened, directory) if not private_copy(p)]


# Opens with their flags: the "open" audit event carries (path, mode, flags).
_FLAG_RECORDS: list[list[tuple[str, int]]] = []


def _flags_hook(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _FLAG_RECORDS and isinstance(args[0], (str, bytes)):
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else -1
        for record in _FLAG_RECORDS:
            record.append((os.fsdecode(args[0]), flags))


sys.addaudithook(_flags_hook)


@contextlib.contextmanager
def opens_with_flags() -> Iterator[list[tuple[str, int]]]:
    record: list[tuple[str, int]] = []
    _FLAG_RECORDS.append(record)
    try:
        yield record
    finally:
        _FLAG_RECORDS.remove(record)


@contextlib.contextmanager
def bounded_memory() -> Iterator[None]:
    """No allocation of more than HEADROOM can succeed inside (RLIMIT_AS)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = psutil.Process().memory_info().vms + HEADROOM
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def peak_rss_growth() -> Iterator[list[int]]:
    """Sample resident memory every 2 ms; yields ``[peak growth in bytes]``."""
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss - base)
            stop.wait(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], proc.memory_info().rss - base)


@contextlib.contextmanager
def fast_switching() -> Iterator[None]:
    """Let threads interleave every 50 us, so that races happen often."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class Swapper:
    """A thread that keeps replacing ``target`` by what each maker puts at a staging name,
    in turn, with ``os.replace`` (atomic: the name always exists). Makers link or
    symlink; nothing is opened. On exit the first maker's object is put back."""

    def __init__(self, target: Path, stage: Path, makers: list[Callable[[Path], None]]) -> None:
        self.target, self.stage, self.makers = target, stage, makers
        self.swaps = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _put(self, maker: Callable[[Path], None]) -> None:
        tmp = self.stage / f"swap-{self.swaps}"
        maker(tmp)
        os.replace(tmp, self.target)
        self.swaps += 1

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for maker in self.makers:
                    self._put(maker)
                    time.sleep(0)
        except BaseException as e:  # reported by __exit__
            self.error = e

    def __enter__(self) -> Swapper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()
        self._put(self.makers[0])
        if self.error is not None:
            raise self.error


def linker(master: Path) -> Callable[[Path], None]:
    return lambda tmp: os.link(master, tmp)


def symlinker(target: Path | str) -> Callable[[Path], None]:
    return lambda tmp: os.symlink(target, tmp)


def staged_fifo(stage: Path) -> Path:
    """One FIFO that every swap links into place: a probe on this name sees (and, by
    opening it for writing, unblocks) anyone who opens any of its placements for reading,
    so a regression fails the test instead of hanging it."""
    fifo = stage / "the.fifo"
    os.mkfifo(fifo)
    return fifo


PROBE_SCRIPT = textwrap.dedent(
    """
    import errno, os, signal, sys, time
    fifo, attempts, seen, stop = sys.argv[1], 0, 0, []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("ready", flush=True)
    while not stop:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:
                print("error", e, flush=True)
                sys.exit(2)
        else:
            seen += 1
            os.close(fd)
        attempts += 1
        time.sleep(0.0005)
    print(attempts, seen, flush=True)
    """
)


@contextlib.contextmanager
def fifo_reader_probe(fifo: Path) -> Iterator[dict[str, int]]:
    """Count how often anyone has ``fifo`` open for reading: a non-blocking open for
    writing succeeds only then (ENXIO otherwise). The probe is another process, so it
    also unblocks a reader stuck in ``open`` while holding this process's GIL: a
    regression fails the test instead of hanging it. Counts are filled in on exit."""
    counts = {"attempts": 0, "readers_seen": 0}
    probe = subprocess.Popen(
        [sys.executable, "-I", "-c", PROBE_SCRIPT, str(fifo)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert probe.stdout is not None and probe.stdout.readline() == "ready\n"
        yield counts
    finally:
        probe.terminate()
        out, _ = probe.communicate(timeout=10)
    assert probe.returncode == 0, out
    counts["attempts"], counts["readers_seen"] = map(int, out.split())


def flip_bit(path: Path, pos: int, bit: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 1 << bit
    path.write_bytes(bytes(raw))


def save_state() -> dict[str, Any]:
    model, opt = trained(0)
    return {
        "model": model,
        "optimizer": opt,
        "rng": shardsafe.RNGState(),
        "x": X,
        "mask": MASK,
        "cfg": dict(CFG),
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One checkpoint per layout: model, Adam state, RNG, two plain tensors and a dict."""
    root = tmp_path_factory.mktemp("pristine")
    state = save_state()
    for layout in LAYOUTS:
        shardsafe.save(root / layout, state, layout=layout)
    return {
        "root": root,
        "model": weights(state["model"]),
        "optimizer": optimizer_tensors(state["optimizer"]),
    }


@pytest.fixture
def copy_of(pristine: dict[str, Any], tmp_path: Path) -> Callable[[str], Path]:
    def make(layout: str = "sharded") -> Path:
        dest = tmp_path / "downloads" / f"ckpt-{layout}"
        shutil.copytree(pristine["root"] / layout, dest)
        return dest

    return make


def fresh() -> dict[str, Any]:
    model = make_model(1)
    return {"model": model, "optimizer": make_optimizer(model)}


def data_file(ckpt: Path, layout: str = "sharded", which: str = "model") -> Path:
    return ckpt / (SHARD if layout == "sharded" else f"{which}.safetensors")


def load_refused(ckpt: Path, state: dict[str, Any] | None = None) -> CheckpointCorruptError:
    """A CheckpointCorruptError (exactly), nothing restored, nothing outside opened."""
    state = state if state is not None else fresh()
    model_before = weights(state["model"]) if "model" in state else {}
    opt_before = optimizer_tensors(state["optimizer"]) if "optimizer" in state else {}
    rng_before = global_rng()
    with recorded_opens() as opened, pytest.raises(CheckpointError) as info:
        shardsafe.load(ckpt, state)
    assert type(info.value) is CheckpointCorruptError, f"{type(info.value).__name__}: {info.value}"
    assert outside(opened, ckpt) == []
    if "model" in state:
        assert_bitwise(weights(state["model"]), model_before)
    if "optimizer" in state:
        assert_bitwise(optimizer_tensors(state["optimizer"]), opt_before)
    assert global_rng() == rng_before
    return info.value


# ======================================================================================
# 1. verify and load open each data file once, by descriptor, under a swapping thread


def _decoy_of(real: Path, where: Path) -> Path:
    """The real file with every tensor byte inverted: its header (and header CRC) is the
    real one's, so reading it would surface as a data checksum mismatch."""
    raw = bytearray(real.read_bytes())
    start = header_span(real)
    raw[start:] = bytes(b ^ 0xFF for b in raw[start:])
    where.write_bytes(bytes(raw))
    return where


REFUSALS_IN_A_RACE = (
    "is a symbolic link",
    "is not a regular file (a named pipe (FIFO))",
    "was replaced while it was being opened",
)


def _race_setup(ckpt: Path, tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    target = data_file(ckpt)
    stage = tmp_path / "stage"
    stage.mkdir()
    master = stage / "master.safetensors"
    shutil.copyfile(target, master)
    decoy = _decoy_of(target, tmp_path / "decoy.safetensors")
    return target, stage, master, decoy


def test_verify_never_reads_a_decoy_swapped_in_while_it_runs(copy_of: Any, tmp_path: Path) -> None:
    ckpt = copy_of("sharded")
    target, stage, master, decoy = _race_setup(ckpt, tmp_path)
    manifest = read_manifest(ckpt)
    assert run_cli("verify", str(ckpt))[0] == 0  # imports the command before recording
    outcomes = {"ok": 0, "refused": 0}
    seen: set[str] = set()
    fifo = staged_fifo(stage)
    makers = [linker(master), symlinker(decoy), linker(fifo), symlinker(f"../../{decoy.name}")]
    deadline = time.monotonic() + RACE_SECONDS
    with (
        recorded_opens() as opened,
        fast_switching(),
        fifo_reader_probe(fifo) as probe,
        Swapper(target, stage, makers) as swapper,
    ):
        i = 0
        while time.monotonic() < deadline or not (outcomes["ok"] and outcomes["refused"]):
            assert time.monotonic() < deadline + 20, outcomes
            i += 1
            if i % 4 == 0:
                rc, out, err = run_cli("verify", str(ckpt))
                assert rc in (0, 1), (rc, out, err)
                problems = [] if rc == 0 else [line for line in out.splitlines()[:-1]]
                assert err == "", err
                assert rc == 1 or out.startswith("OK: "), out
            elif i % 4 == 1:
                with LocalStorage(str(ckpt)) as storage:
                    problems = find_problems(storage, manifest)
            else:
                problems = find_problems(str(ckpt), manifest)
            for problem in problems:
                assert any(f in problem for f in REFUSALS_IN_A_RACE), problem
                seen.update(f for f in REFUSALS_IN_A_RACE if f in problem)
            outcomes["refused" if problems else "ok"] += 1
    assert swapper.swaps > 20 and probe["readers_seen"] == 0, (swapper.swaps, probe)
    assert outside_but_private(opened, ckpt) == []
    assert not any(os.path.realpath(p) == os.path.realpath(decoy) for p in opened)
    assert {"is a symbolic link", "is not a regular file (a named pipe (FIFO))"} & seen
    assert find_problems(str(ckpt), manifest) == []  # the real file is back: OK again


def test_load_never_reads_a_decoy_swapped_in_while_it_runs(
    copy_of: Any, pristine: dict[str, Any], tmp_path: Path
) -> None:
    ckpt = copy_of("sharded")
    target, stage, master, decoy = _race_setup(ckpt, tmp_path)
    outcomes = {"loaded": 0, "refused": 0}
    fifo = staged_fifo(stage)
    makers = [linker(master), symlinker(decoy), linker(fifo), symlinker("/dev/zero")]
    deadline = time.monotonic() + RACE_SECONDS
    with (
        recorded_opens() as opened,
        fast_switching(),
        fifo_reader_probe(fifo) as probe,
        Swapper(target, stage, makers) as swapper,
    ):
        while time.monotonic() < deadline or not (outcomes["loaded"] and outcomes["refused"]):
            assert time.monotonic() < deadline + 20, outcomes
            state = {"model": make_model(1)}
            before = weights(state["model"])
            try:
                out = shardsafe.load(ckpt, state)
            except CheckpointCorruptError as e:
                assert any(f in str(e) for f in REFUSALS_IN_A_RACE), str(e)
                assert_bitwise(weights(state["model"]), before)
                outcomes["refused"] += 1
            else:
                assert_bitwise(weights(state["model"]), pristine["model"])
                assert bits(out["x"]) == bits(X) and out["cfg"] == CFG
                outcomes["loaded"] += 1
    assert swapper.swaps > 20 and probe["readers_seen"] == 0, (swapper.swaps, probe)
    assert outside(opened, ckpt) == []


def test_verify_cross_checks_a_private_copy_not_the_checkpoint_path(
    copy_of: Any, tmp_path: Path
) -> None:
    """The safetensors cross-check reads a temp copy of the header bytes shardsafe read:
    the data file's name is opened once, with O_PATH, and never by a path again."""
    ckpt = copy_of("consolidated")
    manifest = read_manifest(ckpt)
    with opens_with_flags() as flagged:
        assert find_problems(str(ckpt), manifest) == []
    for name in manifest.files:
        mine = [flags for path, flags in flagged if os.path.basename(path) == name]
        assert len(mine) == 1, (name, mine)
        assert mine[0] & os.O_PATH, (name, mine)
    copies = [p for p, _ in flagged if private_copy(p)]
    assert len([p for p in copies if p.endswith("header.safetensors")]) == len(manifest.files)


# ======================================================================================
# 2. CheckpointManager retention never follows, deletes or writes through a link


def _small_state(seed: int) -> dict[str, Any]:
    return {"model": make_model(seed), "step": seed}


def test_retention_leaves_a_symlinked_step_directory_and_its_target_alone(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    shardsafe.save(elsewhere / "ckpt", _small_state(9))
    before = listing(elsewhere)
    manager = CheckpointManager(root, keep_last=1)
    manager.save(1, _small_state(1))
    link = root / "step-000000002"
    os.symlink(elsewhere / "ckpt", link)
    with pytest.warns(UserWarning, match="step-000000002 is a symbolic link, not a directory"):
        manager.save(3, _small_state(3))
        manager.save(4, _small_state(4))
    manager.close()
    assert listing(elsewhere) == before
    assert link.is_symlink() and os.readlink(link) == str(elsewhere / "ckpt")
    assert sorted(os.listdir(root)) == ["latest", link.name, "step-000000004"]
    with pytest.warns(UserWarning, match="step-000000002 is a symbolic link"):
        assert manager.latest() == str(root / "step-000000004")
        assert manager.complete_steps() == [4]


def test_a_newer_symlinked_step_is_neither_latest_nor_a_reason_to_refuse(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    shardsafe.save(elsewhere / "ckpt", _small_state(9))
    before = listing(elsewhere)
    root.mkdir()
    os.symlink(elsewhere / "ckpt", root / "step-000000009")
    manager = CheckpointManager(root, keep_last=1)
    with pytest.warns(UserWarning, match="step-000000009 is a symbolic link"):
        manager.save(3, _small_state(3))  # not "older than the newest committed step"
        assert manager.latest() == str(root / "step-000000003")
        state = {"model": make_model(0)}
        assert manager.load_latest(state) == {"step": 3}
    manager.close()
    assert_bitwise(weights(state["model"]), weights(make_model(3)))
    assert listing(elsewhere) == before


def test_saving_into_a_step_name_that_is_a_symlink_writes_nothing_through_it(
    tmp_path: Path,
) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    root.mkdir()
    os.symlink(elsewhere, root / "step-000000005")
    manager = CheckpointManager(root)
    with (
        pytest.warns(UserWarning, match="step-000000005 is a symbolic link"),
        pytest.raises(CheckpointError, match="is a symbolic link, not a directory"),
    ):
        manager.save(5, _small_state(5))
    manager.close()
    assert os.listdir(elsewhere) == []
    assert (root / "step-000000005").is_symlink()


def _foreign_notes(step: Path, elsewhere: Path) -> None:
    (step / "notes.txt").write_text("my notes")


def _foreign_subdir(step: Path, elsewhere: Path) -> None:
    (step / "eval").mkdir()
    (step / "eval" / "results.json").write_text("{}")


def _foreign_data_link(step: Path, elsewhere: Path) -> None:
    os.replace(step / SHARD, elsewhere / SHARD)
    os.symlink(elsewhere / SHARD, step / SHARD)


def _foreign_manifest_link(step: Path, elsewhere: Path) -> None:
    os.replace(step / "manifest.json", elsewhere / "manifest.json")
    os.symlink(elsewhere / "manifest.json", step / "manifest.json")


def _foreign_fifo(step: Path, elsewhere: Path) -> None:
    os.mkfifo(step / "shard-00001-of-00002.safetensors")


@pytest.mark.parametrize(
    "plant",
    [_foreign_notes, _foreign_subdir, _foreign_data_link, _foreign_manifest_link, _foreign_fifo],
    ids=["notes.txt", "subdirectory", "data-file symlink", "manifest symlink", "fifo"],
)
def test_retention_leaves_a_step_holding_what_shardsafe_did_not_write(
    tmp_path: Path, plant: Callable[[Path, Path], None]
) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    manager = CheckpointManager(root, keep_last=1)
    old = Path(manager.save(1, _small_state(1)))
    plant(old, elsewhere)
    before, outside_before = listing(old), listing(elsewhere)
    with pytest.warns(UserWarning, match=r"left .*step-000000001 in place: it holds"):
        manager.save(2, _small_state(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.save(3, _small_state(3))
    manager.close()
    assert listing(old) == before
    assert listing(elsewhere) == outside_before
    assert not (root / "step-000000002").exists()
    assert manager.latest() == str(root / "step-000000003")


def test_retention_unlinks_a_hard_link_without_touching_its_other_name(tmp_path: Path) -> None:
    """A data file that is a hard link to a file elsewhere is a regular file with a name
    shardsafe writes, so it goes with its checkpoint; the other name keeps its bytes."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    manager = CheckpointManager(root, keep_last=1)
    old = Path(manager.save(1, _small_state(1)))
    keep = elsewhere / "precious.safetensors"
    os.link(old / SHARD, keep)
    content = keep.read_bytes()
    manager.save(2, _small_state(2))
    manager.close()
    assert not old.exists()
    assert keep.read_bytes() == content


def test_the_latest_pointer_and_a_stale_temp_never_write_through_a_symlink(
    tmp_path: Path,
) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    precious = elsewhere / "precious.txt"
    precious.write_text("keep me")
    os.symlink(precious, root / "latest")
    os.symlink(precious, root / f".latest.tmp-{os.getpid()}")  # what commit writes first
    os.symlink(precious, root / ".latest.tmp-999999")  # a stale one retention removes
    manager = CheckpointManager(root)
    manager.save(1, _small_state(1))
    manager.close()
    assert precious.read_text() == "keep me"
    assert not (root / "latest").is_symlink()
    assert (root / "latest").read_text() == "step-000000001\n"
    assert sorted(os.listdir(root)) == ["latest", "step-000000001"]


def test_retention_racing_a_step_directory_swapped_for_a_symlink(tmp_path: Path) -> None:
    """While saves with keep_last=1 try to delete step 1, a thread keeps moving the real
    directory away and putting a symlink to an outside checkpoint in its place. Whatever
    the interleaving, the outside checkpoint keeps every file; a save may only fail in
    retention, after its commit, saying so."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    shardsafe.save(elsewhere / "ckpt", _small_state(9))
    before = listing(elsewhere)
    manager = CheckpointManager(root, keep_last=1)
    name = root / "step-000000001"
    manager.save(1, _small_state(1))
    hidden = root / ".hidden"
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):
                os.rename(name, hidden)
            os.symlink(elsewhere / "ckpt", name)
            time.sleep(0)
            os.unlink(name)
            with contextlib.suppress(FileNotFoundError):
                os.rename(hidden, name)
            time.sleep(0)

    thread = threading.Thread(target=swap, daemon=True)
    failures = 0
    with warnings.catch_warnings(), fast_switching():
        warnings.simplefilter("ignore")
        thread.start()
        try:
            deadline = time.monotonic() + RACE_SECONDS
            step = 2
            while time.monotonic() < deadline:
                try:
                    manager.save(step, _small_state(step))
                except CheckpointError as e:
                    assert "the new checkpoint is committed, but deleting" in str(e), str(e)
                    failures += 1
                assert (root / f"step-{step:09d}" / "manifest.json").is_file()
                step += 1
        finally:
            stop.set()
            thread.join(timeout=10)
    manager.close()
    assert listing(elsewhere) == before
    assert manager.latest() == str(root / f"step-{step - 1:09d}")


# ======================================================================================
# 3. FIFOs and device nodes are refused without being opened for reading


def _place_special(path: Path, kind: str, stack: contextlib.ExitStack) -> str:
    """Put a non-regular file at ``path``; return how the refusal names it."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        return "a named pipe (FIFO)"
    if kind == "socket":
        sock = stack.enter_context(socket.socket(socket.AF_UNIX))
        cwd = os.getcwd()
        os.chdir(path.parent)  # a socket's path is limited to 108 bytes: bind a short one
        try:
            sock.bind(path.name)
        finally:
            os.chdir(cwd)
        return "a socket"
    major, minor, mode, what = {
        "null device": (1, 3, stat.S_IFCHR, "a character device"),
        "zero device": (1, 5, stat.S_IFCHR, "a character device"),
        "block device": (7, 0, stat.S_IFBLK, "a block device"),
    }[kind]
    try:
        os.mknod(path, 0o666 | mode, os.makedev(major, minor))
    except PermissionError:
        pytest.skip("os.mknod is not permitted here")
    return what


def _commands_on(ckpt: Path, which: str) -> list[tuple[str, Callable[[], Any]]]:
    manifest = read_manifest(ckpt) if which == "data" else None
    ops: list[tuple[str, Callable[[], Any]]] = [
        ("load", lambda: shardsafe.load(ckpt, {"model": make_model(1)})),
        ("verify", lambda: run_cli("verify", str(ckpt))),
        ("inspect", lambda: run_cli("inspect", str(ckpt))),
        ("inspect --json", lambda: run_cli("inspect", "--json", str(ckpt))),
    ]
    if manifest is not None:
        ops.append(("find_problems", lambda: find_problems(str(ckpt), manifest)))
    return ops


def _expect_refusal(op: str, result: Any, which: str, fragment: str) -> None:
    if isinstance(result, BaseException):
        assert type(result) is CheckpointCorruptError, repr(result)
        assert fragment in str(result), str(result)
    elif op == "find_problems":
        assert len(result) == 1 and fragment in result[0], result
    elif op.startswith("inspect") and which == "data":
        assert result[0] == 0, result  # inspect reads manifest.json only
    elif op == "verify" and which == "data":
        rc, out, _ = result
        assert rc == 1 and fragment in out and out.splitlines()[-1].startswith("FAILED"), result
    else:
        assert_clean_failure(*result)
        assert fragment in result[2], result


def _run(op: Callable[[], Any]) -> Any:
    try:
        return op()
    except CheckpointError as e:
        return e


@pytest.mark.parametrize("which", ["data", "manifest"])
def test_a_fifo_is_never_opened_for_reading(copy_of: Any, which: str) -> None:
    ckpt = copy_of("sharded")
    path = data_file(ckpt) if which == "data" else ckpt / "manifest.json"
    ops = _commands_on(ckpt, which)
    with contextlib.ExitStack() as stack:
        what = _place_special(path, "fifo", stack)
        fragment = f"{path.name} is not a regular file ({what})"
        with fifo_reader_probe(path) as probe:
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                for name, op in ops:
                    _expect_refusal(name, _run(op), which, fragment)
        assert probe["attempts"] >= 50 and probe["readers_seen"] == 0, probe


def test_the_fifo_probe_sees_a_reader(tmp_path: Path) -> None:
    """The probe above can fail: it notices anyone holding the FIFO open for reading."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with fifo_reader_probe(fifo) as probe:
            time.sleep(0.2)
    finally:
        os.close(fd)
    assert probe["readers_seen"] >= 5


@pytest.mark.parametrize("which", ["data", "manifest"])
@pytest.mark.parametrize("kind", ["null device", "zero device", "block device", "socket"])
def test_a_device_node_or_socket_is_only_ever_opened_with_o_path(
    copy_of: Any, which: str, kind: str
) -> None:
    ckpt = copy_of("sharded")
    path = data_file(ckpt) if which == "data" else ckpt / "manifest.json"
    ops = _commands_on(ckpt, which)
    with contextlib.ExitStack() as stack:
        what = _place_special(path, kind, stack)
        fragment = f"{path.name} is not a regular file ({what})"
        with opens_with_flags() as flagged:
            for name, op in ops:
                _expect_refusal(name, _run(op), which, fragment)
    mine = [flags for p, flags in flagged if os.path.basename(p) == path.name]
    # data: load, verify, find_problems (inspect never looks); manifest: load, verify, inspects
    expected_looks = {"data": 3, "manifest": 4}[which]
    assert len(mine) == expected_looks, mine
    assert all(flags != -1 and flags & os.O_PATH for flags in mine), mine


@pytest.mark.parametrize("kind", ["fifo", "null device"])
def test_the_manager_passes_over_a_special_manifest_without_opening_it(
    tmp_path: Path, kind: str
) -> None:
    manager = CheckpointManager(tmp_path / "root")
    manager.save(1, _small_state(1))
    newest = Path(manager.save(2, _small_state(2)))
    with contextlib.ExitStack() as stack:
        what = _place_special(newest / "manifest.json", kind, stack)
        probe_ctx = (
            fifo_reader_probe(newest / "manifest.json")
            if kind == "fifo"
            else contextlib.nullcontext({"attempts": 0, "readers_seen": 0})
        )
        with opens_with_flags() as flagged, probe_ctx as probe:
            pattern = f"passing over .*step-000000002.*{re.escape(what)}"
            deadline, calls = time.monotonic() + 0.3, 0
            while time.monotonic() < deadline or calls < 20:
                with pytest.warns(UserWarning, match=pattern):
                    assert manager.latest() == str(tmp_path / "root" / "step-000000001")
                calls += 1
        assert probe["readers_seen"] == 0
    manager.close()
    mine = [flags for p, flags in flagged if p == "manifest.json"]
    assert mine and all(flags & os.O_PATH for flags in mine)


def test_a_fifo_as_the_root_lock_is_refused_without_being_opened(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    lock = root / ".shardsafe.lock"
    os.mkfifo(lock)
    manager = CheckpointManager(root)
    with fifo_reader_probe(lock) as probe:
        for _ in range(5):
            with pytest.raises(CheckpointError, match=r"is damaged: .*a named pipe \(FIFO\)"):
                manager.save(1, _small_state(1))
        time.sleep(0.1)
    assert probe["readers_seen"] == 0
    assert os.listdir(root) == [".shardsafe.lock"] and stat.S_ISFIFO(os.lstat(lock).st_mode)


def test_a_symlinked_root_lock_is_never_written_through(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    precious = elsewhere / "precious.json"
    precious.write_text('{"pid": 1, "host": "elsewhere"}')
    lock = root / ".shardsafe.lock"
    os.symlink(precious, lock)
    manager = CheckpointManager(root)
    with pytest.raises(CheckpointError, match=r"is damaged: .*is a symbolic link"):
        manager.save(1, _small_state(1))  # not a lock shardsafe writes: damaged
    old = time.time() - 3600
    os.utime(lock, (old, old), follow_symlinks=False)
    with pytest.raises(CheckpointError, match=r"is damaged: .*is a symbolic link"):
        manager.save(1, _small_state(1))  # however old: a damaged lock is never taken over
    assert precious.read_text() == '{"pid": 1, "host": "elsewhere"}'
    lock.unlink()  # what the message says to do: the link itself, never what it names
    manager.save(1, _small_state(1))
    assert precious.read_text() == '{"pid": 1, "host": "elsewhere"}'
    assert not lock.is_symlink() and json.loads(lock.read_text())["pid"] == os.getpid()
    manager.close()
    assert not lock.exists() and precious.exists()


# ======================================================================================
# 4. inspect reads manifest.json exactly once, while it is being swapped


def test_inspect_output_is_whole_while_the_manifest_is_swapped(
    copy_of: Any, tmp_path: Path
) -> None:
    ckpt = copy_of("sharded")
    target = ckpt / "manifest.json"
    stage = tmp_path / "stage"
    stage.mkdir()
    a = stage / "a.json"
    shutil.copyfile(target, a)
    doc = manifest_doc(ckpt)
    doc["values"]["cfg"]["meta"]["step"] = 6
    doc["info"]["shardsafe_version"] = "9.9.9"
    b = stage / "b.json"
    b.write_bytes(forge.manifest_bytes(doc))
    garbage = stage / "garbage.json"
    garbage.write_bytes(a.read_bytes()[:5000])
    invalid = stage / "invalid.json"
    invalid.write_bytes(b"\xff" + a.read_bytes()[1:])
    decoy = tmp_path / "decoy.json"
    shutil.copyfile(b, decoy)
    modes = [("inspect",), ("inspect", "--json"), ("verify",)]
    expected: dict[tuple[str, ...], set[str]] = {mode: set() for mode in modes}
    for master in (a, b):
        os.link(master, stage / "tmp")
        os.replace(stage / "tmp", target)
        for mode in modes:
            rc, out, err = run_cli(*mode, str(ckpt))
            assert (rc, err) == (0, ""), (mode, out, err)
            expected[mode].add(out)
    assert len(expected[("inspect",)]) == len(expected[("inspect", "--json")]) == 2
    fifo = staged_fifo(stage)
    makers = [
        linker(a),
        linker(b),
        linker(garbage),
        linker(fifo),
        linker(invalid),
        symlinker(decoy),
    ]
    counts = {"complete": 0, "refused": 0}
    deadline = time.monotonic() + RACE_SECONDS
    with (
        recorded_opens() as opened,
        fast_switching(),
        fifo_reader_probe(fifo) as probe,
        Swapper(target, stage, makers),
    ):
        while time.monotonic() < deadline or not (counts["complete"] and counts["refused"]):
            assert time.monotonic() < deadline + 20, counts
            for mode in modes:
                rc, out, err = run_cli(*mode, str(ckpt))
                if rc == 0:
                    assert out in expected[mode] and err == "", (mode, out, err)
                    if mode[-1] == "--json":
                        strict_json(out)
                    counts["complete"] += 1
                else:
                    assert out == "", (mode, out)
                    assert_clean_failure(rc, out, err)
                    counts["refused"] += 1
    assert probe["readers_seen"] == 0, probe
    assert outside_but_private(opened, ckpt) == []


def test_inspect_opens_manifest_json_once_and_no_data_file(copy_of: Any) -> None:
    ckpt = copy_of("consolidated")
    for args in (("inspect",), ("inspect", "--json")):
        with opens_with_flags() as flagged:
            rc, _, err = run_cli(*args, str(ckpt))
        assert (rc, err) == (0, "")
        names = [os.path.basename(p) for p, _ in flagged]
        assert names.count("manifest.json") == 1, names
        assert not [n for n in names if n.endswith(".safetensors")], names


# ======================================================================================
# 5. Checksums cover every byte read: manifest, headers, data


@pytest.fixture(scope="module")
def victim(pristine: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A copy reused across hypothesis examples (each restores what it damaged)."""
    ckpt = tmp_path_factory.mktemp("victim") / "ckpt"
    shutil.copytree(pristine["root"] / "sharded", ckpt)
    return {
        "ckpt": ckpt,
        "manifest": (ckpt / "manifest.json").read_bytes(),
        "data": data_file(ckpt).read_bytes(),
        "header_end": header_span(data_file(ckpt)),
    }


def _refused_everywhere(ckpt: Path) -> CheckpointCorruptError:
    err = load_refused(ckpt)
    rc, out, verr = run_cli("verify", str(ckpt))
    assert rc == 1, (out, verr)
    return err


HYPOTHESIS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@HYPOTHESIS
@given(data=st.data())
def test_any_single_bit_flip_in_the_manifest_is_refused(victim: dict[str, Any], data: Any) -> None:
    raw = victim["manifest"]
    pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
    bit = data.draw(st.integers(0, 7), label="bit")
    path = victim["ckpt"] / "manifest.json"
    try:
        flip_bit(path, pos, bit)
        _refused_everywhere(victim["ckpt"])
    finally:
        path.write_bytes(raw)


def test_every_bit_of_the_manifest_checksum_line_matters(victim: dict[str, Any]) -> None:
    """Exhaustively: each bit of the trailer line (``,`` to the final newline), including
    the eight hex digits, which are also loaded."""
    raw = victim["manifest"]
    start = raw.rindex(b',\n "manifest_crc32": "')
    digits = raw.rindex(b'"', 0, len(raw) - 3) - 8
    assert re.fullmatch(rb"[0-9a-f]{8}", raw[digits : digits + 8])
    parse(raw)
    for pos in range(start, len(raw)):
        for bit in range(8):
            damaged = bytearray(raw)
            damaged[pos] ^= 1 << bit
            with pytest.raises(CheckpointCorruptError):
                parse(bytes(damaged))
    path = victim["ckpt"] / "manifest.json"
    try:
        for pos in range(digits, digits + 8):
            for bit in range(8):
                path.write_bytes(raw)
                flip_bit(path, pos, bit)
                load_refused(victim["ckpt"])
    finally:
        path.write_bytes(raw)


@HYPOTHESIS
@given(data=st.data())
def test_any_single_bit_flip_in_a_data_file_header_is_refused(
    victim: dict[str, Any], data: Any
) -> None:
    pos = data.draw(st.integers(0, victim["header_end"] - 1), label="pos")
    bit = data.draw(st.integers(0, 7), label="bit")
    path = data_file(victim["ckpt"])
    try:
        flip_bit(path, pos, bit)
        err = _refused_everywhere(victim["ckpt"])
        assert SHARD in str(err), str(err)
    finally:
        path.write_bytes(victim["data"])


def _edit_header_metadata(ckpt: Path, layout: str) -> tuple[Path, str]:
    path = data_file(ckpt, layout)
    raw = path.read_bytes()
    assert raw.count(b'"format":"pt"') == 1
    path.write_bytes(raw.replace(b'"format":"pt"', b'"format":"pu"'))
    return path, "has a damaged safetensors header: its CRC32 does not match"


def _edit_manifest(old: bytes, new: bytes) -> Callable[[Path, str], tuple[Path, str]]:
    def edit(ckpt: Path, layout: str) -> tuple[Path, str]:
        path = ckpt / "manifest.json"
        raw = path.read_bytes()
        assert old in raw
        path.write_bytes(raw.replace(old, new, 1))
        return path, "manifest.json is damaged: its content does not match its CRC32"

    return edit


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "edit",
    [
        _edit_header_metadata,
        _edit_manifest(b'"step":5', b'"step":7'),
        _edit_manifest(b'"lr":0.001', b'"lr":0.003'),
        _edit_manifest(b'"name":"run"', b'"name":"ran"'),
    ],
    ids=["header pt->pu", "step 5->7", "lr 0.001->0.003", "name run->ran"],
)
def test_a_same_length_edit_that_keeps_everything_valid_is_caught(
    copy_of: Any, layout: str, edit: Callable[[Path, str], tuple[Path, str]]
) -> None:
    ckpt = copy_of(layout)
    path, fragment = edit(ckpt, layout)
    err = _refused_everywhere(ckpt)
    assert fragment in str(err) and path.name in str(err), str(err)


def _as_old_manifest(ckpt: Path, covers: list[str] | None = None) -> None:
    """What shardsafe wrote before checksums covered the manifest and the headers (format
    version 1, as first released)."""
    doc = manifest_doc(ckpt)
    doc["version"] = 1
    doc.pop(forge.CRC_KEY)
    if covers is None:
        doc["checksum"].pop("covers")
    else:
        doc["checksum"]["covers"] = covers
    if covers is None or "headers" not in covers:
        for entry in doc["files"].values():
            entry.pop("header_crc32")
    (ckpt / "manifest.json").write_text(json.dumps(doc, indent=1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_manifest_from_before_the_new_checksums_still_loads_bitwise(
    copy_of: Any, pristine: dict[str, Any], layout: str
) -> None:
    ckpt = copy_of(layout)
    _as_old_manifest(ckpt)
    assert read_manifest(ckpt).covers == frozenset({"data"})
    model = make_model(1)
    opt = make_optimizer(model)
    out = shardsafe.load(ckpt, {"model": model, "optimizer": opt})
    assert_bitwise(weights(model), pristine["model"])
    assert_bitwise(optimizer_tensors(opt), pristine["optimizer"])
    assert bits(out["x"]) == bits(X) and bits(out["mask"]) == bits(MASK) and out["cfg"] == CFG
    rc, stdout, err = run_cli("verify", str(ckpt))
    assert (rc, err) == (0, "")
    lines = stdout.splitlines()
    assert lines[0].startswith("OK: ") and len(lines) == 2
    assert lines[1].startswith("note: not checked: the manifest's own content and the data")
    # Data blocks are still checked in an old checkpoint.
    path = data_file(ckpt, layout)
    flip_bit(path, path.stat().st_size - 1, 0)
    assert "checksum mismatch" in str(load_refused(ckpt))


def test_a_manifest_covering_headers_but_not_itself_notes_only_the_manifest(
    copy_of: Any,
) -> None:
    ckpt = copy_of("sharded")
    _as_old_manifest(ckpt, covers=["data", "headers"])
    rc, out, err = run_cli("verify", str(ckpt))
    assert (rc, err) == (0, "")
    assert out.splitlines()[1].startswith("note: not checked: the manifest's own content, which")
    _edit_header_metadata(ckpt, "sharded")  # headers are still covered
    assert "CRC32 does not match" in str(load_refused(ckpt))


def _drop_trailer(text: str) -> str:
    return text[: text.rindex(',\n "manifest_crc32"')] + "\n}\n"


def _uppercase_digits(text: str) -> str:
    return re.sub(r'"[0-9a-f]{8}"\n\}\n$', '"ABCDEF12"\n}\n', text)


def _forged_covers(covers: Any) -> Callable[[str], str]:
    """The covers list replaced, and the manifest's checksum recomputed (a forger)."""

    def edit(text: str) -> str:
        doc = json.loads(text)
        doc["checksum"]["covers"] = covers
        return forge.manifest_bytes(doc).decode()

    return edit


MISSING = "its own checksum ('manifest_crc32', the last line) is missing or malformed"


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (_drop_trailer, MISSING),
        (lambda t: json.dumps(json.loads(t), indent=2), MISSING),
        (_uppercase_digits, MISSING),
        (lambda t: t.rstrip("\n"), MISSING),
        (lambda t: t + "\n", MISSING),
        (lambda t: t.replace(' "manifest_crc32"', ' "manifest_crc32" '), MISSING),
        (_forged_covers(["data", "headers"]), "'manifest_crc32' and 'checksum.covers' disagree"),
        (_forged_covers(["data", "headers", "manifest", "all"]), "'checksum.covers' is"),
        (_forged_covers(["headers", "manifest"]), "'checksum.covers' is"),
        (_forged_covers("data,headers,manifest"), "'checksum.covers' is"),
    ],
    ids=[
        "line removed",
        "reformatted",
        "uppercase hex",
        "final newline cut",
        "newline added",
        "space in the line",
        "covers drops manifest",
        "covers unknown",
        "covers lacks data",
        "covers a string",
    ],
)
def test_a_manifest_that_claims_its_checksum_but_lacks_it_is_refused(
    copy_of: Any, damage: Callable[[str], str], fragment: str
) -> None:
    ckpt = copy_of("sharded")
    path = ckpt / "manifest.json"
    path.write_text(damage(path.read_text()))
    err = _refused_everywhere(ckpt)
    assert fragment in str(err), str(err)
    assert_clean_failure(*run_cli("inspect", str(ckpt)))


def test_a_manifest_whose_header_crc_is_dropped_is_refused(copy_of: Any) -> None:
    """A forger (checksum recomputed) cannot turn header checking off for one file while
    the manifest still declares that headers are covered."""
    ckpt = copy_of("consolidated")
    doc = manifest_doc(ckpt)
    doc["files"]["model.safetensors"].pop("header_crc32")
    forge.write_manifest(ckpt, doc)
    assert "'model.safetensors' has no valid header_crc32" in str(load_refused(ckpt))


# ======================================================================================
# 6. Shape checks against live objects cannot be bypassed by pointing at another key


@pytest.fixture
def tensor_ckpt(tmp_path: Path) -> Path:
    ckpt = tmp_path / "tensors"
    shardsafe.save(
        ckpt,
        {
            "t": torch.arange(16, dtype=torch.float32),
            "s": torch.tensor(3.0),
            "sq": torch.arange(16, dtype=torch.float32).reshape(4, 4),
            "d": torch.arange(16, dtype=torch.float64),
            "one": torch.ones(1),
        },
    )
    return ckpt


def test_a_live_tensor_is_filled_in_place_from_its_own_key(tensor_ckpt: Path) -> None:
    live = torch.zeros(16)
    out = shardsafe.load(tensor_ckpt, {"t": live})
    assert out["t"] is not None and bits(live) == bits(torch.arange(16, dtype=torch.float32))


@pytest.mark.parametrize(
    ("meta", "fragment"),
    [
        ({"__tensor__": "s"}, "s: checkpoint float32[], live float32[16]"),
        ({"__tensor__": "one"}, "one: checkpoint float32[1], live float32[16]"),
        ({"__tensor__": "sq"}, "sq: checkpoint float32[4, 4], live float32[16]"),
        ({"__tensor__": "d"}, "d: checkpoint float64[16], live float32[16]"),
        ([{"__tensor__": "t"}], "is a live tensor float32[16], but the checkpoint holds a list"),
        ({"__tuple__": [{"__tensor__": "t"}]}, "but the checkpoint holds a tuple for it"),
        (16, "but the checkpoint holds a int for it"),
    ],
    ids=["scalar", "one element", "same numel", "other dtype", "list", "tuple", "int"],
)
def test_a_live_tensor_pointed_at_another_key_is_a_mismatch(
    tensor_ckpt: Path, meta: Any, fragment: str
) -> None:
    doc = manifest_doc(tensor_ckpt)
    doc["values"]["t"]["meta"] = meta
    forge.write_manifest(tensor_ckpt, doc)
    live = torch.zeros(16)
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tensor_ckpt, {"t": live})
    assert fragment in str(info.value), str(info.value)
    assert bits(live) == bits(torch.zeros(16))


@pytest.fixture
def adam_ckpt(tmp_path: Path) -> Path:
    model, opt = trained(0)
    ckpt = tmp_path / "adam"
    shardsafe.save(ckpt, {"model": model, "optimizer": opt})
    return ckpt


def _optimizer_pointed_at(ckpt: Path, target: str) -> tuple[nn.Module, Any, Any, Any]:
    doc = manifest_doc(ckpt)
    doc["values"]["optimizer"]["meta"]["state"]["0.weight"]["exp_avg"] = {"__tensor__": target}
    forge.write_manifest(ckpt, doc)
    model, opt = trained(1)
    return model, opt, weights(model), optimizer_tensors(opt)


@pytest.mark.parametrize(
    "target", ["optimizer/0.bias/exp_avg", "model/0.bias", "optimizer/0.weight/exp_avg_sq"]
)
def test_optimizer_state_pointed_at_a_wrongly_shaped_tensor_is_refused_at_load(
    adam_ckpt: Path, target: str
) -> None:
    model, opt, model_before, opt_before = _optimizer_pointed_at(adam_ckpt, target)
    if target.endswith("exp_avg_sq"):  # same shape: legitimate, loads
        shardsafe.load(adam_ckpt, {"model": model, "optimizer": opt})
        state = opt.state[model[0].weight]
        assert bits(state["exp_avg"]) == bits(state["exp_avg_sq"])
        return
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(adam_ckpt, {"model": model, "optimizer": opt})
    # The optimizer has stepped, so its live state is what the saved one must match.
    assert f"{target}: checkpoint float32[8], live float32[8, 4]" in str(info.value)
    assert_bitwise(weights(model), model_before)
    assert_bitwise(optimizer_tensors(opt), opt_before)


# ======================================================================================
# 7. Hostile adapter metadata is corruption, raised before anything is restored


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        node = doc["values"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _python_words(change: Callable[[list[Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        python = doc["values"]["rng"]["meta"]["per_rank"][0]["python"]["__tuple__"]
        words = python[1]["__tuple__"]
        result = change(words)
        if result is not None:
            python[1]["__tuple__"] = result

    return edit


OPT = ("optimizer", "meta")
RNG0 = ("rng", "meta", "per_rank", 0)
HOSTILE_META: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "module meta is a list": (_set(("model", "meta"), [1, 2]), "is not valid module metadata"),
    "module tensors not a list": (
        _set(("model", "meta", "tensors"), "0.weight"),
        "'tensors' is not a list of names",
    ),
    "module extra is a list": (_set(("model", "meta", "extra"), []), "'extra' is not an object"),
    "param_shapes are ints": (
        _set((*OPT, "param_shapes"), {"0.weight": 8, "0.bias": 8, "2.weight": 4, "2.bias": 4}),
        "the shape of parameter '0.weight' is not a list of non-negative ints",
    ),
    "param shape negative": (
        _set((*OPT, "param_shapes", "0.bias"), [-8]),
        "the shape of parameter '0.bias' is not a list",
    ),
    "state entry is a list": (
        _set((*OPT, "state", "0.weight"), [1, 2]),
        "the state of parameter '0.weight' is not an object",
    ),
    "param group names not strings": (
        _set((*OPT, "param_groups", 0, "params"), [0, 1, 2, 3]),
        "param group 0 has no list of parameter names",
    ),
    "hyperparameters are a list": (
        _set((*OPT, "param_groups", 0, "hyper"), [1]),
        "param group 0 holds no valid hyperparameters",
    ),
    "hyperparameters hold a bad tuple": (
        _set((*OPT, "param_groups", 0, "hyper", "betas"), {"__tuple__": 0.9}),
        "malformed __tuple__ value",
    ),
    "rng per_rank not a list": (_set(("rng", "meta", "per_rank"), {}), "is not RNG state"),
    "rng torch is a float tensor": (
        _set((*RNG0, "torch"), {"__tensor__": "x"}),
        "the torch generator state is not a uint8 tensor",
    ),
    "rng torch is a short uint8 tensor": (
        _set((*RNG0, "torch"), {"__tensor__": "mask"}),
        "is not valid: RuntimeError",
    ),
    "rng torch missing": (
        _set((*RNG0, "torch"), None),
        "the torch generator state is not a uint8 tensor",
    ),
    "rng python word negative": (
        _python_words(lambda w: w.__setitem__(3, -1)),
        "Python's generator state is not 624 words of 32 bits",
    ),
    "rng python word 2**64": (
        _python_words(lambda w: w.__setitem__(3, 2**64)),
        "Python's generator state is not 624 words of 32 bits",
    ),
    "rng python position past the end": (
        _python_words(lambda w: w.__setitem__(624, 10**6)),
        "is not valid: ValueError",
    ),
    "rng python too few words": (_python_words(lambda w: w[:10]), "is not valid: ValueError"),
    "rng python not a triple": (_set((*RNG0, "python"), 5), "is not valid: TypeError"),
    "rng numpy keys too few": (
        _set((*RNG0, "numpy", "keys"), {"__tensor__": "mask"}),
        "numpy's generator keys are not a 1-d int64 tensor",
    ),
    "rng numpy keys not a tensor": (
        _set((*RNG0, "numpy", "keys"), [1, 2]),
        "numpy's generator keys are not a 1-d int64 tensor",
    ),
    "rng cuda not tensors": (
        _set((*RNG0, "cuda"), [1]),
        "the CUDA generator states are not uint8 tensors",
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(HOSTILE_META))
def test_hostile_adapter_metadata_restores_nothing(copy_of: Any, layout: str, case: str) -> None:
    ckpt = copy_of(layout)
    edit, fragment = HOSTILE_META[case]
    doc = manifest_doc(ckpt)
    edit(doc)
    forge.write_manifest(ckpt, doc)
    model = make_model(1)
    opt = make_optimizer(model)
    err = load_refused(ckpt, {"model": model, "optimizer": opt, "rng": shardsafe.RNGState()})
    assert fragment in str(err), str(err)
    assert opt.state_dict()["state"] == {}


def test_an_rng_python_word_of_2_to_the_32_is_refused(copy_of: Any) -> None:
    ckpt = copy_of("sharded")
    doc = manifest_doc(ckpt)
    _python_words(lambda w: w.__setitem__(3, 2**32))(doc)
    forge.write_manifest(ckpt, doc)
    err = load_refused(ckpt, {"model": make_model(1), "rng": shardsafe.RNGState()})
    assert "python's generator state is not 624 words of 32 bits" in str(err).lower()


NUMPY_POSITION_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import shardsafe
    try:
        shardsafe.load(sys.argv[1], {"rng": shardsafe.RNGState()})
    except shardsafe.CheckpointCorruptError as e:
        print("REFUSED", e)
        sys.exit(0)
    print("LOADED", flush=True)
    np.random.random(1 << 16)  # draws from key[pos], key[pos + 1], ...
    print("DREW", flush=True)
    sys.exit(3)
    """
)


def test_an_out_of_range_numpy_position_is_refused(copy_of: Any) -> None:
    ckpt = copy_of("sharded")
    doc = manifest_doc(ckpt)
    doc["values"]["rng"]["meta"]["per_rank"][0]["numpy"]["pos"] = 10**6
    forge.write_manifest(ckpt, doc)
    proc = subprocess.run(
        [sys.executable, "-c", NUMPY_POSITION_SCRIPT, str(ckpt)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("REFUSED"), (
        proc.returncode,
        proc.stdout,
        proc.stderr[-500:],
    )
    assert "numpy" in proc.stdout or "pos" in proc.stdout


# ======================================================================================
# 8. Dtype names come from a fixed table: nothing is imported for a hostile name


DTYPE_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import shardsafe
    watched = ["torch._inductor", "torch._dynamo", "torch.onnx", "torch.testing"]
    before = [m for m in watched if m in sys.modules]
    results = {}
    for name, path in json.loads(sys.argv[1]).items():
        start = time.perf_counter()
        try:
            shardsafe.load(path, {})
            results[name] = ["loaded", "", 0.0]
        except shardsafe.CheckpointCorruptError as e:
            results[name] = ["refused", str(e), time.perf_counter() - start]
        except BaseException as e:
            results[name] = ["other", repr(e), 0.0]
    after = [m for m in watched if m in sys.modules]
    print(json.dumps({"before": before, "after": after, "results": results}))
    """
)
HOSTILE_DTYPES = [
    "_inductor",
    "_dynamo",
    "onnx",
    "testing",
    "nn",
    "Tensor",
    "__builtins__",
    "__class__",
    "FloatTensor",
    "float",
    "torch.float32",
    "float32 ",
    "",
]


def test_a_hostile_dtype_name_is_refused_without_importing_anything(tmp_path: Path) -> None:
    base = tmp_path / "base"
    shardsafe.save(base, {"amp": {"amp_dtype": torch.bfloat16}, "t": torch.ones(2)})
    paths = {}
    for i, name in enumerate([*HOSTILE_DTYPES, 5, ["float32"], None]):
        ckpt = tmp_path / f"c{i}"
        shutil.copytree(base, ckpt)
        doc = manifest_doc(ckpt)
        doc["values"]["amp"]["meta"]["amp_dtype"] = {"__dtype__": name}
        forge.write_manifest(ckpt, doc)
        paths[repr(name)] = str(ckpt)
    bad_tensor = tmp_path / "tensor-dtype"
    shutil.copytree(base, bad_tensor)
    doc = manifest_doc(bad_tensor)
    doc["tensors"]["t"]["dtype"] = "_inductor"
    forge.write_manifest(bad_tensor, doc)
    paths["tensor record"] = str(bad_tensor)
    proc = subprocess.run(
        [sys.executable, "-c", DTYPE_SCRIPT, json.dumps(paths)],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert "torch._inductor" not in report["before"]
    assert report["after"] == report["before"], report["after"]
    for name, (outcome, message, _) in report["results"].items():
        assert outcome == "refused", (name, outcome, message)
        non_strings = ("5", "['float32']", "None")
        expected = "malformed __dtype__ value" if name in non_strings else "unknown dtype"
        assert expected in message, (name, message)


def test_real_dtypes_round_trip_as_the_same_objects(tmp_path: Path) -> None:
    value = {
        "amp_dtype": torch.bfloat16,
        "all": [torch.float16, torch.int8, torch.complex128, torch.bool, torch.float8_e4m3fn],
        "nested": ({"d": torch.uint8},),
    }
    shardsafe.save(tmp_path / "c", {"cfg": value})
    out = shardsafe.load(tmp_path / "c", {})
    assert out["cfg"] == value
    assert out["cfg"]["amp_dtype"] is torch.bfloat16
    assert all(a is b for a, b in zip(out["cfg"]["all"], value["all"]))


# ======================================================================================
# 9. Unusual keys work end to end; what load would refuse, save refuses first

DIGITS_5000 = "9" * 5000
SUPERSCRIPT = "x1\u00b2"
ARABIC_INDIC = "\u0663\u0664\u0665"
RTL = "\u202eexe.gnp"
RTL_PARAM = "\u202eevil"  # parameter names cannot hold "."


class WeirdNames(nn.Module):
    NAMES = (SUPERSCRIPT, "\u0663", RTL_PARAM, "9" * 3000, "10", "2", "e\u0301", "a\u200bb")

    def __init__(self, fill: bool) -> None:
        super().__init__()
        for i, name in enumerate(self.NAMES):
            value = torch.full((3,), float(i)) if fill else torch.zeros(3)
            self.register_parameter(name, nn.Parameter(value))


def weird_state(fill: bool) -> dict[str, Any]:
    tensor = (lambda n: torch.arange(n, dtype=torch.float32)) if fill else torch.zeros
    return {
        "model": WeirdNames(fill),
        SUPERSCRIPT: tensor(3),
        ARABIC_INDIC: tensor(4),
        RTL: tensor(5),
        "n" + DIGITS_5000: 7,
        "cfg": {
            SUPERSCRIPT: 1,
            "\u0663": 2,
            DIGITS_5000: 3,
            RTL: "rtl",
            "10": torch.ones(2),
            "2": torch.zeros(2),
            "\u0664": {"\u0665": [1, 2]},
        },
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unusual_keys_save_load_inspect_and_verify(tmp_path: Path, layout: str) -> None:
    ckpt = tmp_path / "weird"
    saved = weird_state(fill=True)
    shardsafe.save(ckpt, saved, layout=layout)
    live = weird_state(fill=False)
    out = shardsafe.load(ckpt, live)
    assert_bitwise(weights(live["model"]), weights(saved["model"]))
    for key in (SUPERSCRIPT, ARABIC_INDIC, RTL):
        assert bits(live[key]) == bits(saved[key]), key
    assert out["n" + DIGITS_5000] == 7
    cfg = out["cfg"]
    assert cfg[DIGITS_5000] == 3 and cfg[SUPERSCRIPT] == 1 and cfg["\u0664"] == {"\u0665": [1, 2]}
    assert bits(cfg["10"]) == bits(torch.ones(2)) and bits(cfg["2"]) == bits(torch.zeros(2))
    rc, text, err = run_cli("inspect", str(ckpt))
    assert (rc, err) == (0, "") and "\\u202eexe.gnp" in text
    assert terminal_safe_output(text)
    rc, raw, err = run_cli("inspect", "--json", str(ckpt))
    assert (rc, err) == (0, "")
    doc = strict_json(raw)
    assert {v["name"] for v in doc["values"]} == set(saved)
    keys = {t["key"] for t in doc["tensors"]}
    assert {f"model/{n}" for n in WeirdNames.NAMES} <= keys
    assert {SUPERSCRIPT, ARABIC_INDIC, RTL, "cfg/10", "cfg/2"} <= keys
    rc, text, err = run_cli("verify", str(ckpt))
    assert (rc, err) == (0, "") and text.startswith("OK: ")


def _long_attribute() -> dict[str, Any]:
    module = nn.Module()
    module.register_parameter("w" * 4000, nn.Parameter(torch.ones(2)))
    return {"model": module}


def _nested(depth: int, wrap: Callable[[Any], Any]) -> dict[str, Any]:
    value: Any = 1
    for _ in range(depth):
        value = wrap(value)
    return {"deep": value}


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (_long_attribute, CheckpointError, "characters long; a checkpoint holds keys of at most"),
        (lambda: {"t" * 3100: torch.ones(2)}, CheckpointError, "characters long"),
        (lambda: _nested(200, lambda v: [v]), CheckpointError, "nested more than 80 levels"),
        (lambda: _nested(200, lambda v: {"k": v}), CheckpointError, "nested more than 80"),
        (lambda: _nested(60, lambda v: (v,)), CheckpointError, "could not load back"),
        (lambda: _nested(40, lambda v: {1: v}), CheckpointError, "could not load back"),
        (lambda: {"big": 10**5000, "t": torch.ones(1)}, CheckpointError, "4300 digits"),
        (lambda: {"a/b": 1}, ValueError, "must be a non-empty string without '/'"),
        (lambda: {"@x": 1}, ValueError, "does not start with '@'"),
        (lambda: {"f": print}, CheckpointError, "which shardsafe does not know how to save"),
        (lambda: {"cfg": {"f": print}}, CheckpointError, "shardsafe never pickles"),
    ],
    ids=[
        "4000-char attribute",
        "3100-char value name",
        "list 200 deep",
        "dict 200 deep",
        "tuple 60 deep",
        "int-keyed dict 40 deep",
        "int of 5001 digits",
        "slash in name",
        "at sign",
        "function",
        "function in a dict",
    ],
)
def test_save_refuses_first_what_load_would_refuse(
    tmp_path: Path, make: Callable[[], dict[str, Any]], error: type, fragment: str
) -> None:
    ckpt = tmp_path / "refused"
    with pytest.raises(error) as info:
        shardsafe.save(ckpt, make())
    assert fragment in str(info.value), str(info.value)
    assert not (ckpt / "manifest.json").exists()
    assert not ckpt.exists() or os.listdir(ckpt) == []
    shardsafe.save(ckpt, {"ok": 1})  # nothing left behind blocks the next save
    assert shardsafe.load(ckpt, {}) == {"ok": 1}


def test_nesting_right_at_the_limit_round_trips(tmp_path: Path) -> None:
    state = _nested(80, lambda v: [v])
    shardsafe.save(tmp_path / "c", state)
    assert shardsafe.load(tmp_path / "c", {}) == state
    assert run_cli("verify", str(tmp_path / "c"))[0] == 0


# ======================================================================================
# 10. inspect on huge recorded numbers: a clean error or valid, strict output


def _numbers_case(name: str) -> Callable[[Path], None]:
    def edit(ckpt: Path) -> None:
        doc = manifest_doc(ckpt)
        if name == "file bytes 10**30":
            doc["files"][SHARD]["bytes"] = 10**30
        elif name == "file bytes 2**62":
            doc["files"][SHARD]["bytes"] = 2**62
        elif name.startswith("created_unix"):
            doc["info"]["created_unix"] = {
                "created_unix 1e300": 1e300,
                "created_unix -1e300": -1e300,
                "created_unix string": "yesterday",
                "created_unix true": True,
                "created_unix 10**30": 10**30,
            }[name]
        elif name == "world_size 10**30":
            doc["world_size"] = 10**30
        elif name == "block_bytes 2**62":
            doc["checksum"]["block_bytes"] = 2**62
        elif name == "value 10**30":
            doc["values"]["cfg"]["meta"]["step"] = -(10**30)
        elif name == "version not a string":
            doc["info"]["shardsafe_version"] = 10**30
        elif name in ("value 1e999", "value of 5000 digits", "value NaN", "value -Infinity"):
            literal = {
                "value 1e999": "1e999",
                "value of 5000 digits": "9" * 5000,
                "value NaN": "NaN",
                "value -Infinity": "-Infinity",
            }[name]
            doc.pop(forge.CRC_KEY)
            text = json.dumps(forge.pack(doc), indent=1).replace('"step": 5', f'"step": {literal}')
            (ckpt / "manifest.json").write_bytes(forge.sign(text))
            return
        else:
            raise AssertionError(name)
        forge.write_manifest(ckpt, doc)

    return edit


HUGE = {
    "file bytes 10**30": (1, "has no valid 'bytes'"),
    "file bytes 2**62": (0, None),
    "created_unix 1e300": (0, None),
    "created_unix -1e300": (0, None),
    "created_unix 10**30": (0, None),
    "created_unix string": (0, None),
    "created_unix true": (0, None),
    "world_size 10**30": (0, None),
    "block_bytes 2**62": (0, None),
    "value 10**30": (0, None),
    "version not a string": (0, None),
    "value 1e999": (1, "is out of range"),
    "value of 5000 digits": (1, "is not valid JSON"),
    "value NaN": (1, "non-standard constant NaN"),
    "value -Infinity": (1, "non-standard constant -Infinity"),
}


@pytest.mark.parametrize("case", sorted(HUGE))
def test_inspect_on_huge_numbers_is_clean(copy_of: Any, case: str) -> None:
    ckpt = copy_of("sharded")
    _numbers_case(case)(ckpt)
    expected_rc, fragment = HUGE[case]
    rc, text, err = run_cli("inspect", str(ckpt))
    rc_json, raw, err_json = run_cli("inspect", "--json", str(ckpt))
    assert rc == rc_json == expected_rc, (text, err, raw, err_json)
    if expected_rc == 1:
        for r, o, e in ((rc, text, err), (rc_json, raw, err_json)):
            assert_clean_failure(r, o, e)
            assert o == "" and fragment in e, e
        return
    assert err == err_json == ""
    assert text.splitlines()[-1].startswith("total: ")
    doc = strict_json(raw)
    info = manifest_doc(ckpt)
    if case.startswith("created_unix"):
        value = info["info"]["created_unix"]
        finite = isinstance(value, (int, float)) and not isinstance(value, bool)
        assert doc["created_unix"] == (float(value) if finite else None)
        assert doc["created"] is None
        assert "created     ? by shardsafe" in text
    if case == "file bytes 2**62":
        assert doc["totals"]["bytes"] == 2**62 + doc["totals"]["manifest_bytes"]
        assert doc["files"][0]["bytes"] == 2**62
    if case == "world_size 10**30":
        assert doc["world_size"] == 10**30 and f"{10**30} at save" in text
    if case == "value 10**30":
        cfg = next(v for v in doc["values"] if v["name"] == "cfg")
        assert cfg["value"]["step"] == -(10**30)
    if case == "version not a string":
        assert doc["shardsafe_version"] is None


def test_non_finite_floats_round_trip_and_inspect_stays_strict_json(tmp_path: Path) -> None:
    values = [math.inf, -math.inf, math.nan, -0.0, 5e-324, 1.7976931348623157e308]
    ckpt = tmp_path / "floats"
    shardsafe.save(ckpt, {"v": math.inf, "w": values, "t": (math.nan,)})
    out = shardsafe.load(ckpt, {})
    assert out["v"] == math.inf
    assert [struct.pack("<d", v) for v in out["w"]] == [struct.pack("<d", v) for v in values]
    assert isinstance(out["t"], tuple) and math.isnan(out["t"][0])
    rc, raw, err = run_cli("inspect", "--json", str(ckpt))
    assert (rc, err) == (0, "")
    doc = strict_json(raw)
    v = next(v for v in doc["values"] if v["name"] == "v")
    assert v["value"] == {"__float__": "inf"}
    rc, text, err = run_cli("inspect", str(ckpt))
    assert (rc, err) == (0, "") and '{"__float__": "inf"}' in text


# ======================================================================================
# 11. Terminal escapes from a checkpoint never reach the terminal

ESCAPES = {
    "clear": "\x1b[2J",
    "title": "\x1b]0;title\x07",
    "clipboard": "\x1b]52;c;aGVsbG8=\x07",
    "return": "\r",
    "bidi": "\u202e",
}
EVIL = "".join(ESCAPES.values())


def _escape_checkpoint(root: Path, layout: str) -> Path:
    module = nn.Module()
    module.register_parameter("w" + ESCAPES["title"], nn.Parameter(torch.ones(2)))
    module.register_parameter(ESCAPES["bidi"] + "x", nn.Parameter(torch.zeros(3)))
    state = {
        "model": module,
        "name" + ESCAPES["clear"]: {"s": ESCAPES["clipboard"], ESCAPES["return"]: EVIL},
        "t" + ESCAPES["return"]: torch.arange(4.0),
        "cfg": [EVIL, {"k" + ESCAPES["bidi"]: torch.ones(1)}],
    }
    ckpt = root / f"escapes-{layout}"
    shardsafe.save(ckpt, state, layout=layout)
    doc = manifest_doc(ckpt)
    doc["info"]["shardsafe_version"] = ESCAPES["clear"] + "0.1" + ESCAPES["title"]
    doc["info"]["torch_version"] = ESCAPES["bidi"] + "2.13"
    doc["values"]["odd" + ESCAPES["clipboard"]] = {"kind": ESCAPES["clear"] + "module", "meta": {}}
    forge.write_manifest(ckpt, doc)
    return ckpt


def _assert_terminal_safe(*outputs: str) -> None:
    for text in outputs:
        bad = sorted({repr(ch) for ch in text if not (ch.isprintable() or ch == "\n")})
        assert not bad, (bad, text[:300])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_and_verify_escape_everything_from_the_checkpoint(
    tmp_path: Path, layout: str
) -> None:
    ckpt = _escape_checkpoint(tmp_path, layout)
    rc, text, err = run_cli("inspect", str(ckpt))
    assert (rc, err) == (0, "")
    _assert_terminal_safe(text)
    assert "\\x1b[2J0.1\\x1b]0;title\\x07" in text and "\\x1b[2Jmodule" in text
    assert "w\\x1b]0;title\\x07" in text and "\\u202ex" in text
    rc, raw, err = run_cli("inspect", "--json", str(ckpt))
    assert (rc, err) == (0, "")
    _assert_terminal_safe(raw)
    doc = strict_json(raw)
    assert doc["shardsafe_version"] == ESCAPES["clear"] + "0.1" + ESCAPES["title"]
    assert "odd" + ESCAPES["clipboard"] in {v["name"] for v in doc["values"]}
    rc, text, err = run_cli("verify", str(ckpt))
    assert (rc, err) == (0, "")
    _assert_terminal_safe(text)
    # Damaged: every problem line names the escaped keys.
    for path in ckpt.glob("*.safetensors"):
        flip_bit(path, path.stat().st_size - 1, 0)
    first = sorted(ckpt.glob("*.safetensors"))[0]
    first.unlink()
    rc, text, err = run_cli("verify", str(ckpt))
    assert rc == 1 and err == ""
    _assert_terminal_safe(text)
    assert f"data file {first.name} is missing" in text
    if layout == "consolidated":
        assert "checksum mismatch" in text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (("layout",), EVIL),
        (("format",), EVIL),
        (("values",), {"a/" + EVIL: {"kind": "value", "meta": 1}}),
        (("tensors", "t\r", "dtype"), EVIL),
        (("files",), {EVIL + ".safetensors": {"bytes": 10, "header_crc32": 0}}),
    ],
    ids=["layout", "format", "value name", "dtype", "file name"],
)
def test_refusals_of_fields_holding_escapes_are_escaped(
    tmp_path: Path, field: tuple[str, ...], value: Any
) -> None:
    ckpt = _escape_checkpoint(tmp_path, "sharded")
    doc = manifest_doc(ckpt)
    node = doc
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = value
    forge.write_manifest(ckpt, doc)
    for args in (("inspect",), ("inspect", "--json"), ("verify",)):
        rc, out, err = run_cli(*args, str(ckpt))
        assert_clean_failure(rc, out, err)
        _assert_terminal_safe(out, err)


def test_verify_escapes_the_path_in_its_failed_line(tmp_path: Path) -> None:
    ckpt = tmp_path / ("ckpt" + ESCAPES["title"])
    shardsafe.save(ckpt, {"t": torch.ones(4)})
    path = ckpt / SHARD
    flip_bit(path, path.stat().st_size - 1, 0)
    rc, out, err = run_cli("verify", str(ckpt))
    assert rc == 1
    _assert_terminal_safe(out, err)


# ======================================================================================
# 12/13. Costs are linear in the manifest's size


def test_sixteen_thousand_chunks_along_dim_1_and_in_a_2d_grid_parse() -> None:
    """How long they take is measured in ``benchmarks/validation_scale.py``."""
    raw = forge.manifest_bytes(forge.grid_doc(1, 16_000))
    assert len(parse(raw).tensors["model/w"].chunks) == 16_000
    raw = forge.manifest_bytes(forge.grid_doc(125, 128))  # 2-d grid of 16,000 cells
    assert len(parse(raw).tensors["model/w"].chunks) == 16_000


def test_inspect_of_ten_thousand_values_and_tensors(tmp_path: Path) -> None:
    n = 10_000
    doc = forge.grid_doc(1, 1)
    doc["files"] = {SHARD: {"bytes": 16 * n + 4096, "header_crc32": 0}}
    doc["tensors"] = {
        f"v{i}": {
            "dtype": "float32",
            "shape": [4],
            "chunks": [
                {"file": SHARD, "name": f"v{i}", "offsets": [0], "shape": [4], "crc32": [i]}
            ],
        }
        for i in range(n)
    }
    doc["values"] = {f"v{i}": {"kind": "value", "meta": {"__tensor__": f"v{i}"}} for i in range(n)}
    ckpt = tmp_path / "wide"
    ckpt.mkdir()
    forge.write_manifest(ckpt, doc)
    for args in (("inspect",), ("inspect", "--json")):  # timed in validation_scale.py
        rc, out, err = run_cli(*args, str(ckpt))
        assert (rc, err) == (0, "")
    assert strict_json(out)["totals"]["tensors"] == n


def _brick(pairs: int) -> dict[str, Any]:
    """A [2, 2*pairs] tensor tiled exactly by 2*pairs+1 chunks that do not form a grid:
    row 0 cut every 2 columns, row 1 offset by one column."""
    width = 2 * pairs
    doc = forge.grid_doc(1, 1)
    chunks = [
        {"file": SHARD, "name": f"a{i}", "offsets": [0, 2 * i], "shape": [1, 2], "crc32": [0]}
        for i in range(pairs)
    ]
    cuts = [(0, 1), *[(1 + 2 * i, 2) for i in range(pairs - 1)], (width - 1, 1)]
    chunks += [
        {"file": SHARD, "name": f"b{i}", "offsets": [1, o], "shape": [1, n], "crc32": [0]}
        for i, (o, n) in enumerate(cuts)
    ]
    doc["files"] = {SHARD: {"bytes": 4096, "header_crc32": 0}}
    doc["tensors"] = {"model/w": {"dtype": "float32", "shape": [2, width], "chunks": chunks}}
    return doc


def test_more_than_64_chunks_that_do_not_form_a_grid_are_refused() -> None:
    assert len(parse(forge.manifest_bytes(_brick(31))).tensors["model/w"].chunks) == 63
    with pytest.raises(CheckpointCorruptError, match="do not form a grid, and 65 chunks"):
        parse(forge.manifest_bytes(_brick(32)))
    overlapping = _brick(31)
    overlapping["tensors"]["model/w"]["chunks"][1]["offsets"] = [0, 1]  # overlaps a0
    with pytest.raises(CheckpointCorruptError, match="overlap or leave holes"):
        parse(forge.manifest_bytes(overlapping))


# ======================================================================================
# 14. Parsing memory is proportional to the manifest


def test_parsing_a_ten_megabyte_manifest_peaks_under_eight_times_its_size() -> None:
    tensors, per_tensor = 4, 17_000
    doc = forge.grid_doc(1, 1, block_bytes=16 << 20)
    doc["files"] = {SHARD: {"bytes": 1 << 40, "header_crc32": 0}}
    doc["tensors"] = {
        f"model/layers.{t}.weight": {
            "dtype": "float32",
            "shape": [4, per_tensor],
            "chunks": [
                {
                    "file": SHARD,
                    "name": f"model/layers.{t}.weight@0,{i}",
                    "offsets": [0, i],
                    "shape": [4, 1],
                    "crc32": [(t * per_tensor + i) * 2654435761 & 0xFFFFFFFF],
                }
                for i in range(per_tensor)
            ],
        }
        for t in range(tensors)
    }
    doc["values"] = {
        "model": {
            "kind": "module",
            "meta": {"tensors": [f"layers.{t}.weight" for t in range(tensors)], "extra": {}},
        }
    }
    raw = forge.manifest_bytes(doc)
    assert 8 << 20 < len(raw) < 14 << 20, len(raw)
    tracemalloc.start()
    try:
        manifest = parse(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(len(r.chunks) for r in manifest.tensors.values()) == tensors * per_tensor
    assert peak < 8 * len(raw), f"peak {peak / len(raw):.1f}x the manifest's {len(raw)} bytes"


# ======================================================================================
# 15. Sparse files: sizes only the checkpoint vouches for are bounded before allocating


def sparse_checkpoint(root: Path, nbytes: int, bad_block: int | None) -> Path:
    """A checkpoint of one float32 plain value of ``nbytes`` whose data file is a hole
    (zeros, almost no disk). Block CRCs are those of zeros, but for ``bad_block``."""
    ckpt = root / f"sparse-{nbytes >> 20}M"
    ckpt.mkdir()
    numel = nbytes // 4
    header = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            "x": {"dtype": "F32", "shape": [numel], "data_offsets": [0, nbytes]},
        },
        separators=(",", ":"),
    ).encode()
    header += b" " * (-len(header) % 8)
    head = struct.pack("<Q", len(header)) + header
    path = ckpt / SHARD
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + nbytes)
    block = 16 << 20
    crcs = [zlib.crc32(bytes(block))] * -(-nbytes // block)
    if bad_block is not None:
        crcs[bad_block] ^= 1
    doc = forge.grid_doc(1, 1, block_bytes=block)
    doc["files"] = {SHARD: {"bytes": len(head) + nbytes, "header_crc32": zlib.crc32(head)}}
    doc["values"] = {"x": {"kind": "value", "meta": {"__tensor__": "x"}}}
    chunk = {"file": SHARD, "name": "x", "offsets": [0], "shape": [numel], "crc32": crcs}
    doc["tensors"] = {"x": {"dtype": "float32", "shape": [numel], "chunks": [chunk]}}
    forge.write_manifest(ckpt, doc)
    assert os.stat(path).st_blocks * 512 < 1 << 20  # really sparse
    return ckpt


def test_a_sparse_two_gigabyte_tensor_is_refused_before_allocating(tmp_path: Path) -> None:
    ckpt = sparse_checkpoint(tmp_path, 2 << 30, bad_block=32)
    with bounded_memory(), opens_with_flags() as flagged, pytest.raises(CheckpointError) as info:
        shardsafe.load(ckpt, {})
    assert type(info.value) is CheckpointCorruptError
    assert "allocate 2.00 GiB" in str(info.value) and "untrusted_bytes_limit" in str(info.value)
    assert not [p for p, _ in flagged if p.endswith(".safetensors")]  # refused while planning
    expected = [
        f"checksum mismatch in {SHARD}, tensor 'x' (chunk at offsets [0], block 32): the data "
        "file is damaged"
    ]
    with peak_rss_growth() as peak:
        assert find_problems(str(ckpt), read_manifest(ckpt)) == expected
        rc, out, err = run_cli("verify", str(ckpt))
    assert peak[0] < 64 << 20, f"resident memory grew by {peak[0] >> 20} MiB"
    assert rc == 1 and err == "" and out.splitlines()[0] == "  " + expected[0]


def test_verify_of_a_valid_large_file_passes_under_an_address_space_limit(
    tmp_path: Path,
) -> None:
    ckpt = sparse_checkpoint(tmp_path, 1 << 30, bad_block=0)
    manifest = read_manifest(ckpt)
    with bounded_memory():
        problems = find_problems(str(ckpt), manifest)
    assert problems == [
        f"checksum mismatch in {SHARD}, tensor 'x' (chunk at offsets [0], block 0): the data "
        "file is damaged"
    ]


@pytest.mark.parametrize("block_bytes", [1 << 31, 1 << 40])
def test_verify_memory_is_bounded_by_the_files_not_a_claimed_block_size(
    tmp_path: Path, block_bytes: int
) -> None:
    ckpt = tmp_path / "blocks"
    value = torch.arange(100, dtype=torch.float32)
    shardsafe.save(ckpt, {"x": value})
    doc = manifest_doc(ckpt)
    doc["checksum"]["block_bytes"] = block_bytes  # one block per chunk: CRCs still right
    forge.write_manifest(ckpt, doc)
    assert bits(shardsafe.load(ckpt, {})["x"]) == bits(value)
    with bounded_memory():
        problems = find_problems(str(ckpt), read_manifest(ckpt))
    assert problems == []
    rc, out, err = run_cli("verify", str(ckpt))
    assert (rc, err) == (0, "") and out.startswith("OK: "), (out, err)


def test_untrusted_bytes_limit_is_what_lets_a_trusted_load_through(tmp_path: Path) -> None:
    value = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
    ckpt = tmp_path / "mib"
    shardsafe.save(ckpt, {"x": value})
    assert bits(shardsafe.load(ckpt, {})["x"]) == bits(value)
    for limit in (0, (1 << 20) - 1):
        with pytest.raises(CheckpointCorruptError, match=f"untrusted_bytes_limit={limit}\\)"):
            shardsafe.load(ckpt, {}, untrusted_bytes_limit=limit)
    out = shardsafe.load(ckpt, {}, untrusted_bytes_limit=1 << 20)
    assert bits(out["x"]) == bits(value)
    live = torch.zeros(1 << 18)  # a live tensor sizes it: no limit needed
    shardsafe.load(ckpt, {"x": live}, untrusted_bytes_limit=0)
    assert bits(live) == bits(value)


# ======================================================================================
# 16. CheckpointManager: only its own names, and only checkpoints that would load

IGNORED_NAMES = [
    "step-" + "\u0660" * 8 + "\u0663",  # Arabic-Indic digits: int() reads them as 3
    "step-1",
    "step-0000000005",
    "step-00000000\u0667",
    "step-0000_0009",
    "step-000000009 ",
    "step-+00000008",
    "Step-000000009",
    "step-000000009.tmp",
]


def test_the_manager_ignores_names_it_does_not_write(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manager = CheckpointManager(root, keep_last=1)
    manager.save(1, _small_state(1))
    p2 = manager.save(2, _small_state(2))
    for name in IGNORED_NAMES:
        assert step_of(name) is None, name
        shutil.copytree(p2, root / name)
    assert manager.complete_steps() == [2]
    assert manager.latest() == p2 and os.path.isdir(p2)
    state = {"model": make_model(0)}
    assert manager.load_latest(state) == {"step": 2}
    assert_bitwise(weights(state["model"]), weights(make_model(2)))
    before = {name: listing(root / name) for name in IGNORED_NAMES}
    p3 = manager.save(3, _small_state(3))  # not "older than" a 10-digit step 5
    manager.close()
    assert manager.latest() == p3
    assert {name: listing(root / name) for name in IGNORED_NAMES} == before
    assert not os.path.exists(p2)


def _break_manifest_symlink(step: Path, elsewhere: Path) -> str:
    shutil.copyfile(step / "manifest.json", elsewhere / "manifest.json")
    (step / "manifest.json").unlink()
    os.symlink(elsewhere / "manifest.json", step / "manifest.json")
    return "manifest.json is a symbolic link"


def _break_manifest_fifo(step: Path, elsewhere: Path) -> str:
    (step / "manifest.json").unlink()
    os.mkfifo(step / "manifest.json")
    return "manifest.json is not a regular file (a named pipe (FIFO))"


def _break_manifest_byte(step: Path, elsewhere: Path) -> str:
    flip_bit(step / "manifest.json", 100, 2)
    return "does not match its CRC32"


def _break_missing_data(step: Path, elsewhere: Path) -> str:
    (step / SHARD).unlink()
    return f"data file {SHARD} is missing"


def _break_truncated_data(step: Path, elsewhere: Path) -> str:
    os.truncate(step / SHARD, (step / SHARD).stat().st_size - 1)
    return "bytes but the manifest recorded"


def _break_data_header(step: Path, elsewhere: Path) -> str:
    flip_bit(step / SHARD, 20, 0)
    return "damaged safetensors header"


@pytest.mark.parametrize(
    "damage",
    [
        _break_manifest_symlink,
        _break_manifest_fifo,
        _break_manifest_byte,
        _break_missing_data,
        _break_truncated_data,
        _break_data_header,
    ],
    ids=["manifest symlink", "manifest fifo", "manifest byte", "data missing", "truncated", "hdr"],
)
def test_a_broken_newest_checkpoint_is_passed_over(
    tmp_path: Path, damage: Callable[[Path, Path], str]
) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    manager = CheckpointManager(root)
    p1 = manager.save(1, _small_state(1))
    p2 = Path(manager.save(2, _small_state(2)))
    why = damage(p2, elsewhere)
    pattern = f"passing over .*step-000000002: .*{re.escape(why)}"
    with pytest.warns(UserWarning, match=pattern):
        assert manager.latest() == p1
    state = {"model": make_model(0)}
    with pytest.warns(UserWarning, match=pattern):
        assert manager.load_latest(state) == {"step": 1}
    manager.close()
    assert_bitwise(weights(state["model"]), weights(make_model(1)))
    assert os.path.isdir(p1)


def test_damaged_tensor_bytes_make_load_latest_fall_back(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manager = CheckpointManager(root)
    p1 = manager.save(1, _small_state(1))
    p2 = Path(manager.save(2, _small_state(2)))
    path = p2 / SHARD
    start, size = header_span(path), path.stat().st_size
    flip_bit(path, (start + size) // 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # latest()'s cheap checks pass: no warning at all
        assert manager.latest() == str(p2)
    state = {"model": make_model(0)}
    pattern = r"could not load .*step-000000002, trying the previous checkpoint: checksum mismatch"
    with pytest.warns(UserWarning, match=pattern):
        assert manager.load_latest(state) == {"step": 1}
    assert_bitwise(weights(state["model"]), weights(make_model(1)))
    # Both damaged: the newest one's error, and nothing restored.
    path = Path(p1) / SHARD
    flip_bit(path, (header_span(path) + path.stat().st_size) // 2, 3)
    state = {"model": make_model(0)}
    with pytest.warns(UserWarning), pytest.raises(CheckpointCorruptError, match="checksum"):
        manager.load_latest(state)
    manager.close()
    assert_bitwise(weights(state["model"]), weights(make_model(0)))


@pytest.fixture(scope="module")
def one_good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("one-good") / "ckpt"
    shardsafe.save(path, _small_state(4))
    return path


ENTRY_KINDS = ["good", "no manifest", "bad manifest", "symlink", "fifo manifest", "file"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    entries=st.dictionaries(
        st.integers(0, 40), st.sampled_from(ENTRY_KINDS), min_size=0, max_size=6
    ),
    extra=st.lists(st.sampled_from(IGNORED_NAMES), max_size=3, unique=True),
)
def test_latest_is_the_newest_loadable_step_and_exists(
    one_good: Path, tmp_path_factory: pytest.TempPathFactory, entries: dict[int, str], extra: list
) -> None:
    root = tmp_path_factory.mktemp("latest")
    for step, kind in entries.items():
        path = root / f"step-{step:09d}"
        if kind == "symlink":
            os.symlink(one_good, path)
        elif kind == "file":
            path.write_text("not a directory")
        else:
            shutil.copytree(one_good, path)
            if kind == "no manifest":
                (path / "manifest.json").unlink()
            elif kind == "bad manifest":
                flip_bit(path / "manifest.json", 10, 0)
            elif kind == "fifo manifest":
                (path / "manifest.json").unlink()
                os.mkfifo(path / "manifest.json")
    for name in extra:
        shutil.copytree(one_good, root / name)
    good = [s for s, kind in entries.items() if kind == "good"]
    manager = CheckpointManager(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = manager.latest()
    if not good:
        assert found is None
        return
    assert found == str(root / f"step-{max(good):09d}")
    assert os.path.isdir(found) and not os.path.islink(found)
    assert (Path(found) / "manifest.json").is_file()


# ======================================================================================
# Beyond the 16 classes: a checkpoint with many data files


@contextlib.contextmanager
def descriptor_limit(extra: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_more_data_files_than_free_descriptors_still_load_and_verify(tmp_path: Path) -> None:
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(300)}
    ckpt = tmp_path / "many"
    shardsafe.save(ckpt, state, layout="consolidated")
    assert len(list(ckpt.glob("*.safetensors"))) == 300
    with descriptor_limit(200):
        out = shardsafe.load(ckpt, {})
        rc, text, err = run_cli("verify", str(ckpt))
    assert all(bits(out[k]) == bits(v) for k, v in state.items())
    assert (rc, err) == (0, ""), (text[-300:], err)
