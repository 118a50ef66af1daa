"""The trainer's strategies on real gloo ranks: sharded optimizers a user builds under plain
DDP, and resuming at a different world size.

Each rank runs ``Trainer.fit`` in-process, in a process group the harness made (the
trainer joins it, as it joins torchrun's).
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe import CheckpointManager, Trainer
from shardsafe.trainer.example import ExampleModule
from shardsafe.trainer.metrics import read_metrics
from tests.harness import run_ranks

BATCH = 32  # ExampleModule's batch size per rank


def fit(
    rank: int,
    world_size: int,
    run_dir: str,
    *,
    strategy: str = "ddp",
    optimizer: str = "adamw",
    max_steps: int = 6,
    resume: str | None = None,
    layout: str = "sharded",
) -> float:
    torch.manual_seed(0)
    module = ExampleModule(optimizer=optimizer)
    trainer = Trainer(
        strategy=strategy,
        devices=world_size,
        max_steps=max_steps,
        checkpoint_every=3,
        run_dir=run_dir,
        layout=layout,
    )
    return trainer.fit(module, resume=resume).loss


def losses(run_dir: Path) -> dict[int, float]:
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    assert len({r["step"] for r in records}) == len(records), "a step was logged twice"
    return {r["step"]: r["loss"] for r in records}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["zero", "oss"])
def test_sharded_optimizer_built_by_the_module_under_ddp(tmp_path: Path, optimizer: str) -> None:
    if optimizer == "oss":
        pytest.importorskip("fairscale")
    whole = tmp_path / "whole"
    run_ranks(partial(fit, optimizer=optimizer), 2, str(whole))

    # Every rank wrote its own shard of the optimizer state: together, every parameter.
    manifest = shardsafe.read_manifest(whole / "checkpoints" / "step-000000003")
    saved = manifest.values["optimizer"].meta["state"]
    params = [name for name, _ in ExampleModule().named_parameters()]
    assert sorted(saved) == sorted(params)
    assert all(set(saved[p]) >= {"exp_avg", "exp_avg_sq", "step"} for p in params)

    # A run that stopped after step 3 resumes to exactly the same losses.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        whole / "checkpoints" / "step-000000003", resumed / "checkpoints" / "step-000000003"
    )
    run_ranks(partial(fit, optimizer=optimizer, resume="latest"), 2, str(resumed))
    after, before = losses(resumed), losses(whole)
    assert sorted(after) == [4, 5, 6]
    assert [after[s] for s in (4, 5, 6)] == [before[s] for s in (4, 5, 6)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("strategy", "before", "after", "layout"),
    [
        ("ddp", 2, 1, "sharded"),
        ("zero", 1, 2, "sharded"),
        ("fsdp", 2, 1, "consolidated"),
        ("fsdp", 1, 2, "sharded"),
    ],
)
def test_resume_at_another_world_size(
    tmp_path: Path, strategy: str, before: int, after: int, layout: str
) -> None:
    run_ranks(partial(fit, strategy=strategy, max_steps=9, layout=layout), before, str(tmp_path))
    resume = partial(fit, strategy=strategy, max_steps=12, resume="latest", layout=layout)
    run_ranks(resume, after, str(tmp_path))

    loss = losses(tmp_path)
    assert sorted(loss) == list(range(1, 13))
    assert loss[10] < 0.8 * loss[1]  # training went on from the trained weights
    latest = CheckpointManager(tmp_path / "checkpoints").latest()
    assert latest is not None and latest.endswith("step-000000012")
    assert shardsafe.read_manifest(latest).layout == layout
    assert (Path(latest) / "model.safetensors").exists() == (layout == "consolidated")
    progress = shardsafe.load(latest, {})["trainer"]
    # The data position counts samples of the epoch's global order: 9 steps of `before`
    # ranks, then 3 of `after` ranks, each rank taking BATCH samples a step.
    assert progress == {
        "step": 12,
        "seed": 0,
        "epoch": 0,
        "position": (9 * before + 3 * after) * BATCH,
    }


def fit_in_own_directory(rank: int, world_size: int, base: str) -> tuple[int, str]:
    """``fit`` with a relative run_dir, each rank in a directory of its own (as on nodes
    whose run_dir is node-local): rank 1's holds a newer checkpoint, rank 0's none. Then
    a run whose metrics.jsonl rank 0 refuses: what each rank raised."""
    import os

    os.chdir(os.path.join(base, f"node{rank}"))
    torch.manual_seed(0)
    trainer = Trainer(strategy="ddp", devices=world_size, max_steps=1, run_dir="run")
    step = trainer.fit(ExampleModule()).step
    trainer = Trainer(strategy="ddp", devices=world_size, max_steps=1, run_dir=f"{base}/bad")
    with pytest.raises(shardsafe.CheckpointError) as raised:
        trainer.fit(ExampleModule())
    return step, str(raised.value)


@pytest.mark.timeout(60)
def test_what_rank_zero_checks_before_step_one_is_agreed_on_every_rank(tmp_path: Path) -> None:
    # Rank 1 listed the checkpoints on its own and raised alone; rank 0 went on into the
    # first step's all-reduce and failed there with gloo's 'Connection closed by peer'.
    (tmp_path / "node0").mkdir()
    CheckpointManager(tmp_path / "node1" / "run" / "checkpoints").save(5, {"w": torch.ones(1)})
    # Rank 0 alone refused this metrics.jsonl; rank 1 waited in step 1's all-reduce until
    # the process group's timeout.
    (tmp_path / "bad" / "metrics.jsonl").mkdir(parents=True)
    refused = (
        f"fit failed on rank 0: {tmp_path}/bad/metrics.jsonl is a directory, not the run's "
        "metrics file; move it away (or choose another run_dir) and start again"
    )
    assert run_ranks(fit_in_own_directory, 2, str(tmp_path)) == [(1, refused), (1, refused)]


def fit_in_a_group_of_the_callers(rank: int, world_size: int, run_dir: str) -> str:
    """``Trainer(strategy="single")`` (devices=1) called on each rank of a process group
    the caller initialized without torchrun's variables (``mp.spawn``): what it raised."""
    import os

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(name, None)
    trainer = Trainer(max_steps=2, run_dir=run_dir)
    with pytest.raises(ValueError) as raised:
        trainer.fit(ExampleModule())
    return str(raised.value)


@pytest.mark.timeout(60)
def test_devices_that_do_not_match_a_callers_process_group_are_refused(tmp_path: Path) -> None:
    """It trained two replicas whose gradients were never averaged, and saved one
    checkpoint stitched from both (some tensors written by rank 0, others by rank 1)."""
    refused = (
        "devices=1, but this process is one of 2 ranks of the process group already "
        "initialized (init_process_group); make devices match it, with a strategy that runs "
        "on several processes (ddp, zero, fsdp)"
    )
    assert run_ranks(fit_in_a_group_of_the_callers, 2, str(tmp_path / "run")) == [refused] * 2
    assert not (tmp_path / "run" / "checkpoints").exists()
