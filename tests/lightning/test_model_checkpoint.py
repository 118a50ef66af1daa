"""``ModelCheckpoint`` as users configure it, and ordinary Lightning ``.ckpt`` files.

* ``save_top_k=2`` (monitoring ``step``) deletes the older checkpoint directories through
  the strategy; ``save_last=True`` keeps a loadable ``last.ckpt`` directory, replaced at
  every save; ``trainer.save_checkpoint(path)`` replaces ``path``; no staging leftovers.
* ``fit(ckpt_path="last")`` finds and resumes from ``last.ckpt``.
* A run of Lightning's own ``"ddp"`` strategy (a pickled ``.ckpt`` file, its ZeRO state
  consolidated) resumes under ``ShardsafeDDPStrategy`` with the same losses.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe.checkpoint.storage.leftovers import INCOMPLETE_MARKER, marker_bytes
from shardsafe.checkpoint.storage.placement import QUIET_S
from tests.lightning.helpers import Net, losses, run

STEP10, STEP15, LAST = "epoch=1-step=10.ckpt", "epoch=2-step=15.ckpt", "last.ckpt"


def global_step(path: Path) -> int:
    step: int = shardsafe.load(path, {})["lightning"]["global_step"]
    return step


def weights(path: Path) -> dict[str, torch.Tensor]:
    net = Net()
    shardsafe.load(path, {"model": net})
    return net.state_dict()


@pytest.mark.timeout(120)
def test_top_k_and_last_leave_exactly_the_checkpoints_asked_for(
    uninterrupted: Callable[[str], Path],
) -> None:
    root = uninterrupted("zero")
    ckpts = root / "ckpts"
    assert sorted(os.listdir(ckpts)) == [STEP10, STEP15, LAST]  # step 5's directory deleted
    assert not (ckpts / LAST).is_symlink()
    assert global_step(ckpts / LAST) == 15
    last, step15 = weights(ckpts / LAST), weights(ckpts / STEP15)
    assert all(torch.equal(last[k], step15[k]) for k in step15)
    assert {"manifest.json", "shard-00000-of-00002.safetensors"} <= set(os.listdir(ckpts / LAST))
    # trainer.save_checkpoint, twice on the same path: the second replaced the first.
    assert global_step(root / "final.ckpt") == 15
    assert sorted(n for n in os.listdir(root) if not n.startswith("outcome-")) == [
        "ckpts",
        "final.ckpt",
        "losses.jsonl",
    ]


@pytest.mark.timeout(120)
def test_fit_resumes_from_last(tmp_path: Path, uninterrupted: Callable[[str], Path]) -> None:
    root = tmp_path / "moved"
    shutil.copytree(uninterrupted("zero"), root, symlinks=True)
    args = ("--save-last", "--layout", "consolidated", "--max-steps", "20")
    run(root, *args, "--resume", "last", "--log", "resumed.jsonl")
    assert sorted(losses(root, "resumed.jsonl")) == list(range(16, 21))
    # The run was moved, and ModelCheckpoint restores its state (last_model_path, top k)
    # only into the dirpath it was saved from (Lightning warns): so, exactly as with .ckpt
    # files, it keeps the old checkpoints and versions the new last one.
    ckpts = root / "ckpts"
    assert sorted(os.listdir(ckpts)) == [
        STEP10,
        STEP15,
        "epoch=3-step=20.ckpt",
        "last-v1.ckpt",
        LAST,
    ]
    assert global_step(ckpts / LAST) == 15
    assert global_step(ckpts / "last-v1.ckpt") == 20
    assert shardsafe.read_manifest(ckpts / "last-v1.ckpt").layout == "consolidated"
    assert {"model.safetensors", "optimizer.safetensors"} <= set(os.listdir(ckpts / "last-v1.ckpt"))


@pytest.mark.timeout(120)
def test_an_ordinary_lightning_ckpt_file_resumes_with_the_same_losses(
    tmp_path: Path, uninterrupted: Callable[[str], Path]
) -> None:
    whole = losses(uninterrupted("zero"))
    theirs = tmp_path / "lightning"
    run(theirs, "--lightning-ddp")
    assert losses(theirs) == whole  # the strategy trains exactly as Lightning's DDP does
    ckpt = theirs / "ckpts" / STEP10
    assert ckpt.is_file()

    ours = tmp_path / "ours"
    run(ours, "--resume", ckpt, "--log", "resumed.jsonl")
    resumed = losses(ours, "resumed.jsonl")
    assert sorted(resumed) == list(range(11, 16))
    assert [resumed[s] for s in range(11, 16)] == [whole[s] for s in range(11, 16)]


def test_a_run_switched_from_lightnings_strategy_keeps_going_in_the_same_directory(
    tmp_path: Path, uninterrupted: Callable[[str], Path]
) -> None:
    """Resumed from Lightning's own last.ckpt file, the run replaces that file with its
    next last.ckpt directory instead of dying five steps later."""
    whole = losses(uninterrupted("zero"))
    root = tmp_path / "switched"
    run(root, "--lightning-ddp", "--save-last", "--max-steps", "10")
    assert (root / "ckpts" / "last.ckpt").is_file()
    run(root, "--resume", root / "ckpts" / "last.ckpt", "--save-last", "--log", "resumed.jsonl")
    resumed = losses(root, "resumed.jsonl")
    assert [resumed[s] for s in range(11, 16)] == [whole[s] for s in range(11, 16)]
    last = root / "ckpts" / "last.ckpt"
    assert last.is_dir() and (last / "manifest.json").is_file()
    assert shardsafe.load(last, {})["lightning"]["global_step"] == 15


def test_what_an_interrupted_save_left_is_cleared_when_the_next_fit_starts(
    tmp_path: Path,
) -> None:
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    leftover = ckpts / ".epoch=0-step=5.ckpt.shardsafe-partial"
    shardsafe.save(leftover, {"w": torch.ones(3)})  # then made uncommitted, as a kill leaves it
    (leftover / "manifest.json").unlink()
    data = sorted(p.name for p in leftover.iterdir())
    (leftover / INCOMPLETE_MARKER).write_bytes(marker_bytes(data))
    then = time.time() - QUIET_S - 1  # long enough ago not to be another run's save
    for entry in [*leftover.iterdir(), leftover]:
        os.utime(entry, (then, then))
    run(tmp_path, "--max-steps", "3")
    assert sorted(os.listdir(ckpts)) == []
