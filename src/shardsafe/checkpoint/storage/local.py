"""A checkpoint directory on a local (or shared, POSIX) filesystem: :class:`LocalStorage`.

The directory is opened once and every operation is relative to that descriptor, so
swapping the directory (or a name in it) for a symlink midway cannot redirect a read, a
write or a deletion. Names are plain file names; reads refuse anything that is not a
regular file without opening it (see ``files.py``); writes only create new names;
deletions never follow a link and never recurse. Subclass :class:`LocalStorage` to
inject faults in tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import stat
from typing import Any

from ...errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
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
    with_path,
)
from .lock_backends import LocalLockBackend
from .protocol import EntryKind, FileSink


def commit_temp_name(name: str, pid: int | None = None) -> str:
    """The temporary file :meth:`LocalStorage.commit` writes ``name`` to before its rename,
    in process ``pid`` (default: this one). A save records it in its incomplete-save
    marker, so that the next save may clear it (``leftovers.py``)."""
    return f".{name}.tmp-{os.getpid() if pid is None else pid}"


_RENAME_NOREPLACE = 1
"""``renameat2``'s flag: fail with ``EEXIST`` rather than replace the target."""


@functools.cache
def _renameat2() -> Any:
    """libc's ``renameat2``, or ``None`` where there is none (not Linux, an old libc)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    function.restype = ctypes.c_int
    return function


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
        try:
            if self.follow:
                os.makedirs(self.directory, exist_ok=True)
            else:
                parent = os.path.dirname(self.directory.rstrip("/"))
                os.makedirs(parent or ".", exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self.directory)  # an existing symlink is refused when opened
        except (FileExistsError, NotADirectoryError):  # said as "[Errno 17] File exists"
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"{self.directory} is {_what_is_in_the_way(self.directory)}, not a directory",
            ) from None
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

    def commit(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write ``data`` under ``name`` atomically: temp file, fsync, rename, fsync dir.

        ``exclusive``: only if ``name`` does not exist (a hard link, which fails if it
        does: ``FileExistsError``); where the filesystem has no hard links, a rename."""
        tmp = commit_temp_name(check_name(name))
        self.remove(tmp)  # a stale one from a dead process that had this pid
        with naming(self.where(tmp)):
            fd = create_new(self.fd, tmp)
        sink = LocalFileSink(fd, self.where(tmp))
        try:
            sink.write(memoryview(data))
            sink.finish()
            if not (exclusive and (self._rename_new(tmp, name) or self._link_new(tmp, name))):
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            sink.abort()
            self.remove(tmp)
            raise
        self.sync_directory()

    def _rename_new(self, tmp: str, name: str) -> bool:
        """Rename ``tmp`` to ``name`` unless ``name`` exists (``FileExistsError``), in one
        step (Linux ``renameat2(RENAME_NOREPLACE)``); whether the platform and filesystem
        could (``False``: nothing done). A link then an unlink left the temporary file
        inside the committed checkpoint when the process was killed between the two."""
        rename = _renameat2()
        if rename is None:
            return False
        if rename(self.fd, os.fsencode(tmp), self.fd, os.fsencode(name), _RENAME_NOREPLACE) == 0:
            return True
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            raise FileExistsError(code, os.strerror(code), self.where(name))
        if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            return False
        raise OSError(code, os.strerror(code), self.where(tmp))

    def _link_new(self, tmp: str, name: str) -> bool:
        """Link ``tmp`` as ``name`` if ``name`` does not exist, then drop ``tmp``; whether
        the filesystem could (``False``: no hard links here, nothing done). Where
        :meth:`_rename_new` cannot: a kill between the two steps leaves ``tmp``."""
        try:
            os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
        except FileExistsError:
            raise
        except OSError as e:
            if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                return False
            raise
        os.unlink(tmp, dir_fd=self.fd)
        return True

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

    def sizes(self) -> dict[str, int]:
        """Each regular file's size (a stat each, no link followed)."""
        found = {}
        for name in self.names():
            with contextlib.suppress(FileNotFoundError):
                info = os.stat(check_name(name), dir_fd=self.fd, follow_symlinks=False)
                if stat.S_ISREG(info.st_mode):
                    found[name] = info.st_size
        return found

    def names_and_kinds(self) -> dict[str, EntryKind]:
        """``names`` with each one's ``kind`` (a stat each, no link followed); a name gone
        between the listing and its stat is left out."""
        found = {name: self.kind(name) for name in self.names()}
        return {name: kind for name, kind in found.items() if kind is not None}

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
        # The inode's number may be reused by a new file, never with the same ctime.
        identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        return LocalFileReader(fd, info.st_size, name, identity)

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
        return LocalLockBackend(self)


def _what_is_in_the_way(path: str) -> str:
    """What stands where a directory was to be made: the entry itself (a regular file, a
    symbolic link, dangling or not), or a file above it."""
    try:
        return describe_mode(os.lstat(path).st_mode)
    except OSError:
        return "under a file"
