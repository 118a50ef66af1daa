"""The streaming safetensors writer and the validating header reader.

Files written piece by piece must be ordinary safetensors files: the reference
implementation (``safetensors.torch.load_file`` and ``safe_open``) reads them bitwise.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardsafe.checkpoint.format.crc import BlockCrc
from shardsafe.checkpoint.format.safetensors_header import build_header, parse_header
from shardsafe.checkpoint.format.tensor_bytes import byte_view, memory
from shardsafe.checkpoint.io.safetensors_io import StreamWriter, read_header
from shardsafe.checkpoint.storage.files import LocalFileReader
from shardsafe.checkpoint.storage.local import LocalStorage
from shardsafe.errors import CheckpointCorruptError


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 2, generator=g).half(),
        "f64": torch.tensor([1e300, -0.0, float("inf"), float("nan")], dtype=torch.float64),
        "bool": torch.tensor([[True, False, True]]),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0]),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8),
        "scalar": torch.tensor(3.25),
        "scalar_i": torch.tensor(7, dtype=torch.int32),
        "empty": torch.empty(0, 4),
        "empty_bf16": torch.empty(3, 0, dtype=torch.bfloat16),
        "c64": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
    }


def write(
    path: Path, tensors: dict[str, torch.Tensor], piece: int, block_bytes: int = 16
) -> tuple[int, dict[str, tuple[int, ...]]]:
    """Stream ``tensors`` back to back, cut into ``piece``-byte writes."""
    storage = LocalStorage(str(path.parent))
    header = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    writer = StreamWriter(storage.create(path.name), header, block_bytes)
    stream = b"".join(bytes(memory(byte_view(t.contiguous()))) for t in tensors.values())
    for start in range(0, len(stream), piece):
        writer.write(memoryview(stream[start : start + piece]))
    return writer.finish()


def block_crcs(data: bytes, block: int) -> tuple[int, ...]:
    return tuple(zlib.crc32(data[i : i + block]) for i in range(0, len(data), block)) or (0,)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert bytes(memory(byte_view(a.contiguous()))) == bytes(memory(byte_view(b.contiguous())))


@pytest.mark.parametrize("piece", [1, 7, 64, 1 << 20])
def test_streamed_file_loads_with_the_reference_implementation(tmp_path: Path, piece: int) -> None:
    tensors = sample_tensors()
    path = tmp_path / "x.safetensors"
    size, crcs = write(path, tensors, piece)
    assert size == path.stat().st_size
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert_bitwise(loaded[name], t)
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        assert f.metadata() == {"format": "pt"}
        for name, t in tensors.items():
            assert_bitwise(f.get_tensor(name), t)
        # Slicing through safe_open works too (offsets in the header are right).
        assert torch.equal(f.get_slice("f32")[1:3], tensors["f32"][1:3])
    for name, t in tensors.items():
        assert crcs[name] == block_crcs(bytes(memory(byte_view(t.contiguous()))), 16), name


def test_header_is_aligned_and_data_is_back_to_back(tmp_path: Path) -> None:
    tensors = {"a": torch.ones(3, dtype=torch.int8), "b": torch.zeros(2), "c": torch.empty(0)}
    path = tmp_path / "x.safetensors"
    write(path, tensors, 5)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    assert header["a"] == {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]}
    assert header["b"] == {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}
    assert header["c"] == {"dtype": "F32", "shape": [0], "data_offsets": [11, 11]}
    assert len(raw) == 8 + n + 11


def test_same_bytes_as_safetensors_save_file(tmp_path: Path) -> None:
    tensors = {k: v for k, v in sample_tensors().items() if k != "c64"}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write(ours, dict(sorted(tensors.items())), 3)
    save_file(tensors, str(theirs))
    a, b = load_file(str(ours)), load_file(str(theirs))
    for name in tensors:
        assert_bitwise(a[name], b[name])


def test_writing_more_or_less_than_declared_is_refused(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path))
    w = StreamWriter(storage.create("a.safetensors"), [("x", torch.float32, (2,))], 16)
    with pytest.raises(ValueError, match="more bytes written than the header declares"):
        w.write(memoryview(bytes(9)))
    w2 = StreamWriter(storage.create("b.safetensors"), [("x", torch.float32, (2,))], 16)
    w2.write(memoryview(bytes(4)))
    with pytest.raises(ValueError, match="tensor 'x' was not fully written"):
        w2.finish()


def test_block_crc_is_independent_of_how_the_stream_is_cut() -> None:
    data = bytes(range(256)) * 5
    whole = BlockCrc(64)
    whole.update(memoryview(data))
    for cut in (1, 3, 63, 64, 65, 1000):
        c = BlockCrc(64)
        for i in range(0, len(data), cut):
            c.update(memoryview(data[i : i + cut]))
        assert c.finish() == block_crcs(data, 64)
    assert whole.finish() == block_crcs(data, 64)
    assert BlockCrc(64).finish() == (0,)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.uint8]),
            st.lists(st.integers(0, 4), max_size=3),
        ),
        min_size=1,
        max_size=5,
    ),
    st.integers(1, 50),
)
def test_any_tensors_round_trip_through_the_reference_reader(
    tmp_path_factory: pytest.TempPathFactory, specs: list, piece: int
) -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {
        f"t{i}": (torch.rand(tuple(shape), generator=g) * 100).to(dtype)
        for i, (dtype, shape) in enumerate(specs)
    }
    path = tmp_path_factory.mktemp("st") / "x.safetensors"
    write(path, tensors, piece, block_bytes=8)
    loaded = load_file(str(path))
    for name, t in tensors.items():
        assert_bitwise(loaded[name], t)


# ------------------------------------------------------------------ reading headers


def reader_for(path: Path) -> LocalFileReader:
    return LocalStorage(str(path.parent)).open_reader(path.name)


def test_read_header_gives_absolute_offsets(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(4, dtype=torch.int16), "b": torch.tensor(True)}
    path = tmp_path / "x.safetensors"
    write(path, tensors, 100)
    with reader_for(path) as r:
        entries = read_header(r)
        raw = path.read_bytes()
        for name, t in tensors.items():
            e = entries[name]
            assert (e.dtype, e.shape) == (t.dtype, tuple(t.shape))
            assert raw[e.start : e.start + e.nbytes] == bytes(memory(byte_view(t)))


def _file_with_header(path: Path, header: object, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "fragment"),
    [
        ([1], b"", "header is not an object"),
        ({"x": 1}, b"", "tensor 'x' in the safetensors header is not an object"),
        ({"x": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"", "unknown dtype"),
        ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"", "invalid shape"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, b"", "invalid data_offsets"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"1234", "is truncated"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"1234", "occupies 4"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"1234", "is truncated"),
    ],
)
def test_damaged_headers_are_corruption_naming_the_file(
    tmp_path: Path, header: object, data: bytes, fragment: str
) -> None:
    path = _file_with_header(tmp_path / "bad.safetensors", header, data)
    with reader_for(path) as r, pytest.raises(CheckpointCorruptError) as info:
        read_header(r)
    assert "bad.safetensors" in str(info.value) and fragment in str(info.value)


def test_a_header_length_beyond_the_file_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with reader_for(path) as r, pytest.raises(CheckpointCorruptError, match="truncated or damaged"):
        read_header(r)
    path.write_bytes(b"abc")
    with reader_for(path) as r, pytest.raises(CheckpointCorruptError, match="3 bytes, no header"):
        read_header(r)
    path.write_bytes(struct.pack("<Q", 2) + b"\xff\xfe")
    with reader_for(path) as r, pytest.raises(CheckpointCorruptError, match="damaged safetensors"):
        read_header(r)


def test_build_header_matches_the_written_prefix(tmp_path: Path) -> None:
    entries = [("w", torch.bfloat16, (2, 3)), ("s", torch.int64, ())]
    prefix = build_header(entries)
    path = tmp_path / "x.safetensors"
    write(path, {"w": torch.zeros(2, 3, dtype=torch.bfloat16), "s": torch.tensor(1)}, 4)
    assert path.read_bytes()[: len(prefix)] == prefix


# ----------------------------------------------------- agreement with safetensors' reader


def _header_file(
    entries: list[tuple[str, str, list[int], list[int]]], meta: Any, lead: str
) -> bytes:
    header: dict[str, Any] = {} if meta is None else {"__metadata__": meta}
    for name, code, shape, offsets in entries:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": offsets}
    raw = (lead + json.dumps(header)).encode()
    data_len = max((e[3][1] for e in entries if len(e[3]) == 2), default=0)
    return struct.pack("<Q", len(raw)) + raw + bytes(max(data_len, 0))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["F32", "I64", "BF16", "U8", "F99"]),
            st.lists(st.integers(0, 3), max_size=3),
            st.integers(-2, 2),  # offset skew: 0 packs the tensors back to back
            st.integers(-2, 2),  # length skew: 0 is the size shape and dtype need
        ),
        max_size=4,
    ),
    st.sampled_from([None, {"format": "pt"}, {"format": 1}, [1]]),
    st.sampled_from(["", " "]),
)
def test_headers_shardsafe_accepts_are_exactly_those_safetensors_accepts(
    specs: list[tuple[str, list[int], int, int]], meta: Any, lead: str
) -> None:
    """shardsafe parses headers itself (``verify``'s cross-check with ``safe_open`` may not
    run under a memory limit), so its rules must be safetensors' own: same verdict on
    every header, generated around the valid layout with small defects."""
    from safetensors import deserialize

    sizes = {"F32": 4, "I64": 8, "BF16": 2, "U8": 1, "F99": 4}
    entries, pos = [], 0
    for i, (code, shape, skew, grow) in enumerate(specs):
        n = math.prod(shape) * sizes[code]
        start = max(pos + skew, 0)
        entries.append((f"t{i}", code, shape, [start, start + n + grow]))
        pos = start + n + grow
    raw = _header_file(entries, meta, lead)
    try:
        deserialize(raw)
        theirs = True
    except Exception:
        theirs = False
    (length,) = struct.unpack("<Q", raw[:8])
    try:
        parse_header("f.safetensors", raw[: 8 + length], len(raw))
        ours = True
    except CheckpointCorruptError:
        ours = False
    assert ours == theirs, (entries, meta, lead)
