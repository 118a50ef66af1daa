"""Staging: a snapshot of this rank's chunks, so an asynchronous save can write it later.

After ``async_save`` returns, the caller steps the optimizer and changes parameters in
place; the background write must see the state as it was at the call. Adapters hand out
live tensors (ZeRO's local optimizer state, module parameters, DTensor local shards), so
the bytes of every chunk the save will write are copied into a staging buffer before
the call returns.

Buffers are allocated once and reused by every later save of the same tensors (same key,
shape, dtype): the extra host memory is at most one copy of the rank's own state,
allocated at the first save; a save that stages only part of it (``keep``: what the rank
will write) frees the buffers it no longer uses. CUDA tensors are copied into pinned host
memory on a side stream, non-blocking; the copy is finished (``Staged.ready``) before the
call returns unless the caller asks to overlap it (the Trainer, with the next forward and
backward, which do not touch parameters).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from ...protocol import Chunk, SaveItem
from ..plan.collecting import Collected


@dataclass
class Staged:
    """The staged copy of one save's chunks, and how to know it is complete."""

    items: Collected
    events: list[Any]
    """CUDA events recorded after each device's copies (empty on CPU)."""

    def ready(self) -> None:
        """Block until every copy has landed in host memory."""
        for event in self.events:
            event.synchronize()
        self.events.clear()


class Stager:
    """Reusable staging buffers for the chunks of a series of saves (one in flight)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, items: Collected, keep: set[int] | None = None) -> Staged:
        """Copy each chunk into its buffer; return the items with the copies in place.

        ``keep``: stage only the chunks at these places in offer order (those this rank's
        part of the plan writes); the others become data-less ``meta`` tensors, so that
        reading one by mistake fails instead of reading the live state."""
        with self._lock, torch.no_grad():  # no_grad: copies without detaching each tensor
            devices: set[int] = set()
            staged: Collected = {}
            host: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
            index = 0
            used: set[tuple[Any, ...]] = set()
            for name, (adapter, item) in items.items():
                chunks = []
                for chunk in item.chunks:
                    if keep is None or index in keep:
                        chunks.append(self._stage(chunk, devices, host, used))
                    else:
                        chunks.append(_placeholder(chunk))
                    index += 1
                staged[name] = (adapter, SaveItem(item.kind, item.meta, chunks))
            for unused in self._buffers.keys() - used:  # what this save does not stage
                del self._buffers[unused]
            _copy_all(*host)
            events = []
            for device in sorted(devices):
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._streams[device])
                events.append(event)
            return Staged(staged, events)

    def _stage(
        self,
        chunk: Chunk,
        devices: set[int],
        host: tuple[list[torch.Tensor], list[torch.Tensor]],
        used: set[tuple[Any, ...]],
    ) -> Chunk:
        tensor = chunk.tensor
        cuda = tensor.is_cuda
        key = (chunk.key, chunk.offsets, tensor.shape, tensor.dtype, cuda)
        used.add(key)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda, device="cpu")
            self._buffers[key] = buffer
        if cuda:
            stream = self._stream(tensor.device.index or 0)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                buffer.copy_(tensor, non_blocking=True)
                tensor.record_stream(stream)  # kept alive until the copy has run
            devices.add(tensor.device.index or 0)
        elif tensor.device.type == "cpu":
            host[0].append(buffer)
            host[1].append(tensor)
        else:  # another accelerator: its own copy to host
            buffer.copy_(tensor)
        # Built directly: dataclasses.replace costs ~14 us, and a save stages every chunk.
        return Chunk(
            chunk.key, buffer, chunk.global_shape, chunk.offsets, chunk.replicated,
            chunk.lowest_rank_wins, chunk.copies_allowed, chunk.always_verify,
            chunk.per_rank_if_different,
        )  # fmt: skip

    def _stream(self, device: int) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return self._streams[device]

    def release(self) -> None:
        """Free the buffers (the next save allocates them again)."""
        with self._lock:
            self._buffers.clear()


def _placeholder(chunk: Chunk) -> Chunk:
    """``chunk`` with a tensor of its shape and dtype that holds no data (``meta``)."""
    tensor = torch.empty(chunk.tensor.shape, dtype=chunk.tensor.dtype, device="meta")
    return Chunk(
        chunk.key, tensor, chunk.global_shape, chunk.offsets, chunk.replicated,
        chunk.lowest_rank_wins, chunk.copies_allowed, chunk.always_verify,
        chunk.per_rank_if_different,
    )  # fmt: skip


def _copy_all(buffers: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """Copy host tensors into their buffers in one call where torch has one
    (``_foreach_copy_``: the training loop waits for this, and one Python call per tensor
    costs a few microseconds each, hundreds of tensors a save)."""
    if not buffers:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(buffers, tensors)
        return
    for buffer, tensor in zip(buffers, tensors):  # pragma: no cover - torch < 2.2
        buffer.copy_(tensor)
