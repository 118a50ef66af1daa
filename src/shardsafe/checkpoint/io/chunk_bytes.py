"""The bytes of this rank's chunks, as the writers and senders of a save need them."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ...protocol import Chunk
from ..format.tensor_bytes import byte_view, memory


class ChunkBytes:
    """Flat byte views of this rank's chunks, made contiguous on first use.

    One chunk is kept contiguous at a time, so the extra memory of a non-contiguous
    tensor is that one tensor. Device tensors are copied to host in pieces of half the
    buffer, never whole.
    """

    def __init__(self, chunks: list[Chunk], piece_bytes: int) -> None:
        self.chunks = chunks
        self.piece_bytes = max(piece_bytes // 2, 1 << 20)
        self._cache: dict[int, torch.Tensor] = {}

    def view(self, index: int) -> torch.Tensor:
        if index not in self._cache:
            self._cache.clear()  # one tensor at a time: bounded extra memory
            self._cache[index] = byte_view(self.chunks[index].tensor.detach().contiguous())
        return self._cache[index]

    def pieces(self, index: int, start: int, end: int) -> Iterator[memoryview]:
        """Host memory for bytes ``[start, end)`` of a chunk, device tensors copied piecewise."""
        flat = self.view(index)
        if flat.device.type == "cpu":
            yield memory(flat)[start:end]
            return
        for s in range(start, end, self.piece_bytes):
            yield memory(flat[s : min(s + self.piece_bytes, end)].cpu())
