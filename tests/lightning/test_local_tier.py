"""``ShardsafeDDPStrategy(local_checkpoint_dir=..., local_every=5)`` under real processes.

The run of ``local_tier_script.py`` (5 steps an epoch on 2 ranks, so every local save is
on an epoch boundary, where Lightning's resume is exact) keeps ``ModelCheckpoint``
checkpoints every 10 steps and local ones every 5. Killed with SIGKILL part-way:

* after step 7 (a local step 5, no ``ModelCheckpoint`` checkpoint yet), ``fit()``
  resumes from the local tier, where Lightning alone would start from nothing;
* after step 12 (``last.ckpt`` and the local tier both at step 10), ``ckpt_path="last"``
  resumes from the local tier (the faster on a tie); an explicit path then resumes from
  exactly that checkpoint, and the local steps newer than it are gone.

Each logs, for the steps it trains, the losses of a run that was never interrupted, bit
for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.harness import free_port
from tests.lightning.helpers import RUN_TIMEOUT_S, Run, logged_steps, losses, script_environment

SCRIPT = Path(__file__).with_name("local_tier_script.py")


class LocalRun(Run):
    """The processes of one run of ``local_tier_script.py``, one per rank."""

    def __init__(self, root: Path, *args: str | Path, devices: int = 2) -> None:
        self.logs = []
        argv = [sys.executable, str(SCRIPT), "--root", str(root), *map(str, args)]
        argv += ["--local-dir", str(root / "local"), "--devices", str(devices)]
        base = {**script_environment(), "MASTER_ADDR": "127.0.0.1"}
        base["MASTER_PORT"] = str(free_port())
        base.update(WORLD_SIZE=str(devices), NODE_RANK="0")
        self.procs = [self._start(argv, {**base, "LOCAL_RANK": str(r)}) for r in range(devices)]


def run(root: Path, *args: str | Path) -> list[Any]:
    """A run that must succeed; what each rank restored from the local tier."""
    started = LocalRun(root, *args)
    codes = started.wait()
    output = started.output()
    assert codes == [0, 0], f"exit codes {codes}\n{output}"
    return [json.loads((root / f"outcome-{r}.json").read_text())["restored"] for r in (0, 1)]


def kill_after_step(root: Path, *args: str, step: int) -> None:
    started = LocalRun(root, *args, "--step-delay", "0.25")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while logged_steps(root) < step:
            assert started.running(), f"the run ended before step {step}:\n{started.output()}"
            assert time.monotonic() < deadline, f"step {step} not logged in {RUN_TIMEOUT_S}s"
            time.sleep(0.02)
    finally:
        started.kill()


def local_steps(root: Path) -> list[str]:
    """The steps of which the local tier holds a committed rank checkpoint."""
    return sorted(
        {p.parent.parent.name for p in (root / "local").glob("step-*/rank-*/manifest.json")}
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["plain", "fsdp"])
def test_fit_resumes_from_the_local_tier_before_any_modelcheckpoint(
    tmp_path: Path, uninterrupted: Callable[[str], Path], kind: str
) -> None:
    """``kind``: ``ShardsafeDDPStrategy``, or FSDP2 under ``ShardsafeModelParallelStrategy``."""
    whole = losses(uninterrupted(kind))
    which = ["--fsdp"] if kind == "fsdp" else []
    kill_after_step(tmp_path, *which, step=7)
    assert not (tmp_path / "ckpts").exists() or not os.listdir(tmp_path / "ckpts")
    assert "step-000000005" in local_steps(tmp_path)

    restored = run(tmp_path, *which, "--log", "resumed.jsonl")  # ckpt_path=None
    assert restored == [{"step": 5, "tiers": ["local", "local"]}] * 2
    resumed = losses(tmp_path, "resumed.jsonl")
    assert resumed == {s: whole[s] for s in range(6, 16)}


@pytest.mark.timeout(150)
def test_last_takes_the_local_tier_and_an_explicit_path_is_exact(
    tmp_path: Path, uninterrupted: Callable[[str], Path]
) -> None:
    whole = losses(uninterrupted("plain"))
    kill_after_step(tmp_path, step=12)
    step10 = tmp_path / "ckpts" / "epoch=1-step=10.ckpt"
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["epoch=1-step=10.ckpt", "last.ckpt"]

    restored = run(tmp_path, "--resume", "last", "--log", "last.jsonl")
    assert restored == [{"step": 10, "tiers": ["local", "local"]}] * 2
    assert losses(tmp_path, "last.jsonl") == {s: whole[s] for s in range(11, 16)}
    assert "step-000000015" in local_steps(tmp_path)

    # Back to step 10 from ModelCheckpoint's file, for 2 steps: the local step 15 of the
    # abandoned history is deleted, not left for a later resume to pick.
    restored = run(tmp_path, "--resume", step10, "--max-steps", "12", "--log", "exact.jsonl")
    assert restored == [None, None]
    assert losses(tmp_path, "exact.jsonl") == {s: whole[s] for s in (11, 12)}
    assert "step-000000015" not in local_steps(tmp_path)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("damaged", [["step-000000010"], ["step-000000005", "step-000000010"]])
def test_last_is_not_traded_for_an_older_local_step_when_the_newest_is_damaged(
    tmp_path: Path, uninterrupted: Callable[[str], Path], damaged: list[str]
) -> None:
    """``last.ckpt`` and the local tier both at step 10, rank 1's local copy of step 10
    damaged: the tier could only restore step 5, and the fit resumed from there, older
    than ``last.ckpt``; with step 5 damaged too, the fit failed ("no complete step is
    left in any tier"). It resumes from ``last.ckpt`` (step 10) instead, with a warning."""
    whole = losses(uninterrupted("plain"))
    run(tmp_path, "--every", "5", "--max-steps", "10")
    assert local_steps(tmp_path) == ["step-000000005", "step-000000010"]
    for step in damaged:
        (data,) = (tmp_path / "local" / step / "rank-00001").glob("*.safetensors")
        flipped = bytearray(data.read_bytes())
        flipped[-3] ^= 1  # inside the last tensor's bytes
        data.write_bytes(bytes(flipped))

    restored = run(tmp_path, "--resume", "last", "--log", "last.jsonl")
    assert restored == [None, None]  # not from the local tier
    assert losses(tmp_path, "last.jsonl") == {s: whole[s] for s in range(11, 16)}


@pytest.mark.timeout(150)
def test_a_fresh_start_at_another_world_size_over_the_local_tier_is_refused(
    tmp_path: Path,
) -> None:
    """Local steps saved by 2 ranks, no ModelCheckpoint checkpoint yet, resumed on 1: the
    fit started from nothing, silently abandoning them (``load_latest`` refuses this)."""
    kill_after_step(tmp_path, step=7)
    assert "step-000000005" in local_steps(tmp_path)
    started = LocalRun(tmp_path, "--log", "one.jsonl", devices=1)
    codes, output = started.wait(), started.output()
    assert codes != [0], output
    assert (
        "the local tier holds checkpoints of step 5 saved at world size 2, but this run's "
        "world size is 1: local checkpoints load only at the world size that saved them, and "
        "Lightning found no checkpoint to resume from (ckpt_path=None, or 'last' with no last "
        "checkpoint). Relaunch with 2 ranks to resume from them, resume from a ModelCheckpoint "
        "checkpoint with fit(ckpt_path=...), which reshards, or give this run a local "
        "directory of its own to start afresh"
    ) in " ".join(output.split()), output
    assert not (tmp_path / "one.jsonl").exists()
    assert "step-000000005" in local_steps(tmp_path)


@pytest.mark.timeout(150)
def test_a_fresh_start_over_copies_that_complete_no_step_warns_and_saves(
    tmp_path: Path,
) -> None:
    """Found in review: rank 1's copy of the first local step gone (a job killed in its
    first local save), no ModelCheckpoint checkpoint: the fit started afresh in silence,
    and its own first local save was then refused ("hold step 5 of an earlier run ...
    Call load_latest(state) first"), restart after restart."""
    assert run(tmp_path, "--max-steps", "5", "--local-every", "5") == [None, None]
    for copy in (tmp_path / "local").glob("step-*/rank-00001"):
        shutil.rmtree(copy)
    started = LocalRun(tmp_path, "--max-steps", "10", "--local-every", "5", "--log", "b.jsonl")
    codes = started.wait()
    logs = []  # whole: output() keeps each log's tail, which torch's exit noise can fill
    for log in started.logs:
        log.seek(0)
        logs.append(" ".join(log.read().decode(errors="replace").split()))
    output = started.output()
    assert codes == [0, 0], output
    said = (
        "shardsafe: nothing was restored, and the run starts afresh: the newest local "
        "checkpoints, of step 5, are complete for some ranks only (no node holds a copy of "
        "rank(s) 1"
    )
    assert [said in log for log in logs] == [True, True], output  # on each rank
    fresh, first = losses(tmp_path, "b.jsonl"), losses(tmp_path)
    assert sorted(fresh) == list(range(1, 11))
    assert {s: fresh[s] for s in first} == first  # afresh: the first run's steps again
    assert local_steps(tmp_path) == ["step-000000005", "step-000000010"]
    assert sorted(p.name for p in (tmp_path / "local").glob("step-000000010/rank-*")) == [
        "rank-00000",
        "rank-00001",
    ]


@pytest.mark.timeout(120)
def test_with_accumulated_gradients_only_steps_taken_are_saved(tmp_path: Path) -> None:
    """With ``accumulate_grad_batches=2``, the first batch of a fit (no optimizer step
    yet) was saved as a local step: a fresh run's step 0 holding half a window (a kill
    before step 1 resumed from it, its gradients lost, every later loss different), and a
    resumed run's step saved again over the good copy mid-window (found in review)."""
    options = ("--accumulate", "2", "--local-every", "1")
    assert run(tmp_path, *options, "--max-steps", "1") == [None, None]
    assert local_steps(tmp_path) == ["step-000000001"]
    manifests = sorted((tmp_path / "local").glob("step-000000001/rank-*/manifest.json"))
    before = [m.read_bytes() for m in manifests]
    restored = run(tmp_path, *options, "--max-steps", "2", "--log", "resumed.jsonl")
    assert restored == [{"step": 1, "tiers": ["local", "local"]}] * 2
    assert local_steps(tmp_path) == ["step-000000001", "step-000000002"]
    assert [m.read_bytes() for m in manifests] == before  # step 1 not saved again


@pytest.mark.timeout(120)
def test_keep_local_is_how_many_steps_the_local_tier_keeps(tmp_path: Path) -> None:
    run(tmp_path, "--local-every", "1", "--keep-local", "3", "--max-steps", "5")
    assert local_steps(tmp_path) == [f"step-00000000{s}" for s in (3, 4, 5)]


@pytest.mark.timeout(200)
def test_a_callback_that_edits_the_state_dict_resumes_from_the_local_tier(tmp_path: Path) -> None:
    """Lightning's EMAWeightAveraging puts the average in the checkpoint's state_dict and the
    live weights beside it: the local tier dropped the state_dict, and the resume failed
    with KeyError: 'state_dict' on every rank. It is kept now, and the resumed losses are
    the uninterrupted run's."""
    run(tmp_path / "whole", "--ema")
    whole = losses(tmp_path / "whole")
    part = tmp_path / "part"
    kill_after_step(part, "--ema", step=7)
    restored = run(part, "--ema", "--log", "resumed.jsonl")
    assert restored == [{"step": 5, "tiers": ["local", "local"]}] * 2
    assert losses(part, "resumed.jsonl") == {s: whole[s] for s in range(6, 16)}
