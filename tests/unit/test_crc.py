"""The optional CRC32 accelerator computes zlib's exact values, so checkpoints written with
and without it verify either way."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe.checkpoint.format import crc
from shardsafe.checkpoint.io import reader, safetensors_io


def test_accelerated_crc_equals_zlib_including_continuation() -> None:
    data = memoryview(os.urandom(3 << 20))
    assert crc.crc32(data, 0) == zlib.crc32(data)
    split = 1_234_567
    assert crc.crc32(data[split:], crc.crc32(data[:split], 0)) == zlib.crc32(data)


@pytest.mark.parametrize("writer_fast", [True, False])
def test_checkpoints_verify_across_implementations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer_fast: bool
) -> None:
    slow = zlib.crc32
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 300)
    path = tmp_path / "ckpt"
    with monkeypatch.context() as m:
        if not writer_fast:
            m.setattr(safetensors_io, "crc32", slow)
        shardsafe.save(path, {"model": model})
    fresh = torch.nn.Linear(300, 300)
    with monkeypatch.context() as m:
        if writer_fast:
            m.setattr(reader, "crc32", slow)
        shardsafe.load(path, {"model": fresh})
    assert torch.equal(fresh.weight, model.weight)


def test_the_accelerator_is_used_when_installed() -> None:
    pytest.importorskip("isal")
    assert crc.ACCELERATED
