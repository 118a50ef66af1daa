"""How a lock file is created, replaced and aged atomically, per medium.

The rules of the root lock (who owns a root, when a lock is taken over, what the user is
told) are ``lock.RootLock``'s alone; a root's ``Storage.lock_backend()`` supplies one of
these for the operations that differ between media, and says what its medium guarantees.
Reading and removing the lock go through the ``Storage`` protocol itself.

* A filesystem (:class:`LocalLockBackend`): the lock is written to a private file, then
  hard-linked into place. ``link()`` fails if the lock exists, so exactly one run wins,
  and the lock never exists empty (a run arriving a moment later always learns who owns
  it); only a shardsafe older than the hard-link claim could leave an empty one.
* An object store (:class:`ObjectLockBackend`): no links, no rename. Where the store has a
  conditional create (S3's ``PUT`` with ``If-None-Match: *``, which AWS S3 and moto
  honour; s3fs's ``mode="create"``), the lock object is created with it, so exactly one
  run wins even if two start at the same moment. Where it has none (``memory://``, some
  S3-compatible stores that ignore the header), the lock is check-then-write: a second run
  that starts after the first run's first save is refused, but two runs whose first
  saves race within one round trip may both proceed. A store that accepts the
  conditional create but ignores it (the GCS emulator the tests use) lets a second run
  overwrite the lock; so the lock is re-read at every later save (``holds_exclusive``).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Protocol

from .files import create_new


class LockBackend(Protocol):
    """The atomic operations on a lock file in one root, and what the medium guarantees."""

    holds_exclusive: bool
    """Whether a created lock stays this run's alone until released (the medium refuses a
    second create). False where a store may ignore a conditional create: the lock is then
    re-read at every later save."""
    empty_is_unwritten: bool
    """Whether an empty lock may be a writer that died between creating and writing it
    (then taken over once old); else an empty lock is damaged."""
    conditional: bool | None
    """Whether the last :meth:`create` was atomic (None before the first)."""

    def create(self, name: str, raw: bytes) -> bool:
        """Create ``name`` holding ``raw`` unless it exists; False if it existed."""
        ...

    def replace(self, name: str, raw: bytes) -> None:
        """Replace ``name`` with ``raw`` in one step (taking over a dead run's lock)."""
        ...

    def age(self, name: str) -> float:
        """Seconds since ``name`` was last written (0 where unknown)."""
        ...

    def claim_left_behind(self, name: str, seconds: float) -> bool:
        """Whether ``name``, a lock claim, was left by a run killed before it took the
        lock, more than ``seconds`` ago."""
        ...


class _OpenDirectory(Protocol):
    """What the local backend needs of its storage (``LocalStorage``): the directory's
    descriptor, every name opened relative to it."""

    @property
    def fd(self) -> int: ...


class _ObjectPrefix(Protocol):
    """What the object-store backend needs of its storage (``FsspecStorage``)."""

    def create_exclusive(self, name: str, raw: bytes) -> bool: ...
    def exists(self, name: str) -> bool: ...
    def commit(self, name: str, raw: bytes) -> None: ...


class LocalLockBackend:
    """A lock file in a directory, claimed by a hard link (see module doc)."""

    holds_exclusive = True
    empty_is_unwritten = True
    conditional: bool | None = True

    def __init__(self, root: _OpenDirectory) -> None:
        self.root = root

    def create(self, name: str, raw: bytes) -> bool:
        fd = self.root.fd
        claim = self._write_private(name, raw)
        try:
            os.link(claim, name, src_dir_fd=fd, dst_dir_fd=fd)
        except FileExistsError:
            return False
        finally:
            os.unlink(claim, dir_fd=fd)
        return True

    def replace(self, name: str, raw: bytes) -> None:
        fd = self.root.fd
        os.replace(self._write_private(name, raw), name, src_dir_fd=fd, dst_dir_fd=fd)

    def _write_private(self, name: str, raw: bytes) -> str:
        """A new file of this process's own beside ``name``, holding ``raw``, fsynced."""
        claim = f"{name}.{uuid.uuid4().hex}"
        fd = create_new(self.root.fd, claim)
        with open(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        return claim

    def age(self, name: str) -> float:
        try:
            return time.time() - os.stat(name, dir_fd=self.root.fd, follow_symlinks=False).st_mtime
        except OSError:
            return 0.0

    def claim_left_behind(self, name: str, seconds: float) -> bool:
        return self.age(name) > seconds


class ObjectLockBackend:
    """A lock object under a prefix, created conditionally where the store can (see
    module doc)."""

    holds_exclusive = False
    empty_is_unwritten = False
    """One PUT writes it whole, so an empty lock object is damaged."""

    def __init__(self, root: _ObjectPrefix) -> None:
        self.root = root
        self.conditional: bool | None = None

    def create(self, name: str, raw: bytes) -> bool:
        try:
            created = self.root.create_exclusive(name, raw)
            self.conditional = True
            return created
        except NotImplementedError:
            pass
        self.conditional = False
        if self.root.exists(name):
            return False
        self.root.commit(name, raw)
        return True

    def replace(self, name: str, raw: bytes) -> None:
        self.root.commit(name, raw)

    def age(self, name: str) -> float:
        return 0.0

    def claim_left_behind(self, name: str, seconds: float) -> bool:
        return False  # a lock object is created whole: no claim is ever left beside it
