"""A copy that one end of a transfer cannot open is refused at once, on real ranks.

Each rank is a node of its own (2 ranks), with a transfer timeout of 30 s: before these
fixes, a sender that could not open the copy it was to send (its directory removed from
under it: a tmpfs cleaned by another job) raised before saying anything, and its
receiver waited for it until the timeout; so did a sender whose receiver could not clear
the place its replica goes. Now the other end is told at once, in both directions, the
failure is raised by ``wait()`` (replication) or passed over (a restore), and the next
steps replicate as before."""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from shardsafe import CheckpointError
from shardsafe.tiers import TieredCheckpointManager
from tests.distributed.tiers_setup import local_dir
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 30


def _rank_dir(base: str, node: int, step: int, rank: int) -> Path:
    return Path(local_dir(base, node)) / f"step-{step:09d}" / f"rank-{rank:05d}"


def _three_steps(rank: int, world: int, base: str) -> dict[str, Any]:
    """Steps 1-3 saved and waited for, one at a time; at step 2, between rank 0's write
    and its replication, its node's local directory is replaced by a file (so it can
    neither open the copy it sends nor clear the place of the one it receives), and rank
    0 goes on only once rank 1's ``wait()`` of step 2 has returned (or after 15 s), as a
    rank that keeps training would. What each ``wait()`` raised, the seconds each step
    took, and the warnings."""
    from shardsafe.tiers import replication

    os.environ["SHARDSAFE_NODE"] = str(rank)
    signal = Path(base) / "rank-1-waited-for-step-2"
    if rank == 0:
        replicate = replication.Replicator._replicate

        def unusable_first(self: Any, step: int) -> bool:
            if step == 2:
                root = local_dir(base, 0)
                os.rename(root, root + "-gone")
                Path(root).write_text("not a directory")
            return replicate(self, step)

        replication.Replicator._replicate = unusable_first  # type: ignore[method-assign]
    raised: dict[int, str] = {}
    seconds: dict[int, float] = {}
    model = torch.nn.Linear(4, 4)
    with (
        warnings.catch_warnings(record=True) as caught,
        contextlib.closing(
            TieredCheckpointManager(
                os.path.join(base, "persistent"),
                local_dir(base, rank),
                persist_every=None,
                timeout=TIMEOUT,
            )
        ) as manager,
    ):
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            began = time.monotonic()
            manager.save(step, {"model": model})
            try:
                manager.wait()
            except CheckpointError as e:
                raised[step] = str(e)
            seconds[step] = time.monotonic() - began
            if step == 2 and rank == 1:
                signal.touch()
            while step == 2 and rank == 0 and not signal.exists():
                time.sleep(0.05)
                if time.monotonic() - began > 15:
                    break
    said = [str(w.message) for w in caught if "shardsafe:" in str(w.message)]
    return {"raised": raised, "seconds": seconds, "warnings": said}


def test_a_node_whose_local_directory_became_unusable_tells_its_peer_at_once(
    tmp_path: Path,
) -> None:
    """Before, rank 1's ``wait()`` of step 2 returned only when rank 0 closed its
    manager (or after the 30 s timeout), and rank 0 stopped replicating for good."""
    base = str(tmp_path)
    got = run_ranks(_three_steps, 2, base, timeout=100)
    assert max(max(g["seconds"].values()) for g in got) < 5, got
    unusable = (
        f"the local tier's directory {local_dir(base, 0)} cannot be made or opened: File "
        "exists. Give each node a local path it can write (a directory, or nothing yet, on a "
        "tmpfs or NVMe disk)"
    )
    unsent = (
        "rank 0 could not open its local checkpoint of step 2 to send it to rank 1, which "
        f"has no replica of it: {unusable}"
    )
    assert got[0]["raised"] == {
        2: unsent,
        3: f"rank 0 could not write its local checkpoint of step 3: {unusable}",
    }
    assert got[1]["raised"] == {}
    for step in (2, 3):  # rank 0 tells rank 1 it has none, and refuses rank 1's
        refused = (
            f"shardsafe: rank 0 does not keep rank 1's replica of step {step}: it was "
            f"refused: its directory could not be made: {unusable}"
        )
        assert refused in got[0]["warnings"]
    assert f"shardsafe: {unsent}" in got[0]["warnings"]
    assert not [w for w in got[1]["warnings"] if "stopped replicating" in w]
    assert Path(local_dir(base, 0)).read_text() == "not a directory"
    assert sorted(os.listdir(local_dir(base, 1))) == [
        "step-000000001",
        "step-000000002",
        "step-000000003",
    ]
    assert sorted(os.listdir(Path(local_dir(base, 1)) / "step-000000002")) == ["rank-00001"]

