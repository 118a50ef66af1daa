"""Running training scripts as a user does (real processes), and reading what they leave."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shardsafe.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train.py"
FAULTY = ROOT / "tests" / "e2e" / "faulty_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
"""For a single-process run whose numbers are compared bit for bit: a multi-threaded BLAS
may split a reduction differently from one run to the next. (Launched workers get one
thread each anyway, as under torchrun.)"""


def run(
    *command: str | Path,
    timeout: float = 90,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command to completion; fail with its output if it fails."""
    proc = subprocess.run(
        [str(c) for c in command],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def python(
    *args: str | Path, timeout: float = 90, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run(sys.executable, *args, timeout=timeout, env=env)


def losses(run_dir: Path) -> dict[int, float]:
    """``metrics.jsonl`` as step -> loss; fails if any step appears twice."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"duplicate steps in metrics.jsonl: {steps}"
    return {r["step"]: r["loss"] for r in records}


def logged_steps(run_dir: Path) -> int:
    """Whole lines in ``metrics.jsonl`` so far (a line being written is not counted)."""
    return len(read_metrics(str(run_dir / "metrics.jsonl")))


def kill_after_step(
    command: list[str | Path],
    run_dir: Path,
    step: int,
    timeout: float = 90,
    env: dict[str, str] | None = None,
) -> None:
    """Start ``command`` in a session of its own; SIGKILL all of it once ``step`` is logged.

    The launcher and every worker it started die at the same instant, as in a preempted
    job or a pulled plug: nothing gets to clean up.
    """
    proc = subprocess.Popen(
        [str(c) for c in command],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    deadline = time.monotonic() + timeout
    try:
        while logged_steps(run_dir) < step:
            if proc.poll() is not None:
                output = proc.stdout.read().decode() if proc.stdout else ""
                raise AssertionError(
                    f"the run ended (exit {proc.returncode}) before step {step}:\n{output}"
                )
            assert time.monotonic() < deadline, f"step {step} not logged within {timeout}s"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout:
            proc.stdout.close()
