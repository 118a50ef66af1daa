"""The Trainer with a local tier (``local_checkpoint_dir``), killed and resumed for real.

A 2-rank DDP run of 10 steps keeps a persistent checkpoint every 5 steps and a local one
every step. Killed after step 7, it must resume from the local tier (a newer step than
the persistent step 5), say so, and log exactly the losses of a run that was never
interrupted (and has no local tier), bit for bit:

* killed from outside (the launcher and both workers at once, SIGKILL), then resumed
  with ``--resume latest``;
* under ``torchrun --max-restarts 1``, rank 1 SIGKILLs itself at the start of step 8;
  torchrun restarts both workers, which recover from step 7 by themselves.

And on two torchrun agents playing two nodes (each in a working directory of its own, so
the relative ``--local-dir local`` is a different directory on each "node"), a node that
lost its local directory gets its rank's checkpoint back from the replica on the other.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardsafe import CheckpointManager, Trainer
from shardsafe.trainer.example import ExampleModule
from tests.e2e.agents import node_env, two_agents
from tests.e2e.trainer_helpers import ROOT, TORCHRUN, kill_after_step, losses, python
from tests.harness import run_ranks

SCRIPT = Path(__file__).with_name("local_tier_train.py")
STEPS = ("--max-steps", "10", "--checkpoint-every", "5")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of the same 2-rank run, uninterrupted and without a local tier."""
    run_dir = tmp_path_factory.mktemp("whole")
    run_ranks(uninterrupted, 2, str(run_dir))
    found = losses(run_dir)
    assert sorted(found) == list(range(1, 11))
    return found


def uninterrupted(rank: int, world_size: int, run_dir: str) -> None:
    torch.manual_seed(0)
    trainer = Trainer(
        strategy="ddp", devices=world_size, max_steps=10, checkpoint_every=5, run_dir=run_dir
    )
    trainer.fit(ExampleModule())


def resumed_step(output: str) -> int:
    """The step the run said it resumed from, checking that it was the local tier."""
    found = re.search(r"resuming from step (\d+), from the local tier \(every rank", output)
    assert found, output
    return int(found.group(1))


@pytest.mark.timeout(120)
def test_a_killed_run_resumes_from_the_local_tier_with_identical_losses(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    run_dir, local = tmp_path / "run", tmp_path / "local"
    args: list[str | Path] = [SCRIPT, *STEPS, "--run-dir", run_dir, "--local-dir", local]
    kill_after_step([sys.executable, *args, "--step-delay", "0.25"], run_dir, step=7)
    assert persistent(run_dir).complete_steps() == [5]

    resumed = python(*args, "--resume", "latest")
    step = resumed_step(resumed.stdout)
    assert step >= 6  # newer than the persistent tier's step 5: 7, or 6 or 8 by timing
    assert losses(run_dir) == reference


@pytest.mark.timeout(120)
def test_torchrun_restarts_a_killed_worker_from_the_local_tier(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    if not TORCHRUN.exists():
        pytest.skip(f"torchrun is not installed at {TORCHRUN}")
    run_dir, local = tmp_path / "run", tmp_path / "local"
    command = [
        str(TORCHRUN),
        *("--standalone", "--nproc-per-node", "2", "--max-restarts", "1"),
        *("--monitor-interval", "0.1"),
        str(SCRIPT),
        *STEPS,
        *("--run-dir", str(run_dir), "--local-dir", str(local), "--resume", "latest"),
        *("--kill-rank", "1", "--kill-step", "8"),
    ]
    # torch's agent shares its store with the workers, and a restarted worker there can
    # read the previous attempt's gloo addresses (pytorch/pytorch#135712): a fresh store
    # per attempt, as before torch 2.5.
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=100, cwd=ROOT, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "killing rank 1 at its step 8" in output
    assert resumed_step(output) == 7  # the step-7 save was on disk before step 8 began
    assert losses(run_dir) == reference
    final = persistent(run_dir).latest()
    assert final == str(run_dir / "checkpoints" / "step-000000010")


@pytest.mark.timeout(120)
def test_a_node_that_lost_its_local_tier_gets_it_from_its_peer(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    if not TORCHRUN.exists():
        pytest.skip(f"torchrun is not installed at {TORCHRUN}")
    run_dir = tmp_path / "run"
    first = two_nodes(tmp_path, str(SCRIPT), "--max-steps", "7", "--run-dir", str(run_dir))
    assert [code for code, _ in first] == [0, 0], first
    assert "copied to 1 other node(s)" in first[0][1], first[0][1]
    lost = tmp_path / "node1" / "local"
    assert sorted(p.name for p in lost.glob("step-000000007/rank-*")) == [
        "rank-00000",  # rank 0's replica, received from node 0
        "rank-00001",
    ]
    shutil.rmtree(lost)  # the persistent tier's step 7 is no newer: the faster tiers win

    args = ("--max-steps", "10", "--run-dir", str(run_dir), "--resume", "latest")
    second = two_nodes(tmp_path, str(SCRIPT), *args)
    assert all(code == 0 for code, _ in second), second
    assert (
        "resuming from step 7, from the local tier for rank(s) 0 and the peer tier for "
        "rank(s) 1" in second[0][1]
    ), second[0][1]
    assert losses(run_dir) == reference


def two_nodes(tmp_path: Path, *args: str) -> list[tuple[int, str]]:
    """Two torchrun agents (``--nnodes 2``, one worker each), each in ``tmp_path/node<N>``;
    each agent's (exit status, output)."""
    worker = (*args, "--checkpoint-every", "5", "--local-dir", "local")
    return two_agents(tmp_path, node_env(), *worker, timeout=100)


def persistent(run_dir: Path) -> CheckpointManager:
    return CheckpointManager(run_dir / "checkpoints", warn_if_not_empty=False)
