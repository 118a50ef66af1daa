"""Saves and loads leave no keys behind in the process group's store.

Every coordinated operation has a namespace of its own; before, each left about
``2 x ranks + 10`` keys there (heartbeats, progress, phase counters, the
acknowledgement): a run saving thousands of times grew the store (rank 0's or torchrun's
agent's memory) without bound. Real gloo ranks, the real TCPStore's key count.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardsafe
from tests.harness import run_ranks

OPERATIONS = 10


def keys_after_each(rank: int, world_size: int, root: str) -> list[int]:
    store = dist.distributed_c10d._get_default_store()
    counts = []
    for i in range(OPERATIONS):
        path = os.path.join(root, f"ckpt-{i}")
        state: dict[str, Any] = {"w": torch.full((4,), float(i))}
        shardsafe.save(path, state)
        shardsafe.load(path, state)
        dist.barrier()  # rank 0, the last to leave each operation, has left this one
        counts.append(int(store.num_keys()))
    return counts


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 4])
def test_saves_and_loads_leave_no_keys_in_the_store(tmp_path: Path, world_size: int) -> None:
    counts = run_ranks(keys_after_each, world_size, str(tmp_path), timeout=80)[0]
    one_operations_keys = 2 * world_size + 10
    grown = counts[-1] - counts[1]
    assert grown < one_operations_keys, counts
