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
it). If the spool cannot be written (the temporary directory is full, ``TMPDIR`` is not
writable), it stops growing with a warning and the rest is downloaded again.
"""

from __future__ import annotations

import bisect
import os
import tempfile
import warnings
from typing import IO

from .storage import FileReader


class Spool:
    """The spool file and, per object, which of its ranges it holds and where."""

    def __init__(self) -> None:
        self.recording = False
        """Set by the loader while the check pass runs: only those reads are kept."""
        self._file: IO[bytes] | None = None
        self._end = 0
        self._failed = False
        self._starts: dict[str, list[int]] = {}
        self._ranges: dict[str, list[tuple[int, int, int]]] = {}
        """Per object, sorted by start: ``(start, end, position in the spool)``."""

    def wrap(self, reader: FileReader) -> FileReader:
        return SpooledReader(reader, self)

    def keep(self, name: str, offset: int, data: memoryview) -> None:
        if not self.recording or self._failed or not data.nbytes:
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
            warnings.warn(
                f"shardsafe could not keep downloaded bytes in a local temporary file ({e}); "
                "the rest of this load downloads them again. Point TMPDIR at a disk with "
                "room for this rank's state, or load with verify='inline'",
                RuntimeWarning,
                stacklevel=2,
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

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> SpooledReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
