"""``python train.py`` (the trainer launches its workers) and torchrun give the same run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.trainer_helpers import EXAMPLE, TORCHRUN, losses, python, run


@pytest.mark.timeout(120)
def test_python_and_torchrun_give_identical_losses(tmp_path: Path) -> None:
    if not TORCHRUN.exists():
        pytest.skip(f"torchrun is not installed at {TORCHRUN}")
    args = ["--strategy", "ddp", "--devices", "2", "--max-steps", "8", "--checkpoint-every", "4"]
    launched = python(EXAMPLE, *args, "--run-dir", tmp_path / "python")
    run(
        TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        EXAMPLE,
        *args,
        "--run-dir",
        tmp_path / "torchrun",
    )

    by_python, by_torchrun = losses(tmp_path / "python"), losses(tmp_path / "torchrun")
    assert sorted(by_python) == list(range(1, 9))
    assert by_python == by_torchrun
    assert "done: step 8" in launched.stdout  # rank 0 summarises, once
    assert launched.stdout.count("done:") == 1
    for name in ("python", "torchrun"):
        assert (tmp_path / name / "checkpoints" / "step-000000008" / "manifest.json").exists()
