"""Converters touch and allocate only what their input really holds.

Hostile inputs are built for real: ``torch.save`` of expanded (stride-0), strided and
storage-sharing views; DCP checkpoints written by ``dcp.save`` and then edited (an item's
bytes replaced by ``torch.save`` of an expanded view, ``.metadata`` re-pickled with the real
DCP classes and edited sizes); safetensors headers written by hand; a shardsafe manifest
forged with its checksums recomputed. Every conversion of such a file runs in a child
process (``tests/isolated.py``) under a memory bound and a time bound: it must end in a
``CheckpointCorruptError`` that names the problem, without a signal (the SIGSEGV of
``drop_pages`` over an expanded view), an allocation torch refuses, or a change to the
interpreter.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import pickle
import struct
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

# What torch.load(mmap=True) imports lazily: imported with this module, before the child's
# first fingerprint, so that torch's own import does not read as a change an attack made.
import torch.utils.serialization

import shardsafe
from shardsafe import cli
from shardsafe.converters import read_source
from shardsafe.converters.bounds import view_span
from shardsafe.converters.torch_file import drop_pages, page_span
from shardsafe.errors import CheckpointCorruptError
from tests import forge
from tests.isolated import Outcome, run_isolated
from tests.s3server import S3Server

pytestmark = pytest.mark.timeout(300)

# The first call of _get_layout (unpickling a DCP .metadata) fills torch's own cache of
# layouts: fill it now, with this module's import, for the same reason as above.
torch.serialization._get_layout("torch.strided")  # type: ignore[no-untyped-call]

CORRUPT = "shardsafe.errors.CheckpointCorruptError"
BOUND = 512 << 20
"""The child's memory bound: far below the 8 GiB the hostile files declare."""
EIGHT_GIB_FLOATS = 2**31
FORMATS = ["shardsafe", "hf", "dcp", "torch"]


# -- what runs in the child (module level, so that the child can find it)


def convert_case(
    src: str, dst: str, to: str, options: dict[str, Any] | None = None
) -> list[tuple[str, int]]:
    """``shardsafe.convert`` with ``options``; the files it wrote."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # --to torch: the pickle note
        return shardsafe.convert(src, dst, to=to, progress=False, **(options or {})).files


def convert_and_compare(src: str, dst: str, to: str) -> dict[str, bool]:
    """Convert, read the output back (through the converters' own readers), and say for
    each of :func:`views` whether it came back bitwise equal to ``tensor.contiguous()``."""
    convert_case(src, dst, to)
    with read_source(dst) as back:
        return {
            name: same_bytes(back.tensors[f"model/{name}"].load_whole(), tensor)
            for name, tensor in views().items()
        }


def drop_each_and_read_all(path: str) -> dict[str, bool]:
    """Map ``path``, then drop the pages of each tensor in turn, reading every tensor
    after each drop: all must still hold what was saved."""
    expected = views()
    mapped = torch.load(path, mmap=True, weights_only=True)
    intact = dict.fromkeys(expected, True)
    for dropped in mapped.values():
        drop_pages(dropped)
        for name, tensor in mapped.items():
            intact[name] = intact[name] and same_bytes(tensor, expected[name])
    return intact


def resident_file_kib(path: str) -> tuple[int, int]:
    """``RssFile`` (KiB) of this process with a mapped tensor read, then after its pages
    are dropped."""
    tensor = torch.load(path, mmap=True, weights_only=True)["big"]
    tensor.sum()  # fault every page in
    touched = _rss_file_kib()
    drop_pages(tensor)
    return touched, _rss_file_kib()


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("RssFile:"))
    return int(line.split()[1])


# -- building inputs


def views() -> dict[str, torch.Tensor]:
    """Tensors that are not plain contiguous ones: views of one storage (transposed,
    strided, a tail, a row), an overlapping one of modest size, and small tensors whose
    records share pages with their neighbours'."""
    torch.manual_seed(0)
    base = torch.randn(64, 1024)  # 256 KiB: many pages
    return {
        "base": base,
        "transposed": base.t(),
        "every_third": base[:, ::3],
        "tail": base[40:],
        "row": base[7],
        "expanded": torch.arange(3.0).expand(1000, 3),
        "small": torch.tensor([1.0, 2.0, 3.0]),
        "ints": torch.arange(10)[::2],
    }


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat = (a.contiguous().reshape(-1), b.contiguous().reshape(-1))
    return torch.equal(flat[0].view(torch.uint8), flat[1].view(torch.uint8))


def save(path: Path, tree: dict[str, Any]) -> str:
    torch.save(tree, path)
    return str(path)


def expanded_file(path: Path, n: int = EIGHT_GIB_FLOATS) -> str:
    """A torch.save file of a few KiB whose one tensor declares ``n`` float32s."""
    return save(path, {"w": torch.zeros(1).expand(n)})


def crafted_torch_file(path: Path, size: tuple[int, ...], stride: tuple[int, ...]) -> str:
    """A torch.save archive of ``{"w": <one float32 viewed with size and stride>}``,
    pickled as torch.save pickles tensors, for sizes torch.save itself cannot make."""
    import collections
    import zipfile

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if obj is not marker:
                return NotImplemented
            args: tuple[Any, ...] = (storage, 0, size, stride, False, collections.OrderedDict())
            return torch._utils._rebuild_tensor_v2, args

        def persistent_id(self, obj: Any) -> Any:
            return ("storage", torch.FloatStorage, "0", "cpu", 1) if obj is storage else None

    marker, storage = object(), object()
    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"w": marker})
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", buf.getvalue())
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/data/0", bytes(4))
        zf.writestr("archive/version", "3\n")
    return str(path)


def dcp_checkpoint(path: Path) -> Path:
    """A real DCP checkpoint: ``model.w`` (4 floats), ``model.b`` and the bytes item ``step``."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    state = {"model": {"w": torch.arange(4.0), "b": torch.ones(2)}, "step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group
        dcp_save(state, checkpoint_id=str(path))
    return path


def append_item(path: Path, obj: Any) -> tuple[int, int]:
    """``torch.save(obj)`` appended to the checkpoint's data file: ``(offset, length)``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = path / "__0_0.distcp"
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(buf.getvalue())
    return offset, len(buf.getvalue())


def edit_metadata(path: Path, edit: Callable[[Any], None]) -> None:
    """Re-pickle ``.metadata`` (our own file) after ``edit`` changed the real objects."""
    md = pickle.loads((path / ".metadata").read_bytes())
    edit(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


Chunk = tuple[tuple[int, ...], tuple[int, ...], int, int]
"""``(offsets, sizes, byte offset, byte length)``."""


def set_tensor(md: Any, fqn: str, size: tuple[int, ...], chunks: Sequence[Chunk]) -> None:
    """Give ``fqn`` the size and chunks (stored at the given byte ranges) in ``md``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    props = md.state_dict_metadata[fqn].properties
    for index in [i for i in md.storage_data if i.fqn == fqn]:
        del md.storage_data[index]
    md.state_dict_metadata[fqn] = TensorStorageMetadata(
        props,
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _, _ in chunks],
    )
    for offsets, _, offset, length in chunks:
        index = MetadataIndex(fqn, torch.Size(offsets))
        md.storage_data[index] = _StorageInfo("__0_0.distcp", offset, length)


def item_range(md: Any, fqn: str) -> tuple[int, int]:
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    return info.offset, info.length


def safetensors_file(path: Path, header: dict[str, Any], data: bytes = b"") -> str:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def refused(outcome: Outcome, fragment: str) -> None:
    """The attack ended in a clean CheckpointCorruptError saying ``fragment``."""
    assert outcome.exitcode == 0, outcome.describe()
    assert outcome.error == CORRUPT, outcome.describe()
    assert fragment in outcome.message, outcome.describe()
    assert outcome.changed == [], outcome.describe()


def attack(src: str, dst: Path, to: str = "shardsafe", **options: Any) -> Outcome:
    return run_isolated(convert_case, src, str(dst), to, options, memory_bytes=BOUND, seconds=120)


def destination(tmp_path: Path, to: str) -> Path:
    return tmp_path / ("out.pt" if to == "torch" else "out")


# -- torch.save files


def test_the_expanded_view_that_crashed_converts(tmp_path: Path) -> None:
    """Issue #25 item 1: a 4 MiB expanded view made drop_pages madvise 4 MiB past a
    ~6 KB mapping (SIGSEGV). It converts now, to every format, bitwise equal."""
    src = expanded_file(tmp_path / "w.pt", 2**20)
    for to in FORMATS:
        dst = tmp_path / to / ("w.pt" if to == "torch" else "out")
        dst.parent.mkdir()
        outcome = run_isolated(convert_case, src, str(dst), to, memory_bytes=BOUND)
        assert outcome.exitcode == 0 and outcome.error is None, (to, outcome.describe())
        with read_source(dst) as back:
            w = back.tensors["model/w"].load_whole()
        assert same_bytes(w, torch.zeros(2**20)), to


@pytest.mark.parametrize("to", FORMATS)
def test_views_and_shared_storage_convert_bitwise(tmp_path: Path, to: str) -> None:
    src = save(tmp_path / "views.pt", views())
    outcome = run_isolated(
        convert_and_compare, src, str(destination(tmp_path, to)), to, memory_bytes=BOUND
    )
    assert outcome.exitcode == 0 and outcome.error is None, outcome.describe()
    assert outcome.result == dict.fromkeys(views(), True)


@pytest.mark.parametrize("to", FORMATS)
def test_eight_gib_expanded_view_is_refused_in_bounded_memory(tmp_path: Path, to: str) -> None:
    src = expanded_file(tmp_path / "w.pt")
    assert os.path.getsize(src) < 4096
    outcome = attack(src, destination(tmp_path, to), to)
    refused(outcome, "untrusted_bytes_limit=1073741824")
    assert "'model/w': float32[2147483648], 8589934592 bytes made from 4 bytes" in outcome.message
    assert "w.pt" in outcome.message and "If the file is trusted" in outcome.message
    assert not destination(tmp_path, to).exists()


def test_overlapping_views_count_together_and_dry_run_refuses_too(tmp_path: Path) -> None:
    """Three 512 MiB views of 4 bytes each: each within the limit, together not."""
    one = torch.zeros(1).expand(2**27)
    src = save(tmp_path / "three.pt", {"a": one, "b": one, "c": torch.ones(4, 1).expand(4, 2**25)})
    outcome = attack(src, tmp_path / "out", dry_run=True)
    refused(outcome, "would allocate 1610612736 bytes")
    assert not (tmp_path / "out").exists()


def test_many_views_of_one_storage_count_beyond_a_tensor_and_one_alias(tmp_path: Path) -> None:
    """Each view of one storage spans its bytes of the file, so each was backed, but each
    is written whole: a 1 MB file naming one 256 KiB storage 5000 times made a 1.2 GiB
    output (20,000 views of 4 MiB: 80 GB). A tensor and one alias (tied weights) are
    free; the rest counts against the limit, and the dry run refuses too."""
    base = torch.arange(2**16, dtype=torch.float32)  # 256 KiB
    src = save(tmp_path / "shared.pt", {f"w{i}": base for i in range(5000)})
    assert os.path.getsize(src) < 2 << 20
    outcome = attack(src, tmp_path / "out", dry_run=True)
    refused(outcome, f"would allocate {4998 * 2**18} bytes")  # all but base and one alias
    assert "one of more than 2 tensors viewing one storage" in outcome.message
    assert not (tmp_path / "out").exists()
    tied = save(tmp_path / "tied.pt", {"embed": base, "head": base, "bias": torch.ones(3)})
    converted = attack(tied, tmp_path / "tied", untrusted_bytes_limit=0)
    assert converted.exitcode == 0 and converted.error is None, converted.describe()


def test_many_views_of_one_storage_in_a_dcp_bytes_item_count_alike(tmp_path: Path) -> None:
    """The same 5000 views of one 256 KiB storage, held by a DCP checkpoint's bytes item
    (DCP pickles a tuple whole): a 274 KB checkpoint converted to 1.3 GB, never counted
    against the limit that refuses the torch.save file of it."""
    import warnings

    import torch.distributed.checkpoint as dcp

    base = torch.arange(2**16, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP saves in one process
        dcp.save({"x": tuple([base] * 5000)}, checkpoint_id=str(tmp_path / "dcp"))
    assert sum(f.stat().st_size for f in (tmp_path / "dcp").iterdir()) < 2 << 20
    outcome = attack(tmp_path / "dcp", tmp_path / "out", dry_run=True)
    refused(outcome, f"would allocate {4998 * 2**18} bytes")
    assert not (tmp_path / "out").exists()


def test_the_limit_is_an_option(tmp_path: Path) -> None:
    """4 MiB of expanded view: refused at 1 MiB, converted at 8 MiB and by default."""
    src = expanded_file(tmp_path / "w.pt", 2**20)
    refused(attack(src, tmp_path / "a", untrusted_bytes_limit=1 << 20), "4194304 bytes")
    outcome = attack(src, tmp_path / "b", untrusted_bytes_limit=8 << 20)
    assert outcome.exitcode == 0 and outcome.error is None, outcome.describe()
    with pytest.raises(ValueError, match="untrusted_bytes_limit"):
        shardsafe.convert(src, tmp_path / "c", untrusted_bytes_limit=-1)


def test_the_command_line_takes_the_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = expanded_file(tmp_path / "w.pt", 2**20)
    assert cli.main(["convert", src, str(tmp_path / "o"), "--untrusted-bytes-limit", "0"]) == 1
    err = capsys.readouterr().err
    assert "untrusted_bytes_limit=0" in err and "--untrusted-bytes-limit" in err
    assert cli.main(["convert", src, str(tmp_path / "o"), "--untrusted-bytes-limit", "x"]) == 2
    assert "not a number of bytes" in capsys.readouterr().err
    outcome = run_isolated(
        cli.main, ["convert", src, str(tmp_path / "o"), "--untrusted-bytes-limit", "8MiB"]
    )
    assert outcome.exitcode == 0 and outcome.result == 0, outcome.describe()


@pytest.mark.parametrize(
    ("tensor", "fragment"),
    [
        (torch.zeros(1).expand(2**61), "too large for any tensor"),
        (torch.zeros(1).reshape([1] * 65), "has 65 dimensions, more than the 64"),
    ],
    ids=["overflowing-bytes", "too-many-dims"],
)
def test_impossible_sizes_in_a_torch_file(
    tmp_path: Path, tensor: torch.Tensor, fragment: str
) -> None:
    src = save(tmp_path / "w.pt", {"w": tensor})
    outcome = attack(src, tmp_path / "out")
    refused(outcome, fragment)
    assert "w.pt" in outcome.message and "'model/w'" in outcome.message


def test_sizes_torch_cannot_count_in_a_torch_file(tmp_path: Path) -> None:
    """[2**62, 2**62] over one element (strides 0): numel overflows int64."""
    src = crafted_torch_file(tmp_path / "w.pt", (2**62, 2**62), (0, 0))
    refused(attack(src, tmp_path / "out"), "w.pt")


# -- drop_pages


def test_page_span_stays_inside_each_storage(tmp_path: Path) -> None:
    """Only whole pages inside the storage, reached by the view; none for a one-element
    view, whatever it declares."""
    path = save(tmp_path / "views.pt", {**views(), "huge": torch.zeros(1).expand(2**40)})
    page = mmap.PAGESIZE
    for name, tensor in torch.load(path, mmap=True, weights_only=True).items():
        span = page_span(tensor)
        storage = tensor.untyped_storage()
        base, size = storage.data_ptr(), storage.nbytes()
        first, end = view_span(tensor)
        if span is None:
            assert (end - first) < 2 * page or name in ("huge", "expanded"), name
            continue
        start, stop = span
        assert start % page == 0 and stop % page == 0, name
        assert base <= start < stop <= base + size, name
        assert start < base + end and stop > base + first, name  # it holds reached bytes
    assert page_span(torch.zeros(1).expand(2**40)) is None


def test_drop_pages_calls_madvise_only_inside_the_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardsafe.converters import torch_file

    calls: list[tuple[int, int, int]] = []

    class FakeLibc:
        def madvise(self, address: int, length: int, advice: int) -> int:
            calls.append((address, length, advice))
            return 0

    monkeypatch.setattr(torch_file, "_libc", FakeLibc())
    monkeypatch.setattr(sys, "platform", "linux")
    path = save(tmp_path / "w.pt", {"w": torch.zeros(1).expand(2**40), "big": torch.ones(1 << 16)})
    mapped = torch.load(path, mmap=True, weights_only=True)
    drop_pages(mapped["w"])
    assert calls == []
    drop_pages(mapped["big"])
    ((address, length, advice),) = calls
    storage = mapped["big"].untyped_storage()
    assert storage.data_ptr() <= address and address + length <= storage.data_ptr() + (1 << 18)
    assert length >= (1 << 18) - 2 * mmap.PAGESIZE and advice == 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_drop_pages_leaves_every_neighbour_intact(tmp_path: Path) -> None:
    path = save(tmp_path / "views.pt", views())
    outcome = run_isolated(drop_each_and_read_all, path, memory_bytes=BOUND)
    assert outcome.exitcode == 0 and outcome.error is None, outcome.describe()
    assert outcome.result == dict.fromkeys(views(), True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_drop_pages_gives_the_pages_back(tmp_path: Path) -> None:
    path = save(tmp_path / "big.pt", {"big": torch.ones(8 << 20)})  # 32 MiB
    outcome = run_isolated(resident_file_kib, path, memory_bytes=BOUND)
    assert outcome.exitcode == 0 and outcome.error is None, outcome.describe()
    touched, after = outcome.result
    assert touched - after > 24 << 10, outcome.result


# -- DCP


def test_dcp_chunk_of_an_expanded_view_is_refused(tmp_path: Path) -> None:
    """An item's bytes replaced by torch.save of an 8 GiB expanded view (~1.5 KB), the
    metadata edited to declare it."""
    path = dcp_checkpoint(tmp_path / "dcp")
    offset, length = append_item(path, torch.zeros(1).expand(EIGHT_GIB_FLOATS))
    size = (EIGHT_GIB_FLOATS,)
    edit_metadata(path, lambda md: set_tensor(md, "model.w", size, [((0,), size, offset, length)]))
    for to in ("shardsafe", "hf"):
        outcome = attack(str(path), destination(tmp_path, to), to)
        refused(outcome, f"8589934592 bytes made from {length} bytes of")
        assert "__0_0.distcp" in outcome.message and "untrusted_bytes_limit" in outcome.message


def test_dcp_tensor_assembled_from_chunks_is_bounded(tmp_path: Path) -> None:
    """``load_whole``'s torch.empty(shape): a real 4-float chunk plus an expanded one."""
    path = dcp_checkpoint(tmp_path / "dcp")
    offset, length = append_item(path, torch.zeros(1).expand(EIGHT_GIB_FLOATS - 4))

    def edit(md: Any) -> None:
        w_offset, w_length = item_range(md, "model.w")
        chunks = [((0,), (4,), w_offset, w_length), ((4,), (EIGHT_GIB_FLOATS - 4,), offset, length)]
        set_tensor(md, "model.w", (EIGHT_GIB_FLOATS,), chunks)

    edit_metadata(path, edit)
    refused(attack(str(path), tmp_path / "out", "hf"), "untrusted_bytes_limit")


def test_dcp_range_past_the_file_end_counts_only_what_is_there(tmp_path: Path) -> None:
    """The metadata claims 8 GiB of bytes for an 8 GiB chunk; the file ends after 1.5 KB."""
    path = dcp_checkpoint(tmp_path / "dcp")
    offset, length = append_item(path, torch.zeros(1).expand(EIGHT_GIB_FLOATS))
    size = (EIGHT_GIB_FLOATS,)
    chunk = ((0,), size, offset, 4 * EIGHT_GIB_FLOATS)
    edit_metadata(path, lambda md: set_tensor(md, "model.w", size, [chunk]))
    refused(attack(str(path), tmp_path / "out", "hf"), f"made from {length} bytes")


def test_dcp_items_sharing_bytes_are_refused(tmp_path: Path) -> None:
    path = dcp_checkpoint(tmp_path / "dcp")

    def edit(md: Any) -> None:
        offset, length = item_range(md, "model.w")
        chunks = [((0,), (4,), offset, length), ((4,), (4,), offset, length)]
        set_tensor(md, "model.w", (8,), chunks)

    edit_metadata(path, edit)
    refused(attack(str(path), tmp_path / "out"), "share bytes of __0_0.distcp")


def test_dcp_bytes_item_holding_an_expanded_view_is_refused(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    path = dcp_checkpoint(tmp_path / "dcp")
    offset, length = append_item(path, (torch.zeros(1).expand(EIGHT_GIB_FLOATS),))

    def edit(md: Any) -> None:
        md.storage_data[MetadataIndex("step")] = _StorageInfo("__0_0.distcp", offset, length)

    edit_metadata(path, edit)
    refused(attack(str(path), tmp_path / "out"), "'step/0': float32[2147483648]")


@pytest.mark.parametrize(
    ("size", "chunked", "fragment"),
    [
        ((2**62, 2**62), True, "too large for any tensor"),
        ((2**62, 2**62, 0), False, "too large for any tensor"),
        ((2**61,), True, "too large for any tensor"),
        ((1,) * 65, True, "has 65 dimensions"),
    ],
    ids=["huge", "huge-and-empty", "bytes-overflow", "too-many-dims"],
)
def test_dcp_metadata_with_impossible_sizes(
    tmp_path: Path, size: tuple[int, ...], chunked: bool, fragment: str
) -> None:
    path = dcp_checkpoint(tmp_path / "dcp")

    def edit(md: Any) -> None:
        offset, length = item_range(md, "model.w")
        zeros = (0,) * len(size)
        set_tensor(md, "model.w", size, [(zeros, size, offset, length)] if chunked else [])

    edit_metadata(path, edit)
    outcome = attack(str(path), tmp_path / "out")
    refused(outcome, fragment)
    assert ".metadata is not valid DCP metadata: 'model.w'" in outcome.message


# -- Hugging Face and shardsafe sources


@pytest.mark.parametrize(
    ("shape", "fragment"),
    [([2**62, 2**62, 0], "too large for any tensor"), ([1] * 65, "invalid shape")],
    ids=["huge-and-empty", "too-many-dims"],
)
def test_safetensors_header_with_impossible_sizes(
    tmp_path: Path, shape: list[int], fragment: str
) -> None:
    header = {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}
    src = safetensors_file(tmp_path / "w.safetensors", header)
    outcome = attack(src, tmp_path / "out")
    refused(outcome, fragment)
    assert "w.safetensors" in outcome.message


def test_safetensors_header_cannot_declare_more_than_the_file(tmp_path: Path) -> None:
    header = {"w": {"dtype": "F32", "shape": [EIGHT_GIB_FLOATS], "data_offsets": [0, 16]}}
    src = safetensors_file(tmp_path / "w.safetensors", header, bytes(16))
    refused(attack(src, tmp_path / "out"), "w.safetensors")


def test_shardsafe_manifest_cannot_declare_more_than_its_file(tmp_path: Path) -> None:
    """The engine's reader bounds a shardsafe source: a forged 8 GiB chunk is refused."""
    src = safetensors_file(
        tmp_path / "w.safetensors",
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
        bytes(16),
    )
    shardsafe.convert(src, tmp_path / "ss", progress=False)
    doc = forge.read_manifest(tmp_path / "ss")
    record = doc["tensors"]["model/w"]
    record["shape"] = record["chunks"][0]["shape"] = [EIGHT_GIB_FLOATS]
    forge.write_manifest(tmp_path / "ss", doc)
    refused(attack(str(tmp_path / "ss"), tmp_path / "out", "hf"), "larger than file")


# -- object stores: read whole, not mapped


def test_torch_file_on_an_object_store(tmp_path: Path, s3_server: S3Server, s3_bucket: str) -> None:
    """The same rule for a file read whole from an object store (no drop_pages there)."""
    s3_server.put(s3_bucket, "w.pt", Path(expanded_file(tmp_path / "w.pt", 2**20)).read_bytes())
    url = f"s3://{s3_bucket}/w.pt"
    with pytest.raises(CheckpointCorruptError, match="made from 4 bytes"):
        shardsafe.convert(url, tmp_path / "a", progress=False, untrusted_bytes_limit=1 << 20)
    shardsafe.convert(url, tmp_path / "b", progress=False)
    with read_source(tmp_path / "b") as back:
        assert same_bytes(back.tensors["model/w"].load_whole(), torch.zeros(2**20))
