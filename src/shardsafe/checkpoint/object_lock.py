"""One writer per checkpoint root on an object store: ``root/.shardsafe.lock``.

The local lock (``lock.py``) relies on ``link()`` failing when the lock exists; object
stores have no links and no rename. Where the store has a conditional create (S3's
``PUT`` with ``If-None-Match: *``, which AWS S3 and moto honour; s3fs's
``mode="create"``), the lock object is created with it, so exactly one run wins even if
two start at the same moment. Where the store has none (``memory://``, some
S3-compatible stores that ignore the header), the lock is check-then-write: a second run
that starts after the first run's first save is refused, but two runs whose first saves
race within one round trip may both proceed. A store that accepts the conditional create
but ignores it (the GCS emulator the tests use) lets a second run overwrite the lock; so
every later save re-reads it, and a run whose lock now names another stops there.

What it protects: the root's retention and ``latest`` against a second run, from the first
save on. What it cannot: liveness across hosts. A lock left by a killed run names its host
and pid; a run on the same host takes over when that pid is gone; from another host it
refuses and says which object to delete. A damaged lock object is refused the same way
as a local one (``lock_owner.py``, shared by both).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError
from .lock import LOCK_NAME, _alive, _start_time
from .lock_owner import read_owner
from .storage import Storage


class ObjectRootLock:
    """The lock on one object-store root, held by this process once :meth:`acquire` returns."""

    def __init__(self, open_root: Callable[[], Storage]) -> None:
        self._open_root = open_root
        self.me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _start_time(os.getpid()),
            "token": uuid.uuid4().hex,
            "since": time.time(),
        }
        self.held = False
        self.conditional: bool | None = None
        """Whether the store honoured a conditional create (known after ``acquire``)."""

    def acquire(self) -> None:
        """Own the root (before each save's first write): take the lock the first time,
        and on every later save check that it still names this run."""
        if self.held:
            self._confirm()
            return
        with self._open_root() as root:
            raw = json.dumps(self.me).encode()
            if not self._create(root, raw):
                self._take_over_or_refuse(root, raw)
        self.held = True
        atexit.register(self.release)

    def _create(self, root: Storage, raw: bytes) -> bool:
        exclusive = getattr(root, "create_exclusive", None)
        if exclusive is not None:
            try:
                created = bool(exclusive(LOCK_NAME, raw))
                self.conditional = True
                return created
            except NotImplementedError:
                pass
        self.conditional = False
        if root.exists(LOCK_NAME):
            return False
        root.commit(LOCK_NAME, raw)
        return self._owner(root).get("token") == self.me["token"]

    def _take_over_or_refuse(self, root: Storage, raw: bytes) -> None:
        owner = self._owner(root)
        same_host = owner.get("host") == self.me["host"]
        if same_host and owner.get("pid") == self.me["pid"]:
            return  # this process already owns the root (another manager object)
        if same_host and not _alive(owner):
            root.commit(LOCK_NAME, raw)
            if self._owner(root).get("token") == self.me["token"]:
                return
            owner = self._owner(root)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("since", 0)))
        raise CheckpointError(
            f"{root.directory} is being written by another run (pid {owner.get('pid')} on "
            f"host {owner.get('host')}, since {since}). Two runs saving into one root would "
            "interleave checkpoints and delete each other's. Use another root or stop the "
            f"other run; if it is already gone, delete {root.where(LOCK_NAME)}."
        )

    def _confirm(self) -> None:
        """Refuse to go on if the lock object no longer names this run: a store that
        ignores conditional creates let another run overwrite it, or someone replaced or
        deleted it. Detection, not prevention (the other run may have saved already), but
        it stops this run before it writes over, or retention deletes, the other's
        checkpoints. One small GET per save."""
        with self._open_root() as root:
            owner = self._owner(root)
            if owner.get("token") == self.me["token"]:
                return
            self.held = False
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

    def _owner(self, root: Storage) -> dict[str, Any]:
        """Who the lock object names, every field checked (``lock_owner``); ``{}`` if there
        is none. A damaged one (an empty object too: it is written in one PUT) raises."""
        return read_owner(root, LOCK_NAME, root.where(LOCK_NAME), empty_ok=False)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        # At exit too: a lock damaged or replaced since is not this run's to remove.
        with contextlib.suppress(Exception), self._open_root() as root:
            if self._owner(root).get("token") == self.me["token"]:
                root.remove(LOCK_NAME)
