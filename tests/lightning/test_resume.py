"""The original scenario: a LightningModule wrapping its own optimizer, under DDP, resumed.

``configure_optimizers`` returns a ``ZeroRedundancyOptimizer`` (or fairscale ``OSS``, or
a plain Adam), with a StepLR schedule; ``ModelCheckpoint(every_n_train_steps=5,
save_top_k=2)`` saves through ``ShardsafeDDPStrategy`` on both ranks.

* A run killed with SIGKILL after step 7 and resumed with ``fit(ckpt_path=...)`` from its
  step-5 checkpoint logs, for steps 6..15, exactly the losses of a run never interrupted.
  Every checkpoint here falls on an epoch boundary (5 steps an epoch), where Lightning's
  own resume is exact; see the README for mid-epoch checkpoints.
* Resumed on 1 or 3 processes instead, the optimizer state right after the restore
  (gathered from every rank's shard) is bit for bit what the checkpoint holds, and
  training goes on to step 15.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardsafe
from tests.lightning.conftest import OPTIMIZERS
from tests.lightning.helpers import (
    Net,
    Run,
    assert_same_optimizer_state,
    kill_after_step,
    losses,
    run,
)

STEP5 = "epoch=0-step=5.ckpt"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_killed_run_resumes_with_the_same_losses(
    tmp_path: Path, uninterrupted: Callable[[str], Path], optimizer: str
) -> None:
    whole = losses(uninterrupted(optimizer))
    assert sorted(whole) == list(range(1, 16))

    kill_after_step(tmp_path, "--optimizer", optimizer, "--step-delay", "0.25", step=7)
    ckpts = tmp_path / "ckpts"
    assert os.listdir(ckpts) == [STEP5]  # nothing half-written is visible
    assert len(losses(tmp_path)) in (7, 8)  # the kill lands during step 8 at the latest

    step5 = ckpts / STEP5
    run(tmp_path, "--optimizer", optimizer, "--resume", step5, "--log", "resumed.jsonl")
    resumed = losses(tmp_path, "resumed.jsonl")
    assert sorted(resumed) == list(range(6, 16))
    assert [resumed[s] for s in range(6, 16)] == [whole[s] for s in range(6, 16)]
    # Lightning keeps the checkpoint it resumed from; save_top_k=2 applies to the others.
    assert sorted(os.listdir(ckpts)) == [STEP5, "epoch=1-step=10.ckpt", "epoch=2-step=15.ckpt"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("optimizer", ["zero", "oss"])
def test_resuming_on_another_world_size_restores_the_optimizer_bitwise(
    tmp_path: Path, uninterrupted: Callable[[str], Path], optimizer: str, devices: int
) -> None:
    saved = uninterrupted(optimizer) / "ckpts" / "epoch=1-step=10.ckpt"
    dump = tmp_path / "restored.pt"
    args = ("--optimizer", optimizer, "--dump-restored", dump)
    run(tmp_path, *args, "--resume", saved, devices=devices)

    # What the checkpoint holds, read back in one process into a plain Adam.
    net = Net()
    adam = torch.optim.Adam(net.parameters(), lr=1.0)
    shardsafe.load(saved, {"model": net, "optimizer": adam})
    live = torch.load(dump, weights_only=True)
    assert_same_optimizer_state(adam.state_dict(), live["optimizer"])
    assert all(torch.equal(v, live["model"][k]) for k, v in net.state_dict().items())
    assert adam.state_dict()["param_groups"][0]["lr"] == pytest.approx(0.05 * 0.7**3)
    assert sorted(losses(tmp_path)) == list(range(11, 16))
    assert sorted(os.listdir(tmp_path / "ckpts"))[-1].endswith("step=15.ckpt")


@pytest.mark.timeout(150)
def test_lightnings_on_exception_checkpoint_is_a_committed_checkpoint_that_resumes(
    tmp_path: Path, uninterrupted: Callable[[str], Path]
) -> None:
    """``OnExceptionCheckpoint``: a fit that fails on every rank at step 10 leaves
    ``on_exception.ckpt``, a committed checkpoint holding the state after step 10 (the
    uninterrupted run's step-10 checkpoint, bit for bit); resumed, the losses go on."""
    reference = uninterrupted("zero")
    started = Run(tmp_path, "--optimizer", "zero", "--fail-everywhere", "10")
    codes = started.wait()
    assert codes == [1, 1], started.output()
    saved = tmp_path / "on_exception.ckpt"
    assert shardsafe.verify(saved).ok
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["epoch=0-step=5.ckpt"]  # 10 never saved
    expected, got = Net(), Net()
    adam_e = torch.optim.Adam(expected.parameters(), lr=1.0)
    adam_g = torch.optim.Adam(got.parameters(), lr=1.0)
    shardsafe.load(
        reference / "ckpts" / "epoch=1-step=10.ckpt", {"model": expected, "optimizer": adam_e}
    )
    shardsafe.load(saved, {"model": got, "optimizer": adam_g})
    assert all(torch.equal(v, got.state_dict()[k]) for k, v in expected.state_dict().items())
    assert_same_optimizer_state(adam_e.state_dict(), adam_g.state_dict())
    resumed = tmp_path / "resumed"
    run(resumed, "--optimizer", "zero", "--resume", saved)
    whole = losses(reference)
    assert losses(resumed) == {s: whole[s] for s in range(11, 16)}
