"""Page-locked host buffers for reading into CUDA tensors, the copies to the device
overlapping the reads.

A CUDA destination is filled through pinned host memory: a piece of the file is read
into it, its CRC32 checked, and it is copied to the device. With one buffer, each copy
must have run before the next piece can be read into the buffer: one synchronous copy
per 256 KiB piece (``reader.CACHE_PIECE_BYTES``), about a third of a 768 MiB load's time
on an H200 (profiled). With a few buffers taken in turn, each copy is issued asynchronously
on the destination's current stream (so it runs after whatever the caller queued there
before, a ``zero_()`` of the tensor say), and the next pieces are read and checked while
it runs. A buffer is refilled only once the copy that read it has run (its event), and
the reader waits for every copy before a tensor's read returns, so the caller sees a
filled tensor, as with synchronous copies. Memory: :data:`SLOTS` pieces of at most
:data:`PIECE_BYTES`, or one row where a row is larger (see :class:`PinnedRing`).
"""

from __future__ import annotations

from typing import Any

import torch

SLOTS = 4
"""Buffers in the ring: while one piece's copy runs, the next ones are read and checked
(on the H200 a copy took a fraction of a piece's read; the ring's size was not tuned)."""
PIECE_BYTES = 4 << 20
"""Bytes per piece, at most (``piece_bytes_for`` keeps the ring within the pinned half of
``buffer_bytes``): larger than the host's cache-sized pieces, since the copy to the device
reads them from memory anyway, and each piece costs a queued copy and an event. On the
H200, one benchmark run each: a 768 MiB ``verify="inline"`` load took 0.268 s in 256 KiB
pieces, 0.229 s in 4 MiB ones."""


def piece_bytes_for(buffer_bytes: int) -> int:
    """The ring's piece for a load's ``buffer_bytes``: the ring takes the pinned half,
    in :data:`SLOTS` pieces of at most :data:`PIECE_BYTES`, each a power of two (torch's
    pinned allocator rounds up to one, which would otherwise overshoot the half)."""
    share = max(buffer_bytes // 2 // SLOTS, 1)
    return min(PIECE_BYTES, 1 << (share.bit_length() - 1))


class PinnedRing:
    """:data:`SLOTS` pinned buffers of at most ``piece_bytes``, each reused once its last
    copy has run.

    A row larger than a piece (``per_piece`` is then one row) goes through one buffer
    alone, the others freed first, so that pinned memory stays at most
    ``max(SLOTS * piece_bytes, one row)``, as one buffer took before the ring. Buffers
    come from torch's pinned-memory allocator, which keeps freed blocks for the process
    (and rounds sizes up to a power of two: :func:`piece_bytes_for` picks one)."""

    def __init__(self, piece_bytes: int, slots: int = SLOTS) -> None:
        self.piece_bytes = max(piece_bytes, 1)
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[Any] = [None] * slots
        """The event recorded after each slot's last copy, until it has run. A fresh one
        per copy: an event belongs to the device it was first recorded on, and the
        tensors of one load may sit on several GPUs."""
        self._next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next slot and its buffer of ``nbytes``, once no copy reads it any more."""
        if nbytes > self.piece_bytes:  # one row larger than a piece: one buffer alone
            self.drain()
            self._buffers[1:] = [None] * (len(self._buffers) - 1)
            self._next = 0
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        self._wait(slot)
        held = self._buffers[slot]
        if held is None or held.numel() < nbytes:
            self._buffers[slot] = held = None  # free the smaller one first
            held = torch.empty(max(nbytes, 0), dtype=torch.uint8, pin_memory=True, device="cpu")
            self._buffers[slot] = held
        return slot, held[:nbytes]

    def sent(self, slot: int, stream: Any) -> None:
        """A copy out of ``slot``'s buffer was just queued on ``stream``."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        try:
            event.record(stream)
        except BaseException:  # the copy is queued without an event: wait for it here
            stream.synchronize()
            raise
        self._events[slot] = event

    def drain(self) -> None:
        """Return once every copy queued has run."""
        for slot in range(len(self._events)):
            self._wait(slot)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The buffers allocated so far."""
        return [b for b in self._buffers if b is not None]

    def _wait(self, slot: int) -> None:
        event = self._events[slot]
        if event is not None:
            event.synchronize()
            self._events[slot] = None
