"""Rank 0's store serves O(ranks) requests per save and per load (issue 17).

Real gloo groups of 4 and 8 ranks save and load a small DDP + Adam state; every rank
counts the store requests it made (``shardsafe.distributed.store_requests``) and the
counts are summed: that sum is what the one store, hosted by rank 0, served. Per rank it
must stay under a constant whatever the world size; before issue 17 every rank read
every rank's offer and polled every rank's heartbeat, so the count per rank grew with
the number of ranks. And a silent rank, watched by rank 0 alone, is still named on every
rank.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardsafe
from shardsafe import CheckpointError
from shardsafe.distributed import Coordinator, Phase, reset_store_requests, store_requests
from tests.harness import run_ranks

PER_RANK_LIMIT = 30
"""The issue's target: at most 30 x ranks requests per save."""


def _counted(call: Any) -> int:
    """The requests every rank made during ``call`` (made on every rank), summed."""
    dist.barrier()
    reset_store_requests()
    call()
    total = torch.tensor([store_requests()["total"]], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total.item())


def save_and_load(rank: int, world_size: int, root: str) -> dict[str, int]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4)))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 32)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt, "step": 1}
    shardsafe.save(f"{root}/warm", state)  # the first save opens this process's connection
    counts = {
        "save": _counted(lambda: shardsafe.save(f"{root}/a", state)),
        "load": _counted(lambda: shardsafe.load(f"{root}/a", state)),
    }
    return counts


@pytest.mark.timeout(240)
def test_store_requests_per_save_and_load_grow_linearly_with_ranks(tmp_path: Path) -> None:
    """At 2 ranks the fixed costs weigh most: 65 requests per save before the last rank
    to post each phase stopped waiting for (and reading) the wake-up it had just sent
    itself, and rank 0 stopped reading at close counts it already knew."""
    per_rank = {}
    for world_size in (2, 4, 8):
        counts = run_ranks(save_and_load, world_size, str(tmp_path / str(world_size)), timeout=200)
        assert all(c == counts[0] for c in counts)  # summed on every rank alike
        per_rank[world_size] = {k: v / world_size for k, v in counts[0].items()}
        print(world_size, "ranks:", counts[0], "requests")
    for world_size, counts in per_rank.items():
        for what, n in counts.items():
            assert n <= PER_RANK_LIMIT, f"{what} at {world_size} ranks: {n:.1f} requests per rank"
    for what in ("save", "load"):  # no term that grows with ranks: 8 costs ~ what 4 did
        assert per_rank[8][what] <= per_rank[4][what] + 3, per_rank


def one_rank_stops_beating(rank: int, world_size: int, done: str) -> Any:
    """Rank 2 enters, then goes silent as a SIGKILLed rank would (its heartbeat stops, it
    never posts, but its process lives on until the others are done, 12 s at most);
    ranks 0 and 1 wait in the next phase."""
    coord = Coordinator("save", "/silent", timeout=60, dead_after=3.0, aftermath={None: "AFTER."})
    coord.enter(30)
    if rank == 2:
        assert coord._heartbeat is not None
        coord._heartbeat.stop()
        deadline = time.monotonic() + 12
        while len(os.listdir(done)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    start = time.monotonic()
    try:
        coord.exchange(Phase.COLLECT, None, None)
    except CheckpointError as e:
        return str(e), time.monotonic() - start
    finally:
        coord.close()
        open(os.path.join(done, str(rank)), "w").close()
    return "no error", time.monotonic() - start


@pytest.mark.timeout(90)
def test_a_silent_rank_is_named_on_every_rank_though_only_rank_0_watches_it(
    tmp_path: Path,
) -> None:
    """Only rank 0 watches rank 2's heartbeat; rank 1 learns of its death from rank 0,
    through the phase's wake key, with the same message (but its own rank)."""
    results = run_ranks(one_rank_stops_beating, 3, str(tmp_path), timeout=80)
    for rank in (0, 1):
        message, seconds = results[rank]
        assert message == (
            "rank(s) 2 stopped responding during the 'collect' phase of save (no heartbeat "
            f"for 3s; this is rank {rank}): they have probably died (killed, out of memory). "
            "AFTER."
        ), message
        # Named from the heartbeat (this message is made only there: the phase's 60 s
        # timeout says otherwise), with no wall-clock bound, which a loaded machine
        # could break; the seconds are printed for the log.
        print(f"rank {rank} named rank 2 after {seconds:.1f}s")


def every_rank_fails(rank: int, world_size: int, root: str) -> tuple[str, int]:
    """Every rank's state holds a tensor safetensors cannot store: every rank fails the
    collect phase and reports it; returns (the agreed message, the summed requests)."""
    state = {"x": torch.zeros(2, dtype=torch.complex32), "step": 1}
    shardsafe.save(f"{root}/warm", {"step": 1})  # the first save opens the connection
    dist.barrier()
    reset_store_requests()
    with pytest.raises(CheckpointError) as failed:
        shardsafe.save(f"{root}/a", state)
    total = torch.tensor([store_requests()["total"]], dtype=torch.int64)
    dist.all_reduce(total)
    return str(failed.value), int(total.item())


@pytest.mark.timeout(240)
def test_agreeing_on_an_error_every_rank_had_costs_each_rank_a_constant(tmp_path: Path) -> None:
    """Each rank reads a bounded number of the failing ranks' reports (the first 8 to
    fail: the first one's error, then the others in rank order), every rank the same
    ones, and the message counts the rest:
    before, every rank checked every rank's error key, N^2 requests when all N fail (a
    full disk)."""
    world_size = 10
    results = run_ranks(every_rank_fails, world_size, str(tmp_path), timeout=200)
    messages = {message for message, _ in results}
    assert len(messages) == 1, messages  # agreed
    (message,) = messages
    pattern = r"save failed on rank (\d) \(rank\(s\) ([\d, ]+) and 2 more failed too\): "
    named = re.match(pattern, message)
    assert named, message
    first, others = int(named[1]), [int(r) for r in named[2].split(", ")]
    assert others == sorted(set(others)) and len({first, *others}) == 8, message
    assert "complex32" in message
    per_rank = results[0][1] / world_size
    print(f"{per_rank:.1f} store requests per rank for a save every rank failed")
    assert per_rank <= PER_RANK_LIMIT, per_rank
