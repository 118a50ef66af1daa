"""Failures a Lightning user meets: a callback raising on one rank, an unsavable hparam.

* A callback's ``state_dict`` raises on rank 1 during the step-10 save: both ranks end by
  themselves (no launcher kills them) with the same ``CheckpointError``, naming rank 1,
  the exception and where it was raised (not a timeout's "never arrived"), and exit 1;
  the step-5 checkpoint is still the newest one.
* A hyper-parameter JSON cannot hold is reported when ``fit`` starts, naming it and the
  way out, on every rank, before the first step.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import shardsafe
from tests.lightning.helpers import SCRIPT, Run, losses, outcomes


def run_failing(root: Path, *args: str) -> list[int]:
    """Every rank's exit code, once every rank ended by itself."""
    return Run(root, *args).wait(timeout=90)


@pytest.mark.timeout(90)
def test_an_exception_in_a_callback_on_rank_1_ends_both_ranks_with_one_error(
    tmp_path: Path,
) -> None:
    codes = run_failing(tmp_path, "--fail-rank", "1", "--fail-step", "10")
    assert codes == [1, 1]
    line = _line_of(SCRIPT, "raise RuntimeError")
    expected = (
        "CheckpointError: save failed on rank 1: gathering Lightning's checkpoint "
        "(Trainer.save_checkpoint -> dump_checkpoint: callbacks, hooks, loops) failed: "
        f"RuntimeError: state_dict failed on purpose on rank 1 (at {SCRIPT}:{line})"
    )
    ranks = outcomes(tmp_path, 2)
    assert [r["error"] for r in ranks] == [expected, expected]
    # Both ranks ended by themselves with the agreed error (a rank left waiting would
    # have raised a timeout's "never arrived", or been killed by wait's 90 s): no bound
    # on the clock, which a loaded CI machine can stretch.
    assert sorted(losses(tmp_path)) == list(range(1, 11))
    # The previous checkpoint is still the last one, and nothing else became visible.
    assert os.listdir(tmp_path / "ckpts") == ["epoch=0-step=5.ckpt"]
    values = shardsafe.load(tmp_path / "ckpts" / "epoch=0-step=5.ckpt", {})
    assert values["lightning"]["global_step"] == 5


@pytest.mark.timeout(60)
def test_an_unsavable_hyper_parameter_is_reported_when_fit_starts(tmp_path: Path) -> None:
    codes = run_failing(tmp_path, "--bad-hparam")
    assert codes == [1, 1]
    expected = (
        "CheckpointError: hyper-parameter 'activation' of Regression is the class "
        "torch.nn.modules.activation.ReLU, which a checkpoint cannot hold. Leave it out with "
        "self.save_hyperparameters(ignore=['activation']), or pass a value JSON can hold (a "
        "number, string, list or dict) and build the object from it. (shardsafe's Lightning "
        "strategy checks this when fit starts, so that no save fails mid-run: shardsafe "
        "checkpoints hold tensors and JSON data, never pickles.)"
    )
    assert [r["error"] for r in outcomes(tmp_path, 2)] == [expected, expected]
    assert losses(tmp_path) == {}  # not a single step
    assert not (tmp_path / "ckpts").exists()


def _line_of(path: Path, text: str) -> int:
    lines = path.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)
