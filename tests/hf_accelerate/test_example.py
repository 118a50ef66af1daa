"""``examples/accelerate_train.py`` runs as its docstring says, under ``accelerate launch``
on 2 CPU processes: a second run resumes from the newest checkpoint and logs the losses
an uninterrupted run logs, bit for bit."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.harness import RUN_EXAMPLE_THEN_EXIT, free_port, launched

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "accelerate_train.py"


def run(tmp_path: Path, run_dir: str, steps: int) -> str:
    argv = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        RUN_EXAMPLE_THEN_EXIT, str(EXAMPLE), "--run-dir", run_dir, "--steps", str(steps),
    ]  # fmt: skip
    return launched(argv, tmp_path)


def losses(log: str) -> dict[int, str]:
    return {int(s): loss for s, loss in re.findall(r"^step (\d+): loss (\S+), saved$", log, re.M)}


def test_the_second_run_resumes_and_logs_the_uninterrupted_losses(tmp_path: Path) -> None:
    first = run(tmp_path, "runs/a", 40)
    assert "no checkpoint yet: starting at step 0" in first
    second = run(tmp_path, "runs/a", 80)
    assert "resumed at step 40" in second
    whole = run(tmp_path, "runs/b", 80)
    assert sorted(losses(second)) == [50, 60, 70, 80]
    assert losses(second) == {s: v for s, v in losses(whole).items() if s > 40}
    assert sorted(os.listdir(tmp_path / "runs/a/checkpoints")) == [
        "latest", "step-000000006", "step-000000007",
    ]  # fmt: skip
    assert "saved runs/a/checkpoints/step-000000007" in second
