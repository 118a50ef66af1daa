"""What a rank offers to save: each state entry's kind and metadata, and the shapes of
the chunks it holds (not their bytes). Every rank posts its offer in the collect phase;
the save plan is made from all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ... import dtypes
from ...errors import CheckpointError
from ...protocol import JSON, Chunk, SaveItem
from ..format.crc import crc32
from ..format.tensor_bytes import memory


@dataclass(frozen=True)
class ChunkOffer:
    """The shape of a chunk one rank offers; ``index`` is its place in that rank's list."""

    rank: int
    index: int
    key: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    replicated: bool
    lowest_rank_wins: bool = False
    checksum: int | None = None
    """CRC32 of this rank's copy of the chunk, with ``verify_replicas`` (or
    ``Chunk.always_verify``, or ``Chunk.per_rank_if_different``)."""
    copies_allowed: bool = False
    per_rank_if_different: bool = False
    sample: int | None = None
    """CRC32 of a few of this rank's elements (``sample_checksums``): a module's or an
    optimizer's replicated copy, compared across its holders on every save."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)

    def to_json(self) -> dict[str, Any]:
        raw = {
            "key": self.key,
            "dtype": dtypes.dtype_name(self.dtype),
            "global_shape": list(self.global_shape),
            "offsets": list(self.offsets),
            "shape": list(self.shape),
            "replicated": self.replicated,
        }
        if self.lowest_rank_wins:
            raw["lowest"] = True
        if self.checksum is not None:
            raw["crc"] = self.checksum
        if self.copies_allowed:
            raw["copies"] = True
        if self.per_rank_if_different:
            raw["own"] = True
        if self.sample is not None:
            raw["sample"] = self.sample
        return raw

    @staticmethod
    def from_json(rank: int, index: int, raw: dict[str, Any]) -> ChunkOffer:
        dtype = dtypes.from_name(raw["dtype"])
        assert dtype is not None
        return ChunkOffer(
            rank,
            index,
            raw["key"],
            dtype,
            tuple(raw["global_shape"]),
            tuple(raw["offsets"]),
            tuple(raw["shape"]),
            bool(raw["replicated"]),
            bool(raw.get("lowest", False)),
            raw.get("crc"),
            bool(raw.get("copies", False)),
            bool(raw.get("own", False)),
            raw.get("sample"),
        )


@dataclass(frozen=True)
class OfferedEntry:
    """One state entry as one rank saw it."""

    kind: str
    meta: JSON


@dataclass
class Offer:
    """Everything one rank offers, in the form that travels between ranks (JSON)."""

    rank: int
    entries: dict[str, OfferedEntry]
    chunks: list[ChunkOffer]

    @staticmethod
    def of(rank: int, items: dict[str, SaveItem], *, checksums: bool = False) -> Offer:
        """This rank's offer; with ``checksums``, the CRC32 of each chunk's bytes but
        buffers' (``verify_replicas``), which costs one read of those bytes."""
        entries = {name: OfferedEntry(item.kind, item.meta) for name, item in items.items()}
        ours = chunks_of(items)
        full = [
            (checksums and _compared(c)) or c.always_verify or c.per_rank_if_different for c in ours
        ]
        sampled = sample_checksums(
            [
                c.tensor if wanted and not whole else None
                for c, whole, wanted in zip(ours, full, _sampled(items), strict=True)
            ]
        )
        chunks = [
            ChunkOffer(
                rank, i, c.key, c.tensor.dtype, c.global_shape, c.offsets, tuple(c.tensor.shape),
                c.replicated, c.lowest_rank_wins,
                replica_checksum(c.tensor) if whole else None,
                c.copies_allowed,
                c.per_rank_if_different,
                sample,
            )
            for i, (c, whole, sample) in enumerate(zip(ours, full, sampled, strict=True))
        ]  # fmt: skip
        return Offer(rank, entries, chunks)

    def to_json(self) -> dict[str, Any]:
        return {
            "entries": {n: {"kind": e.kind, "meta": e.meta} for n, e in self.entries.items()},
            "chunks": [c.to_json() for c in self.chunks],
        }

    @staticmethod
    def from_json(rank: int, raw: dict[str, Any]) -> Offer:
        entries = {n: OfferedEntry(e["kind"], e["meta"]) for n, e in raw["entries"].items()}
        chunks = [ChunkOffer.from_json(rank, i, c) for i, c in enumerate(raw["chunks"])]
        return Offer(rank, entries, chunks)


def _compared(chunk: Chunk) -> bool:
    """Whether ``verify_replicas`` compares this chunk's copies across ranks: every chunk
    but a buffer's, since other ranks may hold copies of a shard too (``copies_of``)."""
    return not chunk.lowest_rank_wins


SAMPLED_KINDS = frozenset({"module", "optimizer"})
"""Entries whose replicated copies are sampled on every save: a module's parameters and
an optimizer's state are equal on every holder in any data-parallel training, so a
difference is a different tensor under one name (a pipeline stage numbering its layers
from 0), which saving once lost without a word. Buffers (``lowest_rank_wins``) and
other values may differ by design and are not sampled."""

SAMPLES = 16
"""Elements read per sampled tensor: different layers differ in nearly every element."""


def _sampled(items: dict[str, SaveItem]) -> list[bool]:
    """Whether ``Offer.of`` samples each chunk of ``items`` (in :func:`chunks_of` order)."""
    return [
        item.kind in SAMPLED_KINDS and (c.replicated or c.copies_allowed) and not c.lowest_rank_wins
        for item in items.values()
        for c in item.chunks
    ]


def sample_checksums(tensors: list[torch.Tensor | None]) -> list[int | None]:
    """CRC32 of :data:`SAMPLES` evenly spaced elements of each tensor, in row-major order
    whatever its layout (a ``channels_last`` copy samples as a contiguous one), or of all
    of them for a tensor that small; ``None`` where none is given, or where the tensor
    cannot be sampled (a wrapper subclass).

    A contiguous CPU tensor is read through its memory, with no tensor operation: a save
    of tens of thousands of small tensors paid several per tensor. Others gather the
    elements on their device, brought to the host in one copy per device, so a GPU model
    pays one synchronisation per save, not one per tensor."""
    found: list[int | None] = [None] * len(tensors)
    gathered: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, tensor in enumerate(tensors):
        if tensor is None:
            continue
        direct = _sampled_memory(tensor)
        if direct is not None:
            found[i] = crc32(memoryview(direct), 0)
            continue
        picked = _gathered(tensor)
        if picked is not None:
            gathered.setdefault(picked.device, []).append((i, picked))
    for pieces in gathered.values():
        host = torch.cat([p for _, p in pieces]).cpu()
        start = 0
        for i, p in pieces:
            found[i] = crc32(memory(host[start : start + p.numel()]), 0)
            start += p.numel()
    return found


def _indices(count: int) -> list[int]:
    """The row-major positions sampled of a tensor of ``count`` elements."""
    if count <= SAMPLES:
        return list(range(count))
    return [k * count // SAMPLES for k in range(SAMPLES)]


def _sampled_memory(tensor: torch.Tensor) -> bytes | None:
    """The sampled elements' bytes of a contiguous CPU tensor, read from its memory; else
    ``None`` (sampled by :func:`_gathered`)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    try:
        whole = memory(tensor.detach())
    except (ValueError, RuntimeError, TypeError):
        return None
    size = tensor.element_size()
    return b"".join(whole[k * size : (k + 1) * size] for k in _indices(tensor.numel()))


def _gathered(tensor: torch.Tensor) -> torch.Tensor | None:
    """The sampled elements of ``tensor`` as a 1-D uint8 tensor on its device (the same
    row-major positions as :func:`_sampled_memory`), or ``None`` if it cannot be read."""
    try:
        t = tensor.detach()
        if t.numel() == 0:
            return torch.empty(0, dtype=torch.uint8, device=t.device)
        where = torch.tensor(_indices(t.numel()), device=t.device)
        picked = t[torch.unravel_index(where, t.shape)] if t.dim() else t.reshape(1)
        return picked.contiguous().view(torch.uint8).reshape(-1)
    except (RuntimeError, TypeError, NotImplementedError, ValueError):
        return None


def replica_checksum(tensor: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes in row-major order, wherever it lives."""
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return crc32(memory(flat.contiguous()), 0)


def chunks_of(items: dict[str, SaveItem]) -> list[Chunk]:
    """This rank's chunks in offer order (a chunk offer's ``index`` is its place here)."""
    return [c for item in items.values() for c in item.chunks]


def check_same_entries(offers: list[Offer], names: list[str], rank: int) -> None:
    """Every rank must save the same state keys, each of the same kind; say which differ."""
    for offer in offers:
        if sorted(offer.entries) != sorted(names):
            raise CheckpointError(
                f"rank {offer.rank} saved state keys {sorted(offer.entries)}, rank "
                f"{rank} {sorted(names)}; every rank must pass the same keys"
            )
    for name in names:
        kinds = {offer.entries[name].kind for offer in offers}
        if len(kinds) > 1:
            raise CheckpointError(
                f"state[{name!r}] is saved as different kinds of value on different ranks "
                f"({', '.join(sorted(kinds))}); every rank must pass the same kind of object"
            )
