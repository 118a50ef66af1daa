"""Small tensors of stateful objects whose copies differ between ranks: each rank's own.

A stateful object's tensors are normally the same on every rank and stored once (a
scheduler's, a model wrapper's). But a sampler that draws each rank's shard keeps a
generator of its own on each rank, with the same structure and other bytes: one stored
copy would hand every rank the same generator back, silently. So the small tensors of
stateful objects (``Chunk.per_rank_if_different``) are checksummed on every save, and
where the ranks' copies differ, :func:`split_differing` gives each rank's copy a key of
its own (``_names.own_copy_key``) and points that rank's metadata at it. The entry's
metadata then differs between ranks only in those keys, and is recorded once with the
list of keys each rank has its own copy of (``adapters.values.own_copies``): at the same
world size each rank restores its own; at another, every rank restores saving rank 0's,
with a warning (``adapters.values.own_record``).

Pure: no process group, no I/O; rank 0 runs it on every rank's offer before planning.
"""

from __future__ import annotations

from dataclasses import replace

from ... import _names
from ...adapters.values import with_own_copies
from .offer import ChunkOffer, Offer, OfferedEntry
from .save_plan import entry_of


def split_differing(offers: list[Offer]) -> list[str]:
    """Give each rank's copy of every flagged key whose copies differ a key of its own, in
    the offers' chunks and metadata (in place); return those keys, sorted."""
    flagged = {c.key for offer in offers for c in offer.chunks if c.per_rank_if_different}
    by_key: dict[str, list[ChunkOffer]] = {}
    for offer in offers:
        for chunk in offer.chunks:
            if chunk.key in flagged:
                by_key.setdefault(chunk.key, []).append(chunk)
    differing = sorted(key for key, chunks in by_key.items() if _own_copies(chunks))
    if not differing:
        return []
    split = set(differing)
    for offer in offers:
        held = {c.key for c in offer.chunks if c.per_rank_if_different} & split
        own = {key: _names.own_copy_key(key, offer.rank) for key in held}
        offer.chunks = [
            replace(c, key=own[c.key], replicated=False, checksum=None, per_rank_if_different=False)
            if c.key in own and c.per_rank_if_different
            else c
            for c in offer.chunks
        ]
        for name in {entry_of(key) for key in held} & offer.entries.keys():
            entry = offer.entries[name]
            offer.entries[name] = OfferedEntry(entry.kind, with_own_copies(entry.meta, own))
    return differing


def _own_copies(chunks: list[ChunkOffer]) -> bool:
    """Whether the copies of one key are each rank's own: every holder flagged it, and
    they agree on what it is (a key whose dtype or shape differs between ranks is left
    to the planner, which refuses it, whatever its bytes), but not on its bytes."""
    first = chunks[0]
    return (
        all(c.per_rank_if_different for c in chunks)
        and all(
            (c.dtype, c.global_shape, c.offsets, c.shape)
            == (first.dtype, first.global_shape, first.offsets, first.shape)
            for c in chunks
        )
        and len({c.checksum for c in chunks}) > 1
    )
