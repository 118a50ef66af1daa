"""``examples/pipeline_parallel.py`` as its docstring says to run it, with real torchrun:
PP x DP (2 x 2) on 4 processes, a checkpoint, then FSDP2 on 2 processes resuming from it.

The losses the two runs print must be those of one uninterrupted run of the whole model
in one process (the same global batches): the resumed run continues the training exactly,
not merely from similar weights.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import shardsafe
from tests.harness import RUN_EXAMPLE_THEN_EXIT

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pipeline_parallel.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
LOSS = re.compile(r"^step\s+(\d+)\s+loss (\d+\.\d+)\s+\((.+)\)$", re.M)
SAVE_AT, STEPS = 3, 6


def torchrun(nproc: int, *args: str) -> str:
    launcher = (
        [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m", "torch.distributed.run"]
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    argv = [*launcher, "--standalone", f"--nproc-per-node={nproc}", RUN_EXAMPLE_THEN_EXIT]
    proc = subprocess.run(
        [*argv, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    return proc.stdout


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pipeline_parallel_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def uninterrupted_losses(steps: int) -> list[float]:
    """The whole model in one process, each step on both replicas' batches at once."""
    ex = example()
    model = ex.Net()
    opt = ex.adamw(model)
    losses = []
    for step in range(steps):
        xs, ys = zip(*(ex.batch(step, replica) for replica in range(ex.REPLICAS)))
        opt.zero_grad()
        loss = ex.loss_fn(model(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(240)
def test_pp_x_dp_checkpoint_resumes_as_fsdp2_and_the_loss_continues(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    first = torchrun(4, "--run-dir", run_dir, "--steps", str(SAVE_AT))
    second = torchrun(2, "--run-dir", run_dir, "--steps", str(STEPS), "--resume")

    path = tmp_path / "run" / f"step-{SAVE_AT:06d}"
    assert f"saved {path}: " in first and f"resumed {path} at step {SAVE_AT} as FSDP2" in second
    manifest = shardsafe.read_manifest(path)
    assert manifest.world_size == 4 and len(manifest.files) == 4  # every rank wrote a file
    assert all(len(rec.chunks) == 1 for rec in manifest.tensors.values())  # each one once

    printed = LOSS.findall(first) + LOSS.findall(second)
    assert [int(step) for step, _, _ in printed] == list(range(STEPS)), first + second
    assert {how for _, _, how in printed[:SAVE_AT]} == {"PP x DP, 4 ranks"}
    assert {how for _, _, how in printed[SAVE_AT:]} == {"FSDP2, 2 ranks"}
    losses = [float(loss) for _, loss, _ in printed]
    assert losses == pytest.approx(uninterrupted_losses(STEPS), abs=2e-6)
