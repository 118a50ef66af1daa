"""An exception on one rank ends the whole run quickly, says where, and keeps the checkpoint.

The failing rank prints its traceback once; its peer, which fails only because the rank
died (or because the save it joined failed), prints a single line; the launcher stops
the rest and exits non-zero. Nobody waits for a 30-minute collective timeout.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardsafe
from shardsafe import CheckpointManager
from shardsafe.trainer.example import ExampleModule
from tests.e2e.trainer_helpers import FAULTY, ROOT


def failing_run(run_dir: Path, *fault: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            str(FAULTY),
            "--strategy",
            "ddp",
            "--devices",
            "2",
            "--max-steps",
            "10",
            "--checkpoint-every",
            "2",
            "--run-dir",
            str(run_dir),
            "--fail-rank",
            "1",
            *fault,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    return proc, time.monotonic() - started


def assert_intact(run_dir: Path, step: int) -> None:
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    assert latest is not None and latest.endswith(f"step-{step:09d}")
    shardsafe.load(latest, {"model": ExampleModule()})  # reads and checks every checksum


@pytest.mark.timeout(90)
def test_exception_in_training_step_on_rank_1_ends_the_run(tmp_path: Path) -> None:
    proc, seconds = failing_run(tmp_path, "--fail-step", "5")
    assert proc.returncode != 0
    assert seconds < 30, f"took {seconds:.0f}s"
    err = proc.stderr
    assert "shardsafe: rank 1 failed:" in err
    assert "injected failure in training_step on rank 1" in err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert "shardsafe: rank 1 exited with status 1" in err  # the launcher names it too
    assert_intact(tmp_path, step=4)


@pytest.mark.timeout(90)
def test_exception_in_a_save_on_rank_1_ends_the_run(tmp_path: Path) -> None:
    proc, seconds = failing_run(tmp_path, "--fail-step", "4", "--fail-in", "save")
    assert proc.returncode != 0
    assert seconds < 30, f"took {seconds:.0f}s"
    err = proc.stderr
    assert "save failed on rank 1: OSError: injected write failure on rank 1" in err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert_intact(tmp_path, step=2)
    assert not (tmp_path / "checkpoints" / "step-000000004" / "manifest.json").exists()
