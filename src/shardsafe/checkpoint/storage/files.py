"""Opening files inside a checkpoint directory without following links or waking devices.

A checkpoint may come from anyone, so a name inside it may be a symlink (to a file
outside, or to ``/dev/zero``), a FIFO (whose ``open`` waits for a writer forever), a
character device (whose driver runs on ``open``: a tty, a tape) or a directory. Every
open here is relative to an already open directory (``dir_fd``), so the directory cannot
be swapped between two operations, and:

* reads check the type *before* anything is opened for reading. On Linux the name is
  first opened with ``O_PATH`` (which runs no driver and never blocks), checked with
  ``fstat``, and the very same inode is then opened for reading through
  ``/proc/self/fd``; so nothing but a regular file is ever opened, even if the name is
  swapped in between. Elsewhere, ``lstat`` then open then ``fstat``, and the two must be
  the same inode;
* writes create new names only (``O_CREAT | O_EXCL``, which never follows a link);
* nothing is ever reopened by path after it was checked: callers keep the descriptor.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ...errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .dir_sync import DirectorySync
from .direct_writes import DirectWrites

_O_PATH = getattr(os, "O_PATH", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_PROC_FD = bool(_O_PATH) and os.path.isdir("/proc/self/fd")
"""Linux with /proc: reads go through an ``O_PATH`` handle (see the module docstring)."""
READ_FLAGS = os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | _O_NOCTTY | _O_NONBLOCK
DIRECTORY_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC


def check_name(name: str) -> str:
    """``name`` if it is a plain file name (no separator, not ``.``/``..``); else refuse."""
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\0" in name
        or name in (".", "..")
        or (os.altsep is not None and os.altsep in name)
    ):
        raise CheckpointCorruptError(f"refusing file name {name!r}: not a plain file name")
    return name


def describe_mode(mode: int) -> str:
    """What kind of filesystem object a mode is, for messages (a regular file is named
    too: a regular file where a directory should be was called "not a regular file")."""
    for test, what in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "an unknown kind of file"


def _refusal(name: str, mode: int) -> CheckpointCorruptError:
    if stat.S_ISLNK(mode):
        return CheckpointCorruptError(
            f"{name} is a symbolic link; shardsafe only reads regular files inside the "
            "checkpoint directory"
        )
    return CheckpointCorruptError(f"{name} is not a regular file ({describe_mode(mode)})")


def open_regular(dir_fd: int, name: str, where: str) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file ``name`` in ``dir_fd``, and its stat.

    ``where`` names the file in messages. Missing: :class:`CheckpointCorruptError` saying
    so; anything but a regular file: refused without being opened for reading.
    """
    check_name(name)
    try:
        if _PROC_FD:
            return _open_via_o_path(dir_fd, name, where)
        return _open_checked(dir_fd, name, where)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"data file {where} is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refusal(where, stat.S_IFLNK) from None
        raise CheckpointError(f"cannot open {where}: {e}") from e


def open_named_file(path: str) -> int:
    """A read-only descriptor of the regular file at a path a user named (a Lightning
    ``ckpt_path``, a ``.pt`` to import). Links are followed, as the user chose the name
    (Lightning's ``last.ckpt`` may be one); anything but a regular file is refused without
    being opened for reading, as in :func:`open_regular`."""
    try:
        opened = _open_via_o_path if _PROC_FD else _open_checked
        return opened(None, path, path, follow=True)[0]
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"there is no file at {path}") from None
    except OSError as e:
        raise CheckpointError(f"cannot open {path}: {e.strerror}") from None


def _open_via_o_path(
    dir_fd: int | None, name: str, where: str, *, follow: bool = False
) -> tuple[int, os.stat_result]:
    nofollow = 0 if follow else _O_NOFOLLOW
    handle = os.open(name, _O_PATH | nofollow | _O_CLOEXEC, dir_fd=dir_fd)
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode):
            raise _refusal(where, info.st_mode)
        fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | _O_CLOEXEC | _O_NOCTTY)
    finally:
        os.close(handle)
    return fd, _same_regular_file(fd, info, where)


def _open_checked(
    dir_fd: int | None, name: str, where: str, *, follow: bool = False
) -> tuple[int, os.stat_result]:
    info = os.stat(name, dir_fd=dir_fd, follow_symlinks=follow)
    if not stat.S_ISREG(info.st_mode):
        raise _refusal(where, info.st_mode)
    fd = os.open(name, READ_FLAGS & ~_O_NOFOLLOW if follow else READ_FLAGS, dir_fd=dir_fd)
    return fd, _same_regular_file(fd, info, where)


def _same_regular_file(fd: int, before: os.stat_result, where: str) -> os.stat_result:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != (
        before.st_dev,
        before.st_ino,
    ):
        os.close(fd)
        raise CheckpointCorruptError(f"{where} was replaced while it was being opened")
    return info


def open_directory(path: str, *, dir_fd: int | None = None, follow: bool = True) -> int:
    """A descriptor of the directory ``path`` (relative to ``dir_fd`` if given).

    ``follow=False`` refuses a symlink in place of the directory: a manager's step
    directories are never followed out of its root.
    """
    flags = DIRECTORY_FLAGS | (0 if follow else _O_NOFOLLOW)
    try:
        return os.open(path, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CheckpointCorruptError(_not_a_directory(path, dir_fd)) from None
        raise CheckpointError(f"cannot open directory {path}: {e}") from e


def _not_a_directory(path: str, dir_fd: int | None) -> str:
    """Why ``path`` (which ``open`` refused as no directory) is none: it is something else,
    or it is under something that is no directory (``run/afile/sub``: then its own
    ``lstat`` fails too, and the message read "is not a directory, not a directory")."""
    try:
        kind = describe_mode(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        blocker = first_non_directory(path) if dir_fd is None else None
        if blocker is None:
            return f"{path} is not a directory; shardsafe does not follow links"
        kind = describe_mode(os.stat(blocker).st_mode)
        return f"{path} is under {blocker}, which is {kind}, not a directory"
    return f"{path} is {kind}, not a directory; shardsafe does not follow it"


def first_non_directory(path: str) -> str | None:
    """The first of ``path``'s ancestors that exists and is no directory, or ``None``.
    Links are followed, as opening ``path`` follows those above it (``/tmp`` a link to a
    directory is a directory)."""
    parts = os.path.normpath(path).split(os.sep)
    for end in range(1, len(parts)):
        ancestor = os.sep.join(parts[:end]) or os.sep
        try:
            mode = os.stat(ancestor).st_mode
        except OSError:
            return None
        if not stat.S_ISDIR(mode):
            return ancestor
    return None


def with_path(error: OSError, path: str) -> OSError:
    """``error`` naming ``path``: ``os.write`` and ``fsync`` say only "[Errno 28] No space
    left on device", and which file of which checkpoint (so which disk) is what a user
    needs to act on. Same class and errno (``OSError`` picks the subclass by errno)."""
    if error.errno is None:
        return error
    named = OSError(error.errno, error.strerror, path)
    named.__cause__ = error
    return named.with_traceback(error.__traceback__)  # still "at" the failing call


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """Re-raise an ``OSError`` from inside as :func:`with_path` of ``path``."""
    try:
        yield
    except OSError as e:
        raise with_path(e, path) from e


def create_new(dir_fd: int, name: str) -> int:
    """A write descriptor of a *new* file ``name``; an existing name of any kind is refused."""
    check_name(name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
    return os.open(name, flags, 0o644, dir_fd=dir_fd)


WRITEBACK_BYTES = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _libc_sync_file_range() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to begin writing a range to disk, without waiting (Linux; else no-op).

    Durability still comes from the fsync at the end; this only moves work earlier.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class LocalFileSink:
    """A new file written front to back with ``os.write`` (no user-space buffering),
    fsynced on finish.

    Every ``WRITEBACK_BYTES`` the kernel is asked to start writing the new pages to disk
    (``sync_file_range``, as databases do), so the disk works while later bytes are still
    being produced and the final fsync has little left to flush. A background save's
    files are written around the page cache instead while training runs beside it
    (:meth:`avoid_page_cache`).
    """

    direct_writes = DirectWrites
    """What writes around the page cache (a subclass may refuse, to test the fallback)."""

    def __init__(self, fd: int, path: str, *, directory: DirectorySync | None = None) -> None:
        self.path = path
        """The file's path, for messages."""
        self._fd: int | None = fd
        self.written = 0
        self._kicked = 0
        self._directory = directory
        """The fsync of the directory that makes this new file's name durable, if any:
        ``finish`` returns only once it is done too."""
        self._direct: DirectWrites | None = None

    def avoid_page_cache(self, until: threading.Event, piece_bytes: int) -> None:
        """Write around the page cache (``O_DIRECT``, in aligned pieces of ``piece_bytes``)
        until ``until`` is set, where the filesystem allows (``direct_writes.py``)."""
        assert self._fd is not None and self.written == 0
        self._direct = self.direct_writes.start(self._fd, until, piece_bytes)

    @property
    def direct(self) -> bool:
        """Whether the next bytes go around the page cache."""
        return self._direct is not None and self._direct.active()

    def write(self, data: memoryview) -> None:
        """Append ``data``; an ``OSError`` (a full disk) names this file."""
        with naming(self.path):
            self._write(data)

    def _write(self, data: memoryview) -> None:
        assert self._fd is not None
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        if self._direct is not None:
            before = self._direct.taken
            try:
                rest = self._direct.take(view)
            finally:  # also when a write fails: what was taken is counted
                self.written += self._direct.taken - before
            if self._direct.active():
                return
            self._end_direct()
            view = rest
        self._write_buffered(view)

    def _end_direct(self) -> None:
        """Go on buffered: first the bytes the direct writes had taken but not written."""
        if self._direct is None:
            return
        direct, self._direct = self._direct, None
        pending = memoryview(direct.stop())
        self.written -= pending.nbytes
        self._kicked = self.written  # nothing before this is in the page cache
        self._write_buffered(pending)

    def _write_buffered(self, view: memoryview) -> None:
        assert self._fd is not None
        while view.nbytes:
            n = os.write(self._fd, view)
            self.written += n
            view = view[n:]
        if self.written - self._kicked >= WRITEBACK_BYTES:
            start_writeback(self._fd, self._kicked, self.written - self._kicked)
            self._kicked = self.written

    def finish(self) -> int:
        """Write what is left, fsync and close; an ``OSError`` names this file."""
        with naming(self.path):
            return self._finish()

    def _finish(self) -> int:
        assert self._fd is not None
        try:
            self._end_direct()
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = None
            directory, self._directory = self._directory, None
            if directory is not None:
                directory.wait()
        return self.written

    def abort(self) -> None:
        direct, self._direct = self._direct, None
        try:
            if direct is not None:
                direct.release()
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        directory, self._directory = self._directory, None
        if directory is not None:
            # The file is being given up: its name's durability no longer matters.
            with contextlib.suppress(OSError):
                directory.wait()


class LocalFileReader:
    """A regular file (never a symlink, FIFO or device) opened once for positional reads."""

    def __init__(self, fd: int, size: int, name: str, identity: object = None) -> None:
        self.name = name
        self.size = size
        self.identity = identity
        """Which file this is (device, inode, size, modification and change times): a
        reader that closed it and opens the name again refuses a different file
        (``io/reader.py``)."""
        self._fd = fd

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; a short file is corruption."""
        view, pos = out.cast("B") if out.format != "B" else out, offset
        while view.nbytes:
            n = os.preadv(self._fd, [view], pos)
            if n == 0:
                raise CheckpointCorruptError(
                    f"{self.name} is truncated: expected bytes up to offset "
                    f"{offset + out.nbytes}, but the file ends at {pos}"
                )
            view, pos = view[n:], pos + n

    def mapping_path(self) -> str | None:
        """``/proc/self/fd/N``: opening it opens this inode, not whatever the name in the
        directory points to by then (``None`` where ``/proc`` is missing)."""
        return f"/proc/self/fd/{self._fd}" if _PROC_FD and self._fd >= 0 else None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> LocalFileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
