"""A tiered manager's rank copy (``tiers/rank_checkpoint.py``) read by path, as the
one-rank checkpoint it holds.

The tiered manager restores its own copies through a view of its own. Anyone else who
opens one (``shardsafe.load`` of ``<local>/step-N/rank-R``, ``verify``, ``convert``)
reads it here: its record is checked the same way by all three, its RNG entry is its
rank's one record (a checkpoint records one per rank), and a shape refused names what
the copy holds.
"""

from __future__ import annotations

import dataclasses

from ...adapters.rng import RNGAdapter
from ...errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, with_message
from ...protocol import SavedValue
from ..format.manifest import Manifest


def rank_copy_saver(manifest: Manifest) -> int | None:
    """The rank whose rank checkpoint (a tiered manager's local copy,
    ``tiers/rank_checkpoint.py``) ``manifest`` is, or ``None`` for any other checkpoint.
    One whose record does not hold a valid rank and world size is refused, by ``load``
    and ``verify`` alike (a forged one loaded, where verify refused it)."""
    info = manifest.info.get("rank_checkpoint")
    if info is None:
        return None
    found = [info.get(k) for k in ("rank", "world_size")] if isinstance(info, dict) else []
    fields = [v for v in found if type(v) is int and v >= 0]
    if len(fields) != 2:
        raise CheckpointCorruptError(
            "the manifest's 'rank_checkpoint' does not hold a rank and a world size"
        )
    rank, world_size = fields
    if rank >= world_size:
        raise CheckpointCorruptError(
            f"the manifest's 'rank_checkpoint' names rank {rank}, outside its world size "
            f"{world_size}"
        )
    return int(rank)


def rank_copy_as_one_rank(manifest: Manifest) -> Manifest:
    """``manifest``; a tiered manager's rank checkpoint (:func:`rank_copy_saver`) as the
    one-rank checkpoint ``shardsafe convert`` makes of it.

    Its entries hold its rank's metadata as saved, which the manager's load merges first:
    an RNG entry is that rank's one record, where a checkpoint records one per rank.
    Loaded by path (``shardsafe.load`` of ``<local>/step-N/rank-R``, or ``convert``), the
    record is the one of rank 0, as a one-rank checkpoint holds it: the copy's tensors
    are its rank's pieces, whole, as a one-rank save holds them too. Without this the
    load refused a ``Trainer``'s local copy as "not RNG state"; ``verify`` checks the
    entries as this gives them."""
    if rank_copy_saver(manifest) is None:
        return manifest
    values = dict(manifest.values)
    for name, value in values.items():
        if value.kind == RNGAdapter.kind:
            values[name] = SavedValue(name, value.kind, RNGAdapter().merge([value.meta]))
    return dataclasses.replace(manifest, values=values)


def on_a_rank_copy(error: CheckpointMismatchError, loaded: Manifest | None) -> CheckpointError:
    """``error``, saying what a rank copy loaded by path (``loaded``; ``None`` for a
    tiered manager's own load) holds: a sharded run's copy holds its rank's shards at
    their own shapes, which no model of the whole shape takes."""
    saver = rank_copy_saver(loaded) if loaded is not None else None
    if saver is None:
        return error
    return with_message(
        error,
        f"{error}. This is rank {saver}'s local copy of a TieredCheckpointManager: it holds "
        "what that rank held (a sharded model's pieces at their own shapes), loaded by path "
        "as a one-rank checkpoint; restore a sharded run from its local tier with "
        "TieredCheckpointManager(...).load_latest(state) on every rank",
    )
