"""Kill a training run with SIGKILL mid-way, resume it, and get exactly the same losses.

For every strategy: a run of 10 steps with a checkpoint at step 5 is killed (launcher and
workers at once) after step 7 is logged, then resumed from "latest". Steps 6..10 must
equal, bit for bit, those of a run that was never interrupted: weights, optimizer state,
LR schedule, every rank's RNGs and the data position all came back.

The uninterrupted reference runs on the test harness's ranks (for several ranks, in a
process group the caller made, which the trainer joins): cheaper than more processes,
and it also pins that joining a group gives the same numbers as launching one. Each
strategy's reference runs once per module (the async runs compare to ZeRO's).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shardsafe import CheckpointManager, Trainer
from shardsafe.checkpoint.loading import read_manifest
from shardsafe.checkpoint.verifying import find_problems
from shardsafe.trainer.example import ExampleModule
from tests.e2e.trainer_helpers import (
    FAULTY,
    ONE_THREAD,
    kill_after_step,
    logged_steps,
    losses,
    python,
)
from tests.harness import run_ranks

DEVICES = {"single": 1, "ddp": 2, "zero": 2, "fsdp": 2}


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[int, float]]:
    """``whole(strategy)``: the losses of an uninterrupted run (see ``uninterrupted``),
    run once per module."""
    done: dict[str, dict[int, float]] = {}

    def get(strategy: str) -> dict[int, float]:
        if strategy not in done:
            run_dir = tmp_path_factory.mktemp(f"whole-{strategy}")
            devices = DEVICES[strategy]
            run_ranks(
                uninterrupted, devices, strategy, str(run_dir), init_process_group=devices > 1
            )
            done[strategy] = losses(run_dir)
        return done[strategy]

    return get


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", list(DEVICES))
def test_killed_run_resumes_with_identical_losses(
    tmp_path: Path, whole: Callable[[str], dict[int, float]], strategy: str
) -> None:
    args = [
        *("--strategy", strategy, "--devices", str(DEVICES[strategy])),
        *("--max-steps", "10", "--checkpoint-every", "5"),
    ]
    devices = DEVICES[strategy]
    env = ONE_THREAD if devices == 1 else None
    reference = whole(strategy)
    assert sorted(reference) == list(range(1, 11))

    run_dir = tmp_path / "killed"
    command = [sys.executable, FAULTY, *args, "--run-dir", run_dir, "--step-delay", "0.25"]
    kill_after_step(command, run_dir, step=7, env=env)
    assert CheckpointManager(run_dir / "checkpoints").complete_steps() == [5]
    assert logged_steps(run_dir) in (7, 8)  # the kill lands during step 8 at the latest

    resumed = python(FAULTY, *args, "--run-dir", run_dir, "--resume", "latest", env=env)
    assert "resuming from" in resumed.stdout and "step-000000005" in resumed.stdout
    after = losses(run_dir)  # also fails on a step logged twice
    assert sorted(after) == list(range(1, 11))
    assert [after[s] for s in range(6, 11)] == [reference[s] for s in range(6, 11)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", [0, 1])
def test_killed_async_run_resumes_with_identical_losses(
    tmp_path: Path, whole: Callable[[str], dict[int, float]], seed: int
) -> None:
    """``async_save=True``, killed by SIGKILL at a seeded moment between steps 5 and 9
    (the checkpoint of step 5 may or may not have committed yet): resumed from "latest",
    every step's loss is the uninterrupted run's, and "latest" verifies."""
    args = [
        *("--strategy", "zero", "--devices", "2", "--async-save"),
        *("--max-steps", "10", "--checkpoint-every", "5"),
    ]
    reference = whole("zero")
    run_dir = tmp_path / "killed"
    command = [sys.executable, FAULTY, *args, "--run-dir", run_dir, "--step-delay", "0.1"]
    kill_after_step(command, run_dir, step=random.Random(seed).randint(5, 8))
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    if latest is not None:
        assert find_problems(latest, read_manifest(latest)) == []
    resumed = python(FAULTY, *args, "--run-dir", run_dir, "--resume", "latest")
    after = losses(run_dir)
    assert sorted(after) == list(range(1, 11)), resumed.stdout
    assert after == reference
    final = CheckpointManager(run_dir / "checkpoints").latest()
    assert final == str(run_dir / "checkpoints" / "step-000000010")


def uninterrupted(rank: int, world_size: int, strategy: str, run_dir: str) -> None:
    """What ``faulty_train.py`` does without faults, on a harness rank."""
    torch.manual_seed(0)
    trainer = Trainer(
        strategy=strategy, devices=world_size, max_steps=10, checkpoint_every=5, run_dir=run_dir
    )
    trainer.fit(ExampleModule())
