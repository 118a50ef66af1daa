"""Writing a new file around the page cache (``O_DIRECT``) while training runs beside it.

Why: a buffered write only copies the bytes into the page cache; the kernel's flusher
threads write them to disk later, at normal CPU priority, on whichever core is free.
Beside a training loop that keeps every core busy, that work is taken from the training
whatever priority the save's own thread has. Measured on a 2-vCPU machine with a virtio
disk, each DDP rank writing 96 MiB from a nice-19 thread beside its training loop: the
loop kept 86% of its speed with buffered writes and ``sync_file_range`` (as
``LocalFileSink`` writes), 93% with ``O_DIRECT``; ``async_save`` in
``benchmarks/async_checkpoint.py`` went from 84-92% to 90-95%. With ``O_DIRECT`` the
block-layer work runs in the writing thread itself, at its low priority, and the page
cache is left alone.

Why not always: on that same disk, ``O_DIRECT`` writes reach the disk at about 0.46 GB/s
where buffered writes and one fsync reach about 0.6 GB/s. So a background save writes
around the page cache only until someone waits for it (``until``: ``SaveHandle.wait``,
``close``, or the next save); from then on nothing competes with it and it goes on with
buffered writes, at the disk's full buffered speed.

How: until the switch, every byte goes through one page-aligned buffer of
``piece_bytes`` (a multiple of any disk's block size), written whole, so every direct
write is aligned in memory, in size and in the file. The last partial buffer, and
everything after a switch, is written buffered (the flag is turned off first:
``fcntl(F_SETFL)``); the file's fsync makes both durable. Where the filesystem refuses
``O_DIRECT`` (``EINVAL``, as some network and union filesystems do) the file is written
buffered from the start or from the refused write on, and nothing is lost: the refused
buffer is written again.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class DirectWrites:
    """The page-aligned buffer of one file being written with ``O_DIRECT``."""

    def __init__(self, fd: int, until: threading.Event, piece_bytes: int) -> None:
        self._fd = fd
        self._until = until
        self._buffer = mmap.mmap(-1, piece_bytes)
        self._view = memoryview(self._buffer)
        self._size = piece_bytes
        self._fill = 0
        self.taken = 0
        """Bytes accepted so far (in the file, or in the buffer waiting to be)."""
        self._sent = 0
        """Bytes of a short direct write already in the file (then direct writes stop)."""
        self._refused = False

    @classmethod
    def start(cls, fd: int, until: threading.Event, piece_bytes: int) -> DirectWrites | None:
        """Turn ``O_DIRECT`` on for ``fd``; ``None`` where it cannot be (or ``until`` is set)."""
        if not _O_DIRECT or until.is_set() or piece_bytes % mmap.PAGESIZE:
            return None
        try:
            direct = cls(fd, until, piece_bytes)
        except (OSError, MemoryError):  # no memory for the buffer: write buffered
            return None
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
        except OSError:
            direct.release()
            return None
        return direct

    def active(self) -> bool:
        """Whether bytes still go around the page cache."""
        return not self._refused and not self._until.is_set()

    def take(self, data: memoryview) -> memoryview:
        """Copy ``data`` into the buffer, writing the buffer each time it is full; return
        what was not taken (everything from the moment direct writes stop)."""
        while data.nbytes and self.active():
            take = min(self._size - self._fill, data.nbytes)
            self._view[self._fill : self._fill + take] = data[:take]
            self._fill += take
            self.taken += take
            data = data[take:]
            if self._fill == self._size:
                self._send()
        return data

    def _send(self) -> None:
        try:
            n = self._write(self._view)
        except OSError as e:
            if e.errno != errno.EINVAL:  # disk full, I/O error: the save fails, as buffered
                raise
            self._refused = True  # the filesystem refuses O_DIRECT: write buffered
            return
        if n < self._size:
            self._sent, self._refused = n, True
            return
        self._fill = 0

    def _write(self, view: memoryview) -> int:
        """One aligned write around the page cache (a test subclass may fail it)."""
        return os.write(self._fd, view)

    def stop(self) -> bytes:
        """Turn ``O_DIRECT`` off; return the bytes taken but not yet in the file, which the
        caller writes (buffered) next."""
        try:
            flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
            return bytes(self._view[self._sent : self._fill])
        finally:
            self.release()

    def release(self) -> None:
        """Free the buffer (the file is finished or given up)."""
        self._view.release()
        self._buffer.close()
