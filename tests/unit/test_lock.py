"""The root lock ``root/.shardsafe.lock``: one run writes a checkpoint root at a time.

The lock records pid, host and the process's start time. These tests write lock files
the way another run would have left them, with real processes behind the pids (a
``sleep`` that is alive, or one that was killed), and check what the next save does:
take over a lock whose process is gone, refuse one whose process lives or that another
host holds (saying which file to delete), and leave the refused root untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointError, CheckpointManager
from shardsafe.checkpoint.storage.lock import LOCK_NAME, _start_time
from tests.isolated import Outcome, run_isolated

STATE = {"w": torch.arange(12.0).reshape(3, 4)}
HOST = socket.gethostname()


def write_lock(root: Path, **owner: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    path.write_text(json.dumps({"token": "theirs", "since": time.time() - 3600, **owner}))
    return path


def owner_of(root: Path) -> dict[str, Any]:
    return json.loads((root / LOCK_NAME).read_text())  # type: ignore[no-any-return]


def refused(root: Path) -> str:
    before = (root / LOCK_NAME).read_bytes()
    manager = CheckpointManager(root, keep_last=2)
    with pytest.raises(CheckpointError) as info:
        manager.save(1, STATE)
    assert (root / LOCK_NAME).read_bytes() == before  # the other run's lock is untouched
    assert sorted(os.listdir(root)) == [LOCK_NAME]  # and nothing was written
    return str(info.value)


def takes_over(root: Path) -> None:
    manager = CheckpointManager(root, keep_last=2)
    manager.save(1, STATE)
    assert owner_of(root)["pid"] == os.getpid()
    assert owner_of(root)["host"] == HOST
    assert manager.latest() == str(root / "step-000000001")
    manager.close()
    assert not (root / LOCK_NAME).exists()


def test_a_lock_left_by_a_killed_process_on_this_host_is_taken_over(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    started = _start_time(sleeper.pid)
    assert started is not None
    sleeper.kill()
    sleeper.wait()
    write_lock(tmp_path, pid=sleeper.pid, host=HOST, started=started)
    takes_over(tmp_path)


def test_a_live_owner_on_this_host_is_refused(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    path = write_lock(tmp_path, pid=sleeper.pid, host=HOST, started=_start_time(sleeper.pid))
    msg = refused(tmp_path)
    assert f"{tmp_path} is being written by another run (pid {sleeper.pid} on this host" in msg
    assert "Use another root or stop the other run" in msg
    assert f"if it is already gone, delete {path}" in msg


def test_a_reused_pid_is_not_taken_for_the_owner(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    """The pid is alive, but it is another process: its start time differs."""
    real = _start_time(sleeper.pid)
    write_lock(tmp_path, pid=sleeper.pid, host=HOST, started=str(int(real or "0") + 1))
    takes_over(tmp_path)


def test_a_dead_runs_lock_naming_this_pid_is_taken_over_not_shared(tmp_path: Path) -> None:
    """A container restarted on the same hostname runs its script as the same pid: the
    dead run's lock names this process's pid and host, with another start time. It was
    shared as this process's own and never rewritten, so another process could judge it
    dead, take the root over, and delete this run's checkpoints (found in review)."""
    mine = _start_time(os.getpid())
    assert mine is not None
    write_lock(tmp_path, pid=os.getpid(), host=HOST, started=str(int(mine) - 1))
    dead = owner_of(tmp_path)
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, STATE)
    owner = owner_of(tmp_path)
    assert owner["started"] == mine and owner["token"] != "theirs"
    assert owner["since"] > dead["since"]  # rewritten by this run, not the dead run's
    manager.close()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_held_on_another_host_is_refused_naming_the_file_to_delete(
    tmp_path: Path,
) -> None:
    """Another host's pid means nothing here, so the lock is never taken over: the user
    is told which file to delete once they know that run is gone. Then saving works."""
    path = write_lock(tmp_path, pid=os.getpid(), host="gpu-node-17", started="1")
    msg = refused(tmp_path)
    assert f"(pid {os.getpid()} on host gpu-node-17, since " in msg
    assert f"delete {path}." in msg
    path.unlink()  # what the message says to do
    takes_over(tmp_path)


def test_an_empty_lock_file_is_taken_over_once_it_is_old(tmp_path: Path) -> None:
    """A run of an older shardsafe killed between creating the lock file and writing it
    leaves it empty."""
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / LOCK_NAME
    path.write_text("")
    old = time.time() - 60
    os.utime(path, (old, old))
    takes_over(tmp_path)


@pytest.mark.parametrize(
    ("content", "problem"),
    [("{not json", "it is not valid JSON"), ("[1, 2]", "it holds a JSON list, not an object")],
)
def test_a_damaged_lock_file_is_refused_however_old(
    tmp_path: Path, content: str, problem: str
) -> None:
    """A lock is claimed whole (hard link), so one that holds no valid owner is damaged,
    not a killed run's: nobody can tell whose run it was, so it is never taken over. The
    message says so and what to do; then saving works (more in test_hostile_files_and_locks)."""
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / LOCK_NAME
    path.write_text(content)
    old = time.time() - 60
    os.utime(path, (old, old))
    msg = refused(tmp_path)
    assert f"the lock {path} is damaged: {problem}" in msg
    assert f"delete {path} and save again" in msg
    path.unlink()  # what the message says to do
    takes_over(tmp_path)


def test_a_just_created_empty_lock_file_is_refused(tmp_path: Path) -> None:
    """Its writer may be alive and about to fill it in: not yet taken over."""
    (tmp_path / LOCK_NAME).write_text("")
    msg = refused(tmp_path)
    assert "being written by another run (its lock file is empty or unreadable, 0s old)" in msg
    assert f"delete {tmp_path / LOCK_NAME}" in msg


def test_the_lock_is_held_across_saves_and_released_by_close(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in range(3):
        manager.save(step, STATE)
        assert owner_of(tmp_path)["pid"] == os.getpid()
    token = owner_of(tmp_path)["token"]
    manager.save(3, STATE)
    assert owner_of(tmp_path)["token"] == token  # the same claim, not re-created per save
    manager.close()
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000000002", "step-000000003"]


def test_close_does_not_remove_a_lock_someone_else_took_over(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, STATE)
    write_lock(tmp_path, pid=12345, host="gpu-node-17")  # e.g. after a manual delete
    manager.close()
    assert owner_of(tmp_path)["host"] == "gpu-node-17"


def test_plain_save_takes_no_lock(tmp_path: Path) -> None:
    """Only CheckpointManager owns a root; ``save`` writes one directory and no lock."""
    shardsafe.save(tmp_path / "ckpt", STATE)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_only_a_stale_claims_own_name_is_removed_beside_the_lock(tmp_path: Path) -> None:
    """Every name starting .shardsafe.lock. older than a minute was removed: a backup of
    yours, and a directory (which failed every save after its commit)."""
    claim = tmp_path / f"{LOCK_NAME}.{'ab' * 16}"  # a run killed between claim and link
    backup, directory = tmp_path / f"{LOCK_NAME}.bak", tmp_path / f"{LOCK_NAME}.old"
    claim.write_text("{}")
    backup.write_text("mine")
    directory.mkdir()
    hour_ago = time.time() - 3600
    for path in (claim, backup, directory):
        os.utime(path, (hour_ago, hour_ago))
    manager = CheckpointManager(tmp_path, keep_last=1)
    for step in (1, 2):
        manager.save(step, STATE)
    manager.close()
    assert sorted(os.listdir(tmp_path)) == [
        f"{LOCK_NAME}.bak",
        f"{LOCK_NAME}.old",
        "latest",
        "step-000000002",
    ]
    assert backup.read_text() == "mine"


def _save_step_nine(root: str) -> None:
    manager = shardsafe.CheckpointManager(root)
    try:
        manager.save(9, {"w": torch.zeros(2)})
    finally:
        manager.close()


def another_process_saves(root: Path) -> Outcome:
    """Step 9 saved into ``root`` by another process (forked from a server that has
    imported torch: a fresh interpreter took seconds per call)."""
    return run_isolated(_save_step_nine, str(root), seconds=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spelling", ["same", "relative", "symlink"])
def test_two_managers_of_one_process_share_the_lock_until_both_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    """The first of two managers on one root to close removed the lock while the second
    went on saving: another run could then take the root and interleave its steps. So it
    did when the two spelled the root differently (``./ck`` and its absolute path, or a
    symlink to it), the lock's holders being counted by the path as given (found in
    review)."""
    other_name: str | Path = tmp_path
    if spelling == "relative":
        monkeypatch.chdir(tmp_path.parent)
        other_name = f"./{tmp_path.name}"
    elif spelling == "symlink":
        other_name = tmp_path.parent / f"{tmp_path.name}-link"
        os.symlink(tmp_path, other_name)
    first, second = CheckpointManager(tmp_path), CheckpointManager(other_name)
    first.save(1, STATE)
    with pytest.warns(UserWarning, match="did not resume from"):  # a second manager's warning
        second.save(2, STATE)
    first.close()
    assert owner_of(tmp_path)["pid"] == os.getpid()
    other = another_process_saves(tmp_path)
    assert other.exitcode == 0 and other.error == "shardsafe.errors.CheckpointError", other
    assert f"{tmp_path} is being written by another run (pid {os.getpid()}" in other.message
    second.save(3, STATE)
    second.close()
    assert not (tmp_path / LOCK_NAME).exists()
    assert another_process_saves(tmp_path).error is None
    assert sorted(os.listdir(tmp_path)) == ["latest"] + [f"step-00000000{s}" for s in (1, 2, 3, 9)]


@pytest.mark.timeout(120)
def test_a_copy_of_the_root_is_locked_apart_from_the_original(tmp_path: Path) -> None:
    """A root copied while this process saves into it (a backup, ``cp -r``) holds a lock
    naming this process, which a manager of the copy shares as its own; counted by the
    lock's token alone, the original's lock then outlived its manager's close and the
    process (found in review of this session's own change)."""
    root, copy = tmp_path / "ck", tmp_path / "ck2"
    first = CheckpointManager(root)
    first.save(1, STATE)
    shutil.copytree(root, copy, symlinks=True)
    second = CheckpointManager(copy)
    with pytest.warns(UserWarning, match="did not resume from"):
        second.save(2, STATE)
    first.close()
    assert not (root / LOCK_NAME).exists()
    assert another_process_saves(root).error is None
    assert owner_of(copy)["pid"] == os.getpid()
    second.close()
    assert not (copy / LOCK_NAME).exists()


@pytest.mark.timeout(120)
def test_a_forked_child_that_exits_leaves_its_parents_lock(tmp_path: Path) -> None:
    """A child forked while the parent holds the root (a data loader worker, a
    subprocess started by fork) ran the inherited exit handler as it exited normally and
    removed the lock the parent still saved under."""
    script = (
        "import os, sys, torch, shardsafe\n"
        "m = shardsafe.CheckpointManager(sys.argv[1])\n"
        "m.save(1, {'w': torch.zeros(2)})\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(os.path.exists(os.path.join(sys.argv[1], '.shardsafe.lock')))\n"
        "m.save(2, {'w': torch.ones(2)})\n"
        "m.close()\n"
        "print(os.path.exists(os.path.join(sys.argv[1], '.shardsafe.lock')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]
