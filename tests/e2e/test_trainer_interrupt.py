"""Ctrl-C on ``shardsafe fit``: the run stops and says which checkpoint is the last good
one and how to continue from it; meanwhile it was never silent (progress lines).

A real ``shardsafe fit`` in a session of its own gets SIGINT on its whole process group,
as a terminal sends it on Ctrl-C: the launcher and both of its workers, or the single
process of a one-device run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe import CheckpointManager
from tests.e2e.trainer_helpers import ROOT

LAST_GOOD = re.compile(
    r"^shardsafe: interrupted\. The last good checkpoint is step (\d+): (\S+)\. To continue "
    r"from it, run the same command with --resume latest \(Trainer\.fit: resume='latest'\)$",
    re.M,
)


def interrupted_fit(run_dir: Path, *options: str, after: str) -> tuple[int, str, str]:
    """Run ``shardsafe fit`` (every 20 steps a checkpoint) until ``after`` is true (``"a
    checkpoint"``: one is committed; ``"a step"``: the first progress line is out),
    then Ctrl-C it; return its status, stdout and stderr."""
    command = [sys.executable, "-m", "shardsafe", "fit", "--max-steps", "1000000"]
    command += ["--run-dir", str(run_dir), *options]
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    try:
        first = proc.stdout.readline()  # the first progress line: rank 0 is training
        assert first.startswith("shardsafe: step 1/1000000, loss "), first
        if after == "a checkpoint":
            latest = run_dir / "checkpoints" / "latest"
            deadline = time.monotonic() + 60
            while not latest.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, first + out, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("devices", ["1", "2"])
def test_ctrl_c_names_the_last_good_checkpoint(tmp_path: Path, devices: str) -> None:
    strategy = "single" if devices == "1" else "ddp"
    options = ["--strategy", strategy, "--devices", devices, "--checkpoint-every", "20"]
    status, out, err = interrupted_fit(tmp_path, *options, after="a checkpoint")
    assert status == 130 and "done:" not in out, err[-3000:]
    named = LAST_GOOD.findall(err)
    assert len(named) == 1, err[-3000:]  # once, not once per worker
    step, path = int(named[0][0]), Path(named[0][1])
    assert step >= 20 and step % 20 == 0 and path == tmp_path / "checkpoints" / f"step-{step:09d}"
    assert CheckpointManager(tmp_path / "checkpoints").latest() == str(path)  # the newest
    values = shardsafe.load(path, {"model": torch.nn.Module()}, strict=False)  # complete
    assert values["trainer"]["step"] == step
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.timeout(120)
def test_ctrl_c_before_any_checkpoint_says_so(tmp_path: Path) -> None:
    status, _, err = interrupted_fit(tmp_path, "--checkpoint-every", "1000000", after="a step")
    assert status == 130, err[-3000:]
    assert err.endswith(
        f"shardsafe: interrupted before any checkpoint was saved in {tmp_path / 'checkpoints'}; "
        "running the same command again starts at step 0\n"
    ), err[-3000:]
