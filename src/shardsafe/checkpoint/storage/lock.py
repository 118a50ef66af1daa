"""One writer per checkpoint root: ``root/.shardsafe.lock``, on a filesystem or an object store.

Two runs saving into the same root would interleave step directories, and each run's
retention would delete the other's checkpoints. The first run to save creates the lock
holding its pid, host and process start time (atomically: exactly one run wins); the
lock lasts as long as the process. A later run on the same host takes over a lock whose
process is gone (killed, crashed); on another host it cannot tell, so it refuses and
says which file to delete once the other run is known to be dead. The takeover replaces
the lock only while it still holds the bytes that were judged dead: of two runs that find
the same dead lock at once, one takes it over and the other is refused like any second
run (before, the later replace wrote over the first one's fresh lock, and both saved).
A lock that names no valid owner (damaged or forged: ``lock_owner.py`` checks every
field) is never taken over either: the save stops with an error naming the file and
saying what is wrong with it.

These rules are :class:`RootLock`'s, written once. What differs between media is only
how a lock file is created, replaced and aged atomically: the root's
``Storage.lock_backend()`` (``lock_backends.py``: a rename and a hard link on a
filesystem, conditional PUTs on an object store) does that, and says what its medium
guarantees.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from ...errors import CheckpointError
from .locations import is_url
from .lock_backends import LockBackend
from .lock_owner import read_lock, read_owner
from .protocol import Storage

LOCK_NAME = ".shardsafe.lock"
_UNWRITTEN_GRACE_S = 10.0
_CLAIM = re.compile(re.escape(LOCK_NAME) + r"\.[0-9a-f]{32}", re.ASCII)
"""A claim's name (``LockBackend._write_private``, and a dead lock being taken over: the
lock's name and a uuid4's hex): the only names beside the lock the manager removes, never
as a directory. Any name starting
``.shardsafe.lock.`` was removed (a backup of yours), and a directory so named failed
every save after its commit (retention never ran)."""
_HOLDERS: dict[tuple[str, str], int] = {}
"""How many :class:`RootLock` objects of this process hold each lock (by its token and
real location).
Two managers of one process on one root share its lock file (a notebook that makes a
new manager without closing the old one): the first one's ``close`` removed the file
while the second went on saving, and another run could then take the root."""
_HOLDERS_LOCK = threading.Lock()
_TAKEOVER_TRIES = 3
"""How often a run re-reads a lock that changed while it was taking it over (its owner
dead) before it gives up: each change means another run took the lock meanwhile."""
_CLAIM_LEFT_S = 60.0
"""A lock claim (a private file not yet linked into place) older than this was left by a
run killed between writing it and linking it."""


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
    """The lock on one root (opened by ``open_root``), held by this process once
    :meth:`acquire` returns."""

    def __init__(self, open_root: Callable[[], Storage]) -> None:
        self._open_root = open_root
        self._pid = os.getpid()
        self.me = {
            "pid": self._pid,
            "host": socket.gethostname(),
            "started": None,  # read at the first acquire: a manager that never saves
            # (a load's hint of where checkpoints are) opens nothing outside its root
            "token": uuid.uuid4().hex,
            "since": time.time(),
        }
        self.held = False
        self.conditional: bool | None = None
        """Whether the medium's create was atomic (known after ``acquire``): False where a
        store has no conditional create and the lock was checked, then written."""
        self._recheck = False
        """Whether every later save re-reads the lock (see :meth:`_confirm`)."""
        self._key: tuple[str, str] = ("", "")
        """The held lock's token and real location, its key in ``_HOLDERS``: the same for
        every manager of this process that shares the lock file, however each spelled the
        root (``ck``, ``./ck``, its absolute path, a symlink to it). Counted by the path
        as given, the first of two spellings to close removed the lock while the other
        still saved; by the token alone, a copy of the root (whose lock names this
        process, and is shared as its own) kept the original locked for good."""

    def acquire(self) -> None:
        """Own the root (before each save's first write): take the lock the first time;
        on a medium that may not keep it exclusive, check at every later save that it
        still names this run."""
        if self.held:
            if self._recheck:
                self._confirm()
            return
        if self.me["started"] is None:
            self.me["started"] = _start_time(self._pid)
        with self._open_root() as root:
            backend = root.lock_backend()
            raw = json.dumps(self.me).encode()
            if not self._create(root, backend, raw):
                self._take_over_or_refuse(root, backend, raw)
            self._recheck = not backend.holds_exclusive
            where = root.where(LOCK_NAME)
            self._key = (str(self.me["token"]), _canonical(where))
        with _HOLDERS_LOCK:
            _HOLDERS[self._key] = _HOLDERS.get(self._key, 0) + 1
        self.held = True
        atexit.register(self.release)

    def _create(self, root: Storage, backend: LockBackend, raw: bytes) -> bool:
        created = backend.create(LOCK_NAME, raw)
        self.conditional = backend.conditional
        if created and not backend.conditional:  # checked, then written: a race may
            return self._owner(root, backend).get("token") == self.me["token"]  # be lost
        return created

    def _take_over_or_refuse(self, root: Storage, backend: LockBackend, raw: bytes) -> None:
        where = root.where(LOCK_NAME)
        for _ in range(_TAKEOVER_TRIES):  # again only if the lock changed since it was read
            owner, read = read_lock(root, LOCK_NAME, where, empty_ok=backend.empty_is_unwritten)
            if not owner:
                if backend.empty_is_unwritten and backend.age(LOCK_NAME) > _UNWRITTEN_GRACE_S:
                    owner = {"host": self.me["host"]}  # a writer died between create and write
                elif self._create(root, backend, raw):
                    return  # gone meanwhile: released, or moved away by a run taking it over
                else:
                    continue
            if self._this_process(owner):
                # This process already owns the root (another manager object): share its
                # lock, which the last of them to release removes.
                self.me["token"] = owner.get("token")
                return
            if owner.get("host") != self.me["host"] or _alive(owner):
                raise self._taken(root, backend, owner)
            if self._take_over(root, backend, raw, read):
                return
        raise self._taken(root, backend, self._owner(root, backend))

    def _take_over(self, root: Storage, backend: LockBackend, raw: bytes, dead: bytes) -> bool:
        """Replace the dead run's lock (``dead``: its bytes as read) with this run's; False
        if another run changed the lock first (the caller reads who owns it now)."""
        if not backend.replace(LOCK_NAME, raw, dead):
            return False
        # A store with no conditional replace may have let another run write over it.
        return self._owner(root, backend).get("token") == self.me["token"]

    def _taken(self, root: Storage, backend: LockBackend, owner: dict[str, Any]) -> CheckpointError:
        """The error for a root another run owns: who, since when, and what to do."""
        where = root.where(LOCK_NAME)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("since", 0)))
        host = "this host" if owner.get("host") == self.me["host"] else f"host {owner.get('host')}"
        who = f"pid {owner.get('pid')} on {host}, since {since}"
        if not owner:  # created moments ago by a run that has not written its name yet
            who = f"its lock file is empty or unreadable, {backend.age(LOCK_NAME):.0f}s old"
        return CheckpointError(
            f"{os.path.dirname(where)} is being written by another run ({who}). "
            "Two runs saving into one root "
            "would interleave checkpoints and delete each other's. Use another root or stop "
            f"the other run; if it is already gone, delete {where}."
        )

    def _confirm(self) -> None:
        """Refuse to go on if the lock no longer names this run: a store that ignores
        conditional creates let another run overwrite it, or someone replaced or deleted
        it. Detection, not prevention (the other run may have saved already), but it
        stops this run before it writes over, or retention deletes, the other's
        checkpoints. One small read per save."""
        with self._open_root() as root:
            owner = self._owner(root, root.lock_backend())
            if owner.get("token") == self.me["token"]:
                return
            self._let_go()
            who = (
                f"another run (pid {owner.get('pid')} on host {owner.get('host')})"
                if owner
                else "nobody: it was deleted"
            )
            raise CheckpointError(
                f"the lock {root.where(LOCK_NAME)} this run took at its first save now names "
                f"{who}. The store did not keep it exclusive (some S3-compatible stores, "
                "and GCS emulators, ignore conditional creates), or it was replaced by hand. "
                "Two runs saving into one root interleave checkpoints and delete each "
                "other's: stop one, and give each run its own root."
            )

    def _this_process(self, owner: dict[str, Any]) -> bool:
        """Whether ``owner`` is this process (another manager object on the same root):
        its host, pid and start time. Not by pid alone: a container restarted on the same
        hostname runs its script as the same pid (1 under ``docker run``), and took the
        dead run's lock for its own without rewriting it; another process then judged
        that lock dead by its start time, took the root over, and its retention deleted
        this run's checkpoints (found in review)."""
        return (
            owner.get("host") == self.me["host"]
            and owner.get("pid") == self.me["pid"]
            and owner.get("started") == self.me["started"]
        )

    def _owner(self, root: Storage, backend: LockBackend) -> dict[str, Any]:
        """Who the lock names, every field checked (``lock_owner``); ``{}`` if there is
        none (or, where the medium may leave one, an empty one). A damaged lock (or a
        symlink, FIFO: never opened) raises."""
        where = root.where(LOCK_NAME)
        return read_owner(root, LOCK_NAME, where, empty_ok=backend.empty_is_unwritten)

    def is_stale_claim(self, root: Storage, name: str) -> bool:
        """Whether ``name`` in ``root`` is a lock claim left by a run killed before it
        took the lock (the manager removes it)."""
        if _CLAIM.fullmatch(name) is None or root.kind(name) == "directory":
            return False
        return root.lock_backend().claim_left_behind(name, _CLAIM_LEFT_S)

    def _let_go(self) -> bool:
        """Stop holding the lock; whether another object of this process still holds it."""
        self.held = False
        with _HOLDERS_LOCK:
            others = _HOLDERS.get(self._key, 1) - 1
            if others > 0:
                _HOLDERS[self._key] = others
            else:
                _HOLDERS.pop(self._key, None)
        return others > 0

    def release(self) -> None:
        if os.getpid() != self._pid:
            # A forked child (its atexit handlers run as it exits normally): the lock,
            # which names its parent, is the parent's to remove, and the parent still saves.
            self.held = False
            return
        if not self.held or self._let_go():
            return  # not held, or another manager of this process still saves into the root
        # At exit too: a lock damaged or replaced since is not this run's to remove.
        with contextlib.suppress(Exception), self._open_root() as root:
            if self._owner(root, root.lock_backend()).get("token") == self.me["token"]:
                root.remove(LOCK_NAME)


_SCHEME_ALIASES = {"s3a://": "s3://", "gcs://": "gs://"}


def _canonical(where: str) -> str:
    """One spelling of a lock's place: a path resolved, a URL with its scheme's usual name
    (``s3a://`` and ``s3://`` name one object; two managers of one process keyed by each
    spelling took the lock twice, and the first to close deleted it, found in review)."""
    if not is_url(where):
        return os.path.realpath(where)
    for alias, usual in _SCHEME_ALIASES.items():
        if where.startswith(alias):
            return usual + where[len(alias) :]
    return where
