"""``Trainer.validate``, ``test`` and ``predict`` with ``ckpt_path=`` a shardsafe checkpoint
directory (or ``"last"``), on 2 processes under ``ShardsafeDDPStrategy``: they run on the
checkpoint's weights, as Lightning's own do on a ``.ckpt`` file."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import shardsafe
from tests.lightning.helpers import Net, run
from tests.lightning.lightning_script import evaluation_data

pytestmark = pytest.mark.timeout(120)
STEP15 = "epoch=2-step=15.ckpt"


def saved_net(root: Path) -> Net:
    net = Net()
    shardsafe.load(root / "ckpts" / STEP15, {"model": net})
    return net


@pytest.mark.parametrize(("mode", "ckpt"), [("validate", "last"), ("test", STEP15)])
def test_validate_and_test_run_on_the_checkpoints_weights(
    tmp_path: Path, uninterrupted: Callable[[str], Path], mode: str, ckpt: str
) -> None:
    trained = uninterrupted("zero")
    path = "last" if ckpt == "last" else str(trained / "ckpts" / ckpt)
    if ckpt == "last":  # looked up where the run's ModelCheckpoint saves: a copy of them
        shutil.copytree(trained / "ckpts", tmp_path / "ckpts", symlinks=True)
    run(tmp_path, "--optimizer", "zero", "--evaluate", mode, "--resume", path)
    x, y = evaluation_data()
    with torch.no_grad():
        expected = nn.functional.mse_loss(saved_net(trained).net(x), y).item()
    for rank in (0, 1):
        (metrics,) = json.loads((tmp_path / f"{mode}-{rank}.json").read_text())
        name = "val_loss" if mode == "validate" else "test_loss"
        assert metrics[name] == pytest.approx(expected, rel=1e-6)


def test_validate_best_after_a_fit_runs_on_the_best_checkpoints_weights(
    tmp_path: Path, uninterrupted: Callable[[str], Path]
) -> None:
    """``ckpt_path="best"`` is the best checkpoint of the fit the Trainer ran (a new
    Trainer knows none: Lightning refuses it, whatever the strategy, as docs/lightning.md
    says). Monitoring ``step``, the best is step 15; the fit went on to step 17, so the
    metrics show which weights were validated."""
    trained = uninterrupted("zero")
    run(tmp_path, "--optimizer", "zero", "--max-steps", "17", "--validate-best")
    x, y = evaluation_data()
    with torch.no_grad():
        expected = nn.functional.mse_loss(saved_net(trained).net(x), y).item()
    for rank in (0, 1):
        (metrics,) = json.loads((tmp_path / f"validate-{rank}.json").read_text())
        assert metrics["val_loss"] == pytest.approx(expected, rel=1e-6)


def test_predict_gives_the_checkpoints_outputs_bitwise(
    tmp_path: Path, uninterrupted: Callable[[str], Path]
) -> None:
    trained = uninterrupted("zero")
    path = trained / "ckpts" / STEP15
    run(tmp_path, "--optimizer", "zero", "--evaluate", "predict", "--resume", path)
    net = saved_net(trained)
    seen = 0
    for rank in (0, 1):
        for x, predicted in torch.load(tmp_path / f"predicted-{rank}.pt", weights_only=True):
            with torch.no_grad():
                assert torch.equal(predicted, net.net(x))
            seen += len(x)
    assert seen == len(evaluation_data()[0])
