"""``CheckpointManager``: step directories, the ``latest`` pointer and retention, as on disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe import CheckpointManager
from shardsafe.checkpoint.storage import leftovers


def test_keep_last_two_of_five_saves(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    manager = CheckpointManager(root, keep_last=2)
    assert manager.latest() is None
    model = nn.Linear(3, 2)
    weights = {}
    for step in (100, 200, 300, 400, 500):
        with torch.no_grad():
            model.weight.fill_(step)
        path = manager.save(step, {"model": model, "step": step})
        assert path == str(root / f"step-{step:09d}")
        weights[step] = model.weight.clone()
        assert manager.latest() == path
        assert (root / "latest").read_text() == f"step-{step:09d}\n"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [
        "step-000000400",
        "step-000000500",
    ]
    assert sorted(os.listdir(root / "step-000000500")) == [
        "manifest.json",
        "shard-00000-of-00001.safetensors",
    ]
    assert manager.complete_steps() == [400, 500]
    assert manager.latest() == str(root / "step-000000500")

    live = nn.Linear(3, 2)
    out = manager.load_latest({"model": live})
    assert out == {"step": 500}
    assert torch.equal(live.weight, weights[500])
    shardsafe.load(root / "step-000000400", {"model": live})
    assert torch.equal(live.weight, weights[400])
    manager.close()  # gives up the root's writer lock: nothing else is left behind
    assert sorted(os.listdir(root)) == ["latest", "step-000000400", "step-000000500"]


def test_a_step_directory_without_a_manifest_is_not_a_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(10, {"model": nn.Linear(2, 2)}, layout="consolidated")
    # An interrupted save of a later step: data written, manifest never committed.
    half = tmp_path / "step-000000099"
    half.mkdir()
    (half / "model.safetensors").write_bytes(os.urandom(64))
    (half / ".manifest.json.tmp-1234").write_bytes(b"{")
    # Its marker, which a save writes first, naming what it may create.
    names = ["model.safetensors", ".manifest.json.tmp-1234"]
    (half / ".shardsafe-incomplete").write_bytes(leftovers.marker_bytes(names))
    assert manager.latest() == str(tmp_path / "step-000000010")
    assert manager.complete_steps() == [10]
    live = nn.Linear(2, 2)
    assert manager.load_latest({"model": live}) == {}
    # The next commit cleans the leftover up; retention counts committed steps only.
    manager.save(20, {"model": nn.Linear(2, 2)})
    manager.close()
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000000010", "step-000000020"]
    assert (tmp_path / "latest").read_text() == "step-000000020\n"


def test_loading_a_root_or_run_directory_names_the_newest_checkpoint(tmp_path: Path) -> None:
    """``shardsafe.load("run/checkpoints", ...)`` said only 'a save into it may have been
    interrupted', which sends the user looking for a crash; it now gives the hint that
    ``inspect`` and ``verify`` give (docs/saving-and-loading.md)."""
    manager = CheckpointManager(tmp_path / "run" / "checkpoints")
    for step in (10, 20):
        manager.save(step, {"t": torch.ones(2)})
    manager.close()
    missing = (
        "has no manifest.json, so it is not a committed checkpoint (a save into it may have "
        "been interrupted)"
    )
    newest = tmp_path / "run" / "checkpoints" / "step-000000020"
    with pytest.raises(shardsafe.CheckpointNotFoundError) as caught:
        shardsafe.load(tmp_path / "run" / "checkpoints", {"t": torch.zeros(2)})
    assert str(caught.value) == (
        f"{tmp_path / 'run' / 'checkpoints'} {missing}. It looks like a checkpoint root; the "
        f"newest committed checkpoint in it is {newest}"
    )
    with pytest.raises(shardsafe.CheckpointNotFoundError) as caught:
        shardsafe.load(tmp_path / "run", {"t": torch.zeros(2)})
    assert str(caught.value) == (
        f"{tmp_path / 'run'} {missing}. It looks like a Trainer run directory: its checkpoints "
        f"are under {tmp_path / 'run' / 'checkpoints'}; the newest is {newest}"
    )
    (tmp_path / "other").mkdir()
    with pytest.raises(shardsafe.CheckpointNotFoundError) as caught:
        shardsafe.load(tmp_path / "other", {})
    assert str(caught.value) == f"{tmp_path / 'other'} {missing}"


def test_without_keep_last_everything_is_kept(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    for step in range(4):
        manager.save(step, {"x": step})
    assert manager.complete_steps() == [0, 1, 2, 3]
    assert manager.latest() == str(tmp_path / "step-000000003")


def test_other_files_in_the_root_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step-1").mkdir()  # not a step directory name the manager writes
    manager = CheckpointManager(tmp_path, keep_last=1)
    for step in (1, 2):
        manager.save(step, {"x": step})
    manager.close()
    assert sorted(os.listdir(tmp_path)) == ["latest", "notes.txt", "step-000000002", "step-1"]


def test_load_latest_with_nothing_saved_returns_none(tmp_path: Path) -> None:
    assert CheckpointManager(tmp_path / "empty").load_latest({"x": 1}) is None


@pytest.mark.parametrize("keep_last", [0, -1])
def test_keep_last_must_be_positive(keep_last: int) -> None:
    with pytest.raises(ValueError, match=f"keep_last={keep_last} must be an int, at least 1"):
        CheckpointManager("x", keep_last=keep_last)


@pytest.mark.parametrize("step", [-1, 1.5, True, "3", 2**63])
def test_step_must_be_a_non_negative_int(tmp_path: Path, step: object) -> None:
    with pytest.raises(ValueError, match="must be a non-negative int below 2"):
        CheckpointManager(tmp_path).save(step, {"x": 1})  # type: ignore[arg-type]


def test_load_latest_refuses_storage_settings_it_would_ignore(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "root")
    manager.save(1, {"t": torch.ones(2)})
    with pytest.raises(TypeError, match=r"pass them to CheckpointManager\(root, storage_options"):
        manager.load_latest({"t": torch.zeros(2)}, storage_options={"anon": True})
    with pytest.raises(TypeError, match=r"call shardsafe.load\(path, state, storage=\.\.\.\)"):
        manager.load_latest({"t": torch.zeros(2)}, storage=lambda path: None)  # type: ignore[arg-type]
    t = torch.zeros(2)
    manager.load_latest({"t": t})
    assert torch.equal(t, torch.ones(2))


def test_a_regular_file_where_a_directory_belongs_is_called_a_regular_file(
    tmp_path: Path,
) -> None:
    """Messages called a regular file "not a regular file" (describe_mode's fallback)."""
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "step-000000001").write_text("mine")
    manager = CheckpointManager(tmp_path / "root", keep_last=1)
    with pytest.warns(UserWarning, match=r"step-000000001 is a regular file, not a directory"):
        manager.save(2, {"x": 2})
    manager.close()
    assert (tmp_path / "root" / "step-000000001").read_text() == "mine"
    (tmp_path / "file").write_text("mine")
    with pytest.raises(shardsafe.CheckpointError, match=r"file is a regular file, not a directory"):
        CheckpointManager(tmp_path / "file").save(1, {"x": 1})
    assert (tmp_path / "file").read_text() == "mine"


def test_a_directory_where_latest_belongs_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """Each save committed, then raised IsADirectoryError from the pointer's rename, and
    retention never ran (keep_last=1 kept every step)."""
    (tmp_path / "latest").mkdir()
    (tmp_path / "latest" / "mine").write_text("mine")
    manager = CheckpointManager(tmp_path, keep_last=1)
    for step in (1, 2):
        with pytest.raises(shardsafe.CheckpointError) as refused:
            manager.save(step, {"x": step})
        assert str(refused.value) == (
            f"{tmp_path / 'latest'} is a directory, where CheckpointManager keeps its latest "
            "pointer (a one-line file naming the newest step); shardsafe will not delete it. "
            "Move it away and save again; nothing was written."
        )
    manager.close()
    assert sorted(os.listdir(tmp_path)) == ["latest"]
    assert os.listdir(tmp_path / "latest") == ["mine"]


def test_only_the_pointers_own_temporary_files_are_removed_from_the_root(tmp_path: Path) -> None:
    """Every name starting .latest.tmp- was removed: a file of yours, and a directory
    (which failed every save after its commit, so retention never ran)."""
    (tmp_path / ".latest.tmp-mine").write_text("mine")
    (tmp_path / ".latest.tmp-123").mkdir()
    (tmp_path / ".latest.tmp-123" / "x").write_text("mine")
    (tmp_path / ".latest.tmp-456").write_text("step-000000000\n")  # a killed pointer update
    manager = CheckpointManager(tmp_path, keep_last=1)
    for step in (1, 2):
        manager.save(step, {"x": step})
    manager.close()
    assert sorted(os.listdir(tmp_path)) == [
        ".latest.tmp-123",
        ".latest.tmp-mine",
        "latest",
        "step-000000002",
    ]
    assert (tmp_path / ".latest.tmp-mine").read_text() == "mine"
    assert (tmp_path / ".latest.tmp-123" / "x").read_text() == "mine"


@pytest.mark.timeout(60)
def test_load_latest_and_latest_wait_for_the_managers_save_in_flight(tmp_path: Path) -> None:
    """Found in review: ``load_latest`` during the manager's own ``async_save`` restored the
    step before it, in silence (the run's next save then found its step taken), and
    ``latest`` named that step; both wait for the save in flight first."""
    import time

    from shardsafe.checkpoint.options import SaveHooks

    model = nn.Linear(4, 4)
    manager = CheckpointManager(tmp_path)
    with torch.no_grad():
        model.weight.fill_(1.0)
    manager.save(1, {"model": model})
    with torch.no_grad():
        model.weight.fill_(2.0)
    slow = SaveHooks(before_write=lambda: time.sleep(0.5))
    handle = manager.async_save(2, {"model": model}, hooks=slow)
    assert manager.latest() == str(tmp_path / "step-000000002")
    handle = manager.async_save(3, {"model": model}, hooks=slow)
    with torch.no_grad():
        model.weight.fill_(-5.0)
    manager.load_latest({"model": model})
    assert handle.done()
    assert torch.equal(model.weight, torch.full((4, 4), 2.0))
    manager.close()


@pytest.mark.timeout(60)
def test_a_hook_asking_for_latest_during_an_async_save_does_not_wait_for_itself(
    tmp_path: Path,
) -> None:
    """Found in review: ``latest`` waits for the save in flight, and an ``after_commit``
    hook of that very save, run by its writer thread, waited for itself for ever."""
    from shardsafe.checkpoint.options import SaveHooks

    manager = CheckpointManager(tmp_path)
    seen: list[str | None] = []
    hook = SaveHooks(after_commit=lambda: seen.append(manager.latest()))
    manager.async_save(1, {"w": torch.ones(2)}, hooks=hook)
    assert manager.wait() == str(tmp_path / "step-000000001")
    assert seen == [str(tmp_path / "step-000000001")]
    manager.close()


@pytest.mark.timeout(60)
def test_a_failed_async_save_is_not_swallowed_by_a_load_errors_hint(tmp_path: Path) -> None:
    """Found in review: the hint of a load's error ("the newest committed checkpoint in it
    is ...") asked the manager for ``latest``, which raised the failed background save's
    error, marked it seen, and the hint dropped it: no later save said a word of it."""
    import errno

    from shardsafe.checkpoint.options import SaveHooks

    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    manager = CheckpointManager(tmp_path / "run")
    manager.save(1, {"w": torch.ones(2)})
    manager.async_save(2, {"w": torch.ones(2)}, hooks=SaveHooks(before_write=full))
    with pytest.raises(shardsafe.CheckpointNotFoundError) as refused:
        shardsafe.load(tmp_path / "run", {})
    assert str(refused.value).endswith(
        "It looks like a checkpoint root; the newest committed checkpoint in it is "
        f"{tmp_path / 'run' / 'step-000000001'}"
    ), str(refused.value)
    with pytest.raises(shardsafe.CheckpointError, match="No space left on device"):
        manager.save(3, {"w": torch.ones(2)})
    manager.close()


@pytest.mark.timeout(60)
def test_closing_the_manager_leaves_the_users_save_handle_answering(tmp_path: Path) -> None:
    """Found in review: ``close()`` closed the handle ``async_save`` had returned, and the
    user's ``wait()`` after it raised "this SaveHandle ... was closed", a
    ``CheckpointError`` as a failed save raises, for a save that had committed. A failed
    save's handle still raises its own error, once ``close()`` has raised it too."""
    import errno

    from shardsafe.checkpoint.options import SaveHooks

    manager = CheckpointManager(tmp_path / "ok")
    handle = manager.async_save(1, {"w": torch.ones(2)})
    manager.close()
    assert manager.complete_steps() == [1]
    assert handle.done()
    assert handle.wait() == str(tmp_path / "ok" / "step-000000001")

    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    manager = CheckpointManager(tmp_path / "failed")
    handle = manager.async_save(1, {"w": torch.ones(2)}, hooks=SaveHooks(before_write=full))
    with pytest.raises(shardsafe.CheckpointError, match="No space left on device") as closed:
        manager.close()
    assert handle.done()
    with pytest.raises(shardsafe.CheckpointError) as waited:
        handle.wait()
    assert waited.value is closed.value
