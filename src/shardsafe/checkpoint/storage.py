"""Bytes in and out of one checkpoint directory. Nothing here knows about tensors.

The interface is deliberately tiny (after torchsnapshot): named files inside one
directory, written sequentially and fsynced, read by byte range. The directory is opened
once and every operation is relative to that descriptor, so swapping the directory (or
a name in it) for a symlink midway cannot redirect a read, a write or a deletion. Names
are plain file names; reads refuse anything that is not a regular file without opening
it (see ``files.py``); writes only create new names; deletions never follow a link and
never recurse. Subclass :class:`LocalStorage` to inject faults in tests.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .dir_sync import DirectorySync
from .files import (
    LocalFileReader,
    LocalFileSink,
    check_name,
    create_new,
    describe_mode,
    naming,
    open_directory,
    open_regular,
    start_writeback,
    with_path,
)

if TYPE_CHECKING:
    from .lock_backends import LocalLockBackend, LockBackend

__all__ = [
    "CacheAvoidingSink",
    "EntryKind",
    "FileSink",
    "LocalFileReader",
    "LocalFileSink",
    "LocalStorage",
    "Storage",
    "start_writeback",
]


EntryKind = Literal["file", "directory", "symlink", "other"]
"""What a name in a storage is (:meth:`Storage.kind`); an object store has only files
and directories (prefixes)."""


class FileSink(Protocol):
    """A new file or object, written front to back. A sink that can keep its bytes out
    of the page cache is also a :class:`CacheAvoidingSink`."""

    def write(self, data: memoryview) -> None: ...

    def finish(self) -> int:
        """Flush and fsync; return the number of bytes written."""
        ...

    def abort(self) -> None: ...


@runtime_checkable
class CacheAvoidingSink(FileSink, Protocol):
    """A sink that can write around the page cache (a local file: ``O_DIRECT``), so that
    a background save does not evict the training's pages. A capability: a sink without
    it (an upload, or a user's sink older than it) is written the usual way."""

    def avoid_page_cache(self, until: threading.Event, piece_bytes: int) -> None:
        """Keep the bytes out of the page cache, in pieces of ``piece_bytes``, until
        ``until`` is set; called before the first write."""
        ...


class FileReader(Protocol):
    """One object opened for ranged reads; ``read_into`` fills a view from an offset."""

    name: str
    size: int

    def read_into(self, offset: int, out: memoryview) -> None: ...
    def mapping_path(self) -> str | None:
        """A path naming this very open file (``/proc/self/fd/N``), for a reader that must
        memory-map it by name (``torch.load(mmap=True)``); ``None`` where there is none."""
        ...

    def close(self) -> None: ...
    def __enter__(self) -> FileReader: ...
    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class Storage(Protocol):
    """What the engine needs from where a checkpoint lives: named byte objects in one
    directory (or object-store prefix), never tensors.

    :class:`LocalStorage` (POSIX) and ``object_storage.FsspecStorage`` (``s3://`` and the
    other fsspec URLs) implement it. Every ``name`` is a plain file name checked by
    ``files.check_name``: nothing can address an object outside the directory.

    * writing: ``create`` (a new object, streamed; ``finish`` makes it visible),
      ``commit`` (one object written atomically: the manifest, ``latest``), ``touch``,
      ``remove``, ``sync_directory`` (make earlier creations durable before a commit);
    * reading: ``open_reader`` (ranged reads), ``read_small``, ``names``, ``kind``,
      ``exists``, ``describe``;
    * the directory: ``is_directory``, ``require_directory``, ``make_directory``,
      ``remove_directory`` (once empty), ``child``, ``remove_child`` (a child directory,
      once empty, never through a link), ``where`` (for messages), ``close``;
    * capabilities, what callers decide by instead of by the class:
      ``cheap_rereads``, ``cheap_metadata``, ``abort_pending_uploads`` and
      ``lock_backend`` (and, on a sink, :class:`CacheAvoidingSink`).
    """

    directory: str

    @property
    def cheap_rereads(self) -> bool:
        """Whether reading the same bytes a second time costs no second transfer (a local
        file comes from the page cache). ``load(verify="first")`` reads every byte twice:
        where this is False it keeps the first read in a local spool (``spool.py``)."""
        ...

    @property
    def cheap_metadata(self) -> bool:
        """Whether creating, listing and removing small files costs no round trip to a
        server (a local or shared filesystem). A background save then prepares its
        directory at the call, to plan before staging (``background._plan_first``)."""
        ...

    def abort_pending_uploads(self) -> int:
        """Abort uploads a killed save left unfinished under this directory (invisible
        but billed on an object store); return how many. Nothing to do on a filesystem."""
        ...

    def lock_backend(self) -> LockBackend:
        """How a lock file is created and replaced atomically on this medium
        (``lock_backends.py``), for the one lock that holds the rules (``lock.RootLock``)."""
        ...

    def is_directory(self) -> bool: ...
    def require_directory(self) -> None: ...
    def make_directory(self) -> None: ...
    def remove_directory(self) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Storage: ...
    def __exit__(self, *exc: object) -> None: ...
    def where(self, name: str) -> str: ...
    def create(self, name: str, size_hint: int = 0) -> FileSink:
        """A new object; ``size_hint``: the bytes it will hold, if known (an object
        store sizes its upload parts by it). Once its ``finish`` returns, the object
        and its name are durable: a save commits its manifest without syncing again."""
        ...

    def commit(self, name: str, data: bytes) -> None: ...
    def sync_directory(self) -> None: ...
    def remove(self, name: str) -> None: ...
    def touch(self, name: str) -> None: ...
    def names(self) -> list[str]: ...
    def kind(self, name: str) -> EntryKind | None: ...
    def describe(self, name: str) -> str: ...
    def exists(self, name: str) -> bool: ...
    def open_reader(self, name: str) -> FileReader: ...
    def read_small(self, name: str, limit: int) -> bytes: ...
    def child(self, name: str) -> Storage: ...
    def remove_child(self, name: str) -> None: ...


def commit_temp_name(name: str, pid: int | None = None) -> str:
    """The temporary file :meth:`LocalStorage.commit` writes ``name`` to before its rename,
    in process ``pid`` (default: this one). A save records it in its incomplete-save
    marker, so that the next save may clear it (``leftovers.py``)."""
    return f".{name}.tmp-{os.getpid() if pid is None else pid}"


class LocalStorage:
    """A checkpoint directory on a local (or shared, POSIX) filesystem.

    ``follow=False`` (what :class:`CheckpointManager` uses for its step directories)
    refuses a symlink in place of the directory itself; the path above it is the user's
    and is followed. The directory is opened on first use and stays open until
    :meth:`close`.
    """

    cheap_rereads = True  # a second read comes from the page cache
    cheap_metadata = True  # names are made and removed without a server round trip

    def __init__(self, directory: str, *, follow: bool = True) -> None:
        self.directory = os.fspath(directory)
        self.follow = follow
        self._fd: int | None = None

    # -- the directory itself

    @property
    def fd(self) -> int:
        """The open directory (opened now if it was not yet)."""
        if self._fd is None:
            self._fd = self._open()
        return self._fd

    def _open(self) -> int:
        if self.follow:
            return open_directory(self.directory)
        parent, base = os.path.split(self.directory.rstrip("/") or "/")
        parent_fd = open_directory(parent or ".")
        try:
            return open_directory(check_name(base), dir_fd=parent_fd, follow=False)
        finally:
            os.close(parent_fd)

    def is_directory(self) -> bool:
        """True if the directory exists (a symlink to one counts only with ``follow``)."""
        try:
            self.fd  # noqa: B018 - opens it
        except (FileNotFoundError, NotADirectoryError):
            return False
        except CheckpointCorruptError:
            return False
        return True

    def require_directory(self) -> None:
        """Raise :class:`CheckpointNotFoundError` unless the directory exists."""
        try:
            self.fd  # noqa: B018 - opens it
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.directory} does not exist") from None
        except CheckpointCorruptError as e:
            raise CheckpointNotFoundError(str(e)) from None

    def make_directory(self) -> None:
        """Create the directory (and, when followed, its parents) if needed, and open it."""
        if self._fd is not None:
            return
        if self.follow:
            os.makedirs(self.directory, exist_ok=True)
        else:
            parent = os.path.dirname(self.directory.rstrip("/"))
            os.makedirs(parent or ".", exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.directory)  # an existing symlink is refused when opened
        self._fd = self._open()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove_directory(self) -> None:
        """Remove the (empty) directory itself; closes it first."""
        self.close()
        os.rmdir(self.directory)

    def __enter__(self) -> LocalStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def where(self, name: str) -> str:
        """``name`` inside this directory, for messages."""
        return os.path.join(self.directory, name)

    # -- writing

    def create(self, name: str, size_hint: int = 0) -> FileSink:
        """A new file; a name that exists already (of any kind) is refused. Its name is
        durable once ``finish`` returns, as its bytes are (``dir_sync``)."""
        try:
            fd = create_new(self.fd, name)
        except FileExistsError:
            raise CheckpointError(
                f"{self.where(name)} appeared while the checkpoint was being written; "
                "shardsafe never writes over a file it did not create"
            ) from None
        except OSError as e:  # no room for one more name (ENOSPC): say where
            raise with_path(e, self.where(name)) from e
        try:
            return LocalFileSink(fd, self.where(name), directory=DirectorySync(self.fd))
        except BaseException:
            os.close(fd)
            raise

    def commit(self, name: str, data: bytes) -> None:
        """Write ``data`` under ``name`` atomically: temp file, fsync, rename, fsync dir."""
        tmp = commit_temp_name(check_name(name))
        self.remove(tmp)  # a stale one from a dead process that had this pid
        with naming(self.where(tmp)):
            fd = create_new(self.fd, tmp)
        sink = LocalFileSink(fd, self.where(tmp))
        try:
            sink.write(memoryview(data))
            sink.finish()
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            sink.abort()
            self.remove(tmp)
            raise
        self.sync_directory()

    def sync_directory(self) -> None:
        os.fsync(self.fd)

    def remove(self, name: str) -> None:
        """Unlink ``name`` if present (a link is removed itself, never what it points at)."""
        try:
            os.unlink(check_name(name), dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise CheckpointError(
                f"{self.where(name)} is a directory, which shardsafe did not create; "
                "it is left in place"
            ) from None
        except OSError as e:
            if e.errno in (errno.EISDIR, errno.EPERM) and self.kind(name) == "directory":
                raise CheckpointError(
                    f"{self.where(name)} is a directory, which shardsafe did not create; "
                    "it is left in place"
                ) from None
            raise

    def touch(self, name: str) -> None:
        """Create an empty marker file (not fsynced: a marker, not data)."""
        try:
            with naming(self.where(name)):
                os.close(create_new(self.fd, name))
        except FileExistsError:
            if self.kind(name) != "file":
                raise CheckpointCorruptError(
                    f"{self.where(name)} exists and is not a regular file"
                ) from None

    def names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.fd))
        except FileNotFoundError:
            return []

    # -- reading

    def kind(self, name: str) -> EntryKind | None:
        """``"file"``, ``"directory"``, ``"symlink"``, ``"other"``, or ``None`` if absent."""
        try:
            mode = os.stat(check_name(name), dir_fd=self.fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISREG(mode):
            return "file"
        if stat.S_ISDIR(mode):
            return "directory"
        return "symlink" if stat.S_ISLNK(mode) else "other"

    def describe(self, name: str) -> str:
        """What ``name`` is, for messages (``a symbolic link``, ``a named pipe (FIFO)``)."""
        try:
            return describe_mode(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode)
        except OSError:
            return "missing"

    def exists(self, name: str) -> bool:
        return self.kind(name) is not None

    def open_reader(self, name: str) -> LocalFileReader:
        fd, info = open_regular(self.fd, name, name)
        return LocalFileReader(fd, info.st_size, name)

    def read_small(self, name: str, limit: int) -> bytes:
        with self.open_reader(name) as reader:
            if reader.size > limit:
                raise CheckpointCorruptError(
                    f"{name} is {reader.size} bytes, over the {limit} limit"
                )
            out = bytearray(reader.size)
            reader.read_into(0, memoryview(out))
            return bytes(out)

    def child(self, name: str) -> LocalStorage:
        """The subdirectory ``name``, never followed if it is a link."""
        return type(self)(os.path.join(self.directory, check_name(name)), follow=False)

    def remove_child(self, name: str) -> None:
        """Remove the empty subdirectory ``name`` (relative to the open directory: a link
        in its place is refused by ``rmdir`` itself, never followed)."""
        os.rmdir(check_name(name), dir_fd=self.fd)

    def abort_pending_uploads(self) -> int:
        return 0  # a killed write leaves a file, cleared by name

    def lock_backend(self) -> LocalLockBackend:
        """The lock on a filesystem: claimed by a hard link (``lock_backends.py``)."""
        from .lock_backends import LocalLockBackend

        return LocalLockBackend(self)
