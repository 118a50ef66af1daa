"""A local copy of the bytes a load checks first, so an object store is downloaded once.

``load(verify="first")`` reads every byte it will restore twice: once to check it before
anything is restored, once into the live tensors. From a local disk the second read
comes from the page cache; from an object store it would be a second download. So for a
store the first pass also writes what it downloads into a spool: one anonymous
temporary file (``tempfile.TemporaryFile``: private, already unlinked, gone when the
load ends or the process dies), and the second pass reads those ranges from it. The
bytes are checked against their CRC32s again on the second read, exactly as without a
spool, so nothing is trusted because it came from the spool.

Cost: local disk space for the bytes this rank restores in place, for the duration of
the load; host memory stays bounded (the spool is a file, and the page cache may drop
it). So there is no spool, and the bytes are downloaded twice, with a warning, where it
would not be a disk: a temporary directory in memory (``tmpfs``, ``ramfs``: the spool
would take as much RAM as the state), or one without room for the bytes plus 1 GiB (all
ranks of a node spool at once). If the spool cannot be written after all, it stops
growing with a warning and the rest is downloaded again. ``TMPDIR`` chooses the
directory; ``verify="inline"`` needs no spool.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import IO

from ... import _warnings
from .protocol import FileReader

SPARE_BYTES = 1 << 30
"""Room a spool leaves free on its disk, beyond the bytes it will hold."""
_IN_MEMORY = ("tmpfs", "ramfs")


def spool_for(nbytes: int) -> Spool | None:
    """A spool for ``nbytes``, or ``None`` (with a warning) if the temporary directory is
    in memory or too small for them (see the module docstring)."""
    directory = tempfile.gettempdir()
    kind = _filesystem_type(directory)
    if kind in _IN_MEMORY:
        why = f"{directory} is a {kind} (in memory)"
    else:
        try:
            stats = os.statvfs(directory)
        except OSError as e:
            why = f"{directory} cannot be used ({e})"
        else:
            free = stats.f_bavail * stats.f_frsize
            if free >= nbytes + SPARE_BYTES:
                return Spool()
            why = f"{directory} has {free >> 20} MiB free, {nbytes >> 20} MiB + 1 GiB needed"
    _warn(
        f"shardsafe downloads each byte twice in this load: {why}. Point TMPDIR at a "
        "local disk, or load with verify='inline'"
    )
    return None


def _filesystem_type(path: str) -> str | None:
    """The type of the filesystem ``path`` is on, from ``/proc/self/mounts`` (Linux)."""
    best, kind = "", None
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) >= 3:
                    point = fields[1].replace("\\040", " ")
                    inside = path == point or path.startswith(point.rstrip("/") + "/")
                    if inside and len(point) >= len(best):
                        best, kind = point, fields[2]
    except OSError:
        return None
    return kind


def _warn(message: str) -> None:
    _warnings.warn(message, RuntimeWarning)


class Spool:
    """The spool file and, per object, which of its ranges it holds and where."""

    def __init__(self) -> None:
        self._recording = False
        self._file: IO[bytes] | None = None
        self._end = 0
        self._failed = False
        self._starts: dict[str, list[int]] = {}
        self._ranges: dict[str, list[tuple[int, int, int]]] = {}
        """Per object, sorted by start: ``(start, end, position in the spool)``."""

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Keep what is read inside the block (the loader's check pass), and only that."""
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def wrap(self, reader: FileReader) -> FileReader:
        return SpooledReader(reader, self)

    def keep(self, name: str, offset: int, data: memoryview) -> None:
        if not self._recording or self._failed or not data.nbytes:
            return
        try:
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="shardsafe-spool-")  # noqa: SIM115 (closed by close())
            fd, at = self._file.fileno(), self._end
            written = 0
            while written < data.nbytes:
                written += os.pwrite(fd, data[written:], at + written)
        except OSError as e:
            self._failed = True
            _warn(
                f"shardsafe could not keep downloaded bytes in a local temporary file ({e}); "
                "the rest of this load downloads them again. Point TMPDIR at a disk with "
                "room for this rank's state, or load with verify='inline'"
            )
            return
        starts = self._starts.setdefault(name, [])
        i = bisect.bisect_right(starts, offset)
        starts.insert(i, offset)
        self._ranges.setdefault(name, []).insert(i, (offset, offset + data.nbytes, at))
        self._end += data.nbytes

    def serve(self, name: str, offset: int, out: memoryview) -> int:
        """Fill ``out`` from the spool for as long as it holds the bytes from ``offset``
        on; return how many bytes it filled (possibly none)."""
        if self._file is None:
            return 0
        starts, ranges = self._starts.get(name, []), self._ranges.get(name, [])
        done = 0
        while done < out.nbytes:
            at = offset + done
            i = bisect.bisect_right(starts, at) - 1
            if i < 0 or ranges[i][1] <= at:
                break
            start, end, position = ranges[i]
            take = min(out.nbytes - done, end - at)
            got = os.preadv(self._file.fileno(), [out[done : done + take]], position + at - start)
            done += got
            if got < take:
                break
        return done

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._starts.clear()
        self._ranges.clear()


class SpooledReader:
    """A :class:`FileReader` that keeps what it reads in a :class:`Spool` and serves reads
    the spool holds from it."""

    def __init__(self, inner: FileReader, spool: Spool) -> None:
        self.name, self.size = inner.name, inner.size
        self._inner, self._spool = inner, spool

    def read_into(self, offset: int, out: memoryview) -> None:
        view = out.cast("B") if out.format != "B" else out
        done = self._spool.serve(self.name, offset, view)
        if done < view.nbytes:
            rest = view[done:]
            self._inner.read_into(offset + done, rest)
            self._spool.keep(self.name, offset + done, rest)

    def mapping_path(self) -> str | None:
        return None  # an object: nothing to map

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> SpooledReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
