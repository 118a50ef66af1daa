"""``save_plan`` and ``transfers``: who writes what, and how bytes cross ranks. Pure: no
process group."""

from __future__ import annotations

import itertools
import math
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsafe.checkpoint.plan.offer import ChunkOffer
from shardsafe.checkpoint.plan.save_plan import (
    FilePlan,
    SavePlan,
    consolidated_file_name,
    plan_save,
    shard_file_name,
)
from shardsafe.checkpoint.plan.transfers import Assemble, LocalBytes, Received, plan_transfers
from shardsafe.errors import CheckpointError

F32 = torch.float32


def offers_of(
    world_size: int,
    replicated: dict[str, tuple[int, ...]],
    sharded: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]] | None = None,
    dtype: torch.dtype = F32,
) -> list[list[ChunkOffer]]:
    """Every rank offers every replicated tensor, plus its own pieces of sharded ones.

    ``sharded[key]`` lists ``(rank, offsets, shape)``; the global shape is inferred.
    """
    offers: list[list[ChunkOffer]] = [[] for _ in range(world_size)]

    def add(
        rank: int,
        key: str,
        gshape: tuple[int, ...],
        off: tuple[int, ...],
        shape: tuple[int, ...],
        rep: bool,
    ) -> None:
        offers[rank].append(
            ChunkOffer(rank, len(offers[rank]), key, dtype, gshape, off, shape, rep)
        )

    for key, shape in replicated.items():
        for r in range(world_size):
            add(r, key, shape, (0,) * len(shape), shape, True)
    for key, pieces in (sharded or {}).items():
        gshape = _global(pieces)
        for rank, off, shape in pieces:
            add(rank, key, gshape, off, shape, False)
    return offers


def _global(pieces: list[tuple[int, tuple[int, ...], tuple[int, ...]]]) -> tuple[int, ...]:
    ndim = len(pieces[0][1])
    return tuple(max(off[d] + shape[d] for _, off, shape in pieces) for d in range(ndim))


def entries_by_key(plan: SavePlan) -> dict[str, list[tuple[FilePlan, object]]]:
    out: dict[str, list[tuple[FilePlan, object]]] = defaultdict(list)
    for f in plan.files:
        for e in f.entries:
            out[e.key].append((f, e))
    return out


def bytes_per_rank(plan: SavePlan) -> Counter[int]:
    load: Counter[int] = Counter()
    for f in plan.files:
        load[f.writer] += sum(e.nbytes for e in f.entries)
    return load


# ------------------------------------------------------------------ sharded layout


def test_sharded_replicated_tensors_are_written_once_and_balanced() -> None:
    sizes = {f"model/layer{i}.weight": (n,) for i, n in enumerate([1000, 10, 300, 300, 250, 7])}
    plan = plan_save(offers_of(2, sizes), "sharded", ["model"])
    assert plan.layout == "sharded" and plan.world_size == 2
    assert [f.name for f in plan.files] == [shard_file_name(0, 2), shard_file_name(1, 2)]
    assert [f.name for f in plan.files] == [
        "shard-00000-of-00002.safetensors",
        "shard-00001-of-00002.safetensors",
    ]
    assert [f.writer for f in plan.files] == [0, 1]
    found = entries_by_key(plan)
    assert sorted(found) == sorted(sizes)
    for key, places in found.items():
        assert len(places) == 1, key
        (f, e) = places[0]
        assert e.name == key and e.shape == sizes[key] and e.offsets == (0,)
        assert [s.rank for s in e.sources] == [f.writer]
    load = bytes_per_rank(plan)
    assert sum(load.values()) == 4 * sum(math.prod(s) for s in sizes.values())
    # 1000 floats alone on one rank, everything else (867) on the other.
    assert sorted(load.values()) == [867 * 4, 1000 * 4]


def test_sharded_state_stays_with_its_owner_and_replicas_fill_the_gap() -> None:
    offers = offers_of(
        2,
        {"model/a": (100,), "model/b": (100,)},
        {"optimizer/x": [(0, (0,), (300,)), (1, (300,), (100,))]},
    )
    plan = plan_save(offers, "sharded", ["model", "optimizer"])
    writers = {e.key: (f.writer, e.name) for f in plan.files for e in f.entries}
    # Rank 0 holds 300 floats of sharded state already, so both replicas go to rank 1.
    assert writers["model/a"] == (1, "model/a") and writers["model/b"] == (1, "model/b")
    xs = [
        (f.writer, e.name, e.offsets, e.shape)
        for f in plan.files
        for e in f.entries
        if e.key == "optimizer/x"
    ]
    assert sorted(xs) == [(0, "optimizer/x", (0,), (300,)), (1, "optimizer/x", (300,), (100,))]
    assert bytes_per_rank(plan) == Counter({0: 1200, 1: 1200})


def test_a_shard_file_holds_its_whole_tensors_first_then_its_pieces_each_by_key() -> None:
    """FSDP2's shape: sharded parameters and moments, replicated step scalars. The scalars
    every rank of a load reads come together after the header, not spread among the
    shards (the load reads a file in the same order: ``loading._in_file_order``)."""
    sharded = {
        f"{value}/{n}.weight{moment}": [(0, (0, 0), (2, 4)), (1, (2, 0), (2, 4))]
        for value in ("model", "optimizer")
        for n in range(3)
        for moment in (["/exp_avg", "/exp_avg_sq"] if value == "optimizer" else [""])
    }
    steps = {f"optimizer/{n}.weight/step": () for n in range(3)}
    plan = plan_save(offers_of(2, steps, sharded), "sharded", ["model", "optimizer"])
    for f in plan.files:
        keys = [e.key for e in f.entries]
        whole = [e.key for e in f.entries if e.key.endswith("/step")]
        assert keys[: len(whole)] == sorted(whole)
        assert keys[len(whole) :] == sorted(k for k in sharded)
    assert sum(len([e for e in f.entries if e.key.endswith("/step")]) for f in plan.files) == 3


def test_several_pieces_of_one_tensor_on_one_rank_get_distinct_names() -> None:
    offers = offers_of(1, {}, {"t": [(0, (0, 0), (2, 3)), (0, (2, 0), (2, 3))]})
    plan = plan_save(offers, "sharded", ["t"])
    assert [e.name for e in plan.files[0].entries] == ["t@0,0", "t@2,0"]


class _CountedOffer(ChunkOffer):
    """A chunk offer that counts every look at its rank."""

    looks = 0

    def __getattribute__(self, name: str) -> Any:
        if name == "rank":
            _CountedOffer.looks += 1
        return super().__getattribute__(name)


def test_naming_the_chunks_of_a_tensor_sharded_over_many_ranks_is_linear() -> None:
    """One FSDP2 tensor over 2048 ranks: naming each rank's chunk looked at every offer of
    the tensor (ranks^2 = 4 million looks per tensor, minutes for a model's tensors at
    that scale). Counted, not timed."""
    ranks = 2048
    offers = [
        [_CountedOffer(r, 0, "w", F32, (ranks, 4), (r, 0), (1, 4), False)] for r in range(ranks)
    ]
    _CountedOffer.looks = 0
    plan = plan_save(offers, "sharded", ["w"])
    assert [e.name for f in plan.files for e in f.entries] == ["w"] * ranks
    assert _CountedOffer.looks <= 16 * ranks, _CountedOffer.looks


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(st.integers(0, 5000), min_size=1, max_size=30),
)
def test_replicas_are_assigned_once_and_balanced_within_one_tensor(
    world_size: int, sizes: list[int]
) -> None:
    shapes = {f"v/t{i:02d}": (n,) for i, n in enumerate(sizes)}
    plan = plan_save(offers_of(world_size, shapes), "sharded", ["v"])
    found = entries_by_key(plan)
    assert sorted(found) == sorted(shapes)
    assert all(len(p) == 1 for p in found.values())
    load = bytes_per_rank(plan)
    per_rank = [load.get(r, 0) for r in range(world_size)]
    assert max(per_rank) - min(per_rank) <= 4 * max(sizes)
    for f in plan.files:
        assert f.name == shard_file_name(f.writer, world_size) and f.entries


def test_a_plan_is_the_same_whatever_order_ranks_list_their_chunks() -> None:
    shapes = {f"m/t{i}": (i * 37 % 11 + 1,) for i in range(12)}
    a = plan_save(offers_of(3, shapes), "sharded", ["m"])
    b_offers = offers_of(3, dict(reversed(list(shapes.items()))))
    b = plan_save(b_offers, "sharded", ["m"])

    def summary(p: SavePlan) -> list[tuple[str, int, list[str]]]:
        return [(f.name, f.writer, [e.key for e in f.entries]) for f in p.files]

    assert summary(a) == summary(b)


def test_ranks_disagreeing_about_a_tensor_is_an_error_naming_it() -> None:
    offers = offers_of(2, {"model/w": (4, 4)})
    bad = offers[1][0]
    offers[1][0] = ChunkOffer(1, 0, bad.key, torch.float16, (4, 4), (0, 0), (4, 4), True)
    with pytest.raises(
        CheckpointError,
        match=r"ranks disagree about tensor 'model/w': rank 0 has float32\[4, 4\], "
        r"rank 1 has float16\[4, 4\]",
    ):
        plan_save(offers, "sharded", ["model"])


def test_shards_that_do_not_cover_a_tensor_are_an_error() -> None:
    offers = offers_of(2, {}, {"opt/x": [(0, (0,), (3,)), (1, (4,), (4,))]})
    with pytest.raises(
        CheckpointError,
        match=r"the shards of 'opt/x' held by ranks \[0, 1\] do not cover its shape \[8\]",
    ):
        plan_save(offers, "sharded", ["opt"])


def test_replicated_on_some_ranks_and_sharded_on_others_is_an_error() -> None:
    offers = offers_of(2, {"w": (4,)})
    offers[1][0] = ChunkOffer(1, 0, "w", F32, (4,), (0,), (4,), False)
    with pytest.raises(
        CheckpointError, match="'w' is replicated on some ranks and sharded on others"
    ):
        plan_save(offers, "sharded", ["w"])


# ------------------------------------------------------------------ consolidated layout


def test_consolidated_files_are_named_after_state_values() -> None:
    offers = offers_of(
        2,
        {"model/fc.weight": (3, 2), "model/fc.bias": (3,), "lr": ()},
        {
            "optimizer/fc.weight/exp_avg": [(1, (1, 0), (2, 2)), (0, (0, 0), (1, 2))],
            "my rng/rank-00001/torch": [(1, (0,), (5,))],
        },
    )
    plan = plan_save(offers, "consolidated", ["model", "optimizer", "my rng", "lr"])
    assert [f.name for f in plan.files] == [
        "lr.safetensors",
        "model.safetensors",
        "optimizer.safetensors",
        "value-002.safetensors",
    ]
    assert all(f.writer == 0 for f in plan.files)
    entries = {f.name: [(e.name, e.key, e.offsets, e.shape) for e in f.entries] for f in plan.files}
    assert entries["model.safetensors"] == [
        ("fc.bias", "model/fc.bias", (0,), (3,)),
        ("fc.weight", "model/fc.weight", (0, 0), (3, 2)),
    ]
    assert entries["lr.safetensors"] == [("lr", "lr", (), ())]
    assert entries["value-002.safetensors"] == [
        ("rank-00001/torch", "my rng/rank-00001/torch", (0,), (5,))
    ]
    (opt,) = plan.files[2].entries
    assert opt.shape == (3, 2) and [(s.rank, s.offsets) for s in opt.sources] == [
        (0, (0, 0)),
        (1, (1, 0)),
    ]
    # Replicated tensors come from the writer itself: nothing to send for them.
    for e in plan.files[1].entries:
        assert [s.rank for s in e.sources] == [0]


def test_consolidated_file_name() -> None:
    assert consolidated_file_name("model", 0) == "model.safetensors"
    assert consolidated_file_name("ema.v2", 3) == "ema.v2.safetensors"
    for odd in ["my model", "../x", "a..b", ".hidden", "x/y", "é", "x" * 102, "ema."]:
        assert consolidated_file_name(odd, 7) == "value-007.safetensors"


def test_a_value_whose_name_ends_in_a_dot_saves_consolidated(tmp_path: Path) -> None:
    """``ema.`` made ``ema..safetensors``, which the save's own check of its manifest
    refused as "malformed": the save of a legitimate state failed."""
    import shardsafe

    state = {"ema.": {"w": torch.arange(4.0)}}
    shardsafe.save(tmp_path / "ck", state, layout="consolidated")
    out = shardsafe.load(tmp_path / "ck", {"ema.": {"w": torch.zeros(4)}})
    assert torch.equal(out["ema."]["w"], torch.arange(4.0))
    assert sorted(os.listdir(tmp_path / "ck")) == ["manifest.json", "value-000.safetensors"]


def test_two_values_never_share_a_consolidated_file() -> None:
    # "a b" needs a numbered name, "value-000" *is* that name: each must get its own file,
    # or both tensors named "w" would land in one file and one would be lost.
    offers = offers_of(1, {"a b/w": (2,), "value-000/w": (2,), "value-000-1/w": (2,)})
    plan = plan_save(offers, "consolidated", ["a b", "value-000", "value-000-1"])
    names = [f.name for f in plan.files]
    assert len(names) == len(set(names)) == 3
    assert all(len(f.entries) == 1 for f in plan.files)


# ------------------------------------------------------------------ transfers


def _stream(
    plan: SavePlan, steps: list[list[object]], messages: list, writer: int = 0
) -> list[list[tuple[int, int, int, int]]]:
    """What the writer emits per file, as merged (rank, chunk index, start, end) ranges."""
    out = []
    for fsteps in steps:
        ranges: list[tuple[int, int, int, int]] = []
        for step in fsteps:
            if isinstance(step, LocalBytes):
                parts = [(writer, step.part.index, step.part.start, step.part.end)]
            elif isinstance(step, Received):
                m = messages[step.message]
                parts = [(m.src, p.index, p.start, p.end) for p in m.parts]
            else:
                assert isinstance(step, Assemble)
                parts = [(s.rank, s.index, 0, s.nbytes) for s, _ in step.pieces if s.nbytes]
            for p in parts:
                if ranges and ranges[-1][:2] == p[:2] and ranges[-1][3] == p[2]:
                    ranges[-1] = (*ranges[-1][:3], p[3])
                else:
                    ranges.append(p)
        out.append(ranges)
    return out


def _expected_stream(plan: SavePlan) -> list[list[tuple[int, int, int, int]]]:
    return [
        [(s.rank, s.index, 0, s.nbytes) for e in f.entries for s in e.sources if s.nbytes]
        for f in plan.files
    ]


def _check_transfers(plan: SavePlan, limit: int) -> None:
    steps, messages = plan_transfers(plan.files, limit)
    # Bounded messages, never from the writer, never empty.
    for m in messages:
        assert 0 < m.nbytes <= limit
        assert m.src != 0
    # Every byte of every non-writer chunk travels exactly once.
    covered: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for m in messages:
        for p in m.parts:
            covered[(m.src, p.index)].append((p.start, p.end))
    needed = {
        (s.rank, s.index): s.nbytes
        for f in plan.files
        for e in f.entries
        for s in e.sources
        if s.rank != 0 and s.nbytes
    }
    assert set(covered) == set(needed)
    for where, spans in covered.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == needed[where]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), spans
    # The writer consumes messages in the order they are listed (each sender sends its
    # own in that order), so the point-to-point exchange cannot deadlock.
    used = []
    for fsteps in steps:
        for step in fsteps:
            if isinstance(step, Received):
                used.append(step.message)
            elif isinstance(step, Assemble):
                for _, ids in step.pieces:
                    used.extend(ids)
    assert used == list(range(len(messages)))
    # And the bytes arrive in file order: the stream is exactly the entries' bytes.
    assert _stream(plan, steps, messages) == _expected_stream(plan)


def test_transfers_of_a_dim0_split_tensor_are_bounded_and_complete() -> None:
    offers = offers_of(
        3,
        {"model/w": (64,)},
        {"opt/m": [(0, (0, 0), (10, 8)), (1, (10, 0), (25, 8)), (2, (35, 0), (5, 8))]},
    )
    plan = plan_save(offers, "consolidated", ["model", "opt"])
    _, messages = plan_transfers(plan.files, 100)
    assert [m.nbytes for m in messages] == [100] * 8 + [100, 60]
    _check_transfers(plan, 100)


def test_small_chunks_from_one_rank_share_a_message() -> None:
    offers = offers_of(2, {}, {f"opt/s{i}": [(1, (0,), (3,))] for i in range(5)})
    plan = plan_save(offers, "consolidated", ["opt"])
    steps, messages = plan_transfers(plan.files, 1000)
    assert len(messages) == 1 and messages[0].nbytes == 5 * 12
    assert [type(s) for s in steps[0]] == [Received]
    _check_transfers(plan, 1000)


def test_a_tensor_split_on_dim1_is_assembled() -> None:
    offers = offers_of(2, {}, {"tp/w": [(0, (0, 0), (4, 3)), (1, (0, 3), (4, 5))]})
    plan = plan_save(offers, "consolidated", ["tp"])
    steps, messages = plan_transfers(plan.files, 16)
    (step,) = steps[0]
    assert isinstance(step, Assemble) and step.entry.shape == (4, 8)
    assert [(src.rank, ids) for src, ids in step.pieces] == [(0, ()), (1, (0, 1, 2, 3, 4))]
    assert [m.nbytes for m in messages] == [16, 16, 16, 16, 16]
    _check_transfers(plan, 16)


@st.composite
def consolidated_plans(draw: st.DrawFn) -> SavePlan:
    world_size = draw(st.integers(2, 4))
    replicated = {f"m/r{i}": (draw(st.integers(0, 40)),) for i in range(draw(st.integers(0, 3)))}
    sharded = {}
    for i in range(draw(st.integers(1, 5))):
        rows = draw(st.lists(st.integers(0, 30), min_size=1, max_size=world_size))
        cols = draw(st.integers(1, 4))
        ranks = draw(st.permutations(range(world_size)))
        pieces, start = [], 0
        for rank, n in zip(ranks, rows):
            pieces.append((rank, (start, 0), (n, cols)))
            start += n
        if draw(st.booleans()) and start > 0 and cols > 1:  # split on dim 1 instead
            pieces = [(ranks[0], (0, 0), (start, 1)), (ranks[-1], (0, 1), (start, cols - 1))]
        sharded[f"o{i % 2}/s{i}"] = pieces
    offers = offers_of(world_size, replicated, sharded)
    return plan_save(offers, "consolidated", ["m", "o0", "o1"])


@settings(max_examples=200, deadline=None)
@given(consolidated_plans(), st.integers(1, 300))
def test_transfers_are_bounded_cover_every_byte_once_and_arrive_in_order(
    plan: SavePlan, limit: int
) -> None:
    _check_transfers(plan, limit)
