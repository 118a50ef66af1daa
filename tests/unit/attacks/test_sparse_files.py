"""Sparse files: sizes only the checkpoint vouches for are bounded before allocating."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

import shardsafe
from shardsafe import CheckpointCorruptError, CheckpointError
from shardsafe.checkpoint.loading import read_manifest
from shardsafe.checkpoint.verifying import find_problems
from tests import forge
from tests.unit.attacks.common import SHARD, bits, manifest_doc, opens_with_flags, run_cli

pytestmark = pytest.mark.timeout(60)

HEADROOM = 512 << 20


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
