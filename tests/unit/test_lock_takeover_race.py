"""Two runs that find the same dead lock at once: only one of them takes the root over.

A lock whose process is gone is taken over by the next run on the same host. The
takeover used to be a plain ``os.replace`` (an unconditional PUT on S3): a run that read
the dead lock, then replaced it after another run had already taken it over, wrote over
that run's fresh lock, and both saved into the root (of six processes started at once,
up to six owned it). These tests play that interleaving deterministically: run A reads
the dead lock, run B (naming a live process) takes it over, then A completes its
takeover. A must be refused with the message any second run gets, and B must keep the
lock. The processes behind the pids are real (a ``sleep``, alive or killed).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardsafe import CheckpointError
from shardsafe.checkpoint.storage.local import LocalStorage
from shardsafe.checkpoint.storage.lock import LOCK_NAME, RootLock, _start_time
from shardsafe.checkpoint.storage.lock_backends import LocalLockBackend, ObjectLockBackend
from shardsafe.checkpoint.storage.object_storage import FsspecStorage
from shardsafe.checkpoint.storage.protocol import Storage
from tests.s3server import S3Server

HOST = socket.gethostname()


def dead_lock() -> bytes:
    """A lock left by a process of this host that was killed."""
    proc = subprocess.Popen(["sleep", "60"])
    started = _start_time(proc.pid)
    proc.kill()
    proc.wait()
    owner = {"pid": proc.pid, "host": HOST, "started": started, "token": "dead", "since": 1.0}
    return json.dumps(owner).encode()


def run_of(pid: int, open_root: Callable[[], Storage]) -> RootLock:
    """The lock of a run in process ``pid`` (a live ``sleep``: another process's run)."""
    lock = RootLock(open_root)
    lock.me.update(pid=pid, started=_start_time(pid))
    return lock


def overtaken_by(rival: RootLock, storage_class: type[Any], backend_class: type[Any]) -> Any:
    """A storage class whose lock backend lets ``rival`` take the dead lock over between
    this run's read of it and its replace: two runs that found it at the same moment."""

    class Backend(backend_class):  # type: ignore[misc,valid-type]
        def replace(self, *args: Any) -> Any:
            rival.acquire()
            return super().replace(*args)

    class Overtaken(storage_class):  # type: ignore[misc,valid-type]
        def lock_backend(self) -> Any:
            return Backend(self)

    return Overtaken


def refusal(where: str, rival: RootLock) -> str:
    """The message of a run that finds the root locked by a live run on this host."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rival.me["since"]))
    return (
        f"{os.path.dirname(where)} is being written by another run (pid {rival.me['pid']} "
        f"on this host, since {since}). Two runs saving into one root would interleave "
        "checkpoints and delete each other's. Use another root or stop the other run; "
        f"if it is already gone, delete {where}."
    )


def only_the_first_takes_over(
    rival: RootLock, mine: RootLock, read_lock: Callable[[], bytes], where: str
) -> None:
    with pytest.raises(CheckpointError) as info:
        mine.acquire()
    assert str(info.value) == refusal(where, rival)
    assert json.loads(read_lock())["token"] == rival.me["token"]  # the winner's lock stays
    assert rival.held and not mine.held


def test_of_two_local_runs_taking_over_one_dead_lock_only_one_owns_the_root(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    (tmp_path / LOCK_NAME).write_bytes(dead_lock())
    rival = run_of(sleeper.pid, lambda: LocalStorage(str(tmp_path)))
    racing = overtaken_by(rival, LocalStorage, LocalLockBackend)
    mine = RootLock(lambda: racing(str(tmp_path)))
    only_the_first_takes_over(
        rival, mine, (tmp_path / LOCK_NAME).read_bytes, str(tmp_path / LOCK_NAME)
    )
    assert os.listdir(tmp_path) == [LOCK_NAME]  # no private name left beside it
    rival.release()
    assert os.listdir(tmp_path) == []


def test_of_two_s3_runs_taking_over_one_dead_lock_only_one_owns_the_root(
    s3_server: S3Server, s3_bucket: str, sleeper: subprocess.Popen[bytes]
) -> None:
    root, key = f"s3://{s3_bucket}/run", f"run/{LOCK_NAME}"
    s3_server.put(s3_bucket, key, dead_lock())
    rival = run_of(sleeper.pid, lambda: FsspecStorage(root))
    racing = overtaken_by(rival, FsspecStorage, ObjectLockBackend)
    mine = RootLock(lambda: racing(root))
    only_the_first_takes_over(
        rival, mine, lambda: s3_server.get(s3_bucket, key), f"{root}/{LOCK_NAME}"
    )
    assert s3_server.keys(s3_bucket) == [key]
    rival.release()
    assert s3_server.keys(s3_bucket) == []


def test_an_s3_lock_replaced_between_the_read_and_the_put_is_left_alone(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """The PUT carries ``If-Match`` with the ETag of the bytes read: another run's lock,
    written after the GET, is not written over (moto honours it, as AWS S3 does)."""
    import s3fs

    key, dead, theirs = f"{s3_bucket}/run/{LOCK_NAME}", dead_lock(), b'{"theirs": 1}'

    class ReplacedAfterTheGet(s3fs.S3FileSystem):  # type: ignore[misc]
        def call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
            got = super().call_s3(method, *args, **kwargs)
            if method == "get_object":
                s3_server.put(s3_bucket, f"run/{LOCK_NAME}", theirs)
            return got

    fs = ReplacedAfterTheGet(
        skip_instance_cache=True, client_kwargs={"endpoint_url": s3_server.endpoint}
    )
    s3_server.put(s3_bucket, f"run/{LOCK_NAME}", dead)
    storage = FsspecStorage(f"s3://{s3_bucket}/run", fs=fs)
    assert storage.replace_if_holds(LOCK_NAME, dead, b"mine") is False
    assert fs.cat_file(key) == theirs
    s3_server.put(s3_bucket, f"run/{LOCK_NAME}", dead)  # still the dead lock at the PUT:
    assert FsspecStorage(f"s3://{s3_bucket}/run").replace_if_holds(LOCK_NAME, dead, b"mine")
    assert s3_server.get(s3_bucket, f"run/{LOCK_NAME}") == b"mine"


def test_a_store_without_a_conditional_replace_keeps_the_plain_put(tmp_path: Path) -> None:
    """``memory://`` (and gcsfs) have no ``If-Match``: the takeover writes the lock as before,
    and the lock is re-read at every later save there (``holds_exclusive``)."""
    storage = FsspecStorage(f"memory://takeover-{tmp_path.name}/run")
    storage.commit(LOCK_NAME, b"dead")
    with pytest.raises(NotImplementedError):
        storage.replace_if_holds(LOCK_NAME, b"dead", b"mine")
    backend = storage.lock_backend()
    assert backend.replace(LOCK_NAME, b"mine", b"not what it holds") is True
    assert storage.read_small(LOCK_NAME, 100) == b"mine" and not backend.holds_exclusive


def test_a_live_lock_moved_away_by_mistake_is_put_back_never_over_a_newer_one(
    tmp_path: Path,
) -> None:
    """A run that renamed away another run's fresh lock (taken over just before its rename)
    links it back; a lock created in that instant is never overwritten."""
    moved = f"{LOCK_NAME}.{'0' * 32}"
    backend = LocalStorage(str(tmp_path)).lock_backend()
    (tmp_path / moved).write_bytes(b"live")
    inode = (tmp_path / moved).stat().st_ino
    backend._put_back(moved, LOCK_NAME)
    assert os.listdir(tmp_path) == [LOCK_NAME] and (tmp_path / LOCK_NAME).stat().st_ino == inode
    (tmp_path / LOCK_NAME).rename(tmp_path / moved)
    (tmp_path / LOCK_NAME).write_bytes(b"newer")
    backend._put_back(moved, LOCK_NAME)
    assert os.listdir(tmp_path) == [LOCK_NAME] and (tmp_path / LOCK_NAME).read_bytes() == b"newer"
