"""One live manager per local directory: two ``TieredCheckpointManager``s given the same
node-local directory (two persistent roots, say a model's and its EMA's, or one job
launched twice) wrote the same ``step-<step>/rank-<rank>`` directories, each replacing
the other's checkpoints in silence, and a restore found the other's state there.

Each rank of a manager holds, for as long as the manager lives, a read lock on one byte
of its local directory (an open-file-description lock, ``F_OFD_SETLK``, on the directory
itself: no file is made there), at an offset given by the name the ranks agree under
and their run's token (agreed when the manager is made): the ranks of one manager on
one node share their byte. A manager that finds a lock on any other byte (a live
manager of another name, or of another job under the same name) refuses the directory;
a run that ended holds nothing, so a later one may resume from what it left, as the
local tier is for. Where the platform or the filesystem has no such locks, nothing is checked.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import weakref

from ..checkpoint.storage.local import LocalStorage
from ..errors import CheckpointError

_FLOCK = "hhqqi"
"""``struct flock``: type, whence, start, length, pid (Linux, 64-bit offsets)."""


class LocalLock:
    """This rank's hold on its manager's local directory (released by :meth:`release`)."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd
        if fd is not None:
            _HELD.add(self)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        _HELD.discard(self)
        if fd is not None:
            os.close(fd)  # its lock goes with the last descriptor of the description

    def __del__(self) -> None:  # a manager never closed: its lock goes with it
        self.release()


_HELD: weakref.WeakSet[LocalLock] = weakref.WeakSet()
"""The locks this process holds: a forked child (a DataLoader worker) closes its copies
of their descriptors at once. It shares their open file description, so its copy kept
the lock after the manager that took it was closed, and a later manager of another name
was refused as long as the worker lived."""


def _forget_in_child() -> None:
    for lock in list(_HELD):
        lock.release()


os.register_at_fork(after_in_child=_forget_in_child)


def offset_of(owner: str) -> int:
    """The byte the manager that the ranks agree under ``owner`` locks."""
    digest = hashlib.sha256(owner.encode("utf-8", "surrogatepass")).hexdigest()
    return int(digest[:15], 16) + 1


def take(root: LocalStorage, owner: str) -> LocalLock:
    """Lock ``owner``'s byte of the directory ``root``; refuse if a manager of another
    name holds its own there now."""
    set_lock, get_lock = getattr(fcntl, "F_OFD_SETLK", None), getattr(fcntl, "F_OFD_GETLK", None)
    if set_lock is None or get_lock is None:
        return LocalLock(None)
    own = offset_of(owner)
    fd = os.dup(root.fd)
    try:
        fcntl.fcntl(fd, set_lock, struct.pack(_FLOCK, fcntl.F_RDLCK, os.SEEK_SET, own, 1, 0))
        for start, length in ((0, own), (own + 1, 0)):  # every other byte (0: to the end)
            probe = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
            found = struct.unpack(_FLOCK, fcntl.fcntl(fd, get_lock, probe))[0]
            if found != fcntl.F_UNLCK:
                raise CheckpointError(
                    f"the local tier's directory {root.directory} is in use by another live "
                    "TieredCheckpointManager (another job, or a manager of another persistent "
                    "root or name): both would "
                    "write the same step-<step>/rank-<rank> directories, replacing each "
                    "other's checkpoints. Give each manager a local directory of its own"
                )
    except OSError:  # no such locks here (a filesystem without them): nothing to check
        os.close(fd)
        return LocalLock(None)
    except BaseException:
        os.close(fd)
        raise
    return LocalLock(fd)
