"""Running ``lightning_script.py`` as a user runs a Lightning script, and reading what it left.

Every run is a real ``python lightning_script.py ...``; Lightning's launcher starts the
other ranks as further processes (``LOCAL_RANK=1 python lightning_script.py ...``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

SCRIPT = Path(__file__).with_name("lightning_script.py")
RUN_TIMEOUT_S = 120.0


def command(root: Path, *args: str | Path) -> list[str]:
    return [sys.executable, str(SCRIPT), "--root", str(root), *map(str, args)]


def run(root: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """A run that must succeed."""
    proc = subprocess.run(
        command(root, *args), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc


def losses(root: Path, name: str = "losses.jsonl") -> dict[int, float]:
    """Step -> loss as rank 0 logged them; fails on a step logged twice."""
    path = root / name
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records}


def logged_steps(root: Path) -> int:
    """Whole lines in ``losses.jsonl`` so far (a line being written is not counted)."""
    try:
        text = (root / "losses.jsonl").read_text()
    except FileNotFoundError:
        return 0
    return text.count("\n")


def kill_after_step(root: Path, *args: str | Path, step: int) -> None:
    """Start a run in a session of its own; SIGKILL every process of it once ``step`` is
    logged, as a preemption or a pulled plug would: nothing gets to clean up."""
    proc = subprocess.Popen(
        command(root, *args),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while logged_steps(root) < step:
            if proc.poll() is not None:
                error = proc.stderr.read().decode()[-6000:] if proc.stderr else ""
                raise AssertionError(
                    f"the run ended (exit {proc.returncode}) before step {step}:\n{error}"
                )
            assert time.monotonic() < deadline, f"step {step} not logged within {RUN_TIMEOUT_S}s"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stderr:
            proc.stderr.close()


def outcomes(root: Path, world_size: int) -> list[dict[str, Any]]:
    """How ``fit`` ended on each rank: ``{"pid": ..., "error": "Type: message" or None}``."""
    return [json.loads((root / f"outcome-{r}.json").read_text()) for r in range(world_size)]


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


class Net(nn.Module):
    """The script's network under the same names (``net.0.weight``...), without Lightning."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def assert_same_optimizer_state(saved: dict[str, Any], live: dict[str, Any]) -> None:
    """torch-format optimizer states: the same parameters, state tensors bit for bit (dtype
    too), the same hyperparameters."""
    assert sorted(saved["state"]) == sorted(live["state"])
    for index, state in saved["state"].items():
        assert sorted(state) == sorted(live["state"][index]), index
        for name, tensor in state.items():
            other = live["state"][index][name]
            assert tensor.dtype == other.dtype and torch.equal(tensor, other), (index, name)
    assert saved["param_groups"] == live["param_groups"]
