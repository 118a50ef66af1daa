"""CheckpointManager retention never follows, deletes or writes through a link."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

import shardsafe
from shardsafe import CheckpointError, CheckpointManager
from tests.unit.attacks.common import (
    RACE_SECONDS,
    SHARD,
    _small_state,
    assert_bitwise,
    fast_switching,
    listing,
    make_model,
    weights,
)

pytestmark = pytest.mark.timeout(60)


def test_retention_leaves_a_symlinked_step_directory_and_its_target_alone(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    shardsafe.save(elsewhere / "ckpt", _small_state(9))
    before = listing(elsewhere)
    manager = CheckpointManager(root, keep_last=1)
    manager.save(1, _small_state(1))
    link = root / "step-000000002"
    os.symlink(elsewhere / "ckpt", link)
    with pytest.warns(UserWarning, match="step-000000002 is a symbolic link, not a directory"):
        manager.save(3, _small_state(3))
        manager.save(4, _small_state(4))
    manager.close()
    assert listing(elsewhere) == before
    assert link.is_symlink() and os.readlink(link) == str(elsewhere / "ckpt")
    assert sorted(os.listdir(root)) == ["latest", link.name, "step-000000004"]
    with pytest.warns(UserWarning, match="step-000000002 is a symbolic link"):
        assert manager.latest() == str(root / "step-000000004")
        assert manager.complete_steps() == [4]


def test_a_newer_symlinked_step_is_neither_latest_nor_a_reason_to_refuse(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    shardsafe.save(elsewhere / "ckpt", _small_state(9))
    before = listing(elsewhere)
    root.mkdir()
    os.symlink(elsewhere / "ckpt", root / "step-000000009")
    manager = CheckpointManager(root, keep_last=1)
    with pytest.warns(UserWarning, match="step-000000009 is a symbolic link"):
        manager.save(3, _small_state(3))  # not "older than the newest committed step"
        assert manager.latest() == str(root / "step-000000003")
        state = {"model": make_model(0)}
        assert manager.load_latest(state) == {"step": 3}
    manager.close()
    assert_bitwise(weights(state["model"]), weights(make_model(3)))
    assert listing(elsewhere) == before


def test_saving_into_a_step_name_that_is_a_symlink_writes_nothing_through_it(
    tmp_path: Path,
) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    root.mkdir()
    os.symlink(elsewhere, root / "step-000000005")
    manager = CheckpointManager(root)
    with (
        pytest.warns(UserWarning, match="step-000000005 is a symbolic link"),
        pytest.raises(CheckpointError, match="is a symbolic link, not a directory"),
    ):
        manager.save(5, _small_state(5))
    manager.close()
    assert os.listdir(elsewhere) == []
    assert (root / "step-000000005").is_symlink()


def _foreign_notes(step: Path, elsewhere: Path) -> None:
    (step / "notes.txt").write_text("my notes")


def _foreign_subdir(step: Path, elsewhere: Path) -> None:
    (step / "eval").mkdir()
    (step / "eval" / "results.json").write_text("{}")


def _foreign_data_link(step: Path, elsewhere: Path) -> None:
    os.replace(step / SHARD, elsewhere / SHARD)
    os.symlink(elsewhere / SHARD, step / SHARD)


def _foreign_manifest_link(step: Path, elsewhere: Path) -> None:
    os.replace(step / "manifest.json", elsewhere / "manifest.json")
    os.symlink(elsewhere / "manifest.json", step / "manifest.json")


def _foreign_fifo(step: Path, elsewhere: Path) -> None:
    os.mkfifo(step / "shard-00001-of-00002.safetensors")


@pytest.mark.parametrize(
    "plant",
    [_foreign_notes, _foreign_subdir, _foreign_data_link, _foreign_manifest_link, _foreign_fifo],
    ids=["notes.txt", "subdirectory", "data-file symlink", "manifest symlink", "fifo"],
)
def test_retention_leaves_a_step_holding_what_shardsafe_did_not_write(
    tmp_path: Path, plant: Callable[[Path, Path], None]
) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    manager = CheckpointManager(root, keep_last=1)
    old = Path(manager.save(1, _small_state(1)))
    plant(old, elsewhere)
    before, outside_before = listing(old), listing(elsewhere)
    with pytest.warns(UserWarning, match=r"left .*step-000000001 in place: it holds"):
        manager.save(2, _small_state(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.save(3, _small_state(3))
    manager.close()
    assert listing(old) == before
    assert listing(elsewhere) == outside_before
    assert not (root / "step-000000002").exists()
    assert manager.latest() == str(root / "step-000000003")


def test_retention_unlinks_a_hard_link_without_touching_its_other_name(tmp_path: Path) -> None:
    """A data file that is a hard link to a file elsewhere is a regular file with a name
    shardsafe writes, so it goes with its checkpoint; the other name keeps its bytes."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    manager = CheckpointManager(root, keep_last=1)
    old = Path(manager.save(1, _small_state(1)))
    keep = elsewhere / "precious.safetensors"
    os.link(old / SHARD, keep)
    content = keep.read_bytes()
    manager.save(2, _small_state(2))
    manager.close()
    assert not old.exists()
    assert keep.read_bytes() == content


def test_the_latest_pointer_and_a_stale_temp_never_write_through_a_symlink(
    tmp_path: Path,
) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    precious = elsewhere / "precious.txt"
    precious.write_text("keep me")
    os.symlink(precious, root / "latest")
    os.symlink(precious, root / f".latest.tmp-{os.getpid()}")  # what commit writes first
    os.symlink(precious, root / ".latest.tmp-999999")  # a stale one retention removes
    manager = CheckpointManager(root)
    manager.save(1, _small_state(1))
    manager.close()
    assert precious.read_text() == "keep me"
    assert not (root / "latest").is_symlink()
    assert (root / "latest").read_text() == "step-000000001\n"
    assert sorted(os.listdir(root)) == ["latest", "step-000000001"]


def test_retention_racing_a_step_directory_swapped_for_a_symlink(tmp_path: Path) -> None:
    """While saves with keep_last=1 try to delete step 1, a thread keeps moving the real
    directory away and putting a symlink to an outside checkpoint in its place. Whatever
    the interleaving, the outside checkpoint keeps every file; a save may only fail in
    retention, after its commit, saying so."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    shardsafe.save(elsewhere / "ckpt", _small_state(9))
    before = listing(elsewhere)
    manager = CheckpointManager(root, keep_last=1)
    name = root / "step-000000001"
    manager.save(1, _small_state(1))
    hidden = root / ".hidden"
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):
                os.rename(name, hidden)
            os.symlink(elsewhere / "ckpt", name)
            time.sleep(0)
            os.unlink(name)
            with contextlib.suppress(FileNotFoundError):
                os.rename(hidden, name)
            time.sleep(0)

    thread = threading.Thread(target=swap, daemon=True)
    failures = 0
    with warnings.catch_warnings(), fast_switching():
        warnings.simplefilter("ignore")
        thread.start()
        try:
            deadline = time.monotonic() + RACE_SECONDS
            step = 2
            while time.monotonic() < deadline:
                try:
                    manager.save(step, _small_state(step))
                except CheckpointError as e:
                    assert "the new checkpoint is committed, but deleting" in str(e), str(e)
                    failures += 1
                assert (root / f"step-{step:09d}" / "manifest.json").is_file()
                step += 1
        finally:
            stop.set()
            thread.join(timeout=10)
    manager.close()
    assert listing(elsewhere) == before
    assert manager.latest() == str(root / f"step-{step - 1:09d}")
