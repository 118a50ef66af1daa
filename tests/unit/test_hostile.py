"""Hostile checkpoints (a downloaded checkpoint is untrusted input), beyond the damaged ones
of ``test_bad_checkpoints.py`` and the manifest parser cases of ``test_manifest.py``.

Every load here goes through ``shardsafe.load`` on real files and must

* raise a specific :class:`CheckpointCorruptError` (not the base class, which is what an
  unexpected ``TypeError`` or ``RecursionError`` inside the engine would surface as),
  with a message naming the problem;
* open nothing outside the checkpoint directory (every ``open`` is recorded by an audit
  hook, as in ``test_bad_checkpoints.py``);
* allocate nothing large: loads run under :func:`bounded_memory`, which lowers
  ``RLIMIT_AS`` to what the process has mapped plus 512 MiB, so any large allocation
  fails at once (its error would not be a CheckpointCorruptError), and which also checks
  that resident memory did not grow by more than 64 MiB;
* finish: a FIFO in place of a file must not block ``open`` forever.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import shardsafe
from shardsafe import CheckpointCorruptError, CheckpointError
from shardsafe.checkpoint.format.manifest import crc_block_count
from shardsafe.checkpoint.io.reader import CheckpointReader
from shardsafe.checkpoint.loading import read_manifest
from shardsafe.checkpoint.storage.local import LocalStorage
from shardsafe.checkpoint.verifying import find_problems
from tests import forge
from tests.opens import outside, recorded_opens

pytestmark = pytest.mark.timeout(60)

HEADROOM = 512 << 20
RSS_GROWTH = 64 << 20


@contextlib.contextmanager
def bounded_memory() -> Iterator[None]:
    """No single allocation of more than HEADROOM can succeed inside; RSS stays flat."""
    proc = psutil.Process()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = proc.memory_info().vms + HEADROOM
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    rss = proc.memory_info().rss
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    grown = proc.memory_info().rss - rss
    assert grown < RSS_GROWTH, f"resident memory grew by {grown >> 20} MiB"


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


VALUE = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB, returned by load unasked


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make_model()
    root = tmp_path_factory.mktemp("pristine")
    for layout in ("sharded", "consolidated"):
        shardsafe.save(
            root / layout,
            {"model": model, "x": VALUE, "cfg": {"lr": 0.1, "name": "run"}},
            layout=layout,
        )
    return {"root": root, "model": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.fixture
def copy_of(pristine: dict[str, Any], tmp_path: Path) -> Callable[[str], Path]:
    def make(layout: str) -> Path:
        dest = tmp_path / "downloads" / layout
        shutil.copytree(pristine["root"] / layout, dest)
        return dest

    return make


def data_file(ckpt: Path, layout: str) -> Path:
    """The file holding the model weights (and, sharded, everything else)."""
    return ckpt / (
        "shard-00000-of-00001.safetensors" if layout == "sharded" else "model.safetensors"
    )


def value_file(ckpt: Path, layout: str) -> tuple[Path, str]:
    """The file and in-file name of the plain value tensor ``x``."""
    if layout == "sharded":
        return ckpt / "shard-00000-of-00001.safetensors", "x"
    return ckpt / "x.safetensors", "x"


def manifest(ckpt: Path) -> dict[str, Any]:
    """The manifest's document, version 2's chunk table expanded (see ``tests/forge.py``)."""
    return forge.read_manifest(ckpt)


def write_manifest(ckpt: Path, doc: dict[str, Any]) -> None:
    """Write a forged manifest: with its checksum recomputed (see ``tests/forge.py``)."""
    forge.write_manifest(ckpt, doc)


def split(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def rewrite(ckpt: Path, path: Path, header_bytes: bytes, data: bytes) -> None:
    """Replace a data file's header and record its new size and header checksum, as a
    forger would, so that the header parser is what must catch the problem."""
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)
    forge.resign_file(ckpt, path)


def fresh_state() -> dict[str, Any]:
    torch.manual_seed(1)
    return {"model": make_model()}


def load_refused(ckpt: Path) -> CheckpointCorruptError:
    """Load a hostile checkpoint: a CheckpointCorruptError, bounded memory, nothing
    restored, nothing outside the directory opened."""
    state = fresh_state()
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with bounded_memory(), recorded_opens() as opened, pytest.raises(CheckpointError) as info:
        shardsafe.load(ckpt, state)
    assert type(info.value) is CheckpointCorruptError, f"{type(info.value).__name__}: {info.value}"
    assert outside(opened, ckpt) == []
    for k, v in state["model"].state_dict().items():
        assert torch.equal(v, before[k]), k
    return info.value


def test_the_memory_guard_stops_a_large_allocation() -> None:
    """The guard itself: without it the checks below could not fail on an allocation."""
    with pytest.raises(RuntimeError, match="can't allocate"), bounded_memory():
        torch.empty(1 << 31, dtype=torch.uint8)
    with bounded_memory():
        torch.empty(64 << 20, dtype=torch.uint8)  # while modest ones still work


def test_the_pristine_copies_load_under_the_guard(copy_of: Any, pristine: dict[str, Any]) -> None:
    for layout in ("sharded", "consolidated"):
        state = fresh_state()
        with bounded_memory():
            out = shardsafe.load(copy_of(layout), state)
        assert torch.equal(out["x"], VALUE)
        for k, v in state["model"].state_dict().items():
            assert torch.equal(v, pristine["model"][k])


# ------------------------------------------------------------- size and allocation claims


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_a_terabyte_tensor_backed_by_a_tiny_file_fails_before_allocating(
    copy_of: Any, layout: str
) -> None:
    """The manifest claims a 1 TiB plain value and a data file big enough to hold it; the
    real file has 256 KiB. Load (which returns plain values unasked) and the verifiers
    must notice the file before allocating anything of the claimed size."""
    ckpt = copy_of(layout)
    path, _ = value_file(ckpt, layout)
    doc = manifest(ckpt)
    numel = 1 << 38
    rec = doc["tensors"]["x"]
    rec["shape"] = [numel]
    rec["chunks"][0]["shape"] = [numel]
    block = doc["checksum"]["block_bytes"]
    rec["chunks"][0]["crc32"] = [0] * crc_block_count(numel * 4, block)
    doc["files"][path.name]["bytes"] = numel * 4 + 4096
    write_manifest(ckpt, doc)

    err = load_refused(ckpt)
    # Refused while planning, before any data file is opened: no live tensor bounds it.
    assert "would make rank 0 allocate 1024.00 GiB for tensors whose size only" in str(err)
    with bounded_memory():
        problems = find_problems(str(ckpt), read_manifest(ckpt))  # what `shardsafe verify` runs
        with CheckpointReader(LocalStorage(str(ckpt)), read_manifest(ckpt)) as reader:
            found = reader.verify_all()
    assert any("bytes but the manifest recorded" in p for p in problems), problems
    assert any("bytes but the manifest recorded" in p for p in found), found


@pytest.mark.parametrize("across", ["one tensor", "two tensors"])
def test_chunks_that_alias_one_stored_tensor_are_refused(copy_of: Any, across: str) -> None:
    """4096 chunks naming the same 256 KiB stored tensor would make load allocate 1 GiB
    (with 65536 chunks, 16 GiB) from a 256 KiB file, every checksum matching."""
    ckpt = copy_of("sharded")
    doc = manifest(ckpt)
    rec = doc["tensors"]["x"]
    (c0,) = rec["chunks"]
    n = VALUE.numel()
    if across == "one tensor":
        copies = 4096
        rec["shape"] = [n * copies]
        rec["chunks"] = [dict(c0, offsets=[i * n]) for i in range(copies)]
    else:
        doc["tensors"]["y"] = json.loads(json.dumps(rec))
        doc["values"]["y"] = {"kind": "value", "meta": {"__tensor__": "y"}}
    write_manifest(ckpt, doc)
    err = load_refused(ckpt)
    assert "manifest.json is malformed" in str(err)
    assert f"stored tensor {c0['name']!r} of {c0['file']}" in str(err)


def test_header_entries_that_alias_the_same_bytes_are_refused(copy_of: Any) -> None:
    """The same amplification through the data file: 4096 header entries, distinct names,
    all pointing at the same 256 KiB (1 GiB to allocate); the manifest's chunks name
    distinct entries."""
    ckpt = copy_of("consolidated")
    path, name = value_file(ckpt, "consolidated")
    header, data = split(path)
    copies = 4096
    for i in range(1, copies):
        header[f"x{i}"] = header[name]
    doc = manifest(ckpt)
    rec = doc["tensors"]["x"]
    (c0,) = rec["chunks"]
    rec["shape"] = [VALUE.numel() * copies]
    rec["chunks"] = [
        dict(c0, name=name if i == 0 else f"x{i}", offsets=[i * VALUE.numel()])
        for i in range(copies)
    ]
    write_manifest(ckpt, doc)
    rewrite(ckpt, path, json.dumps(header).encode(), data)
    err = load_refused(ckpt)
    assert f"{path.name}: tensor" in str(err) and "overlaps" in str(err)


def test_many_references_to_one_tensor_read_it_once(copy_of: Any) -> None:
    """Value metadata may name one tensor many times (legitimately: a list holding the same
    tensor twice). Each reference must not reread it: 4000 references in a 90 KB manifest
    would otherwise make load read 4000 x 256 KiB = 1 GiB."""
    ckpt = copy_of("consolidated")
    doc = manifest(ckpt)
    doc["values"]["cfg"]["meta"] = [{"__tensor__": "x"}] * 4000
    write_manifest(ckpt, doc)
    io = psutil.Process().io_counters
    before = io().read_chars
    with bounded_memory():
        out = shardsafe.load(ckpt, fresh_state())
    read = io().read_chars - before
    assert len(out["cfg"]) == 4000 and all(t is out["x"] for t in out["cfg"])
    assert torch.equal(out["x"], VALUE)
    on_disk = sum(p.stat().st_size for p in ckpt.iterdir())
    assert read < 2 * on_disk, f"read {read >> 20} MiB from a {on_disk >> 10} KiB checkpoint"


# ------------------------------------------------------------------- the data file header


def _with_header(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path, Path], None]:
    def apply(ckpt: Path, path: Path) -> None:
        header, data = split(path)
        edited = edit(header)
        raw = edited if isinstance(edited, bytes) else json.dumps(header).encode()
        rewrite(ckpt, path, raw, data)

    return apply


def _raw_header(make: Callable[[bytes], bytes]) -> Callable[[Path, Path], None]:
    def apply(ckpt: Path, path: Path) -> None:
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        rewrite(ckpt, path, make(raw[8 : 8 + n]), raw[8 + n :])

    return apply


def _declared_length(length: int) -> Callable[[Path, Path], None]:
    def apply(ckpt: Path, path: Path) -> None:
        raw = bytearray(path.read_bytes())
        raw[:8] = struct.pack("<Q", length)
        path.write_bytes(raw)

    return apply


def _set_entry(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        header["0.weight" if "0.weight" in header else "model/0.weight"][field] = value

    return edit


def _nest(depth: int) -> Callable[[dict[str, Any]], bytes]:
    def edit(header: dict[str, Any]) -> bytes:
        text = json.dumps(dict(header, __metadata__="NEST"))
        return text.replace('"NEST"', "[" * depth + "]" * depth).encode()

    return edit


def _duplicate_name(raw: bytes) -> bytes:
    # Rename one tensor to another's name, same length: valid JSON with a duplicate key.
    for a, b in ((b'"2.weight"', b'"0.weight"'), (b'"model/2.weight"', b'"model/0.weight"')):
        if a in raw:
            return raw.replace(a, b)
    raise AssertionError("no tensor to rename")


HEADER_CASES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "header JSON cut short": (_raw_header(lambda h: h[: len(h) // 2]), "damaged safetensors"),
    "header length 0": (_declared_length(0), "damaged safetensors header"),
    "header length past the end": (_declared_length(1 << 30), "truncated or damaged safetensors"),
    "header length 2**64-1": (_declared_length(2**64 - 1), "truncated or damaged safetensors"),
    "duplicate tensor names": (_raw_header(_duplicate_name), "damaged safetensors header"),
    "non-UTF-8 header": (_raw_header(lambda h: h.replace(b'"F32"', b'"F\xff2"', 1)), "damaged"),
    "nested 100000 deep": (_with_header(_nest(100_000)), "damaged safetensors"),
    "header is a list": (_raw_header(lambda h: b"[" + h + b"]"), "header is not an object"),
    "dtype F16 for F32 bytes": (_with_header(_set_entry("dtype", "F16")), "shape and dtype need"),
    "dtype unknown": (_with_header(_set_entry("dtype", "F128")), "unknown dtype"),
    "dtype not a string": (_with_header(_set_entry("dtype", {"F32": 1})), "unknown dtype"),
    "negative dim": (_with_header(_set_entry("shape", [-32, -16])), "invalid shape"),
    "huge dims": (_with_header(_set_entry("shape", [2**62, 2**62])), "shape and dtype need"),
    "negative offset": (_with_header(_set_entry("data_offsets", [-8, 2040])), "claims bytes"),
    "offsets past the end": (_with_header(_set_entry("data_offsets", [0, 2**62])), "claims bytes"),
    "offsets reversed": (_with_header(_set_entry("data_offsets", [2048, 0])), "claims bytes"),
    "offsets not ints": (_with_header(_set_entry("data_offsets", [0.0, 2048.0])), "data_offsets"),
}


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_a_hostile_safetensors_header(copy_of: Any, layout: str, case: str) -> None:
    ckpt = copy_of(layout)
    path = data_file(ckpt, layout)
    damage, fragment = HEADER_CASES[case]
    damage(ckpt, path)
    err = load_refused(ckpt)
    assert path.name in str(err) and fragment in str(err), str(err)


# ------------------------------------------------------- files that are not regular files


@pytest.mark.parametrize("which", ["data", "manifest"])
def test_a_fifo_instead_of_a_file_does_not_block(copy_of: Any, which: str) -> None:
    """A tar archive can hold named pipes; opening one for reading waits for a writer."""
    ckpt = copy_of("sharded")
    path = data_file(ckpt, "sharded") if which == "data" else ckpt / "manifest.json"
    path.unlink()
    os.mkfifo(path)
    err = load_refused(ckpt)
    assert f"{path.name} is not a regular file" in str(err)


def test_a_directory_instead_of_a_data_file(copy_of: Any) -> None:
    ckpt = copy_of("consolidated")
    path = data_file(ckpt, "consolidated")
    path.unlink()
    path.mkdir()
    err = load_refused(ckpt)
    assert f"{path.name} is not a regular file" in str(err)


@pytest.mark.parametrize("target", ["outside file", "relative ..", "/dev/zero", "dangling"])
@pytest.mark.parametrize("which", ["data", "manifest"])
def test_symlinks_out_of_the_directory_are_not_followed(
    copy_of: Any, which: str, target: str
) -> None:
    ckpt = copy_of("sharded")
    path = data_file(ckpt, "sharded") if which == "data" else ckpt / "manifest.json"
    decoy = ckpt.parent / f"decoy-{path.name}"
    shutil.copyfile(path, decoy)
    link = {
        "outside file": str(decoy),
        "relative ..": os.path.join("..", decoy.name),
        "/dev/zero": "/dev/zero",
        "dangling": str(ckpt.parent / "nothing-here"),
    }[target]
    path.unlink()
    path.symlink_to(link)
    err = load_refused(ckpt)
    assert f"{path.name} is a symbolic link" in str(err)


# ------------------------------------------------------------------- value metadata


@pytest.mark.parametrize(
    ("meta", "fragment"),
    [
        ({"__tensor__": [1]}, "malformed __tensor__ value"),
        ({"__tensor__": {"x": 1}}, "malformed __tensor__ value"),
        ({"__tensor__": "nope"}, "value 'cfg' refers to tensor 'nope', which the manifest"),
        ("DEEP", "nested too deeply"),
    ],
    ids=["list ref", "dict ref", "unknown ref", "deep"],
)
def test_hostile_metadata_of_a_plain_value(copy_of: Any, meta: Any, fragment: str) -> None:
    """Plain values come back from load even when not asked for, so their metadata is
    decoded for any caller. 600 levels are within what JSON parsing accepts but beyond
    what decoding them recursively survives."""
    ckpt = copy_of("consolidated")
    doc = manifest(ckpt)
    doc["values"]["cfg"]["meta"] = meta
    doc.pop(forge.CRC_KEY)
    text = json.dumps(forge.pack(doc)).replace('"DEEP"', "[" * 600 + "]" * 600)
    (ckpt / "manifest.json").write_bytes(forge.sign(text))
    err = load_refused(ckpt)
    assert fragment in str(err), str(err)


# --------------------------------------------------------------------- property test


@pytest.fixture(scope="module")
def header_victim(pristine: dict[str, Any]) -> dict[str, Any]:
    ckpt = pristine["root"] / "sharded"
    path = data_file(ckpt, "sharded")
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return {"ckpt": ckpt, "raw": raw, "end": 8 + n, "doc": manifest(ckpt)}


_INTERESTING = st.one_of(
    st.integers(-(2**64), 2**64),
    st.sampled_from([0, 1, 4, 8, 2047, 2048, 2049, 2**31, 2**63 - 1, 2**63, -1]),
    st.sampled_from(["F32", "F16", "BF16", "I32", "I64", "U8", "BOOL", "F8_E4M3", "x", ""]),
    st.lists(st.integers(-4, 2**33), max_size=3),
    st.none(),
)


def _mutate_bytes(raw: bytearray, end: int, data: st.DataObject) -> bytearray:
    """Flip, overwrite, insert or delete bytes of the length prefix and JSON header."""
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        pos = data.draw(st.integers(0, end - 1), label="pos")
        kind = data.draw(st.sampled_from(["flip", "byte", "insert", "delete"]), label="kind")
        if kind == "flip":
            raw[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif kind == "byte":
            raw[pos] = data.draw(st.sampled_from(b'0129"{}[],:-eE .\xff\x00'), label="byte")
        elif kind == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=3), label="bytes")
            end += 1
        else:
            del raw[pos]
            end -= 1
    return raw


def _mutate_fields(raw: bytearray, end: int, data: st.DataObject) -> bytearray:
    """Replace, add or drop fields of tensor entries in the JSON header; re-encode it."""
    header = json.loads(raw[8:end])
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        name = data.draw(st.sampled_from(sorted(header)), label="tensor")
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "other"]))
        if not isinstance(header[name], dict) or data.draw(st.booleans(), label="whole"):
            header[name] = data.draw(_INTERESTING, label="entry")
        elif field in ("shape", "data_offsets") and data.draw(st.booleans(), label="one"):
            values = header[name].get(field)
            if isinstance(values, list) and values:
                i = data.draw(st.integers(0, len(values) - 1), label="index")
                values[i] = data.draw(_INTERESTING, label="item")
        else:
            header[name][field] = data.draw(_INTERESTING, label="value")
    text = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(text)) + text + raw[end:])


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.data())
def test_mutated_headers_load_exactly_or_raise_corrupt(
    header_victim: dict[str, Any], pristine: dict[str, Any], tmp_path: Path, data: st.DataObject
) -> None:
    """Mutate the length prefix and JSON header of a real data file, byte by byte or field
    by field (the manifest's recorded size follows the file, so the header parser is
    reached): load either returns exactly the saved state, or raises
    CheckpointCorruptError and restores nothing; `shardsafe verify` then reports a
    problem too; no other exception escapes; nothing large is allocated."""
    mutate = data.draw(st.sampled_from([_mutate_bytes, _mutate_fields]), label="how")
    raw = mutate(bytearray(header_victim["raw"]), header_victim["end"], data)
    ckpt = tmp_path / f"mutant-{len(list(tmp_path.iterdir()))}"
    ckpt.mkdir()
    path = data_file(ckpt, "sharded")
    path.write_bytes(raw)
    doc = json.loads(json.dumps(header_victim["doc"]))
    doc["files"][path.name]["bytes"] = max(len(raw), 8)
    write_manifest(ckpt, doc)
    forge.resign_file(ckpt, path)

    state = fresh_state()
    try:
        with bounded_memory():
            out = shardsafe.load(ckpt, state)
    except CheckpointError as e:
        assert type(e) is CheckpointCorruptError, f"{type(e).__name__}: {e}"
        event(f"refused: {str(e).split(': ', 1)[-1][:40]}")
        with bounded_memory():
            assert find_problems(str(ckpt), read_manifest(ckpt)), "verify passed what load refused"
        return
    event("loaded")
    assert torch.equal(out["x"], VALUE)
    for k, v in state["model"].state_dict().items():
        assert torch.equal(v, pristine["model"][k]), k
    assert math.isclose(out["cfg"]["lr"], 0.1)
