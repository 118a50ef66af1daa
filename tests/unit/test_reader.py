"""``CheckpointReader``: any box of a tensor saved in several chunks, verified block by block.

The files here are written with the engine's own streaming writer and described by a
manifest that goes through ``parse``, so the reader sees exactly what a real multi-rank
save would leave behind, without needing the ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardsafe
from shardsafe.checkpoint import saving
from shardsafe.checkpoint.format.manifest import ChunkRecord, Manifest, TensorRecord, parse
from shardsafe.checkpoint.format.tensor_bytes import byte_view, memory
from shardsafe.checkpoint.io.reader import CheckpointReader
from shardsafe.checkpoint.io.safetensors_io import StreamWriter
from shardsafe.checkpoint.storage.local import LocalStorage
from shardsafe.errors import CheckpointCorruptError

BLOCK = 64
FULL = torch.arange(6 * 10 * 4, dtype=torch.float32).reshape(6, 10, 4)
# Three chunks in two files: rows 0-2 whole; rows 3-5 split along dim 1 at column 7.
CHUNKS = {
    "a.safetensors": [((0, 0, 0), (3, 10, 4))],
    "b.safetensors": [((3, 0, 0), (3, 7, 4)), ((3, 7, 0), (3, 3, 4))],
}


def write_checkpoint(root: Path) -> Path:
    storage = LocalStorage(str(root))
    storage.make_directory()
    files, records = {}, []
    for fname, boxes in CHUNKS.items():
        pieces = [
            FULL[tuple(slice(o, o + n) for o, n in zip(off, shape))].contiguous()
            for off, shape in boxes
        ]
        names = [f"t@{','.join(map(str, off))}" for off, _ in boxes]
        header = [(n, p.dtype, tuple(p.shape)) for n, p in zip(names, pieces)]
        writer = StreamWriter(storage.create(fname), header, BLOCK)
        for p in pieces:
            writer.write(memory(byte_view(p)))
        size, crcs = writer.finish()
        files[fname] = size
        records += [
            ChunkRecord(fname, n, off, shape, crcs[n]) for n, (off, shape) in zip(names, boxes)
        ]
    tensors = {"t": TensorRecord(FULL.dtype, tuple(FULL.shape), tuple(records))}
    manifest = Manifest("sharded", 2, BLOCK, {}, tensors, files, {})
    storage.commit("manifest.json", manifest.to_json())
    return root


def reader(root: Path) -> CheckpointReader:
    raw = (root / "manifest.json").read_bytes()
    return CheckpointReader(LocalStorage(str(root)), parse(raw))


@st.composite
def boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offsets, shape = [], []
    for n in FULL.shape:
        lo = draw(st.integers(0, n - 1))
        offsets.append(lo)
        shape.append(draw(st.integers(1, n - lo)))
    return tuple(offsets), tuple(shape)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("chunks"))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(boxes())
def test_any_box_reads_back_exactly(
    ckpt: Path, box: tuple[tuple[int, ...], tuple[int, ...]]
) -> None:
    offsets, shape = box
    with reader(ckpt) as r:
        got = r.read("t", offsets, shape)
    expected = FULL[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]
    assert got.shape == expected.shape and torch.equal(got, expected)


def test_whole_tensor_and_verify_all(ckpt: Path) -> None:
    with reader(ckpt) as r:
        assert torch.equal(r.read("t"), FULL)
        assert r.verify_all() == []


def test_only_the_blocks_a_read_needs_are_verified(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path / "c")
    # Damage the last row of chunk a (rows 0-2): bytes of row 2 live in its last blocks.
    path = root / "a.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(raw)
    with reader(root) as r:
        assert torch.equal(r.read("t", (0, 0, 0), (1, 10, 4)), FULL[:1])  # row 0: clean blocks
        assert torch.equal(r.read("t", (3, 0, 0), (3, 10, 4)), FULL[3:])  # other file
        with pytest.raises(CheckpointCorruptError) as info:
            r.read("t", (2, 9, 0), (1, 1, 4))
        msg = str(info.value)
        last_block = (3 * 10 * 4 * 4 - 1) // BLOCK
        assert "checksum mismatch in a.safetensors, tensor 't'" in msg
        assert f"(chunk at offsets [0, 0, 0], block {last_block})" in msg
        problems = r.verify_all()
    assert len(problems) == 1 and "a.safetensors" in problems[0] and "'t'" in problems[0]


def test_checksum_blocks_of_a_real_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(saving, "CRC_BLOCK_BYTES", BLOCK)
    w = torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16)  # one row per block
    shardsafe.save(tmp_path / "c", {"w": w}, layout="consolidated")
    manifest = shardsafe.read_manifest(tmp_path / "c")
    assert manifest.block_bytes == BLOCK and len(manifest.tensors["w"].chunks[0].crc32) == 32
    path = tmp_path / "c" / "w.safetensors"
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 32 * 64 + 20 * 64 + 3] ^= 0x01  # a byte of row 20
    path.write_bytes(raw)
    with pytest.raises(CheckpointCorruptError, match=r"w.safetensors, tensor 'w' .*block 20\)"):
        shardsafe.load(tmp_path / "c", {"w": torch.zeros(32, 16)})


@pytest.mark.parametrize(
    ("buffer_bytes", "piece"),
    [
        (64 << 20, 4 << 20),  # the default: four pieces of the cap, 16 MiB pinned
        (40 << 20, 4 << 20),
        (24 << 20, 2 << 20),  # 3 MiB each would be 4 MiB once torch rounds it: 2 MiB
        (1 << 20, 128 << 10),  # the smallest buffer_bytes allowed
    ],
)
def test_the_pinned_ring_keeps_within_half_the_budget_in_powers_of_two(
    buffer_bytes: int, piece: int
) -> None:
    from shardsafe.checkpoint.io.pinned_ring import SLOTS, piece_bytes_for

    got = piece_bytes_for(buffer_bytes)
    assert got == piece
    assert got & (got - 1) == 0 and SLOTS * got <= buffer_bytes // 2
