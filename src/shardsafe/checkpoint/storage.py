"""Bytes in and out of one checkpoint directory. Nothing here knows about tensors.

The interface is deliberately tiny (after torchsnapshot): named files inside one
directory, written sequentially and fsynced, read by byte range. Names are always plain
file names (the manifest parser guarantees it), and reads refuse symlinks and anything
that is not a regular file, so a hostile checkpoint cannot make shardsafe read outside
its directory. Subclass :class:`LocalStorage` to inject faults in tests, or to add a
backend.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import sys
from typing import Any, Protocol

from ..errors import CheckpointCorruptError, CheckpointError


class FileSink(Protocol):
    def write(self, data: memoryview) -> None: ...
    def finish(self) -> int:
        """Flush and fsync; return the number of bytes written."""
        ...

    def abort(self) -> None: ...


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
    """A new file written front to back with unbuffered writes, fsynced on finish.

    Every ``WRITEBACK_BYTES`` the kernel is asked to start writing the new pages to disk
    (``sync_file_range``, as databases do), so the disk works while later bytes are still
    being produced and the final fsync has little left to flush.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        self._fd: int | None = os.open(path, flags, 0o644)
        self.written = 0
        self._kicked = 0

    def write(self, data: memoryview) -> None:
        assert self._fd is not None
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        while view.nbytes:
            n = os.write(self._fd, view)
            self.written += n
            view = view[n:]
        if self.written - self._kicked >= WRITEBACK_BYTES:
            start_writeback(self._fd, self._kicked, self.written - self._kicked)
            self._kicked = self.written

    def finish(self) -> int:
        assert self._fd is not None
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        return self.written

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LocalStorage:
    """A checkpoint directory on a local (or shared, POSIX) filesystem."""

    def __init__(self, directory: str) -> None:
        self.directory = os.fspath(directory)

    def _path(self, name: str) -> str:
        if not name or os.sep in name or name in (".", "..") or (os.altsep and os.altsep in name):
            raise CheckpointCorruptError(f"refusing file name {name!r}: not a plain file name")
        return os.path.join(self.directory, name)

    # -- writing

    def make_directory(self) -> None:
        os.makedirs(self.directory, exist_ok=True)

    def create(self, name: str) -> FileSink:
        return LocalFileSink(self._path(name))

    def commit(self, name: str, data: bytes) -> None:
        """Write ``data`` under ``name`` atomically: temp file, fsync, rename, fsync dir."""
        tmp = self._path(f".{name}.tmp-{os.getpid()}")
        sink = LocalFileSink(tmp)
        try:
            sink.write(memoryview(data))
            sink.finish()
            os.replace(tmp, self._path(name))
        except BaseException:
            sink.abort()
            _remove_quietly(tmp)
            raise
        self.sync_directory()

    def sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        _remove_quietly(self._path(name))

    def touch(self, name: str) -> None:
        """Create an empty file (not fsynced: a marker, not data)."""
        os.close(os.open(self._path(name), os.O_WRONLY | os.O_CREAT, 0o644))

    def names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []

    # -- reading

    def exists(self, name: str) -> bool:
        return os.path.lexists(self._path(name))

    def open_reader(self, name: str) -> LocalFileReader:
        return LocalFileReader(self._path(name), name)

    def read_small(self, name: str, limit: int) -> bytes:
        with self.open_reader(name) as reader:
            if reader.size > limit:
                raise CheckpointCorruptError(
                    f"{name} is {reader.size} bytes, over the {limit} limit"
                )
            out = bytearray(reader.size)
            reader.read_into(0, memoryview(out))
            return bytes(out)


class LocalFileReader:
    """A regular file (never a symlink) opened for positional reads."""

    def __init__(self, path: str, name: str) -> None:
        self.name = name
        try:
            # O_NONBLOCK: opening a FIFO (a tar archive can hold one) would wait for a
            # writer forever; regular files, the only kind read, ignore the flag.
            flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
            self._fd = os.open(path, flags)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"data file {name} is missing") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointCorruptError(
                    f"{name} is a symbolic link; shardsafe only reads regular files inside "
                    "the checkpoint directory"
                ) from None
            raise CheckpointError(f"cannot open {name}: {e}") from e
        info = os.fstat(self._fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(self._fd)
            raise CheckpointCorruptError(f"{name} is not a regular file")
        self.size = info.st_size

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; a short file is corruption."""
        view, pos = out.cast("B") if out.format != "B" else out, offset
        while view.nbytes:
            n = os.preadv(self._fd, [view], pos)
            if n == 0:
                raise CheckpointCorruptError(
                    f"{self.name} is truncated: expected bytes up to offset "
                    f"{offset + out.nbytes}, but the file ends at {self.size}"
                )
            view, pos = view[n:], pos + n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> LocalFileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
