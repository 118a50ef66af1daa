"""A checkpoint with more data files than free descriptors still loads and verifies."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import shardsafe
from tests.unit.attacks.common import bits, run_cli

pytestmark = pytest.mark.timeout(60)


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
