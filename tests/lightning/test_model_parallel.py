"""``ShardsafeModelParallelStrategy``: FSDP2 (``fully_shard`` in ``configure_model``), CPU, gloo.

The module's parameters and Adam's state are DTensors, each rank holding half of each;
the checkpoint holds every rank's shards. Resumed on 2 ranks from step 10 it logs the
losses of the uninterrupted run; resumed on 3 ranks, the optimizer state and weights
right after the restore (gathered whole) are bit for bit what the checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardsafe
from tests.lightning.helpers import Net, assert_same_optimizer_state, losses, run

FSDP = ("--optimizer", "plain", "--fsdp")
STEP10 = "epoch=1-step=10.ckpt"


@pytest.mark.timeout(120)
def test_an_fsdp2_run_resumes_with_the_same_losses(
    tmp_path: Path, uninterrupted: Callable[[str], Path]
) -> None:
    root = uninterrupted("fsdp")
    whole = losses(root)
    saved = root / "ckpts" / STEP10
    assert shardsafe.read_manifest(saved).world_size == 2
    run(tmp_path, *FSDP, "--resume", saved, "--log", "resumed.jsonl")
    resumed = losses(tmp_path, "resumed.jsonl")
    assert sorted(resumed) == list(range(11, 16))
    assert [resumed[s] for s in range(11, 16)] == [whole[s] for s in range(11, 16)]


@pytest.mark.timeout(120)
def test_an_fsdp2_checkpoint_reshards_onto_3_ranks_bitwise(
    tmp_path: Path, uninterrupted: Callable[[str], Path]
) -> None:
    saved = uninterrupted("fsdp") / "ckpts" / STEP10
    dump = tmp_path / "restored.pt"
    run(tmp_path, *FSDP, "--resume", saved, "--dump-restored", dump, devices=3)
    net = Net()
    adam = torch.optim.Adam(net.parameters(), lr=1.0)
    shardsafe.load(saved, {"model": net, "optimizer": adam})
    live = torch.load(dump, weights_only=True)
    assert_same_optimizer_state(adam.state_dict(), live["optimizer"])
    assert all(torch.equal(v, live["model"][k]) for k, v in net.state_dict().items())
    assert sorted(losses(tmp_path)) == list(range(11, 16))


@pytest.mark.timeout(150)
def test_fsdp2_background_saves_hold_what_blocking_saves_hold_and_resume_the_same(
    tmp_path: Path, uninterrupted: Callable[[str], Path]
) -> None:
    """``ShardsafeModelParallelStrategy(async_save=True)``: the DTensor shards staged and
    written in the background are the blocking run's, bit for bit, and resume the same."""
    blocking = uninterrupted("fsdp")
    run(tmp_path, *FSDP, "--async-save", "--save-last", "--step-delay", "0.05")
    assert losses(tmp_path) == losses(blocking)
    names = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert names == ["epoch=1-step=10.ckpt", "epoch=2-step=15.ckpt", "last.ckpt"]
    for name in names:
        background, reference = Net(), Net()
        adam_b = torch.optim.Adam(background.parameters(), lr=1.0)
        adam_r = torch.optim.Adam(reference.parameters(), lr=1.0)
        shardsafe.load(tmp_path / "ckpts" / name, {"model": background, "optimizer": adam_b})
        shardsafe.load(blocking / "ckpts" / name, {"model": reference, "optimizer": adam_r})
        assert all(
            torch.equal(v, background.state_dict()[k]) for k, v in reference.state_dict().items()
        )
        assert_same_optimizer_state(adam_r.state_dict(), adam_b.state_dict())
    resumed = tmp_path / "resumed"
    run(resumed, *FSDP, "--async-save", "--resume", tmp_path / "ckpts" / STEP10)
    whole = losses(blocking)
    assert losses(resumed) == {s: whole[s] for s in range(11, 16)}
