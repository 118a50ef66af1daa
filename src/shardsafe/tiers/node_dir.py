"""The node-local directory: ``step-<step>/rank-<rank>/`` rank checkpoints.

A node's directory holds the rank checkpoints its own ranks wrote and the replicas its
ranks received from other nodes, in the same layout: ``rank-00003`` is rank 3's
checkpoint whichever rank wrote it here. Each is an ordinary checkpoint (manifest last),
so one without a manifest is an interrupted write or receipt, never a step.

Every rank of a node shares the directory, but each writes and deletes only the rank
directories it owns (its own, and the replicas of the ranks it receives from), so two
ranks never touch one directory. Entries are opened without following links; names
other than the ones this module writes are left alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass

from .. import _warnings
from ..checkpoint.format.manifest import MANIFEST_NAME
from ..checkpoint.manager import loadable_manifest, step_dir_name, step_of
from ..checkpoint.storage.files import check_name, open_directory
from ..checkpoint.storage.local import LocalStorage
from ..checkpoint.storage.removal import delete_checkpoint, foreign_entries
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from . import local_lock, partitions, rank_checkpoint
from .local_lock import LocalLock

_RANK_DIR = re.compile(r"rank-([0-9]{5,})", re.ASCII)


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def rank_of(name: str) -> int | None:
    match = _RANK_DIR.fullmatch(name)
    if match is None:
        return None
    rank = int(match.group(1))
    return rank if rank_dir_name(rank) == name else None


@dataclass(frozen=True)
class Held:
    """A committed rank checkpoint in this node's directory that passes the cheap checks."""

    step: int
    rank: int
    world_size: int
    run: str = ""
    """The token of the run and save that wrote it (``rank_checkpoint.run_of``)."""


@dataclass(frozen=True)
class Refused:
    """A committed rank checkpoint in this node's directory that would not load, and why."""

    step: int
    rank: int
    why: str


class _Under(LocalStorage):
    """The directory ``name`` of ``parent``, opened (and made) under a fresh descriptor of
    ``parent`` and never followed if a link; so are its children. (``LocalStorage``'s
    ``child`` opens the path above it by name, which follows a link in place of a step
    directory when the rank directory below it is opened.)"""

    def __init__(self, parent: LocalStorage, name: str) -> None:
        super().__init__(parent.where(check_name(name)), follow=False)
        self.parent, self.name = parent, name

    def _open(self) -> int:
        return self._walk(make=False)

    def make_directory(self) -> None:
        if self._fd is None:
            self._fd = self._walk(make=True)

    def _walk(self, *, make: bool) -> int:
        parent_fd = self.parent._open()
        try:
            if make:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self.name, dir_fd=parent_fd)
            return open_directory(self.name, dir_fd=parent_fd, follow=False)
        except CheckpointCorruptError as e:  # it names the entry: name the path
            raise CheckpointCorruptError(f"{self.directory}{str(e)[len(self.name) :]}") from None
        finally:
            os.close(parent_fd)

    def child(self, name: str) -> LocalStorage:
        return _Under(self, name)


def _prune(root: LocalStorage, step_dir: LocalStorage, step: int) -> None:
    """Delete ``step_dir`` (the directory of ``step`` in ``root``) if it is empty."""
    if not step_dir.names():
        step_dir.close()
        with contextlib.suppress(OSError):  # another rank just wrote into it
            os.rmdir(step_dir_name(step), dir_fd=root.fd)


class NodeDir:
    """The node-local directory at ``root`` (created on first use)."""

    def __init__(self, root: str, persistent: str = "") -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.persistent = persistent
        """The persistent tier of the run using it (``rank_checkpoint.root_of``): a copy
        another run wrote (another ``run_dir``, the same local directory) is refused."""

    def _root(self) -> LocalStorage:
        storage = LocalStorage(self.root)
        try:
            storage.make_directory()
        except OSError as e:
            storage.close()
            raise CheckpointError(
                f"the local tier's directory {self.root} cannot be made or opened: "
                f"{e.strerror or e}. Give each node a local path it can write (a directory, "
                "or nothing yet, on a tmpfs or NVMe disk)"
            ) from e
        return storage

    def lock(self, owner: str) -> tuple[LocalLock, bool]:
        """Hold the directory for the manager the ranks agree under ``owner``; refused
        while a manager of another name holds it (``local_lock.py``). Also whether this
        call made the directory. One that cannot be made or opened is not locked: the
        first save or restore says what is wrong with it, as before."""
        made = not os.path.lexists(self.root)
        try:
            root = self._root()
        except CheckpointError:
            return local_lock.LocalLock(None), False
        with root:
            return local_lock.take(root, owner), made

    def unmake(self) -> None:
        """Remove the directory :meth:`lock` made, if still empty (a manager refused)."""
        with contextlib.suppress(OSError):
            os.rmdir(self.root)

    def rank_storage(self, step: int, rank: int, *, create: bool) -> LocalStorage:
        """``step-<step>/rank-<rank>``, made (with its step directory) if ``create``."""
        for attempt in range(3):
            with self._root() as root, _Under(root, step_dir_name(step)) as step_dir:
                if create:
                    step_dir.make_directory()
            rank_dir = step_dir.child(rank_dir_name(rank))
            if not create:
                return rank_dir
            try:
                rank_dir.make_directory()
                return rank_dir
            except FileNotFoundError:  # retention removed the empty step directory
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def steps(self) -> list[int]:
        """Every step directory here, oldest first (real directories only)."""
        with self._root() as root:
            found = [(s, n) for n in root.names() if (s := step_of(n)) is not None]
            return sorted(s for s, n in found if root.kind(n) == "directory")

    def ranks_in(self, step: int) -> list[int]:
        """Every rank directory of ``step`` (committed or not)."""
        with self._root() as root, _Under(root, step_dir_name(step)) as step_dir:
            if not step_dir.is_directory():
                return []
            found = [(r, n) for n in step_dir.names() if (r := rank_of(n)) is not None]
            return sorted(r for r, n in found if step_dir.kind(n) == "directory")

    def committed(self, step: int, rank: int) -> bool:
        with (
            contextlib.suppress(CheckpointError, OSError),
            self.rank_storage(step, rank, create=False) as storage,
        ):
            return storage.kind(MANIFEST_NAME) == "file"
        return False

    def held(
        self, ranks: Container[int] | None = None, refused: list[Refused] | None = None
    ) -> Iterator[Held]:
        """Every committed rank checkpoint here (of ``ranks`` only, if given) that would
        load, newest step first; one that would not (damaged, or naming another rank or
        step) is passed over, and added to ``refused`` if given."""
        for step in reversed(self.steps()):
            for rank in self.ranks_in(step):
                if ranks is not None and rank not in ranks:
                    continue
                found = self._check(step, rank)
                if isinstance(found, Held):
                    yield found
                elif found is not None and refused is not None:
                    refused.append(Refused(step, rank, found))

    def foreign(self) -> tuple[int, str] | None:
        """The newest step here holding a copy another run saved (its persistent tier is
        not :attr:`persistent`), and that run's tier; ``None`` if there is none. A copy
        that cannot be read is left to :meth:`held` to refuse."""
        if not self.persistent or not os.path.isdir(self.root):
            return None
        for step in reversed(self.steps()):
            for rank in self.ranks_in(step):
                try:
                    with self.rank_storage(step, rank, create=False) as storage:
                        if storage.kind(MANIFEST_NAME) != "file":
                            continue
                        theirs = rank_checkpoint.root_of(loadable_manifest(storage))
                except (CheckpointError, OSError):
                    continue
                if theirs and theirs != self.persistent:
                    return step, theirs
        return None

    def _check(self, step: int, rank: int) -> Held | str | None:
        """The copy, if it would load; else why not, or ``None`` if it is no copy (no
        manifest: an interrupted write or receipt; gone since it was listed)."""
        try:
            with self.rank_storage(step, rank, create=False) as storage:
                kind = storage.kind(MANIFEST_NAME)
                if kind is None:
                    return None
                if kind != "file":  # no write of ours leaves one: said, not passed over
                    described = storage.describe(MANIFEST_NAME)  # in silence (found in review)
                    return f"its {MANIFEST_NAME} is {described}, not a regular file"
                # Checked and parsed once (a survey reads them all).
                manifest = loadable_manifest(storage)
                saved_rank, world_size, saved_step = rank_checkpoint.saved_by(manifest)
                if (saved_rank, saved_step) != (rank, step):
                    return f"it holds rank {saved_rank}'s checkpoint of step {saved_step}"
                theirs = rank_checkpoint.root_of(manifest)
                if theirs and self.persistent and theirs != self.persistent:
                    return (
                        f"another run saved it, whose persistent tier is {theirs}, not this "
                        f"run's {self.persistent}; give each run a local directory of its own"
                    )
                rank_checkpoint.placed_tensors(manifest)  # what its load would refuse
                partitions.recorded_in(manifest.info[rank_checkpoint.INFO_KEY])
                return Held(step, rank, world_size, rank_checkpoint.run_of(manifest))
        except (FileNotFoundError, CheckpointNotFoundError):
            return None
        except (CheckpointError, OSError) as e:
            return f"{type(e).__name__}: {e}"

    def remove(self, step: int, rank: int, *, prune: bool = False) -> None:
        """Delete ``step-<step>/rank-<rank>`` (what shardsafe wrote in it); with ``prune``
        (retention), then the step directory if nothing is left in it. A deletion that
        fails (raised) removes the copy's manifest at least, where it can."""
        with self._root() as root, _Under(root, step_dir_name(step)) as step_dir:
            if not step_dir.is_directory():
                return
            if step_dir.kind(rank_dir_name(rank)) == "directory" and self._foreign(step_dir, rank):
                self._uncommit(step_dir, rank)  # said once, as its manifest goes
            elif step_dir.kind(rank_dir_name(rank)) == "directory":
                try:
                    delete_checkpoint(step_dir, rank_dir_name(rank), replaced=False)
                except Exception:
                    # Failed before its manifest went (the record of what it deletes is
                    # written first: a full disk, an I/O error refuse it; or the warning
                    # that it holds files of yours was made an error by the user's filter,
                    # ``-W error``, before the manifest went below). Left committed,
                    # a later step of a run restored to an older one was restored again
                    # after a restart, beside the other ranks' copies the resumed run
                    # wrote of that step (this rank's write of it failed, as this
                    # deletion did): a mix of two runs, loaded in silence.
                    with contextlib.suppress(CheckpointError, OSError):
                        self._uncommitted(step_dir, rank)
                    raise
            if prune:
                _prune(root, step_dir, step)

    def fresh_rank_storage(self, step: int, rank: int) -> LocalStorage:
        """``step-<step>/rank-<rank>`` emptied of any earlier copy and made, for a copy to be
        written or received. One that holds what shardsafe did not write cannot be
        emptied: refused, naming it (a copy was written beside it, or its first file
        "appeared while the checkpoint was being written", which it had not)."""
        self.remove(step, rank)
        with self._root() as root, _Under(root, step_dir_name(step)) as step_dir:
            foreign = step_dir.is_directory() and self._foreign(step_dir, rank)
        if foreign:
            where = os.path.join(self.root, step_dir_name(step), rank_dir_name(rank))
            raise CheckpointError(
                f"{where} cannot take a new copy: it holds {foreign[:3]}, which shardsafe "
                "did not write; delete the directory (or move those away)"
            )
        return self.rank_storage(step, rank, create=True)

    @staticmethod
    def _foreign(step_dir: LocalStorage, rank: int) -> list[str]:
        """What ``rank``'s directory in ``step_dir`` holds that shardsafe did not write."""
        if step_dir.kind(rank_dir_name(rank)) != "directory":
            return []
        with step_dir.child(rank_dir_name(rank)) as rank_dir:
            return foreign_entries(rank_dir)

    def prune(self, step: int) -> None:
        """Delete the directory of ``step`` if nothing is left in it."""
        with self._root() as root, _Under(root, step_dir_name(step)) as step_dir:
            if step_dir.is_directory():
                _prune(root, step_dir, step)

    def _uncommit(self, step_dir: LocalStorage, rank: int) -> None:
        """``rank``'s copy (in ``step_dir``) holds what shardsafe did not write, so it is not
        deleted: remove its manifest at least, so that it is never restored as a step it
        no longer is (a rank of a run restored to an older step, or a copy retention gave
        up), and say so, once: a copy without a manifest is said nothing of again (it was
        said twice at each removal, and again at every later one)."""
        foreign = self._foreign(step_dir, rank)
        directory = self._uncommitted(step_dir, rank)
        if directory is None:
            return
        _warnings.warn(
            f"shardsafe: removed the manifest of {directory} so that it is never "
            f"restored, but left the directory in place: it holds {foreign[:3]}, which "
            "shardsafe did not write; delete it yourself",
        )

    def _uncommitted(self, step_dir: LocalStorage, rank: int) -> str | None:
        """Remove the manifest of ``rank``'s copy in ``step_dir``; the copy's directory,
        or ``None`` if it had none to remove."""
        with step_dir.child(rank_dir_name(rank)) as rank_dir:
            if rank_dir.kind(MANIFEST_NAME) != "file":
                return None
            rank_dir.remove(MANIFEST_NAME)
            rank_dir.sync_directory()
            return str(rank_dir.directory)

    def clear_partial(self, step: int, rank: int, *, prune: bool = False) -> None:
        """Remove an interrupted write or receipt of ``rank``'s checkpoint of ``step``; with
        ``prune``, then the step directory if nothing is left in it."""
        if not self.committed(step, rank):
            self.remove(step, rank, prune=prune)

    def links_work(self, rank: int) -> bool:
        """Whether hard links can be made in this directory, which a node's ranks need to
        share their part files (``node_share.py``): a pair of empty probe files
        (``.link-probe-<rank>``), removed right after (a leftover one is removed first)."""
        with self._root() as root:
            source, target = f".link-probe-{rank}", f".link-probe-{rank}-linked"
            for name in (source, target):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=root.fd)
            flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            os.close(os.open(source, flags, 0o600, dir_fd=root.fd))
            try:
                os.link(
                    source, target, src_dir_fd=root.fd, dst_dir_fd=root.fd, follow_symlinks=False
                )
                return True
            except OSError:
                return False
            finally:
                for name in (source, target):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=root.fd)

    def link_reported(
        self,
        step: int,
        rank: int,
        name: str,
        storage: LocalStorage,
        *,
        reported: tuple[Sequence[int], int],
        what: str,
        gone: str,
    ) -> tuple[int, int]:
        """Hard-link the file ``name`` of ``rank``'s directory of ``step``, which a node-mate
        wrote or received there and reported as ``(device, inode)`` and size
        (``reported``), into ``storage`` under the same name; its identity. Its bytes are
        not read: the mate checked them (see the callers). Refused with a
        :class:`CheckpointError` naming it as ``what`` (and nothing left in ``storage``)
        if it is gone (``gone``: why it may be) or is not that file (another one, or a
        link, swapped in)."""
        with self.rank_storage(step, rank, create=False) as source:
            try:
                os.link(
                    name, name, src_dir_fd=source.fd, dst_dir_fd=storage.fd, follow_symlinks=False
                )
            except FileNotFoundError as e:  # a raw "[Errno 2] ... -> ..." named neither
                raise CheckpointError(
                    f"{source.where(name)}, {what}, is gone since it reported it ({gone})"
                ) from e
            found = os.stat(name, dir_fd=storage.fd, follow_symlinks=False)
            inode, size = reported
            if (
                not stat.S_ISREG(found.st_mode)
                or [found.st_dev, found.st_ino] != list(inode)
                or found.st_size != size
            ):
                with contextlib.suppress(OSError):
                    storage.remove(name)
                raise CheckpointError(
                    f"{source.where(name)} is not {what} (another file, or a link, is in its place)"
                )
        return found.st_dev, found.st_ino

    def free_bytes(self) -> int:
        """Bytes the filesystem of the directory can still take (for an unprivileged user)."""
        with self._root():
            stats = os.statvfs(self.root)
        return stats.f_bavail * stats.f_frsize

    def used_bytes(self, ranks: set[int]) -> int:
        """Bytes the rank checkpoints of ``ranks`` take here (all steps); a file linked
        into a replica (``transfer.py``) counts once."""
        total, seen = 0, set()
        for step in self.steps():
            for rank in self.ranks_in(step):
                if rank not in ranks:
                    continue
                with (
                    contextlib.suppress(OSError, CheckpointError),
                    self.rank_storage(step, rank, create=False) as storage,
                ):
                    for name in storage.names():
                        found = os.stat(name, dir_fd=storage.fd, follow_symlinks=False)
                        if (found.st_dev, found.st_ino) not in seen:
                            seen.add((found.st_dev, found.st_ino))
                            total += found.st_size
        return total
