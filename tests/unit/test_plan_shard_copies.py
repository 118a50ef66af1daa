"""Ranks that hold copies of one shard (a DTensor on one of several sibling submeshes:
under TP x FSDP2, a parameter tensor parallelism leaves whole is sharded over each ``dp``
submesh, so every ``tp`` rank holds the shard of its ``dp`` coordinate) store it once.
Pure: no process group."""

from __future__ import annotations

import pytest
import torch

from shardsafe.checkpoint.plan.offer import ChunkOffer
from shardsafe.checkpoint.plan.save_plan import plan_save
from shardsafe.errors import CheckpointError

F32 = torch.float32


def _tp_dp_offers(crc: list[int | None] | None = None) -> list[list[ChunkOffer]]:
    """Mesh (dp=2, tp=2), rank = 2 * dp + tp: ``w`` [8, 4] sharded in rows over dp only
    (ranks 0, 1 hold rows 0-3; ranks 2, 3 rows 4-7); ``v`` [8] sharded over all four."""
    crc = crc or [None] * 4
    offers = []
    for rank in range(4):
        dp = rank // 2
        w = ChunkOffer(
            rank, 0, "m/w", F32, (8, 4), (4 * dp, 0), (4, 4), False, False, crc[rank], True
        )
        v = ChunkOffer(rank, 1, "m/v", F32, (8,), (2 * rank,), (2,), False, copies_allowed=True)
        offers.append([w, v])
    return offers


def _written(plan: object) -> dict[str, list[tuple[int, tuple[int, ...]]]]:
    out: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
    for f in plan.files:  # type: ignore[attr-defined]
        for e in f.entries:
            out.setdefault(e.key, []).append((f.writer, e.offsets))
    return {k: sorted(v, key=lambda w: w[1]) for k, v in out.items()}


def test_copies_of_a_shard_are_written_once_by_one_of_their_holders() -> None:
    written = _written(plan_save(_tp_dp_offers(), "sharded", ["m"]))
    assert [o for _, o in written["m/v"]] == [(0,), (2,), (4,), (6,)]
    (w0, o0), (w1, o1) = written["m/w"]
    assert (o0, o1) == ((0, 0), (4, 0))
    assert w0 in (0, 1) and w1 in (2, 3)


def test_copies_of_a_shard_are_spread_over_their_holders() -> None:
    """Many copied shards: each holder of a dp coordinate writes about half of them."""
    offers: list[list[ChunkOffer]] = [[] for _ in range(4)]
    for i in range(8):
        for rank in range(4):
            dp = rank // 2
            offers[rank].append(
                ChunkOffer(
                    rank,
                    i,
                    f"m/w{i}",
                    F32,
                    (8, 4),
                    (4 * dp, 0),
                    (4, 4),
                    False,
                    copies_allowed=True,
                )
            )
    plan = plan_save(offers, "sharded", ["m"])
    assert sorted(len(f.entries) for f in plan.files) == [4, 4, 4, 4]


def test_consolidated_takes_one_copy_of_each_shard() -> None:
    plan = plan_save(_tp_dp_offers(), "consolidated", ["m"])
    (f,) = plan.files
    (w,) = [e for e in f.entries if e.key == "m/w"]
    assert [(s.rank, s.offsets) for s in w.sources] == [(0, (0, 0)), (2, (4, 0))]


def test_verify_replicas_names_the_shard_whose_copies_differ() -> None:
    with pytest.raises(CheckpointError) as info:
        plan_save(_tp_dp_offers([7, 7, 8, 9]), "sharded", ["m"])
    message = str(info.value)
    assert "the copies of 'm/w' differ between ranks" in message
    assert "rank 2" in message and "rank 3" in message and "rank 0" not in message
    assert "one shard (offsets [4, 0], shape [4, 4])" in message
    plan_save(_tp_dp_offers([7, 7, 8, 8]), "sharded", ["m"])  # equal copies: fine


def test_shards_that_overlap_without_being_equal_are_still_refused() -> None:
    offers = _tp_dp_offers()
    offers[1][0] = ChunkOffer(1, 0, "m/w", F32, (8, 4), (2, 0), (4, 4), False, copies_allowed=True)
    with pytest.raises(CheckpointError, match="do not cover its shape"):
        plan_save(offers, "sharded", ["m"])


def test_equal_boxes_that_are_not_dtensor_shards_are_refused() -> None:
    """Two ranks offering their own (non-DTensor) state under one key and box: only one
    could be stored, so the save is refused instead of keeping rank 0's silently."""
    offers = [[ChunkOffer(r, 0, "opt/w/exp_avg", F32, (4,), (0,), (4,), False)] for r in range(2)]
    with pytest.raises(CheckpointError, match=r"do not cover its shape .* exactly once"):
        plan_save(offers, "sharded", ["opt"])
