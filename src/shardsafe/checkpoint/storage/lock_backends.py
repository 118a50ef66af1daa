"""How a lock file is created, replaced and aged atomically, per medium.

The rules of the root lock (who owns a root, when a lock is taken over, what the user is
told) are ``lock.RootLock``'s alone; a root's ``Storage.lock_backend()`` supplies one of
these for the operations that differ between media, and says what its medium guarantees.
Reading and removing the lock go through the ``Storage`` protocol itself.

* A filesystem (:class:`LocalLockBackend`): the lock is written to a private file, then
  hard-linked into place. ``link()`` fails if the lock exists, so exactly one run wins,
  and the lock never exists empty (a run arriving a moment later always learns who owns
  it); only a shardsafe older than the hard-link claim could leave an empty one.
  A dead run's lock is taken over by renaming it to a private name (of two runs that
  read the same dead lock, only one can move it), checking that what moved is the file
  whose bytes were read (the same inode, held open), then claiming the empty place with
  the same hard link (a run killed in between leaves the dead lock under a claim's name,
  removed like a claim). If a live run's fresh lock was moved instead (it took the dead one
  over between this run's read and its rename), it is linked straight back, which never
  overwrites; only a third run that found the root empty in that instant and created a
  lock there could displace it.
* An object store (:class:`ObjectLockBackend`): no links, no rename. Where the store has a
  conditional create (S3's ``PUT`` with ``If-None-Match: *``, which AWS S3 and moto
  honour; s3fs's ``mode="create"``), the lock object is created with it, so exactly one
  run wins even if two start at the same moment. Where it has none (``memory://``, some
  S3-compatible stores that ignore the header), the lock is check-then-write: a second run
  that starts after the first run's first save is refused, but two runs whose first
  saves race within one round trip may both proceed. A store that accepts the
  conditional create but ignores it (the GCS emulator the tests use) lets a second run
  overwrite the lock; so the lock is re-read at every later save (``holds_exclusive``).
  A dead run's lock is replaced on S3 by a ``PUT`` with ``If-Match`` on the ETag of the
  lock as read (AWS S3 and moto honour it), so of two runs that read it only one
  replaces it. Elsewhere (gcsfs, ``memory://``, an S3-compatible store that answers
  ``If-Match`` with ``NotImplemented``) the replace is a plain ``PUT``: two runs
  taking over one dead lock at the same moment may both proceed, and the re-read at each
  later save stops one of them.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Protocol

from ...errors import CheckpointError
from .files import create_new, open_regular


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

    def replace(self, name: str, raw: bytes, old: bytes) -> bool:
        """Replace ``name`` with ``raw`` only if it still holds exactly ``old`` (a dead run's
        lock, as read), in one step; False if another run changed it first."""
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
    def replace_if_holds(self, name: str, old: bytes, raw: bytes) -> bool: ...
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

    def replace(self, name: str, raw: bytes, old: bytes) -> bool:
        moved = self._move_away(name, old)
        if moved is None:
            return False
        try:
            return self.create(name, raw)  # False: a run that found no lock created one
        finally:
            _unlink(self.root.fd, moved)

    def _move_away(self, name: str, old: bytes) -> str | None:
        """Rename the lock to a private name if it is still the one that was read (its
        bytes ``old``); that name, or None if another run changed or moved it first."""
        fd = self.root.fd
        try:
            held, read = open_regular(fd, name, name)
        except CheckpointError:  # gone (another run moved it), or no longer a file
            return None
        try:  # held open, its inode cannot be reused by another file meanwhile
            if os.read(held, len(old) + 1) != old:
                return None
            moved = f"{name}.{uuid.uuid4().hex}"
            try:
                os.rename(name, moved, src_dir_fd=fd, dst_dir_fd=fd)
            except FileNotFoundError:
                return None
            try:
                now = os.stat(moved, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:  # removed at once as a stale claim (an old mtime)
                return None  # the caller reads the lock again, and finds none
            if os.path.samestat(read, now):
                return moved
            self._put_back(moved, name)
            return None
        finally:
            os.close(held)

    def _put_back(self, moved: str, name: str) -> None:
        """Return a live run's lock, moved away by mistake (it took the dead one over just
        before this run's rename), with a link: it never overwrites a lock made since."""
        fd = self.root.fd
        with contextlib.suppress(FileExistsError):
            os.link(moved, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        _unlink(fd, moved)

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


def _unlink(dir_fd: int, name: str) -> None:
    """Remove ``name``, a lock moved to a claim's name, unless a save's cleanup of stale
    claims (``RootLock.is_stale_claim``) removed it first."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


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

    def replace(self, name: str, raw: bytes, old: bytes) -> bool:
        try:
            return self.root.replace_if_holds(name, old, raw)
        except NotImplementedError:
            self.root.commit(name, raw)  # no conditional replace: see module doc
            return True

    def age(self, name: str) -> float:
        return 0.0

    def claim_left_behind(self, name: str, seconds: float) -> bool:
        return False  # a lock object is created whole: no claim is ever left beside it
