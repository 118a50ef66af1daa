"""Saving under a name that already holds a checkpoint (Lightning's ``last.ckpt``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.checkpoint import SaveOptions
from shardsafe.checkpoint.replacing import save_replacing
from shardsafe.checkpoint.saving import save as save_checkpoint
from shardsafe.checkpoint.storage import placement
from shardsafe.checkpoint.storage.leftovers import record
from shardsafe.checkpoint.storage.local import LocalStorage
from shardsafe.checkpoint.storage.removal import delete_checkpoint


def save(path: Path, value: float) -> None:
    save_replacing(str(path), {"w": torch.full((3,), value)}, SaveOptions())


def loaded(path: Path) -> float:
    return float(shardsafe.load(path, {})["w"][0])


def test_a_new_name_appears_committed_and_nothing_else_is_left(tmp_path: Path) -> None:
    save(tmp_path / "last.ckpt", 1.0)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    assert (tmp_path / "last.ckpt" / "manifest.json").is_file()
    assert loaded(tmp_path / "last.ckpt") == 1.0


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_saving_again_replaces_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    if not exchange:
        monkeypatch.setattr(placement, "_renameat2", lambda: None)
    save(tmp_path / "last.ckpt", 1.0)
    save(tmp_path / "last.ckpt", 2.0)
    assert loaded(tmp_path / "last.ckpt") == 2.0
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_a_file_under_the_name_is_refused_and_kept(tmp_path: Path) -> None:
    (tmp_path / "last.ckpt").write_bytes(b"a torch.save file")
    with pytest.raises(shardsafe.CheckpointError) as info:
        save(tmp_path / "last.ckpt", 1.0)
    assert str(info.value) == (
        f"{tmp_path}/last.ckpt is a file (a checkpoint saved without shardsafe?), not a "
        "checkpoint directory, so shardsafe will not replace it with the new checkpoint (it "
        "only ever replaces a checkpoint it wrote). Move it away, or save under another name."
    )
    assert (tmp_path / "last.ckpt").read_bytes() == b"a torch.save file"
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_a_directory_with_foreign_files_is_refused_and_kept(tmp_path: Path) -> None:
    save(tmp_path / "last.ckpt", 1.0)
    (tmp_path / "last.ckpt" / "notes.txt").write_text("mine")
    with pytest.raises(shardsafe.CheckpointError, match=r"holds \['notes.txt'\], which"):
        save(tmp_path / "last.ckpt", 2.0)
    assert loaded(tmp_path / "last.ckpt") == 1.0
    assert (tmp_path / "last.ckpt" / "notes.txt").read_text() == "mine"


def test_a_symlink_is_replaced_and_its_target_untouched(tmp_path: Path) -> None:
    save(tmp_path / "epoch=0-step=5.ckpt", 1.0)
    (tmp_path / "last.ckpt").symlink_to("epoch=0-step=5.ckpt")
    save(tmp_path / "last.ckpt", 2.0)
    assert not (tmp_path / "last.ckpt").is_symlink()
    assert loaded(tmp_path / "last.ckpt") == 2.0
    assert loaded(tmp_path / "epoch=0-step=5.ckpt") == 1.0


def test_a_committed_leftover_staging_directory_is_skipped_then_deleted(tmp_path: Path) -> None:
    # What a crash between the commit and the rename leaves.
    shardsafe.save(tmp_path / ".last.ckpt.shardsafe-partial", {"w": torch.zeros(3)})
    assert placement.Placement.of(str(tmp_path / "last.ckpt")).staging == (
        ".last.ckpt.shardsafe-partial-1"
    )
    save(tmp_path / "last.ckpt", 3.0)
    assert loaded(tmp_path / "last.ckpt") == 3.0
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_a_parent_directory_is_created(tmp_path: Path) -> None:
    save(tmp_path / "a" / "b" / "model.ckpt", 4.0)
    assert loaded(tmp_path / "a" / "b" / "model.ckpt") == 4.0


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_lightning_ckpt_file_under_the_name_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """A run switched from Lightning's own strategy finds its last.ckpt file there, which
    Lightning itself overwrites at every save."""
    if not exchange:
        monkeypatch.setattr(placement, "_renameat2", lambda: None)
    torch.save({"state_dict": {"w": torch.ones(3)}}, tmp_path / "last.ckpt")
    save(tmp_path / "last.ckpt", 2.0)
    assert loaded(tmp_path / "last.ckpt") == 2.0
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


@pytest.mark.parametrize(
    ("name", "content"),
    [("last.ckpt", b"not a zip file"), ("weights.pt", b"PK\x03\x04 a zip, but not a .ckpt")],
)
def test_other_files_under_the_name_are_still_refused(
    tmp_path: Path, name: str, content: bytes
) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(shardsafe.CheckpointError, match="is a file"):
        save(tmp_path / name, 1.0)
    assert (tmp_path / name).read_bytes() == content


class _Interrupted(LocalStorage):
    """Ctrl-C while the first data file is written."""

    def create(self, name: str, size_hint: int = 0) -> Any:
        if name.endswith(".safetensors"):
            raise KeyboardInterrupt
        return super().create(name, size_hint)


def test_what_an_interrupted_save_left_is_cleared_and_nothing_else(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        save_replacing(
            str(tmp_path / "epoch=0-step=5.ckpt"),
            {"w": torch.ones(3)},
            SaveOptions(storage=_Interrupted),
        )
    assert sorted(os.listdir(tmp_path)) == [".epoch=0-step=5.ckpt.shardsafe-partial"]
    save(tmp_path / "last.ckpt", 1.0)
    os.rename(tmp_path / "last.ckpt", tmp_path / ".last.ckpt.shardsafe-partial")  # committed
    (tmp_path / ".cache.shardsafe-partial").write_text("a file of yours")
    (tmp_path / ".mine").mkdir()

    interrupted = tmp_path / ".epoch=0-step=5.ckpt.shardsafe-partial"
    assert placement.clear_interrupted(str(tmp_path)) == []  # just written: maybe in progress
    _age(interrupted, placement.QUIET_S + 1)
    cleared = placement.clear_interrupted(str(tmp_path))
    assert cleared == [".epoch=0-step=5.ckpt.shardsafe-partial"]
    assert sorted(os.listdir(tmp_path)) == [
        ".cache.shardsafe-partial",
        ".last.ckpt.shardsafe-partial",
        ".mine",
    ]
    assert placement.clear_interrupted(str(tmp_path / "absent")) == []


def test_the_empty_name_an_interrupted_background_save_held_goes_with_it(
    tmp_path: Path,
) -> None:
    """A background save of the Lightning strategies holds its name from the start, as an
    empty directory; interrupted, it left that name, which the next run's ModelCheckpoint
    saw taken (and saved as ``-v1``). It goes with the staging directory; a name holding
    anything, or whose staging directory is kept, stays."""
    for name in ("a.ckpt", "b.ckpt", "c.ckpt"):
        with pytest.raises(KeyboardInterrupt):
            save_replacing(
                str(tmp_path / name), {"w": torch.ones(3)}, SaveOptions(storage=_Interrupted)
            )
        (tmp_path / name).mkdir()
    (tmp_path / "b.ckpt" / "notes.txt").write_text("mine")
    (tmp_path / "lone.ckpt").mkdir()  # no staging directory: not a held name
    _age(tmp_path / ".a.ckpt.shardsafe-partial", placement.QUIET_S + 1)
    _age(tmp_path / ".b.ckpt.shardsafe-partial", placement.QUIET_S + 1)
    assert sorted(placement.clear_interrupted(str(tmp_path))) == [
        ".a.ckpt.shardsafe-partial",
        ".b.ckpt.shardsafe-partial",
    ]
    assert sorted(os.listdir(tmp_path)) == [
        ".c.ckpt.shardsafe-partial",  # just written: maybe in progress, and its name kept
        "b.ckpt",
        "c.ckpt",
        "lone.ckpt",
    ]


def test_a_committed_save_whose_name_was_held_empty_is_given_its_name(tmp_path: Path) -> None:
    """A run killed between a background save's commit and its rename left the whole
    checkpoint hidden in its staging directory and its name held empty: the next run's
    ModelCheckpoint saved that step as ``-v1``, and the hidden copy was never deleted.
    Once quiet, it is given its name; a committed one whose name holds anything stays."""
    save(tmp_path / ".a.ckpt.shardsafe-partial", 1.0)
    (tmp_path / "a.ckpt").mkdir()
    save(tmp_path / ".b.ckpt.shardsafe-partial", 2.0)
    (tmp_path / "b.ckpt").mkdir()
    (tmp_path / "b.ckpt" / "notes.txt").write_text("mine")
    assert placement.clear_interrupted(str(tmp_path)) == []  # just written: maybe in progress
    assert sorted(os.listdir(tmp_path)) == [
        ".a.ckpt.shardsafe-partial", ".b.ckpt.shardsafe-partial", "a.ckpt", "b.ckpt",
    ]  # fmt: skip
    _age(tmp_path / ".a.ckpt.shardsafe-partial", placement.QUIET_S + 1)
    _age(tmp_path / ".b.ckpt.shardsafe-partial", placement.QUIET_S + 1)
    assert placement.clear_interrupted(str(tmp_path)) == []  # nothing deleted
    assert sorted(os.listdir(tmp_path)) == [".b.ckpt.shardsafe-partial", "a.ckpt", "b.ckpt"]
    assert shardsafe.verify(tmp_path / "a.ckpt").ok
    assert loaded(tmp_path / "a.ckpt") == 1.0


def test_a_staging_directory_written_to_lately_is_another_runs_save_and_is_kept(
    tmp_path: Path,
) -> None:
    with pytest.raises(KeyboardInterrupt):
        save_replacing(
            str(tmp_path / "a.ckpt"), {"w": torch.ones(3)}, SaveOptions(storage=_Interrupted)
        )
    staged = tmp_path / ".a.ckpt.shardsafe-partial"
    _age(staged, placement.QUIET_S + 1)
    newest = sorted(staged.iterdir())[0]
    os.utime(newest)  # one file changed now: a save still writing it
    assert placement.clear_interrupted(str(tmp_path)) == []
    assert placement.clear_interrupted(str(tmp_path), quiet_for=0) == [staged.name]
    assert os.listdir(tmp_path) == []


class _InterruptedDeletion(LocalStorage):
    """Killed while deleting the first data file, the manifest already gone."""

    def remove(self, name: str) -> None:
        if name.endswith(".safetensors"):
            raise KeyboardInterrupt
        super().remove(name)


def test_a_checkpoint_whose_deletion_was_interrupted_is_deleted_and_nothing_else(
    tmp_path: Path,
) -> None:
    """``save_top_k`` deletes an old checkpoint by its name, which no later save takes
    again: a kill after its manifest went left its data files there for good (a kill
    test on a loaded machine found one). The deletion's record says what it was; an
    interrupted save in place, a checkpoint killed before its manifest went, and one
    holding a file of yours stay, whatever their age."""
    for name in ("epoch=0-step=5.ckpt", "before-manifest.ckpt", "yours.ckpt"):
        save(tmp_path / name, 1.0)
    with pytest.raises(KeyboardInterrupt), _InterruptedDeletion(str(tmp_path)) as root:
        delete_checkpoint(root, "epoch=0-step=5.ckpt")
    left = sorted(os.listdir(tmp_path / "epoch=0-step=5.ckpt"))
    assert left[0] == ".shardsafe-incomplete" and left[1].endswith(".safetensors"), left
    with pytest.raises(KeyboardInterrupt), _InterruptedDeletion(str(tmp_path)) as root:
        delete_checkpoint(root, "yours.ckpt")
    (tmp_path / "yours.ckpt" / "notes.txt").write_text("mine")
    with LocalStorage(str(tmp_path / "before-manifest.ckpt")) as step:
        record(step, step.names(), deleting=True)  # killed before the manifest went
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(
            str(tmp_path / "in-place.ckpt"), {"w": torch.ones(3)}, SaveOptions(storage=_Interrupted)
        )
    assert ".shardsafe-incomplete" in os.listdir(tmp_path / "in-place.ckpt")

    with pytest.warns(UserWarning, match=r"left .*yours\.ckpt in place: it holds \['notes"):
        assert placement.clear_interrupted(str(tmp_path)) == ["epoch=0-step=5.ckpt"]
    assert sorted(os.listdir(tmp_path)) == ["before-manifest.ckpt", "in-place.ckpt", "yours.ckpt"]
    assert loaded(tmp_path / "before-manifest.ckpt") == 1.0


def _age(directory: Path, seconds: float) -> None:
    """Set the modification time of ``directory`` and what is in it ``seconds`` back."""
    then = time.time() - seconds
    for entry in directory.iterdir():
        os.utime(entry, (then, then), follow_symlinks=False)
    os.utime(directory, (then, then))
