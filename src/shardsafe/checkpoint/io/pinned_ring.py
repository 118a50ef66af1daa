"""Page-locked host buffers for reading into CUDA tensors, the copies to the device
overlapping the reads.

A CUDA destination is filled through pinned host memory: a piece of the file is read
into it, its CRC32 checked, and it is copied to the device. With one buffer, each copy
must have run before the next piece can be read into the buffer: one synchronous copy
per 256 KiB piece (``reader.CACHE_PIECE_BYTES``), on an H200 about a third of the time
of a 768 MiB load. With a few buffers taken in turn, each copy is issued asynchronously
on the destination's current stream (so it runs after whatever the caller queued there
before, a ``zero_()`` of the tensor say), and the next pieces are read and checked while
it runs. A buffer is refilled only once the copy that read it has run (its event), and
the reader waits for every copy before a tensor's read returns, so the caller sees a
filled tensor, as with synchronous copies. Memory: :data:`SLOTS` pieces of at most
:data:`PIECE_BYTES`.
"""

from __future__ import annotations

from typing import Any

import torch

SLOTS = 4
"""Buffers in the ring: enough that reading and checking (on the host) never waits for a
copy in flight, which on PCIe or NVLink-C2C takes a fraction of the read's time."""
PIECE_BYTES = 4 << 20
"""Bytes per piece (at most; ``loading.py`` keeps the ring within half ``buffer_bytes``):
larger than the host's cache-sized pieces, since the copy to the device reads them from
memory anyway, and each piece costs a queued copy and an event (on an H200, 256 KiB
pieces left a 768 MiB load spending a fifth of its time queueing them)."""


class PinnedRing:
    """:data:`SLOTS` pinned buffers, each reused once its last copy has run."""

    def __init__(self, slots: int = SLOTS) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[Any] = [None] * slots
        """One CUDA event per slot, made once and recorded again after each copy."""
        self._pending = [False] * slots
        self._next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next slot and its buffer of ``nbytes``, once no copy reads it any more
        (grown only for a row larger than a piece)."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        self._wait(slot)
        held = self._buffers[slot]
        if held is None or held.numel() < nbytes:
            self._buffers[slot] = held = None  # free the smaller one first
            held = torch.empty(max(nbytes, 0), dtype=torch.uint8, pin_memory=True)
            self._buffers[slot] = held
        return slot, held[:nbytes]

    def sent(self, slot: int, stream: Any) -> None:
        """A copy out of ``slot``'s buffer was just queued on ``stream``."""
        if self._events[slot] is None:
            self._events[slot] = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._events[slot].record(stream)
        self._pending[slot] = True

    def drain(self) -> None:
        """Return once every copy queued has run."""
        for slot in range(len(self._events)):
            self._wait(slot)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The buffers allocated so far."""
        return [b for b in self._buffers if b is not None]

    def _wait(self, slot: int) -> None:
        if self._pending[slot]:
            self._events[slot].synchronize()
            self._pending[slot] = False
