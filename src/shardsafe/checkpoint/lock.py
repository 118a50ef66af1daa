"""One writer per checkpoint root: ``root/.shardsafe.lock``.

Two runs saving into the same root would interleave step directories, and each run's
retention would delete the other's checkpoints. The first run to save creates the lock
file (``O_EXCL``, so exactly one wins) holding its pid, host and process start time; the
lock lasts as long as the process. A later run on the same host takes over a lock whose
process is gone (killed, crashed); on another host it cannot tell, so it refuses and
says which file to delete once the other run is known to be dead. A lock that names no
valid owner (damaged or forged: ``lock_owner.py`` checks every field) is never taken over
either: the save stops with an error naming the file and saying what is wrong with it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import time
import uuid
from typing import Any

from ..errors import CheckpointError
from .lock_owner import read_owner
from .storage import LocalStorage

LOCK_NAME = ".shardsafe.lock"
_UNWRITTEN_GRACE_S = 10.0


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (guards against pid reuse), if readable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(owner: dict[str, Any]) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    started = owner.get("started")
    return started is None or _start_time(pid) in (None, started)


class RootLock:
    """The lock on one root, held by this process once :meth:`acquire` succeeds."""

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, LOCK_NAME)
        self.me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _start_time(os.getpid()),
            "token": uuid.uuid4().hex,
            "since": time.time(),
        }
        self.held = False

    def acquire(self) -> None:
        if self.held:
            return
        # Write our name to a private file, then hard-link it into place: link() fails if
        # the lock exists, so exactly one run wins, and the lock never exists empty (a run
        # arriving a moment later always learns who owns it).
        tmp = self._write_private()
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            os.remove(tmp)
            self._take_over_or_refuse()
        else:
            os.remove(tmp)
        self.held = True
        atexit.register(self.release)

    def _take_over_or_refuse(self) -> None:
        owner = self._owner()
        if not owner and self._age() > _UNWRITTEN_GRACE_S:
            owner = {"host": self.me["host"]}  # a writer died between create and write
        same_host = owner.get("host") == self.me["host"]
        if same_host and owner.get("pid") == self.me["pid"]:
            return  # this process already owns the root (another manager object)
        if same_host and not _alive(owner):
            os.replace(self._write_private(), self.path)
            if self._owner().get("token") == self.me["token"]:
                return
            owner = self._owner()  # lost a race with another process taking over
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("since", 0)))
        where = "this host" if owner.get("host") == self.me["host"] else f"host {owner.get('host')}"
        who = f"pid {owner.get('pid')} on {where}, since {since}"
        if not owner:  # created moments ago by a run that has not written its name yet
            who = f"its lock file is empty or unreadable, {self._age():.0f}s old"
        raise CheckpointError(
            f"{os.path.dirname(self.path)} is being written by another run ({who}). "
            "Two runs saving into one root "
            "would interleave checkpoints and delete each other's. Use another root or stop "
            f"the other run; if it is already gone, delete {self.path}."
        )

    def _write_private(self) -> str:
        tmp = f"{self.path}.{self.me['token']}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with open(os.open(tmp, flags, 0o644), "w") as f:
            json.dump(self.me, f)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _age(self) -> float:
        try:
            return time.time() - os.lstat(self.path).st_mtime
        except OSError:
            return 0.0

    def _owner(self) -> dict[str, Any]:
        """Who the lock file names, every field checked (``lock_owner``); ``{}`` if it is
        gone or empty. A damaged lock (or a symlink, FIFO: never opened) raises."""
        root, name = os.path.split(self.path)
        try:
            storage = LocalStorage(root)
            storage.require_directory()
        except CheckpointError:
            return {}
        with storage:
            return read_owner(storage, name, self.path, empty_ok=True)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        # At exit too: a lock damaged or replaced since is not this run's to remove.
        with contextlib.suppress(CheckpointError, OSError):
            if self._owner().get("token") == self.me["token"]:
                os.remove(self.path)
