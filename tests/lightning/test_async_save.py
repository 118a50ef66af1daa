"""``ShardsafeDDPStrategy(async_save=True)``: a fit's checkpoints are written in the
background, and nothing a user could check differs from blocking saves: the same tensors
in each checkpoint, the same names kept by ``save_top_k``, a resume with the same losses,
and, killed mid-write, no checkpoint that is not complete."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe.checkpoint.storage.leftovers import is_deletion
from shardsafe.checkpoint.storage.local import LocalStorage
from tests.lightning.helpers import (
    RUN_TIMEOUT_S,
    Net,
    Run,
    assert_same_optimizer_state,
    kill_after_step,
    logged_steps,
    losses,
    outcomes,
    run,
)

pytestmark = pytest.mark.timeout(150)


def saved(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """A checkpoint's model and optimizer, read into plain objects in one process."""
    net = Net()
    adam = torch.optim.Adam(net.parameters(), lr=1.0)
    shardsafe.load(path, {"model": net, "optimizer": adam})
    return net.state_dict(), adam.state_dict()


def test_background_saves_hold_what_blocking_saves_hold_and_resume_the_same(
    tmp_path: Path, uninterrupted: Callable[[str], Path]
) -> None:
    blocking = uninterrupted("zero")
    run(tmp_path, "--optimizer", "zero", "--async-save", "--step-delay", "0.05")
    assert losses(tmp_path) == losses(blocking)
    names = sorted(os.listdir(tmp_path / "ckpts"))
    assert names == ["epoch=1-step=10.ckpt", "epoch=2-step=15.ckpt"]  # save_top_k=2
    for name in names:
        model, optimizer = saved(tmp_path / "ckpts" / name)
        model_b, optimizer_b = saved(blocking / "ckpts" / name)
        assert all(torch.equal(model[k], model_b[k]) for k in model_b)
        assert_same_optimizer_state(optimizer_b, optimizer)  # type: ignore[arg-type]
        assert shardsafe.verify(tmp_path / "ckpts" / name).ok

    resumed_root = tmp_path / "resumed"
    step10 = tmp_path / "ckpts" / "epoch=1-step=10.ckpt"
    run(resumed_root, "--optimizer", "zero", "--async-save", "--resume", step10)
    whole = losses(blocking)
    assert losses(resumed_root) == {s: whole[s] for s in range(11, 16)}


def test_a_run_killed_while_a_checkpoint_is_written_shows_only_complete_ones(
    tmp_path: Path,
) -> None:
    """Killed right after step 16: the step-15 save may still be in flight. The step-5
    checkpoint that save_top_k rotates out is deleted only once step 15 has committed, so
    at least two complete checkpoints are there either way, and nothing else but the
    name the save in flight holds, empty (``cleanup.hold_name``), or the step-5
    checkpoint killed mid-deletion (its manifest gone first, its record saying so),
    which the resumed run deletes when its fit starts (``placement._finish_deletion``)."""
    args = ("--optimizer", "zero", "--async-save", "--max-steps", "25")
    kill_after_step(tmp_path, *args, "--step-delay", "0.2", step=16)
    ckpts = tmp_path / "ckpts"
    names = sorted(n for n in os.listdir(ckpts) if not n.startswith("."))
    assert set(names) <= {
        "epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt", "epoch=2-step=15.ckpt",
    }  # fmt: skip
    incomplete = [n for n in names if not (ckpts / n / "manifest.json").exists()]
    held = [n for n in incomplete if not os.listdir(ckpts / n)]
    # Step 5 empty: its deletion killed between its record's removal and its own (seen
    # once on a loaded machine); a load refuses an empty directory, saying so.
    emptied = [n for n in held if n == "epoch=0-step=5.ckpt"]
    held = [n for n in held if n not in emptied]
    assert held in ([], ["epoch=2-step=15.ckpt"]), incomplete
    deleting = [n for n in incomplete if n not in held and n not in emptied]
    assert deleting in ([], ["epoch=0-step=5.ckpt"]), incomplete
    for name in deleting:
        with LocalStorage(str(ckpts / name)) as step:
            assert is_deletion(step), os.listdir(ckpts / name)
    names = [n for n in names if n not in incomplete]
    assert len(names) >= 2
    for name in names:
        assert shardsafe.verify(ckpts / name).ok, name
    run(tmp_path, *args, "--resume", ckpts / names[-1], "--log", "resumed.jsonl")
    assert max(losses(tmp_path, "resumed.jsonl")) == 25
    after = sorted(n for n in os.listdir(ckpts) if not n.startswith("."))
    assert not set(deleting) & set(after), after
    for name in after:  # the held name, if any, holds the resumed run's save of step 15
        if name not in emptied:
            assert shardsafe.verify(ckpts / name).ok, name


def test_a_checkpoint_rotated_out_is_removed_once_the_new_one_commits(tmp_path: Path) -> None:
    """The step-5 checkpoint save_top_k rotates out when step 15 is saved was left for the
    next save (step 20) to remove, so a preemption between two saves left it behind for
    good (the resumed callback no longer names it: found in review). It goes at the first
    batch after step 15 commits: the run is killed once it is gone, which must be before
    step 20's save (4 steps of 0.4 s after step 15's)."""
    args = ("--optimizer", "zero", "--async-save", "--max-steps", "25", "--step-delay", "0.4")
    ckpts, old = tmp_path / "ckpts", tmp_path / "ckpts" / "epoch=0-step=5.ckpt"
    started = Run(tmp_path, *args)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not (logged_steps(tmp_path) >= 15 and not old.exists()):
            assert started.running(), f"the run ended first:\n{started.output()}"
            assert time.monotonic() < deadline, f"not removed within {RUN_TIMEOUT_S}s"
            time.sleep(0.02)
        killed_at = logged_steps(tmp_path)
    finally:
        started.kill()
    assert killed_at < 20, killed_at  # removed before the next save, not by it
    names = sorted(n for n in os.listdir(ckpts) if not n.startswith("."))
    assert names == ["epoch=1-step=10.ckpt", "epoch=2-step=15.ckpt"]


def test_a_repeating_filename_is_versioned_as_blocking_saves_version_it(tmp_path: Path) -> None:
    """``filename="{epoch}"`` saved every step: ``ModelCheckpoint`` gives a name already
    taken a version suffix, but a background save's name appeared only at its commit, so
    the next save took the same name and replaced the one in flight, and ``save_top_k=3``
    kept two (found in review). Each commit is made slow here (0.5 s), so that every
    save is still in flight when the next name is chosen."""
    args = ("--optimizer", "zero", "--filename", "{epoch}", "--every", "1", "--top-k", "3")
    run(tmp_path / "blocking", *args, "--max-steps", "4")
    run(tmp_path / "async", *args, "--max-steps", "4", "--async-save", "--slow-commit", "0.5")
    names = sorted(os.listdir(tmp_path / "blocking" / "ckpts"))
    assert names == ["epoch=0-v1.ckpt", "epoch=0-v2.ckpt", "epoch=0.ckpt"]
    ckpts = tmp_path / "async" / "ckpts"
    assert sorted(n for n in os.listdir(ckpts) if not n.startswith(".")) == names
    for name in names:
        model, _ = saved(ckpts / name)
        model_b, _ = saved(tmp_path / "blocking" / "ckpts" / name)
        assert all(torch.equal(model[k], model_b[k]) for k in model_b), name


@pytest.mark.parametrize("stopped", ["before the commit", "before the name"])
def test_a_run_killed_before_last_links_target_is_named_names_the_checkpoint_to_resume(
    tmp_path: Path, stopped: str
) -> None:
    """``save_last="link"`` points ``last.ckpt`` at a save's name as the save starts; a
    run killed before the checkpoint took that name left the link pointing at nothing,
    and ``fit(ckpt_path="last")`` trained from step 0 (found in review). The name is held
    from the start, so the resume stops, naming the checkpoint to resume from: the
    newest complete one beside it, or the save's own if it committed before the kill."""
    args = ("--optimizer", "zero", "--async-save", "--save-last", "link", "--max-steps", "25")
    slow = "--slow-write" if stopped == "before the commit" else "--slow-commit"
    kill_after_step(tmp_path, *args, "--step-delay", "0.1", slow, "3", step=12)
    ckpts = tmp_path / "ckpts"
    assert os.readlink(ckpts / "last.ckpt") == "epoch=1-step=10.ckpt"
    assert os.listdir(ckpts / "epoch=1-step=10.ckpt") == []  # held, never given the checkpoint
    assert shardsafe.verify(ckpts / "epoch=0-step=5.ckpt").ok
    resumed = Run(tmp_path / "resumed", *args, "--dirpath", ckpts, "--resume", "last")
    assert resumed.wait() == [1, 1], resumed.output()
    head = (
        f"CheckpointNotFoundError: {ckpts / 'last.ckpt'} is an empty directory, not a "
        "checkpoint: a background save (async_save=True) holds its name from the start, "
    )
    if stopped == "before the commit":
        expected = head + (
            "and this one never committed (the run stopped, or the save failed, while it was "
            f"written); the newest complete checkpoint beside it is "
            f"{ckpts / 'epoch=0-step=5.ckpt'}: resume from it (ckpt_path=...)"
        )
    else:
        staged = ckpts / ".epoch=1-step=10.ckpt.shardsafe-partial"
        assert shardsafe.verify(staged).ok
        expected = head + (
            "and the run stopped after the save committed but before it took the name. The "
            f"whole checkpoint is at {staged}: resume from it (ckpt_path=...)"
        )
    assert [r["error"] for r in outcomes(tmp_path / "resumed", 2)] == [expected] * 2
