"""``TieredCheckpointManager`` on real ranks: 4 processes as 2 simulated nodes of 2."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed.tiers_setup import local_dir, rank_dirs, train
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(300)
STEPS = 6


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(train, 4, str(tmp_path_factory.mktemp("full")), STEPS, timeout=180)


def _same_run(resumed: list[dict], full: list[dict], start: int) -> None:
    """Each rank restored the uninterrupted run's state of ``start`` bitwise, and went on
    with the same losses and state, bitwise."""
    for r in range(4):
        assert resumed[r]["start"] == start
        restored, saved = resumed[r]["at"][start], full[r]["at"][start]
        assert len(restored) == len(saved)
        assert all(torch.equal(a, b) for a, b in zip(restored, saved))
        assert resumed[r]["losses"] == full[r]["losses"][start:]
        last = max(full[r]["at"])
        assert all(torch.equal(a, b) for a, b in zip(resumed[r]["at"][last], full[r]["at"][last]))


def test_local_steps_are_replicated_to_the_other_node_and_retained(
    uninterrupted: list[dict], tmp_path: Path
) -> None:
    # The record holds the steps retention kept (keep_local=2, and the newest step every
    # rank has replicated, which the last rank to finish may not have counted yet); a
    # step that failed to be written or replicated would have been warned about.
    newest = [STEPS - 1, STEPS]
    for r in range(4):
        assert uninterrupted[r]["warnings"] == []
        for kind in ("written", "replicated"):
            assert uninterrupted[r][kind][-2:] == newest
            assert set(uninterrupted[r][kind]) <= {STEPS - 2, *newest}
    # rank 0 keeps rank 2's replicas and rank 2 rank 0's (the other node, same position)
    for r, source in ((0, 2), (2, 0)):
        assert list(uninterrupted[r]["received"]) == [source]
        assert uninterrupted[r]["received"][source][-2:] == newest


def test_restart_restores_from_the_local_tier(uninterrupted: list[dict], tmp_path: Path) -> None:
    base = str(tmp_path)
    run_ranks(train, 4, base, 3, timeout=180)
    # keep_local=2, and the newest step every rank has replicated (which the last rank to
    # finish may not have counted yet when the first applies retention)
    dirs = rank_dirs(base, 0)
    every_rank = ["rank-00000", "rank-00001", "rank-00002", "rank-00003"]
    assert dirs["step-000000002"] == dirs["step-000000003"] == every_rank
    assert set(dirs) <= {"step-000000001", "step-000000002", "step-000000003"}
    resumed = run_ranks(train, 4, base, STEPS, timeout=180)
    assert resumed[0]["tiers"] == ["local"] * 4
    _same_run(resumed, uninterrupted, 3)


def test_a_lost_node_restores_from_its_replicas(uninterrupted: list[dict], tmp_path: Path) -> None:
    base = str(tmp_path)
    run_ranks(train, 4, base, 3, timeout=180)
    shutil.rmtree(local_dir(base, 1))
    resumed = run_ranks(train, 4, base, STEPS, timeout=180)
    assert resumed[0]["tiers"] == ["local", "local", "peer", "peer"]
    _same_run(resumed, uninterrupted, 3)


def test_both_nodes_lost_restore_from_the_persistent_tier(
    uninterrupted: list[dict], tmp_path: Path
) -> None:
    base = str(tmp_path)
    run_ranks(train, 4, base, 3, timeout=180)
    shutil.rmtree(local_dir(base, 0))
    shutil.rmtree(local_dir(base, 1))
    resumed = run_ranks(train, 4, base, STEPS, timeout=180)
    assert resumed[0]["tiers"] == ["persistent"] * 4
    _same_run(resumed, uninterrupted, 2)
