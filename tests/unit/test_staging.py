"""Staging copies a chunk's bytes and nothing else: every other field of the chunk (how
the planner treats it) must survive, staged or replaced by a placeholder. A field lost
here changes the plan of every background save that offers staged chunks (a per-rank
generator stored once, silently)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardsafe.adapters.values import StatefulAdapter
from shardsafe.checkpoint.io.staging import Stager
from shardsafe.protocol import Chunk, SaveItem


def _every_flag_set() -> Chunk:
    flags = {f.name: True for f in dataclasses.fields(Chunk) if f.type in ("bool", bool)}
    assert flags, "Chunk has no boolean fields left to check"
    return Chunk("s/t", torch.arange(4.0), (8,), (4,), **flags)


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "placeholder"])
def test_staging_keeps_every_field_of_a_chunk_but_its_tensor(staged: bool) -> None:
    chunk = _every_flag_set()
    items = {"s": (StatefulAdapter(), SaveItem("stateful", {}, [chunk]))}
    out = Stager().stage(items, keep=None if staged else set()).items["s"][1].chunks[0]
    for field in dataclasses.fields(Chunk):
        if field.name != "tensor":
            assert getattr(out, field.name) == getattr(chunk, field.name), field.name
    assert out.tensor.shape == chunk.tensor.shape and out.tensor.dtype == chunk.tensor.dtype
    assert out.tensor.device.type == ("cpu" if staged else "meta")
    if staged:
        assert torch.equal(out.tensor, chunk.tensor)
        assert out.tensor.data_ptr() != chunk.tensor.data_ptr()  # a copy, not the live one
