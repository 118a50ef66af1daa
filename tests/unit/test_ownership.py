"""The ownership model, pure: who writes a tensor that a subset of ranks holds, and how
every rank's metadata becomes one manifest entry (or a refusal). No process group; the
same paths run for real in ``tests/distributed/test_pipeline_parallel.py``."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
import torch

from shardsafe._names import own_copy_key, shared_key
from shardsafe.adapters.module import ModuleAdapter
from shardsafe.adapters.optimizer import match_groups
from shardsafe.adapters.optimizer_merge import merge_optimizer_metas
from shardsafe.adapters.values import (
    PER_RANK,
    StatefulAdapter,
    merge_per_rank,
    own_record,
    representative,
)
from shardsafe.checkpoint.plan.offer import ChunkOffer, Offer, OfferedEntry, replica_checksum
from shardsafe.checkpoint.plan.per_rank import split_differing
from shardsafe.checkpoint.plan.save_plan import plan_save
from shardsafe.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from shardsafe.protocol import LoadContext, SavedValue

F32 = torch.float32


def chunk(rank: int, index: int, key: str, n: int, **kw: Any) -> ChunkOffer:
    return ChunkOffer(rank, index, key, F32, (n,), (0,), (n,), True, **kw)


def writers(plan: Any) -> dict[str, int]:
    return {e.key: f.writer for f in plan.files for e in f.entries}


def test_a_stage_replicated_on_its_data_parallel_group_is_written_once_by_a_member() -> None:
    """PP x DP 2 x 2: stage 0 on ranks 0 and 2, stage 1 on ranks 1 and 3. Every tensor is
    written once, by one of its holders, and the two holders of a stage share the bytes."""
    offers: list[list[ChunkOffer]] = [[] for _ in range(4)]
    for rank in range(4):
        stage = rank % 2
        for i in range(8):
            offers[rank].append(chunk(rank, i, f"model/s{stage}.w{i}", 1000 + i))
    plan = plan_save(offers, "sharded", ["model"])
    who = writers(plan)
    assert len(who) == 16
    for key, writer in who.items():
        assert writer % 2 == int(key[7])  # a member of the stage's group
    load: Counter[int] = Counter()
    for f in plan.files:
        load[f.writer] += sum(e.nbytes for e in f.entries)
    assert len(load) == 4 and max(load.values()) <= 1.25 * sum(load.values()) / 4


def test_a_buffer_is_written_by_the_lowest_rank_holding_it() -> None:
    offers = [
        [chunk(0, 0, "model/a.seen", 1, lowest_rank_wins=True)],
        [chunk(1, 0, "model/a.seen", 1, lowest_rank_wins=True),
         chunk(1, 1, "model/b.seen", 1, lowest_rank_wins=True)],
        [chunk(2, 0, "model/b.seen", 1, lowest_rank_wins=True)],
    ]  # fmt: skip
    plan = plan_save(offers, "sharded", ["model"])
    assert writers(plan) == {"model/a.seen": 0, "model/b.seen": 1}


def test_verify_replicas_names_the_tensor_and_which_ranks_hold_which_copy() -> None:
    same, other = replica_checksum(torch.zeros(4)), replica_checksum(torch.ones(4))
    offers = [[chunk(r, 0, "model/w", 4, checksum=c)] for r, c in enumerate([same, same, other])]
    with pytest.raises(CheckpointError) as info:
        plan_save(offers, "sharded", ["model"])
    assert (
        "the copies of 'model/w' differ between ranks: ranks 0, 1 hold one version, rank 2 another"
        in str(info.value)
    )
    offers[2][0] = chunk(2, 0, "model/w", 4, checksum=same)
    plan_save(offers, "sharded", ["model"])  # equal copies: fine


def test_replica_checksums_see_every_byte_and_ignore_layout() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert replica_checksum(t) == replica_checksum(t.t().contiguous().t())
    flipped = t.clone()
    flipped.view(torch.int32)[2, 3] ^= 1  # one bit of one element
    assert replica_checksum(t) != replica_checksum(flipped)


def _opt_meta(groups: list[tuple[float, list[str]]], state: dict[str, Any]) -> dict[str, Any]:
    return {
        "param_groups": [{"params": p, "hyper": {"lr": lr}} for lr, p in groups],
        "param_shapes": {n: [2] for _, p in groups for n in p},
        "state": state,
    }


def test_pipeline_stages_optimizer_metadata_merges_by_name() -> None:
    stage0 = _opt_meta([(0.1, ["a", "b"])], {"a": {"m": 1}, "b": {"m": 2}})
    stage1 = _opt_meta([(0.1, ["c"])], {"c": {"m": 3}})
    merged = merge_optimizer_metas([stage0, stage0, stage1, stage1])  # PP x DP order
    assert merged["param_groups"] == [{"params": ["a", "b", "c"], "hyper": {"lr": 0.1}}]
    assert merged["state"] == {"a": {"m": 1}, "b": {"m": 2}, "c": {"m": 3}}
    assert set(merged["param_shapes"]) == {"a", "b", "c"}


def test_a_stage_with_its_own_learning_rate_gets_a_group_of_its_own() -> None:
    merged = merge_optimizer_metas([_opt_meta([(0.1, ["a"])], {}), _opt_meta([(0.2, ["c"])], {})])
    assert merged["param_groups"] == [
        {"params": ["a"], "hyper": {"lr": 0.1}},
        {"params": ["c"], "hyper": {"lr": 0.2}},
    ]


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (
            _opt_meta([(0.2, ["a"])], {}),
            "parameter 'a' is in param group 0 on rank 1 and in param group 0 on rank 0, with "
            r"other hyperparameters \(lr=0.2 against lr=0.1\)",
        ),
        (
            _opt_meta([(0.1, ["a"])], {"a": {"m": 9}}),
            r"ranks 0 and 1 both hold optimizer state for parameter 'a', but not the same "
            r"\('m': 1 and 9\)",
        ),
        (
            _opt_meta([(0.1, ["a"])], {"a": {"m": 1, "v": 2}}),
            r"for parameter 'a', but not the same \(state names \['m'\] and \['m', 'v'\]\)",
        ),
        (
            {**_opt_meta([(0.1, ["a"])], {}), "param_shapes": {"a": [3]}},
            "ranks disagree about the shape of parameter 'a'",
        ),
    ],
)
def test_replicas_that_disagree_cannot_be_merged(second: Any, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        merge_optimizer_metas([_opt_meta([(0.1, ["a"])], {"a": {"m": 1}}), second])


def test_tensor_valued_hyperparameters_that_differ_are_refused() -> None:
    def meta(ref: str, params: list[str]) -> dict[str, Any]:
        return {
            "param_groups": [{"params": params, "hyper": {"lr": {"__tensor__": ref}, "x": ref}}],
            "param_shapes": {},
            "state": {},
        }

    with pytest.raises(CheckpointError, match="tensor-valued hyperparameters that differ"):
        merge_optimizer_metas([meta("o/@groups/0/lr", ["a"]), meta("o/@groups/0/lr2", ["b"])])


def _ctx(world: int = 1, saved_world: int = 1, rank: int = 0) -> LoadContext:
    return LoadContext(name="o", rank=rank, world_size=world, saved_world_size=saved_world)


class _P:
    """A stand-in parameter: match_groups only needs names (``ctx.param_fqn``)."""


def test_live_groups_find_their_hyperparameters_by_parameter_name() -> None:
    a, b, c = (
        torch.nn.Parameter(torch.zeros(1)),
        torch.nn.Parameter(torch.zeros(1)),
        torch.nn.Parameter(torch.zeros(1)),
    )
    names = {id(a): "a", id(b): "b", id(c): "c"}
    ctx = LoadContext(name="o", rank=0, world_size=1, saved_world_size=2, param_names=names)
    saved = [{"params": ["c"], "hyper": {"lr": 0.2}}, {"params": ["a", "b"], "hyper": {"lr": 0.1}}]
    chosen, problems = match_groups([{"params": [a, b]}, {"params": [c]}], saved, ctx)
    assert (chosen, problems) == ([1, 0], [])
    chosen, problems = match_groups([{"params": [a, b, c]}], saved, ctx)
    assert (
        "live param group 0 holds parameters that were saved in param groups 0 and 1" in problems[0]
    )


def test_module_names_are_the_union_of_the_stages() -> None:
    merged = ModuleAdapter().merge(
        [
            {"tensors": ["tok.weight", "layers.0.w"], "extra": {"x": 1}},
            {"tensors": ["layers.1.w", "out.weight"], "extra": {"x": 1, "y": 3}},
        ]
    )
    assert merged == {
        "tensors": ["tok.weight", "layers.0.w", "layers.1.w", "out.weight"],
        "extra": {"x": 1, "y": 3},
    }
    # Extra state is recorded once: two stages holding it with different values would
    # each get rank 0's back, so the save is refused, naming the entry, ranks and values.
    with pytest.raises(
        CheckpointError,
        match=r"non-tensor state 'x' differs between ranks 0 and 2 \(\{\"tag\": \"a\"\} and "
        r"\{\"tag\": \"b\"\}\); it is recorded once",
    ):
        ModuleAdapter().merge(
            [
                {"tensors": [], "extra": {"x": {"tag": "a"}}},
                {"tensors": [], "extra": {}},
                {"tensors": [], "extra": {"x": {"tag": "b"}}},
            ]
        )
    with pytest.raises(CheckpointError, match="'w' is a tensor on some ranks"):
        ModuleAdapter().merge([{"tensors": ["w"], "extra": {}}, {"tensors": [], "extra": {"w": 1}}])


def test_values_that_differ_between_ranks_are_recorded_per_rank() -> None:
    assert merge_per_rank([{"last_epoch": 3}] * 3) == {"last_epoch": 3}
    merged = merge_per_rank([{"last_epoch": 3}, {"last_epoch": 4}])
    assert merged == {PER_RANK: [{"last_epoch": 3}, {"last_epoch": 4}]}
    saved = SavedValue("scheduler", "stateful", merged)
    assert own_record(saved, _ctx(2, 2, rank=1)).meta == {"last_epoch": 4}
    with pytest.raises(CheckpointMismatchError, match="restores rank by rank at world size 2"):
        StatefulAdapter().plan_load(None, saved, _ctx(1, 2))
    with pytest.raises(
        CheckpointError, match="non-tensor values differ between ranks 0 and 1, and it"
    ):
        merge_per_rank([{"t": {"__tensor__": "s/t"}}, {"t": {"__tensor__": "s/t"}, "n": 1}])


def _generator_offer(rank: int, state: torch.Tensor) -> Offer:
    """A rank's offer of a sampler whose generator state is ``state`` (a small tensor of a
    stateful object: compared on every save)."""
    chunk = ChunkOffer(
        rank, 0, "sampler/generator", state.dtype, tuple(state.shape), (0,), tuple(state.shape),
        True, checksum=replica_checksum(state), per_rank_if_different=True,
    )  # fmt: skip
    entry = OfferedEntry("stateful", {"generator": {"__tensor__": "sampler/generator"}, "e": 1})
    return Offer(rank, {"sampler": entry}, [chunk])


def test_copies_that_differ_get_a_key_per_rank_and_the_entry_a_record_per_rank() -> None:
    offers = [_generator_offer(r, torch.full((8,), r, dtype=torch.uint8)) for r in range(3)]
    assert split_differing(offers) == ["sampler/generator"]
    keys = [o.chunks[0].key for o in offers]
    assert keys == [f"sampler/generator/@rank-0000{r}" for r in range(3)]
    assert not any(o.chunks[0].replicated for o in offers)
    metas = [o.entries["sampler"].meta for o in offers]
    assert [m["generator"] for m in metas] == [{"__tensor__": k} for k in keys]
    merged = merge_per_rank(metas)
    # One record, and the keys each rank has its own copy of (not one record per rank).
    assert merged == {
        PER_RANK: {
            "shared": {"generator": {"__tensor__": "sampler/generator"}, "e": 1},
            "own": ["sampler/generator"],
        }
    }
    plan = plan_save([o.chunks for o in offers], "sharded", ["sampler"])
    assert [(f.writer, [e.key for e in f.entries]) for f in plan.files] == [
        (r, [keys[r]]) for r in range(3)
    ]
    saved = SavedValue("sampler", "stateful", merged)
    assert own_record(saved, _ctx(3, 3, rank=2)).meta == metas[2]
    # At another world size: saving rank 0's record (with a warning), and a converter's.
    assert own_record(saved, _ctx(1, 3)).meta == metas[0]
    assert representative(merged) == metas[0]


def test_equal_copies_stay_one_and_other_differences_are_still_refused() -> None:
    same = [_generator_offer(r, torch.zeros(8, dtype=torch.uint8)) for r in range(2)]
    assert split_differing(same) == []
    assert [o.chunks[0].key for o in same] == ["sampler/generator"] * 2
    offers = [_generator_offer(r, torch.full((8,), r, dtype=torch.uint8)) for r in range(2)]
    offers[1].entries["sampler"].meta["e"] = 2  # the structure's values differ too
    split_differing(offers)
    with pytest.raises(
        CheckpointError, match="structure or non-tensor values differ between ranks 0 and 1"
    ):
        merge_per_rank([o.entries["sampler"].meta for o in offers])
    stateful = {PER_RANK: [{"last_epoch": 3}, {"last_epoch": 4}]}
    assert representative(stateful) == stateful  # a per-stage scheduler has no single value


def test_a_refused_structure_names_the_rank_whose_structure_differs() -> None:
    offers = [_generator_offer(r, torch.full((8,), r, dtype=torch.uint8)) for r in range(3)]
    offers[2].entries["sampler"].meta["extra"] = {"__tensor__": "sampler/extra"}
    split_differing(offers)
    with pytest.raises(CheckpointError, match="non-tensor values differ between ranks 0 and 2, "):
        merge_per_rank([o.entries["sampler"].meta for o in offers])


def test_copies_of_another_shape_or_dtype_are_not_split_but_refused_by_the_planner() -> None:
    offers = [
        _generator_offer(0, torch.zeros(8, dtype=torch.uint8)),
        _generator_offer(1, torch.ones(2, 4, dtype=torch.uint8)),
    ]
    offers[1].chunks[0] = replace(offers[1].chunks[0], global_shape=(2, 4), offsets=(0, 0))
    assert split_differing(offers) == []
    with pytest.raises(CheckpointError, match="ranks disagree about tensor 'sampler/generator'"):
        plan_save([o.chunks for o in offers], "sharded", ["sampler"])


@pytest.mark.parametrize(
    "form",
    [
        {"shared": {"t": {"__tensor__": "s/t"}}},
        {"shared": {"t": {"__tensor__": "s/t"}}, "own": "s/t"},
        {"shared": {"t": {"__tensor__": "s/t"}}, "own": [1]},
        {"shared": {"t": {"__tensor__": "s/t"}}, "own": ["s/t", "s/t"]},
        {"shared": {"t": {"__tensor__": "s/t"}}, "own": ["s/u"]},
        {"shared": {}, "own": [], "more": 1},
        {"shared": {"a": 1}, "own": []},
    ],
    ids=["no own", "own not a list", "a number", "twice", "not in the record", "extra", "empty"],
)
def test_a_forged_record_of_own_copies_is_corrupt_not_a_crash(form: Any) -> None:
    saved = SavedValue("sampler", "stateful", {PER_RANK: form})
    for ctx in (_ctx(2, 2, rank=1), _ctx(1, 2)):
        with pytest.raises(CheckpointCorruptError, match="malformed record of per-rank copies"):
            own_record(saved, ctx)
    with pytest.raises(CheckpointCorruptError, match="malformed record of per-rank copies"):
        representative({PER_RANK: form}, "sampler")


def test_a_per_rank_record_inside_a_per_rank_record_is_corrupt() -> None:
    nested = {PER_RANK: [{PER_RANK: [{}, {}]}, {}]}
    with pytest.raises(CheckpointCorruptError, match="per-rank values inside a per-rank"):
        own_record(SavedValue("s", "stateful", nested), _ctx(2, 2))


def test_an_own_copy_key_is_a_child_of_the_tensor_key_and_maps_back() -> None:
    assert own_copy_key("sampler/generator", 12) == "sampler/generator/@rank-00012"
    assert shared_key("sampler/generator/@rank-00012") == "sampler/generator"
    assert shared_key("sampler/@rank-1") == "sampler/@rank-1"  # not 5 digits: not an own copy
    assert shared_key("sampler/generator") == "sampler/generator"


class _CountingList(list):  # type: ignore[type-arg]
    """The merged groups, counting every look at one of them."""

    looks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        for item in list.__iter__(self):
            _CountingList.looks += 1
            yield item

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        _CountingList.looks += 1
        return list.__getitem__(self, index)


def test_merging_pipeline_stages_groups_looks_only_at_groups_of_the_same_position(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """16 stages of 2000 groups each (a group per parameter is common): each rank's group
    at a position meets that position's merged groups only, not all of them (a scan of
    all of them took over 10 s at 16 x 4000). Counted, not timed."""
    from shardsafe.adapters import optimizer_merge

    class Counted(optimizer_merge._Groups):
        def __init__(self) -> None:
            super().__init__()
            self._groups = _CountingList()

    monkeypatch.setattr(optimizer_merge, "_Groups", Counted)
    ranks, groups = 16, 2000
    metas = [_opt_meta([(0.1, [f"s{r}.p{g}"]) for g in range(groups)], {}) for r in range(ranks)]
    _CountingList.looks = 0
    merged = merge_optimizer_metas(metas)
    assert len(merged["param_groups"]) == groups
    assert merged["param_groups"][5]["params"] == [f"s{r}.p5" for r in range(ranks)]
    # A scan of every merged group looks ranks x groups^2 / 2 = 32 million times.
    assert _CountingList.looks <= 8 * ranks * groups, _CountingList.looks


@pytest.mark.parametrize(
    "records",
    [[{"last_epoch": 1}], [{"last_epoch": 1}] * 3, "x" * 10],
    ids=["too few", "too many", "a string"],
)
def test_a_forged_per_rank_record_is_corrupt_not_a_crash(records: Any) -> None:
    saved = SavedValue("scheduler", "stateful", {PER_RANK: records})
    with pytest.raises(CheckpointError, match="per-rank values that are not one per saving rank"):
        StatefulAdapter().plan_load(None, saved, _ctx(2, 2, rank=1))
