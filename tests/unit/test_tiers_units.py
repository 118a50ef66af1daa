"""The tiered manager's pure parts, without a process group: the topology of replicas,
the choice of what to restore, the view that loads a rank checkpoint (on forged
manifests), the local-space budget, and the node directory facing links and FIFOs."""

from __future__ import annotations

import errno
import itertools
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardsafe
from shardsafe import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from shardsafe.checkpoint import loading
from shardsafe.checkpoint.options import LoadOptions
from shardsafe.checkpoint.plan.collecting import collect
from shardsafe.checkpoint.storage.local import LocalStorage
from shardsafe.tiers import (
    TieredCheckpointManager,
    budget,
    rank_checkpoint,
    replication,
)
from shardsafe.tiers.deferred_warnings import DeferredWarnings
from shardsafe.tiers.fetch import Fetcher
from shardsafe.tiers.node_dir import Held, NodeDir
from shardsafe.tiers.recovery import LOCAL, PEER, PERSISTENT, Choice, choose
from shardsafe.tiers.replication import Peers, Replicator, retained
from shardsafe.tiers.retention import Tally
from shardsafe.tiers.topology import Topology
from tests import forge
from tests.unit.attacks.common import fifo_reader_probe

pytestmark = pytest.mark.timeout(60)

STEP7, RANK0 = "step-000000007", "rank-00000"

# ------------------------------------------------------------------------ topology


def two_by_two() -> Topology:
    return Topology.of(["node:a", "node:a", "node:b", "node:b"])


def test_nodes_are_ordered_by_their_lowest_rank_and_replicas_go_to_the_same_position() -> None:
    topo = Topology.of(["node:x", "node:y", "node:x", "node:y"])  # interleaved ranks
    assert topo.nodes == ((0, 2), (1, 3))
    assert topo.node_of == (0, 1, 0, 1)
    assert [topo.targets(r, 1) for r in range(4)] == [[1], [0], [3], [2]]
    assert [topo.sources(r, 1) for r in range(4)] == [[1], [0], [3], [2]]

    topo = two_by_two()
    assert [topo.targets(r, 1) for r in range(4)] == [[2], [3], [0], [1]]
    assert [topo.sources(r, 1) for r in range(4)] == [[2], [3], [0], [1]]


def test_uneven_nodes_wrap_around_the_smaller_node() -> None:
    topo = Topology.of(["a", "a", "a", "b", "c", "c"])
    assert topo.nodes == ((0, 1, 2), (3,), (4, 5))
    assert [topo.targets(r, 1) for r in range(6)] == [[3], [3], [3], [4], [0], [1]]
    assert [topo.targets(r, 2) for r in range(6)] == [
        [3, 4],
        [3, 5],
        [3, 4],
        [4, 0],
        [0, 3],
        [1, 3],
    ]
    assert topo.sources(3, 1) == [0, 1, 2]  # the one-rank node keeps the whole big node
    assert topo.sources(2, 1) == []


def test_replicas_are_capped_at_the_other_nodes() -> None:
    topo = Topology.of(["a", "b", "c"])
    assert topo.max_replicas() == 2
    assert topo.targets(0, 5) == [1, 2]
    assert topo.sources(0, 5) == [1, 2]
    single = Topology.of(["a", "a"])
    assert single.max_replicas() == 0
    assert single.targets(0, 3) == [] and single.sources(1, 3) == []


SIZES = [(1,), (2, 1), (1, 3), (2, 2), (3, 1, 2), (1, 1, 1, 1), (4, 2, 3)]


@pytest.mark.parametrize("sizes", SIZES)
def test_a_replica_never_lives_on_its_owners_node(sizes: tuple[int, ...]) -> None:
    names = [f"n{node}" for node, size in enumerate(sizes) for _ in range(size)]
    for order in {tuple(names), tuple(sorted(names, key=lambda n: names[::-1].index(n)))}:
        topo = Topology.of(list(order))
        for replicas, rank in itertools.product(range(len(sizes) + 2), range(len(order))):
            targets = topo.targets(rank, replicas)
            assert len(targets) == min(replicas, len(sizes) - 1)
            nodes = [topo.node_of[t] for t in targets]
            assert topo.node_of[rank] not in nodes
            assert len(set(nodes)) == len(nodes)  # one replica per other node
            every = [r for r in range(len(order)) if rank in topo.targets(r, replicas)]
            assert topo.sources(rank, replicas) == every
            for source in topo.sources(rank, replicas):
                assert not topo.same_node(source, rank)
                assert rank in topo.targets(source, replicas)


@pytest.mark.timeout(20)
def test_the_budget_of_a_large_job_is_checked_in_linear_time() -> None:
    """8,192 ranks as 1,024 nodes of 8: each rank's sources were found by a pass over
    every rank's targets, and the budget check (on every rank, before the first local
    write) asks for all of them: about a minute, quadratic in the world size."""
    topo = Topology.of([f"n{rank // 8}" for rank in range(8192)])
    reports = [budget.Report(MIB, 1 << 40, 0)] * 8192
    checked = budget.check(reports, topo, 1, 2, ["/shm"] * 8192)
    assert checked.step_bytes == [16 * MIB] * 1024
    assert topo.sources(8, 1) == [0] and topo.sources(0, 1) == [8184]


def test_a_single_node_job_warns_that_it_has_no_replicas(tmp_path: Path) -> None:
    with pytest.warns(UserWarning) as caught:
        manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=2)
    manager.close()
    assert [str(w.message) for w in caught] == [
        "shardsafe: replicas=2, but the job runs on 1 node(s), so a replica on another node "
        "is possible for 0; a lost node loses its local checkpoints"
    ]
    assert manager.replicas == 0


# ------------------------------------------------------------------------ recovery


def everywhere(*steps: int, world: int = 4) -> list[tuple[int, int, int]]:
    return [(s, r, world) for s in steps for r in range(world)]


def test_the_newest_step_complete_on_every_rank_is_restored_locally() -> None:
    held = [everywhere(2, 3)] * 4
    assert choose(held, two_by_two(), 2) == Choice(3, [LOCAL] * 4, {})


def test_a_step_missing_one_rank_everywhere_is_skipped() -> None:
    copies = [c for c in everywhere(2, 3) if c != (3, 1, 4)]
    assert choose([copies] * 4, two_by_two(), None) == Choice(2, [LOCAL] * 4, {})


def test_a_rank_whose_node_lost_the_step_gets_a_peers_copy() -> None:
    node_a = [c for c in everywhere(3) if c != (3, 1, 4)]
    held = [node_a, node_a, everywhere(3), everywhere(3)]
    assert choose(held, two_by_two(), None) == Choice(3, [LOCAL, PEER, LOCAL, LOCAL], {1: 2})


def test_a_newer_persistent_step_wins_and_an_equal_one_does_not() -> None:
    held = [everywhere(2, 3)] * 4
    assert choose(held, two_by_two(), 4) == Choice(4, [PERSISTENT] * 4)
    assert choose(held, two_by_two(), 3) == Choice(3, [LOCAL] * 4, {})


def test_copies_saved_at_another_world_size_or_naming_another_rank_are_ignored() -> None:
    other = [*everywhere(5, world=2), (6, 7, 4), (6, -1, 4)]
    held = [other + everywhere(2)] * 4
    assert choose(held, two_by_two(), None) == Choice(2, [LOCAL] * 4, {})
    assert choose([everywhere(5, world=2)] * 4, two_by_two(), 1) == Choice(1, [PERSISTENT] * 4)
    # Nothing to restore, but not nothing saved: load_latest refuses to start afresh.
    stranded = [everywhere(5, world=8) + everywhere(3, world=2)] * 4
    assert choose(stranded, two_by_two(), None) == Choice(None, [], stranded=(5, 8))


def test_excluded_copies_are_not_asked_for_again() -> None:
    held = [everywhere(2, 3)] * 4
    # node 0's copy of rank 1's step 3 failed: node 1's replica of it is sent over
    assert choose(held, two_by_two(), None, {(0, 3, 1)}) == Choice(
        3, [LOCAL, PEER, LOCAL, LOCAL], {1: 2}
    )
    # both copies failed: the step is not complete any more
    assert choose(held, two_by_two(), None, {(0, 3, 1), (1, 3, 1)}) == Choice(2, [LOCAL] * 4, {})
    # ... and with a persistent checkpoint of step 2 as well, the local tier still wins a tie
    assert choose(held, two_by_two(), 2, {(0, 3, 1), (1, 3, 1)}) == Choice(2, [LOCAL] * 4, {})


def test_one_step_is_restored_from_the_copies_of_one_run_only() -> None:
    """Each copy carries the token of the run that wrote it: a step whose copies are of
    two runs (an abandoned run's that could not be deleted, a resumed run's) is not
    complete; of two runs complete at one step, the later one's copies are restored."""
    old, new = "0000000000000001aa", "0000000000000002bb"
    step_2 = [(*c, old) for c in everywhere(2)]
    mixed = [(3, 0, 4, old), (3, 1, 4, new), (3, 2, 4, new), (3, 3, 4, new)]
    assert choose([step_2 + mixed] * 4, two_by_two(), None) == Choice(2, [LOCAL] * 4, {})
    # Node 0 holds every rank's copy of step 3 of the old run; node 1, of the new run
    # (its ranks 2 and 3 hold their own, and replicas of ranks 0 and 1): the new run's,
    # node 0's ranks sent theirs from node 1.
    node_0 = [(*c, old) for c in everywhere(3)]
    node_1 = [(*c, new) for c in everywhere(3)]
    held = [node_0, node_0, node_1, node_1]
    assert choose(held, two_by_two(), None) == Choice(3, [PEER, PEER, LOCAL, LOCAL], {0: 2, 1: 3})
    # Copies without a token (written before tokens were recorded) are one run.
    assert choose([everywhere(3)] * 4, two_by_two(), None) == Choice(3, [LOCAL] * 4, {})


def test_a_run_that_a_later_run_at_another_world_size_went_on_from_is_never_restored() -> None:
    """Run A (4 ranks) saved steps 1-3 and persisted step 2; run B (2 ranks) resumed from
    the persistent step 2 and saved step 3 locally; run C (4 ranks again) finds run A's
    step 3 complete. Before, C restored it (and replaced B's copy of step 3 with it): run
    A was abandoned when B resumed, so C falls back to the persistent tier, or refuses
    to start afresh over B's step if nothing was persisted."""
    a = "0000000000000001" + "a" * 16
    b = "0000000000000002" + "b" * 16
    run_a = [(*c, a + "00000003") for c in everywhere(3)]
    run_b = [(*c, b + "00000001") for c in everywhere(3, world=2)]
    held = [run_a + run_b, run_a + run_b, run_a, run_a]
    assert choose(held, two_by_two(), 2) == Choice(2, [PERSISTENT] * 4)
    assert choose(held, two_by_two(), None) == Choice(None, [], stranded=(3, 2))
    # A run at another world size before A's leaves A's steps restorable.
    older = [(*c, "0000000000000000" + "c" * 16 + "00000001") for c in everywhere(5, world=2)]
    assert choose([run_a + older] * 4, two_by_two(), 2) == Choice(3, [LOCAL] * 4, {})


@pytest.mark.parametrize("run", ["ABC", "0" * 65, "../x", 7])
def test_a_run_token_that_is_not_short_lower_case_hex_is_refused(
    tmp_path: Path, run: object
) -> None:
    """A hostile manifest's run token: the survey passes over its copy (``held``)."""
    node = NodeDir(str(tmp_path / "local"))
    with node.rank_storage(3, 0, create=True) as storage:
        items = collect({"w": torch.ones(2)}, 0, 1)
        rank_checkpoint.write(storage, items, rank=0, world_size=1, step=3, run="ab12")
    assert list(node.held()) == [Held(3, 0, 1, "ab12")]
    copy = tmp_path / "local" / "step-000000003" / "rank-00000"
    doc = forge.read_manifest(copy)
    doc["info"]["rank_checkpoint"]["run"] = run
    forge.write_manifest(copy, doc)
    with node.rank_storage(3, 0, create=False) as storage:
        manifest = loading.read_manifest_from(storage)
    with pytest.raises(CheckpointCorruptError, match="run is not a token of at most 64"):
        rank_checkpoint.run_of(manifest)
    assert list(node.held()) == []


def test_the_ranks_of_a_lost_node_are_sent_their_copies_by_the_least_loaded_holders() -> None:
    topo = Topology.of(["a", "a", "b", "b", "c", "c"])
    world = everywhere(4, world=6)
    held = [world, world, [], [], world, world]  # node b lost its directory
    assert choose(held, topo, None) == Choice(
        4, [LOCAL, LOCAL, PEER, PEER, LOCAL, LOCAL], {2: 0, 3: 1}
    )
    # one holder node for four ranks: two ranks each sends one
    topo = two_by_two()
    assert choose([everywhere(4), everywhere(4), [], []], topo, None) == Choice(
        4, [LOCAL, LOCAL, PEER, PEER], {2: 0, 3: 1}
    )


def test_nothing_anywhere_restores_nothing() -> None:
    assert choose([[]] * 4, two_by_two(), None) == Choice(None, [])


def test_with_nothing_to_restore_the_newest_step_some_ranks_hold_is_named() -> None:
    node_a = [c for c in everywhere(2, 3) if c[1] in (0, 1)]
    assert choose([node_a, node_a, [], []], two_by_two(), None) == Choice(
        None, [], incomplete=(3, (2, 3))
    )
    assert choose([node_a, node_a, [], []], two_by_two(), 1) == Choice(1, [PERSISTENT] * 4)


# -------------------------------------------------------- rank_checkpoint.view


def trained(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).pow(2).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def snapshot(state: dict[str, Any]) -> list[torch.Tensor]:
    model, opt = state["model"], state["optimizer"]
    found = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        found += [v.clone() for _, v in sorted(opt.state[p].items())]
    return found


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def rank_ckpt(tmp_path: Path) -> tuple[Path, list[torch.Tensor]]:
    """A rank checkpoint of rank 0 of 1 at step 3, written by ``rank_checkpoint.write``;
    the state it holds."""
    state = trained(0)
    path = tmp_path / "rank-ckpt"
    path.mkdir()
    with LocalStorage(str(path)) as storage:
        rank_checkpoint.write(storage, collect(state, 0, 1), rank=0, world_size=1, step=3)
    return path, snapshot(state)


def load_view(path: Path, state: dict[str, Any], rank: int = 0, world: int = 1) -> Any:
    with LocalStorage(str(path)) as storage:
        return loading.load_chosen(
            storage,
            lambda manifest: state,
            LoadOptions.of(),
            agree_as=f"test:{path}",
            view=rank_checkpoint.view(state, rank=rank, world_size=world),
        )


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda info: info["placements"].__setitem__(key, value)


W = "model/weight"  # shape [3, 4]
NOT_VALID = (CheckpointCorruptError, f"the rank checkpoint's placement of {W!r} is not valid")
NOT_EXACT = (
    CheckpointCorruptError,
    "the rank checkpoint's placements do not name exactly its tensors",
)
NOT_RANK = (
    CheckpointCorruptError,
    "the manifest's 'rank_checkpoint' does not hold a rank, a world size and a step",
)
FORGED: dict[str, tuple[Callable[[dict[str, Any]], None], type[Exception], str]] = {
    "offset out of bounds": (
        _set(W, [[1, 0], [3, 4]]),
        CheckpointCorruptError,
        f"the rank checkpoint places {W!r} (shape [3, 4]) at offsets [1, 0] of a tensor of "
        "shape [3, 4], which does not hold it",
    ),
    "global shape smaller than the piece": (
        _set(W, [[0, 0], [2, 4]]),
        CheckpointCorruptError,
        f"the rank checkpoint places {W!r} (shape [3, 4]) at offsets [0, 0] of a tensor of "
        "shape [2, 4], which does not hold it",
    ),
    "wrong ndim": (_set(W, [[0], [3]]), *NOT_VALID),
    "ndim of offsets and shape differ": (_set(W, [[0, 0], [3, 4, 1]]), *NOT_VALID),
    "negative offset": (_set(W, [[-1, 0], [3, 4]]), *NOT_VALID),
    "negative shape": (_set(W, [[0, 0], [-3, 4]]), *NOT_VALID),
    "huge global shape": (
        _set(W, [[0, 0], [2**62, 2**62]]),
        CheckpointCorruptError,
        f"the rank checkpoint places {W!r} (shape [3, 4]) at offsets [0, 0] of a tensor of "
        f"shape [{2**62}, {2**62}], which has shape [{2**62}, {2**62}], too large for any "
        "tensor (its size overflows int64)",
    ),
    "huge offset": (
        _set(W, [[10**30, 0], [3, 4]]),
        CheckpointCorruptError,
        f"the rank checkpoint places {W!r} (shape [3, 4]) at offsets [{10**30}, 0] of a "
        "tensor of shape [3, 4], which does not hold it",
    ),
    "float": (_set(W, [[0.0, 0], [3, 4]]), *NOT_VALID),
    "string": (_set(W, [["0", 0], [3, 4]]), *NOT_VALID),
    "bool": (_set(W, [[False, 0], [3, 4]]), *NOT_VALID),
    "null": (_set(W, None), *NOT_VALID),
    "three lists": (_set(W, [[0, 0], [3, 4], [3, 4]]), *NOT_VALID),
    "a dict": (_set(W, {"offsets": [0, 0], "shape": [3, 4]}), *NOT_VALID),
    "missing key": (lambda info: info["placements"].pop("model/bias"), *NOT_EXACT),
    "extra key": (_set("model/ghost", [[0], [3]]), *NOT_EXACT),
    "placements not a dict": (lambda info: info.__setitem__("placements", []), *NOT_EXACT),
    "no placements": (lambda info: info.pop("placements"), *NOT_EXACT),
    "other rank and world": (
        lambda info: info.update(rank=1, world_size=2),
        CheckpointMismatchError,
        "this rank checkpoint was saved by rank 1 of 2, not rank 0 of 1",
    ),
    "other world": (
        lambda info: info.update(world_size=4),
        CheckpointMismatchError,
        "this rank checkpoint was saved by rank 0 of 4, not rank 0 of 1",
    ),
    "rank outside its world": (
        lambda info: info.update(rank=2, world_size=2),
        CheckpointCorruptError,
        "rank 2 is outside its world size 2",
    ),
    "rank not an int": (lambda info: info.update(rank="0"), *NOT_RANK),
    "rank a bool": (lambda info: info.update(rank=False), *NOT_RANK),
    "negative step": (lambda info: info.update(step=-3), *NOT_RANK),
    "no world size": (lambda info: info.pop("world_size"), *NOT_RANK),
    "partitioned entries not a map": (
        lambda info: info.update(partitioned=["optimizer"]),
        CheckpointCorruptError,
        "the manifest's 'rank_checkpoint' 'partitioned' is not a map of entry names to "
        "adapter names of at most 4096 characters",
    ),
    "a plain optimizer's copy said to be a ZeRO partition": (
        lambda info: info.update(partitioned={"optimizer": "ZeroAdapter"}),
        CheckpointMismatchError,
        "rank 0's local copy holds state['optimizer'] as its ZeroAdapter partition: the "
        "optimizer state of the parameters this rank owned, the others' being in the other "
        "ranks' copies; this load restores it into a AdamW (OptimizerAdapter), which needs "
        "every parameter's state. A local copy restores only into the optimizer sharding "
        "that saved it; the persistent tier restores into any other",
    ),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_a_forged_placement_is_refused_and_nothing_is_restored(
    rank_ckpt: tuple[Path, list[torch.Tensor]], case: str
) -> None:
    path, _ = rank_ckpt
    edit, error, message = FORGED[case]
    doc = forge.read_manifest(path)
    edit(doc["info"]["rank_checkpoint"])
    forge.write_manifest(path, doc)
    state = trained(1)
    before = snapshot(state)
    with pytest.raises(error) as caught:
        load_view(path, state)
    assert str(caught.value) == message
    assert same(snapshot(state), before)


def test_no_rank_checkpoint_info_is_refused(rank_ckpt: tuple[Path, list[torch.Tensor]]) -> None:
    path, _ = rank_ckpt
    doc = forge.read_manifest(path)
    del doc["info"]["rank_checkpoint"]
    forge.write_manifest(path, doc)
    state = trained(1)
    before = snapshot(state)
    with pytest.raises(CheckpointCorruptError) as caught:
        load_view(path, state)
    assert str(caught.value) == "the manifest is not a rank checkpoint's (no 'rank_checkpoint')"
    assert same(snapshot(state), before)


MALFORMED = {
    "module metadata not an object": ("model", "x", "TypeError"),
    "module metadata without its names": ("model", {"extra": {}}, "KeyError"),
    "a name both a tensor and extra state": (
        "model",
        {"tensors": ["weight", "bias"], "extra": {"weight": 1}},
        "CheckpointError",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_forged_entry_metadata_is_refused_as_corrupt_before_anything_is_restored(
    rank_ckpt: tuple[Path, list[torch.Tensor]], case: str
) -> None:
    """The view merges each entry's metadata (read from disk) through its adapter before
    the planner has validated it: what the adapter cannot make sense of is corruption,
    named by its entry, as the planner names it."""
    path, _ = rank_ckpt
    name, meta, error = MALFORMED[case]
    doc = forge.read_manifest(path)
    doc["values"][name]["meta"] = meta
    forge.write_manifest(path, doc)
    state = trained(1)
    before = snapshot(state)
    with pytest.raises(CheckpointCorruptError) as caught:
        load_view(path, state)
    assert str(caught.value).startswith(
        f"the manifest entry for {name!r} (a 'module' value) is malformed: "
        f"ModuleAdapter.merge failed with {error}: "
    )
    assert same(snapshot(state), before)


CORRUPT_PLACEMENTS = [
    case for case, (_, error, _) in FORGED.items() if error is CheckpointCorruptError
]


@pytest.mark.parametrize(
    ("what", "case"),
    [("placement", case) for case in CORRUPT_PLACEMENTS]
    + [("metadata", case) for case in MALFORMED],
)
def test_a_forged_newest_copy_is_passed_over_and_the_step_before_restored(
    tmp_path: Path, what: str, case: str
) -> None:
    """A well-formed manifest (its checksum recomputed) whose placements or entry
    metadata the load refuses: the survey chose its step, the load refused it, its data
    files' checksums found it sound, so ``load_latest`` raised, at every restart. Now the
    survey passes over a bad placement (``latest()`` too), and a copy whose metadata the
    load refuses is judged damaged, removed, and the step before restored."""
    states = {step: trained(step) for step in (1, 2)}
    manager = TieredCheckpointManager(
        tmp_path / "p", tmp_path / "l", persist_every=None, keep_local=2
    )
    for step, state in states.items():
        manager.save(step, state)
    manager.close()
    copy = tmp_path / "l" / "step-000000002" / "rank-00000"
    doc = forge.read_manifest(copy)
    if what == "placement":
        FORGED[case][0](doc["info"]["rank_checkpoint"])
    else:
        name, meta, _ = MALFORMED[case]
        doc["values"][name]["meta"] = meta
    forge.write_manifest(copy, doc)
    state = trained(9)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        resumed = TieredCheckpointManager(
            tmp_path / "p", tmp_path / "l", persist_every=None, keep_local=2
        )
        assert resumed.latest() == (1 if what == "placement" else 2)
        resumed.load_latest(state)
        resumed.close()
    assert resumed.restored is not None and resumed.restored.step == 1
    assert same(snapshot(state), snapshot(states[1]))
    damaged = [str(w.message) for w in said if "was damaged" in str(w.message)]
    if what == "metadata":
        assert len(damaged) == 1 and "is malformed: ModuleAdapter.merge failed" in damaged[0]
        assert not copy.exists()
    else:
        assert damaged == []


def test_an_entry_saved_as_another_kind_is_a_mismatch_naming_both(
    rank_ckpt: tuple[Path, list[torch.Tensor]],
) -> None:
    path, _ = rank_ckpt
    doc = forge.read_manifest(path)
    doc["values"]["model"]["kind"] = "rng"
    forge.write_manifest(path, doc)
    state = trained(1)
    before = snapshot(state)
    with pytest.raises(CheckpointMismatchError) as caught:
        load_view(path, state)
    assert "state['model'] was saved as a 'rng' value but is loaded into a Linear ('module')" in (
        str(caught.value)
    )
    assert same(snapshot(state), before)


def test_the_unforged_rank_checkpoint_loads_bitwise(
    rank_ckpt: tuple[Path, list[torch.Tensor]],
) -> None:
    path, saved = rank_ckpt
    state = trained(1)
    assert not same(snapshot(state), saved)
    assert load_view(path, state) == {}
    assert same(snapshot(state), saved)


def test_a_valid_placement_in_a_larger_tensor_does_not_fit_a_whole_object(
    rank_ckpt: tuple[Path, list[torch.Tensor]],
) -> None:
    """The piece may be the first rows of a [6, 4] tensor; this rank holds all of a [3, 4]
    one, so the objects do not match (the manager then turns to the persistent tier)."""
    path, _ = rank_ckpt
    doc = forge.read_manifest(path)
    doc["info"]["rank_checkpoint"]["placements"][W] = [[0, 0], [6, 4]]
    forge.write_manifest(path, doc)
    state = trained(1)
    before = snapshot(state)
    with pytest.raises(CheckpointMismatchError) as caught:
        load_view(path, state)
    assert str(caught.value) == (
        "the checkpoint does not match the objects being loaded:\n"
        "  mismatched (1): model/weight: checkpoint float32[6, 4], live float32[3, 4]"
    )
    assert same(snapshot(state), before)


def test_the_ranks_agree_under_the_name_given_else_the_persistent_root(tmp_path: Path) -> None:
    """``name=`` (documented for ranks that spell paths differently) was shadowed by a loop
    variable, so every manager agreed under ``tiers:persist_every``."""
    named = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0, name="run-7")
    named.close()
    assert named._ranks.tag == "tiers:run-7"
    default = TieredCheckpointManager(tmp_path / "q", tmp_path / "m", replicas=0)
    default.close()
    assert default._ranks.tag == f"tiers:{tmp_path / 'q'}"


def test_a_damaged_manifest_of_the_only_step_is_refused_not_a_silent_fresh_start(
    tmp_path: Path,
) -> None:
    """The survey passed over a copy whose manifest fails its checksum, and with nothing
    else to restore, ``load_latest`` returned ``None``: the run started afresh over it."""
    manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0)
    manager.save(7, trained(0))
    manager.close()
    manifest = tmp_path / "l" / STEP7 / RANK0 / "manifest.json"
    raw = bytearray(manifest.read_bytes())
    raw[20] ^= 0x01
    manifest.write_bytes(bytes(raw))
    live = trained(1)
    before = snapshot(live)
    resumed = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0)
    with pytest.raises(CheckpointCorruptError) as caught:
        resumed.load_latest(live)
    resumed.close()
    said = str(caught.value)
    assert said.startswith(
        "nothing was restored, but the local tiers hold rank checkpoints that would not load "
        "(step 7 of rank 0: CheckpointCorruptError: "
    ), said
    assert "is damaged: its content does not match its CRC32 ('manifest_crc32')" in said, said
    assert same(snapshot(live), before)
    assert manifest.read_bytes() == bytes(raw)  # left for the user to look at


def test_a_forged_placement_alone_is_refused_not_a_silent_fresh_start(tmp_path: Path) -> None:
    state = trained(0)
    manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0)
    manager.save(7, state)
    ckpt = tmp_path / "l" / STEP7 / RANK0
    doc = forge.read_manifest(ckpt)
    doc["info"]["rank_checkpoint"]["placements"][W] = [[0, 1], [3, 4]]
    forge.write_manifest(ckpt, doc)
    live = trained(1)
    before = snapshot(live)
    assert manager.latest() is None  # the survey refuses what the load would
    with pytest.raises(CheckpointCorruptError) as caught:
        manager.load_latest(live)
    # So does the Lightning strategy's fresh start (ckpt_path=None and nothing local).
    with pytest.raises(CheckpointCorruptError) as fresh:
        manager._start_afresh("Lightning found no checkpoint", "")
    assert str(fresh.value) == str(caught.value)
    manager.close()
    assert str(caught.value) == (
        "nothing was restored, but the local tiers hold rank checkpoints that would not load "
        f"(step 7 of rank 0: CheckpointCorruptError: the rank checkpoint places {W!r} (shape "
        "[3, 4]) at offsets [0, 1] of a tensor of shape [3, 4], which does not hold it), and "
        "no other step or persistent checkpoint was left to restore. Returning nothing would "
        "start the run afresh and abandon them: repair or delete them (or give this run a "
        "local directory of its own) and restart"
    )
    assert same(snapshot(live), before)


@pytest.mark.parametrize(
    ("timeout", "given", "waits"),
    [
        (7.0, {}, (7.0, 7.0)),  # the manager's timeout, at the entry too
        (300.0, {}, (300.0, 60.0)),  # at the entry, at most shardsafe.load's 60 s
        (7.0, {"timeout": 50.0, "entry_timeout": 20.0}, (50.0, 20.0)),  # the caller's
    ],
)
def test_a_local_load_waits_for_the_ranks_as_long_as_the_managers_timeout(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    timeout: float,
    given: dict[str, float],
    waits: tuple[float, float],
) -> None:
    """Before, a load from the local tier took ``shardsafe.load``'s waits (1800 s in a
    phase, 60 s at the entry) whatever the manager's ``timeout``: a manager made with
    ``timeout=30`` waited 1800 s for a rank hung in the load."""
    saving = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0)
    saving.save(7, trained(0))
    saving.close()
    seen: list[tuple[float, float]] = []
    load_opening = loading.load_opening

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.append((args[3].timeout, args[3].entry_timeout))
        return load_opening(*args, **kwargs)

    monkeypatch.setattr(loading, "load_opening", recorded)
    manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0, timeout=timeout)
    live = trained(1)
    assert manager.load_latest(live, **given) == {}  # type: ignore[arg-type]
    manager.close()
    assert seen == [waits]
    assert same(snapshot(live), snapshot(trained(0)))


@pytest.mark.parametrize("step", ["5", 5.0, True, -1, 2**63, 10**25])
def test_a_step_that_is_not_a_non_negative_int_is_refused_by_name(
    tmp_path: Path, step: object
) -> None:
    manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0)
    for verb in (manager.save, manager.async_save):
        with pytest.raises(
            ValueError, match=rf"^step={step!r} must be a non-negative int below 2\*\*63$"
        ):
            verb(step, trained(0))  # type: ignore[arg-type]
    manager.close()
    assert not (tmp_path / "l").exists() or not list((tmp_path / "l").glob("step-*"))


@pytest.mark.parametrize("timeout", [None, "30", 0, -1, float("nan"), float("inf"), True])
def test_a_timeout_that_is_not_a_positive_number_is_refused_by_name(
    tmp_path: Path, timeout: object
) -> None:
    """Before, on several ranks, None and "30" failed the first exchange with a raw
    TypeError from deep inside, -1 with gloo's "Invalid timeout", and 0 hung a rank."""
    with pytest.raises(ValueError) as caught:
        TieredCheckpointManager(tmp_path / "p", tmp_path / "l", timeout=timeout)  # type: ignore[arg-type]
    assert str(caught.value) == f"timeout={timeout!r} must be a positive number of seconds"
    assert not (tmp_path / "p").exists() and not (tmp_path / "l").exists()


def test_a_timeout_too_large_to_wait_for_is_refused_by_name(tmp_path: Path) -> None:
    """Before, timeout=1e18 (for "never") was taken, and the first local save on several
    ranks failed with a raw 'OverflowError: Python int too large to convert to C int'."""
    with pytest.raises(ValueError) as caught:
        TieredCheckpointManager(tmp_path / "p", tmp_path / "l", timeout=1e18)
    assert str(caught.value) == (
        "timeout=1e+18 is more than the 1e+09 seconds (about 31 years) a rank can wait for "
        "another; pass a smaller number of seconds"
    )
    assert not (tmp_path / "p").exists() and not (tmp_path / "l").exists()


# ------------------------------------------------------- a damaged only copy


def flip_last_byte(ckpt: Path) -> None:
    (data,) = ckpt.glob("*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))


def test_a_damaged_only_copy_is_an_error_never_nothing_to_restore(tmp_path: Path) -> None:
    """Local loads copy each tensor into its object as they read it (verify='inline'),
    so a damaged copy found half-way leaves the objects partly restored: with no other
    source to overwrite them, ``load_latest`` must say so, not return ``None`` (nothing
    there) for the run to train on from a half-restored state."""
    manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0)
    manager.save(1, trained(0))
    flip_last_byte(tmp_path / "l" / "step-000000001" / RANK0)
    with (
        pytest.warns(UserWarning, match="a local checkpoint of step 1 was damaged"),
        pytest.raises(CheckpointCorruptError) as caught,
    ):
        manager.load_latest(trained(1))
    manager.close()
    message = str(caught.value)
    assert message.startswith(
        "no complete step is left in any tier to restore after a damaged local checkpoint: "
        "checksum mismatch in shard-00000-of-00001.safetensors, tensor "
    )
    assert message.endswith("Load a good checkpoint before using these objects.")
    assert tree(tmp_path / "l") == {"step-000000001": "dir"}  # the damaged copy is gone


def test_a_damaged_newest_copy_falls_back_to_the_older_step_bitwise(tmp_path: Path) -> None:
    manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0)
    older = trained(0)
    manager.save(1, older)
    manager.save(2, trained(2))
    flip_last_byte(tmp_path / "l" / "step-000000002" / RANK0)
    live = trained(1)
    with pytest.warns(UserWarning, match="a local checkpoint of step 2 was damaged"):
        assert manager.load_latest(live) == {}
    manager.close()
    assert manager.restored is not None and manager.restored.step == 1
    assert manager.restored.tiers == ["local"]
    assert same(snapshot(live), snapshot(older))


def test_a_copy_gone_between_the_survey_and_the_load_falls_back_to_the_older_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the newest step's manifest deleted after the survey chose it made
    ``load_latest`` raise CheckpointNotFoundError, with step 1 intact on disk."""
    manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0)
    older = trained(0)
    manager.save(1, older)
    manager.save(2, trained(2))
    fetch = Fetcher.fetch

    def fetch_then_vanish(self: Fetcher, choice: Choice, excluded: Any) -> list[int]:
        if choice.step == 2:
            (tmp_path / "l" / "step-000000002" / RANK0 / "manifest.json").unlink()
        return fetch(self, choice, excluded)

    monkeypatch.setattr(Fetcher, "fetch", fetch_then_vanish)
    live = trained(1)
    with pytest.warns(UserWarning, match="a local checkpoint of step 2 was damaged .*no manifest"):
        assert manager.load_latest(live) == {}
    manager.close()
    assert manager.restored is not None and manager.restored.step == 1
    assert manager.restored.tiers == ["local"]
    assert same(snapshot(live), snapshot(older))
    assert not (tmp_path / "l" / "step-000000002" / RANK0).exists()  # its remains deleted


def test_each_rank_directory_is_surveyed_by_one_rank_of_its_node() -> None:
    topology = two_by_two()
    assert [topology.surveyed_by(r, 1) for r in range(4)] == [{0, 2}, {1, 3}, {2, 0}, {3, 1}]
    # No replicas: the lowest rank checks the others' (left by a run that had them).
    assert [topology.surveyed_by(r, 0) for r in range(4)] == [{0, 2, 3}, {1}, {2, 0, 1}, {3}]
    three = Topology.of(["a", "a", "b", "b", "c", "c"])
    # Node a keeps replicas of node c's ranks; the ranks of node b's are no local rank's:
    # its lowest rank checks them (left by a run arranged otherwise).
    assert three.surveyed_by(0, 1) == {0, 4, 2, 3}
    assert three.surveyed_by(1, 1) == {1, 5}
    uneven = Topology.of(["a", "a", "a", "b"])
    assert [uneven.surveyed_by(r, 1) for r in range(4)] == [{0, 3}, {1}, {2}, {3, 0, 1, 2}]


def test_local_checkpoints_that_do_not_fit_with_no_persistent_one_are_a_mismatch(
    tmp_path: Path,
) -> None:
    """Objects that do not fit the local checkpoints (a changed model) are reloaded from
    the persistent tier, which can reshard; with none there, the mismatch is the answer,
    never ``None`` (nothing saved: a silent fresh start)."""
    manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0)
    manager.save(1, {"model": nn.Linear(4, 3)})
    other = nn.Linear(5, 3)
    before = other.weight.detach().clone()
    with (
        pytest.warns(UserWarning, match="the local checkpoints of step 1 do not fit this run"),
        pytest.raises(CheckpointMismatchError) as caught,
    ):
        manager.load_latest({"model": other})
    manager.close()
    assert str(caught.value) == (
        "the checkpoint does not match the objects being loaded:\n"
        "  mismatched (1): model/weight: checkpoint float32[3, 4], live float32[3, 5]"
    )
    assert torch.equal(other.weight, before)
    assert manager.restored is None


def test_a_newer_persistent_step_that_will_not_load_falls_back_to_the_local_tier(
    tmp_path: Path,
) -> None:
    """The survey takes the persistent tier's newest step from its ``latest`` pointer
    without validating it; if that step then does not load (a data file gone) and the
    persistent tier has no other, the complete local step is restored, not ``None``."""
    local, persistent = tmp_path / "l", tmp_path / "p"
    manager = TieredCheckpointManager(persistent, local, replicas=0, persist_every=4)
    states = {}
    for step in range(1, 5):
        states[step] = trained(step)
        manager.save(step, states[step])
    manager.close()
    assert tree(local).keys() >= {"step-000000003", "step-000000004"}
    shutil.rmtree(local / "step-000000004")  # say, the node's newest write was lost
    (data,) = (persistent / "step-000000004").glob("*.safetensors")
    data.unlink()
    manager = TieredCheckpointManager(persistent, local, replicas=0, persist_every=4)
    live = trained(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the persistent manager's "passing over ..."
        assert manager.load_latest(live) == {}
    manager.close()
    assert manager.restored is not None
    assert (manager.restored.step, manager.restored.tiers) == (3, ["local"])
    assert same(snapshot(live), snapshot(states[3]))


# ------------------------------------------------------------------------ budget


MIB = 1 << 20


def test_a_node_without_room_is_named_with_the_bytes_and_the_fixes() -> None:
    roomy, tight = budget.Report(100 * MIB, 10 << 30, 0), budget.Report(100 * MIB, 500 * MIB, 0)
    reports = [roomy, roomy, tight, tight]
    with pytest.raises(CheckpointError) as caught:
        budget.check(reports, two_by_two(), 1, 2, ["/shm/a"] * 2 + ["/shm/b"] * 2)
    assert type(caught.value) is CheckpointError
    assert str(caught.value) == (
        "the local tier needs 1.76 GiB on the node of ranks [2, 3] (/shm/b): 0.39 GiB "
        "per step (its ranks' checkpoints and the replicas it keeps) x (keep_local=2 + 1 being "
        "written + the newest step every rank has replicated), plus 200.0 MiB (its ranks' "
        "previous step, until it is replicated), but only 0.49 GiB is free there. Lower "
        "keep_local (or replicas, where you set them), save locally less state, or give the "
        "local path more room "
        "(a larger /dev/shm: docker --shm-size, or an NVMe path)"
    )


def test_the_budget_reserves_every_step_that_can_be_on_disk_at_once() -> None:
    """keep_local steps, the newest step every rank replicated (older than those while
    the count lags), the step being written, and the node's own step before it (written,
    its replication in flight): 2 own and 2 replica checkpoints of 100 MiB a step."""
    reports = [budget.Report(100 * MIB, 10 << 30, 0)] * 4
    result = budget.check(reports, two_by_two(), 1, 1, ["x"] * 4)
    assert result == budget.Budget([400 * MIB] * 2, 1, [200 * MIB] * 2)
    assert result.required(0) == (1 + 2) * 400 * MIB + 200 * MIB
    exact = [budget.Report(100 * MIB, 1400 * MIB, 0)] * 4
    budget.check(exact, two_by_two(), 1, 1, ["x"] * 4)
    short = [budget.Report(100 * MIB, 1400 * MIB - 1, 0)] * 4
    with pytest.raises(CheckpointError, match=r"needs 1\.37 GiB on the node of ranks \[0, 1\]"):
        budget.check(short, two_by_two(), 1, 1, ["x"] * 4)


def test_a_node_whose_ranks_share_their_data_parallel_tensors_counts_them_once() -> None:
    """Node 0's 2 ranks each hold 90 MiB of data-parallel tensors of their 100 MiB and
    write them once between them (node_share.py): its own step is 110 MiB, not 200; the
    replicas it keeps of node 1's ranks (which do not share) count whole. Before, every
    rank's whole checkpoint counted, and a node that fits once it shares was refused."""
    reports = [budget.Report(100 * MIB, 10 << 30, 0)] * 4
    result = budget.check(reports, two_by_two(), 1, 1, ["x"] * 4, [90 * MIB, 0])
    assert result == budget.Budget([310 * MIB, 400 * MIB], 1, [110 * MIB, 200 * MIB])
    fits = [budget.Report(100 * MIB, 1040 * MIB, 0)] * 2 + reports[2:]
    budget.check(fits, two_by_two(), 1, 1, ["x"] * 4, [90 * MIB, 0])  # 3 x 310 + 110
    with pytest.raises(CheckpointError, match=r"needs 1\.37 GiB on the node of ranks \[0, 1\]"):
        budget.check(fits, two_by_two(), 1, 1, ["x"] * 4)  # counted whole: 3 x 400 + 200


def test_the_space_older_steps_take_counts_as_free_and_uneven_nodes_add_up() -> None:
    reports = [budget.Report(100 * MIB, 10 << 30, 0)] * 2 + [
        budget.Report(100 * MIB, 500 * MIB, 650 * MIB)
    ] * 2
    assert budget.check(reports, two_by_two(), 1, 2, ["x"] * 4) == budget.Budget(
        [400 * MIB] * 2, 2, [200 * MIB] * 2
    )

    topo = Topology.of(["a", "a", "a", "b"])  # b keeps the replicas of all three of a's ranks
    reports = [budget.Report(n * MIB, 1 << 40, 0) for n in (1, 2, 3, 4)]
    assert budget.check(reports, topo, 1, 1, ["x"] * 4).step_bytes == [10 * MIB, 10 * MIB]
    assert budget.check(reports, topo, 0, 1, ["x"] * 4).step_bytes == [6 * MIB, 4 * MIB]
    small = [*reports[:3], budget.Report(4 * MIB, 19 * MIB, 0)]
    with pytest.raises(CheckpointError, match=r"needs 34\.0 MiB on the node of ranks \[3\] \(b\):"):
        budget.check(small, topo, 1, 1, ["a", "a", "a", "b"])


def test_a_huge_keep_local_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0, keep_local=10**15)
    with pytest.raises(CheckpointError, match=r"^the local tier needs .* \(keep_local=10+ \+ 1 "):
        manager.save(1, trained(0))
    manager.wait()
    manager.close()
    assert manager.budget is None
    assert os.listdir(tmp_path / "l") == []
    assert not (tmp_path / "p").exists() or os.listdir(tmp_path / "p") == []


@pytest.mark.parametrize("local", ["p", "p/step-000000003", "link", "p/../p/"])
def test_a_local_path_that_is_the_persistent_root_or_its_step_directory_is_refused(
    tmp_path: Path, local: str
) -> None:
    """Before, the same directory for both failed the first persistent save ('step-000000002
    is not empty (it holds 'rank-00000')'), after the local tier had written there."""
    (tmp_path / "link").symlink_to("p")
    with pytest.raises(CheckpointError) as caught:
        TieredCheckpointManager(tmp_path / "p", tmp_path / local, replicas=0, persist_every=2)
    assert str(caught.value) == (
        f"the local tier's directory {os.path.abspath(tmp_path / local)} and the persistent "
        f"root {tmp_path / 'p'} are the same directory, or one is a step directory of the "
        "other: both tiers write step-<step> directories there. Give the local tier a "
        "directory of its own (on a tmpfs or an NVMe disk)"
    )
    # The persistent root's lock was let go: a manager with a local path of its own works.
    manager = TieredCheckpointManager(
        tmp_path / "p", tmp_path / "p" / "local", replicas=0, persist_every=2
    )
    assert manager.save(2, trained(0)) == ["local", "persistent"]
    manager.close()
    assert sorted(os.listdir(tmp_path / "p")) == [
        "latest",
        "local",
        "step-000000002",
    ]


def test_a_local_step_older_than_one_saved_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """Steps 5, 6, then 3 (keep_local=1): retention after step 6 deleted step 3 while it
    was being written, on some ranks (a race: "could not write its local checkpoint of
    step 3: No such file or directory"), the others' copies never complete. Now refused
    on every rank alike, as CheckpointManager refuses a step behind its root's newest;
    the same step again, and steps after a restore, are saved as before."""
    manager = TieredCheckpointManager(
        tmp_path / "p", tmp_path / "l", replicas=0, persist_every=None, keep_local=1
    )
    try:
        for step in (5, 6):
            manager.save(step, valued_state(step))
        for save in (manager.save, manager.async_save):
            with pytest.raises(CheckpointError) as caught:
                save(3, valued_state(3))
            assert str(caught.value) == (
                "step 3 is older than step 6, which this TieredCheckpointManager already "
                "saved locally: local steps must not go back. Save that step again to "
                "replace it, or load_latest(state) first to resume from an older step"
            )
        manager.save(6, valued_state(60))
        manager.wait()
        assert os.listdir(tmp_path / "l") == ["step-000000006"]
        live = valued_state(0)
        manager.load_latest(live)
        assert torch.equal(live["t"], valued_state(60)["t"])
        manager.save(7, valued_state(7))
    finally:
        manager.close()
    # After a restore of an older step (the newer one damaged), saving goes on from it.
    again = TieredCheckpointManager(
        tmp_path / "p", tmp_path / "l2", replicas=0, persist_every=None, keep_local=2
    )
    try:
        for step in (5, 6):
            again.save(step, valued_state(step))
        again.wait()
        (tmp_path / "l2" / "step-000000006" / "rank-00000" / "manifest.json").unlink()
        live = valued_state(0)
        assert again.load_latest(live) is not None and again.restored is not None
        assert again.restored.step == 5
        again.save(5, valued_state(50))  # refused before: 5 is older than 6, saved first
        again.wait()
    finally:
        again.close()


def valued_state(value: float) -> dict[str, Any]:
    return {"t": torch.full((4,), float(value))}


def test_a_second_live_manager_on_one_local_directory_is_refused_whatever_its_root(
    tmp_path: Path,
) -> None:
    """A model's manager and its EMA's given one local directory, or one job launched twice
    (same roots): before, each replaced the other's step directories in silence (a
    replica arrived "damaged"), and a restore found the other's state there; a second job
    of the same roots was not even noticed (the review's two-jobs case). Now the second is
    refused while the first lives; once it is closed, a manager of the same run may resume
    from the directory (one of another persistent root is refused: the steps are not its
    run's)."""
    local = tmp_path / "l"
    first = TieredCheckpointManager(tmp_path / "model", local, replicas=0, persist_every=None)
    first.save(1, valued_state(1))
    for root in ("ema", "model"):
        with pytest.raises(CheckpointError) as caught:
            TieredCheckpointManager(tmp_path / root, local, replicas=0, persist_every=None)
        assert str(caught.value) == (
            f"the local tier's directory {local} is in use by another live "
            "TieredCheckpointManager (another job, or a manager of another persistent root "
            "or name): both would write the same step-<step>/rank-<rank> directories, "
            "replacing each other's checkpoints. Give each manager a local directory of its "
            "own"
        )
    first.close()
    with pytest.raises(CheckpointError, match="holds step 1 of another run"):
        TieredCheckpointManager(tmp_path / "ema", local, replicas=0, persist_every=None)
    later = TieredCheckpointManager(tmp_path / "model", local, replicas=0, persist_every=None)
    live = valued_state(0)
    assert later.load_latest(live) is not None and torch.equal(live["t"], valued_state(1)["t"])
    later.close()
    assert os.listdir(local) == ["step-000000001"]  # the locks make no file


def _started_then_asleep(started: Any) -> None:
    started.set()
    time.sleep(30)


def test_a_forked_child_does_not_keep_a_closed_managers_lock(tmp_path: Path) -> None:
    """A DataLoader worker forked while the manager lived shares its lock's open file
    description: the lock outlived the manager's close() for as long as the worker
    lived, and a later manager of another root was refused."""
    import multiprocessing

    local = tmp_path / "l"
    first = TieredCheckpointManager(tmp_path / "model", local, replicas=0, persist_every=None)
    fork = multiprocessing.get_context("fork")
    started = fork.Event()
    worker = fork.Process(target=_started_then_asleep, args=(started,))
    worker.start()
    try:
        assert started.wait(30)  # the child is past its at-fork handlers
        first.close()
        TieredCheckpointManager(tmp_path / "ema", local, replicas=0, persist_every=None).close()
    finally:
        worker.kill()
        worker.join()


def test_a_persistent_step_committed_before_latest_moved_is_restored_not_an_older_local_one(
    tmp_path: Path,
) -> None:
    """A kill between the persistent commit of step 10 and the move of `latest` left the
    pointer on step 5: the restore chose local step 9, and every later save of the run
    refused persistent step 10 ("already holds step 10"), restart after restart."""
    manager = TieredCheckpointManager(
        tmp_path / "p", tmp_path / "l", replicas=0, local_every=3, persist_every=5
    )
    for step in range(1, 11):
        manager.save(step, valued_state(step))
    manager.close()
    (tmp_path / "p" / "latest").write_text("step-000000005")  # the pointer one step behind
    again = TieredCheckpointManager(
        tmp_path / "p", tmp_path / "l", replicas=0, local_every=3, persist_every=5
    )
    live = valued_state(0)
    try:
        assert again.load_latest(live) is not None and again.restored is not None
        assert (again.restored.step, again.restored.tiers) == (10, ["persistent"])
        assert torch.equal(live["t"], valued_state(10)["t"])
        again.save(12, valued_state(12))
    finally:
        again.close()


def test_a_closed_manager_refuses_to_save_by_name_and_closes_twice(tmp_path: Path) -> None:
    """Before, a save after close() staged the state, then raised concurrent.futures'
    RuntimeError 'cannot schedule new futures after shutdown'."""
    manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0, persist_every=2)
    state = trained(0)
    manager.save(1, state)
    manager.close()
    manager.close()
    for save, step in itertools.product((manager.save, manager.async_save), (2, 3)):
        with pytest.raises(CheckpointError) as caught:
            save(step, state)
        assert str(caught.value) == (
            f"this TieredCheckpointManager was closed, so it cannot save step {step}; make a "
            "new one (on every rank) to save again"
        )
    manager.wait()
    assert manager.latest() == 1
    assert os.listdir(tmp_path / "l") == ["step-000000001"]
    assert not (tmp_path / "p").exists() or os.listdir(tmp_path / "p") == []


def test_a_restore_in_the_middle_of_a_run_forgets_the_newer_steps_it_deleted(
    tmp_path: Path,
) -> None:
    """keep_local=1. A run counted step 7 replicated everywhere, then restored step 5 (its
    newer copies damaged), which deletes steps 6 and 7. Before, the record still held 7
    as written and counted everywhere: after the new step 6, retention kept '7' (gone)
    as the step to protect and deleted step 5, the only complete one."""
    node = NodeDir(str(tmp_path))
    for step in (5, 6, 7):
        node.rank_storage(step, 0, create=True).close()
    replicator = Replicator(node, 0, 2, Peers([1], []), None, 1, Counted({7}))
    try:
        replicator.record.written[:] = [5, 6, 7]
        replicator.record.replicated[:] = [5, 6, 7]
        replicator.record.everywhere = 7
        for later in (6, 7):  # what the restore's drop_newer does
            node.remove(later, 0, prune=True)
        replicator.resumed_from(5)
        assert (replicator.record.everywhere, replicator.record.written) == (5, [5])
        node.rank_storage(6, 0, create=True).close()  # the new step 6, not yet counted
        replicator.record.written.append(6)
        replicator._retain(6)
        assert node.steps() == [5, 6]
    finally:
        replicator.close()


def test_the_record_of_a_long_run_holds_the_kept_steps_only(tmp_path: Path) -> None:
    """Before, the replication record kept one entry per step saved (and one save
    number per step), sorted by retention at every step: quadratic over a long run."""
    manager = TieredCheckpointManager(
        tmp_path / "p", tmp_path / "l", replicas=0, persist_every=None, keep_local=2
    )
    state = trained(0)
    try:
        for step in range(1, 14):
            manager.async_save(step, state)
        manager.wait()
        replicator = manager._replicator
        record = replicator.record
        assert (record.written, record.replicated) == ([12, 13], [12, 13])
        assert replicator._save_of == {12: 12, 13: 13}
    finally:
        manager.close()
    assert sorted(os.listdir(tmp_path / "l")) == ["step-000000012", "step-000000013"]


def test_a_local_disk_failing_at_every_step_keeps_a_bounded_number_of_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, every failed local write kept its error (and its traceback's frames) until
    the next wait(): a disk full for a whole run held about 4 KiB per step saved."""

    def full(storage: Any, items: Any, **options: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rank_checkpoint, "write_uncommitted", full)
    manager = TieredCheckpointManager(
        tmp_path / "p", tmp_path / "l", replicas=0, persist_every=None
    )
    state = {"model": nn.Linear(2, 2)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(1, 41):
                manager.async_save(step, state)
            manager._replicator.drain()
            assert len(manager._replicator.record.errors) == replication.KEPT_ERRORS
            with pytest.raises(CheckpointError, match="local checkpoint of step 1: "):
                manager.wait()
            assert manager._replicator.record.errors == []
    finally:
        manager.close()


def test_a_failed_local_write_is_raised_by_wait_naming_its_step_and_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, wait() raised 'a local checkpoint failed: [Errno 28] No space left on
    device': which step was missing, it did not say."""
    write = rank_checkpoint.write_uncommitted

    def full_at_7(storage: Any, items: Any, **options: Any) -> Any:
        if options["step"] == 7:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(storage, items, **options)

    monkeypatch.setattr(rank_checkpoint, "write_uncommitted", full_at_7)
    manager = TieredCheckpointManager(
        tmp_path / "p", tmp_path / "l", replicas=0, persist_every=None, keep_local=3
    )
    try:
        with pytest.warns(UserWarning, match="could not write its local checkpoint of step 7"):
            for step in (6, 7, 8):
                manager.async_save(step, {"model": nn.Linear(2, 2)})
            with pytest.raises(CheckpointError) as caught:
                manager.wait()
    finally:
        manager.close()
    assert str(caught.value) == (
        "rank 0 could not write its local checkpoint of step 7: [Errno 28] No space left on device"
    )
    assert isinstance(caught.value.__cause__, OSError)
    local = tmp_path / "l"
    committed = [
        s
        for s in sorted(os.listdir(local))
        if (local / s / "rank-00000" / "manifest.json").exists()
    ]
    assert committed == ["step-000000006", "step-000000008"]


# ------------------------------------------------------------------------ node_dir


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root`` (links as their target, files as their bytes)."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = f"-> {os.readlink(path)}"
            elif path.is_file():
                out[rel] = path.read_bytes()
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = "other"
    return out


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A committed rank checkpoint of step 7, outside the node directory ``tmp_path/l``."""
    manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "elsewhere", replicas=0)
    manager.save(7, trained(0))
    manager.close()
    return tmp_path / "elsewhere"


def the_same_outside(elsewhere: Path, before: dict[str, Any]) -> None:
    assert tree(elsewhere) == before


@pytest.mark.parametrize("link", ["step", "rank"])
def test_a_link_in_place_of_a_step_or_rank_directory_is_never_followed_or_deleted_through(
    tmp_path: Path, elsewhere: Path, link: str
) -> None:
    local = tmp_path / "l"
    if link == "step":
        local.mkdir()
        (local / STEP7).symlink_to(elsewhere / STEP7)
    else:
        (local / STEP7).mkdir(parents=True)
        (local / STEP7 / RANK0).symlink_to(elsewhere / STEP7 / RANK0)
    outside, inside = tree(elsewhere), tree(local)

    node = NodeDir(str(local))
    assert node.steps() == ([7] if link == "rank" else [])
    assert node.ranks_in(7) == []
    assert list(node.held()) == []
    assert not node.committed(7, 0)
    assert node.used_bytes({0}) == 0
    node.clear_partial(7, 0)
    node.remove(7, 0, prune=True)
    assert tree(local) == inside
    the_same_outside(elsewhere, outside)

    manager = TieredCheckpointManager(tmp_path / "p", local, replicas=0, persist_every=None)
    assert manager.load_latest(trained(1)) is None
    with pytest.warns(UserWarning, match="rank 0 could not write its local checkpoint of step 7"):
        manager.save(7, trained(2))  # writing into the link is refused
    with pytest.raises(CheckpointCorruptError) as caught:
        manager.wait()
    manager.close()
    where = local / STEP7 if link == "step" else local / STEP7 / RANK0
    assert str(caught.value) == (
        f"rank 0 could not write its local checkpoint of step 7: {where} is a symbolic link, "
        "not a directory; shardsafe does not follow it"
    )
    assert tree(local) == inside
    the_same_outside(elsewhere, outside)


def _rank_named_zero(doc: dict[str, Any]) -> None:
    doc["info"]["rank_checkpoint"]["rank"] = "zero"


def test_a_local_copy_holding_rng_state_verifies_and_converts(tmp_path: Path) -> None:
    """A rank checkpoint holds its rank's RNG record as saved, which its load merges into
    one per rank: verify's metadata check called every local copy of a ``Trainer`` run
    (whose state holds ``RNGState()``) "not RNG state", and ``convert`` of one failed its
    own read-back."""
    local = tmp_path / "l"
    manager = TieredCheckpointManager(tmp_path / "p", local, replicas=0, persist_every=None)
    manager.save(7, {**trained(0), "rng": shardsafe.RNGState()})
    manager.close()
    copy = local / STEP7 / RANK0
    assert shardsafe.verify(copy).problems == ()
    # a rank that is none: refused, as the manager refuses it
    forged = forge.forged_copy(copy, tmp_path / "forged", _rank_named_zero)
    assert shardsafe.verify(forged).problems == (
        "the manifest's 'rank_checkpoint' does not hold a rank and a world size",
    )
    shardsafe.convert(copy, tmp_path / "converted", progress=False)
    assert shardsafe.verify(tmp_path / "converted").ok
    python, generator = random.getstate(), torch.get_rng_state()
    try:  # the converted RNG state loads (it was written as saved, which no load took)
        shardsafe.load(tmp_path / "converted", {"rng": shardsafe.RNGState()})
        after_converted = torch.rand(3)
        # and the copy itself, by path, as the one-rank checkpoint convert makes of it
        # (it was refused as "not RNG state")
        state = {**trained(1), "rng": shardsafe.RNGState()}
        shardsafe.load(copy, state)
        assert torch.equal(torch.rand(3), after_converted)
        assert all(map(torch.equal, snapshot(state), snapshot(trained(0))))
    finally:
        random.setstate(python)
        torch.set_rng_state(generator)


def test_a_new_run_saving_behind_an_earlier_runs_local_steps_is_refused(tmp_path: Path) -> None:
    """A second run of the same roots, that did not call load_latest, saved steps 1-2
    beside the first run's 1-3 without a word, and its restart restored the first run's
    step 3 over its own work. Its first save is refused; after load_latest it resumes from
    them, as documented. (A run of another persistent root is refused when it is made:
    test_a_local_directory_another_run_filled_is_refused_not_resumed_from.)"""
    local = tmp_path / "l"
    first = TieredCheckpointManager(tmp_path / "a", local, replicas=0, persist_every=None)
    for step in (1, 2, 3):
        first.save(step, trained(0))
    first.close()
    kept = sorted(os.listdir(local))
    second = TieredCheckpointManager(tmp_path / "a", local, replicas=0, persist_every=None)
    with pytest.raises(CheckpointError) as refused:
        second.save(1, trained(1))
    assert str(refused.value) == (
        f"the local directories ({local}) hold step 3 of an earlier run, at or after step 1 "
        "that this TieredCheckpointManager saves first, and it did not restore from them: a "
        "later restore would take that run's step over this run's. Call load_latest(state) "
        "first to resume from them, or give this run local directories of its own; "
        "shardsafe will not delete them for you. Nothing was written"
    )
    assert sorted(os.listdir(local)) == kept == ["step-000000002", "step-000000003"]
    state = trained(1)
    assert second.load_latest(state) is not None and second.restored.step == 3
    assert all(map(torch.equal, snapshot(state), snapshot(trained(0))))
    second.save(4, state)  # resumed: it goes on
    second.close()
    # a save after the earlier run's steps is not behind them: saved
    third = TieredCheckpointManager(tmp_path / "a", local, replicas=0, persist_every=None)
    third.save(5, trained(2))
    third.close()


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"rank": "zero", "world_size": 1, "step": 7}, "does not hold a rank and a world size"),
        ({}, "does not hold a rank and a world size"),
        ([0, 1], "does not hold a rank and a world size"),
        ({"rank": 5, "world_size": 2, "step": 7}, "names rank 5, outside its world size 2"),
    ],
)
def test_a_forged_rank_copy_record_is_refused_by_load_as_by_verify(
    tmp_path: Path, record: Any, problem: str
) -> None:
    """A load by path of a rank copy whose record holds no valid rank took it as a
    rank copy all the same, where verify refused it."""
    local = tmp_path / "l"
    manager = TieredCheckpointManager(tmp_path / "p", local, replicas=0, persist_every=None)
    manager.save(7, {**trained(0), "rng": shardsafe.RNGState()})
    manager.close()

    def forge_record(doc: dict[str, Any]) -> None:
        doc["info"]["rank_checkpoint"] = record

    forged = forge.forged_copy(local / STEP7 / RANK0, tmp_path / "forged", forge_record)
    message = f"the manifest's 'rank_checkpoint' {problem}"
    assert shardsafe.verify(forged).problems == (message,)
    with pytest.raises(CheckpointCorruptError, match=re.escape(message)):
        shardsafe.load(forged, {**trained(1), "rng": shardsafe.RNGState()})


def test_a_checkpoint_forged_into_a_rank_copy_fails_verify_as_it_fails_load(
    tmp_path: Path,
) -> None:
    """An ordinary checkpoint given a valid rank copy record: its RNG entry (one record
    per rank) is then read as one rank's record, which no load takes; verify passed it."""
    shardsafe.save(tmp_path / "c", {**trained(0), "rng": shardsafe.RNGState()})

    def forge_record(doc: dict[str, Any]) -> None:
        doc.setdefault("info", {})["rank_checkpoint"] = {"rank": 0, "world_size": 1, "step": 1}

    forged = forge.forged_copy(tmp_path / "c", tmp_path / "forged", forge_record)
    problems = shardsafe.verify(forged).problems
    assert len(problems) == 1 and problems[0].startswith("state entry 'rng': "), problems
    python, generator = random.getstate(), torch.get_rng_state()
    try:
        with pytest.raises(CheckpointCorruptError) as refused:
            shardsafe.load(forged, {**trained(1), "rng": shardsafe.RNGState()})
    finally:
        random.setstate(python)
        torch.set_rng_state(generator)
    assert problems[0] == f"state entry 'rng': {refused.value}"


def test_a_copy_holding_a_file_of_yours_is_said_once_and_named_where_a_new_one_goes(
    tmp_path: Path,
) -> None:
    """A copy holding a file shardsafe did not write is not deleted: each removal warned
    twice (the deletion left it, then its manifest went) and again at every later one; a
    new copy of the step was then written beside the file, or refused as one whose file
    "appeared while the checkpoint was being written"."""
    local = tmp_path / "l"
    manager = TieredCheckpointManager(tmp_path / "p", local, replicas=0, persist_every=None)
    manager.save(7, trained(0))
    manager.close()
    copy = local / STEP7 / RANK0
    (copy / "notes.txt").write_text("mine")
    node = NodeDir(str(local))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        node.remove(7, 0)
        node.remove(7, 0)
    assert [str(w.message) for w in caught] == [
        f"shardsafe: removed the manifest of {copy} so that it is never restored, but left "
        "the directory in place: it holds ['notes.txt'], which shardsafe did not write; "
        "delete it yourself"
    ]
    assert sorted(os.listdir(copy)) == ["notes.txt", "shard-00000-of-00001.safetensors"]
    manager = TieredCheckpointManager(tmp_path / "p", local, replicas=0, persist_every=None)
    with pytest.warns(UserWarning, match="rank 0 could not write its local checkpoint of step 7"):
        manager.save(7, trained(2))
    with pytest.raises(CheckpointError) as refused:
        manager.wait()
    manager.close()
    assert str(refused.value) == (
        f"rank 0 could not write its local checkpoint of step 7: {copy} cannot take a new "
        "copy: it holds ['notes.txt'], which shardsafe did not write; delete the directory "
        "(or move those away)"
    )
    assert sorted(os.listdir(copy)) == ["notes.txt", "shard-00000-of-00001.safetensors"]


def test_a_rank_directory_without_a_manifest_is_not_held_and_is_cleared(tmp_path: Path) -> None:
    local = tmp_path / "l"
    manager = TieredCheckpointManager(tmp_path / "p", local, replicas=0, persist_every=None)
    manager.save(7, trained(0))
    (local / STEP7 / RANK0 / "manifest.json").unlink()
    node = NodeDir(str(local))
    assert node.ranks_in(7) == [0]
    assert not node.committed(7, 0)
    assert list(node.held()) == []
    assert manager.load_latest(trained(1)) is None
    node.clear_partial(7, 0)
    assert tree(local) == {STEP7: "dir"}
    manager.save(8, trained(0))
    manager.close()
    run = manager._replicator.run  # this manager's token, then the save's number
    assert len(run) == 32 and list(NodeDir(str(local)).held()) == [Held(8, 0, 1, f"{run}00000002")]


@pytest.mark.parametrize("name", ["manifest.json", "shard-00000-of-00001.safetensors"])
def test_a_fifo_in_place_of_a_file_is_never_opened(tmp_path: Path, name: str) -> None:
    local = tmp_path / "l"
    manager = TieredCheckpointManager(tmp_path / "p", local, replicas=0, persist_every=None)
    manager.save(7, trained(0))
    manager.close()
    fifo = local / STEP7 / RANK0 / name
    fifo.unlink()
    os.mkfifo(fifo)
    node = NodeDir(str(local))
    with fifo_reader_probe(fifo) as probe:
        assert list(node.held()) == []
        assert node.committed(7, 0) == (name != "manifest.json")
        node.used_bytes({0})  # a stat, never an open
        manager = TieredCheckpointManager(tmp_path / "p", local, replicas=0, persist_every=None)
        # a step that would not load: never abandoned for a silent fresh start (a FIFO
        # manifest was taken for an interrupted write, and the run started afresh)
        with pytest.raises(CheckpointCorruptError) as refused:
            manager.load_latest(trained(1))
        why = (
            "its manifest.json is a named pipe (FIFO), not a regular file"
            if name == "manifest.json"
            else f"CheckpointCorruptError: {name} is not a regular file (a named pipe (FIFO))"
        )
        assert f"would not load (step 7 of rank 0: {why}), and no other step" in str(refused.value)
        manager.close()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            node.remove(7, 0, prune=True)  # a FIFO is not shardsafe's: left, with a warning
    assert probe["readers_seen"] == 0
    assert fifo.exists()
    # a regular manifest beside the FIFO is removed, so that the copy is never restored,
    # and that is said once; a copy without one is no step, and is said nothing of (a
    # copy that cannot be cleared is named where a new one is to be written there)
    assert [str(w.message) for w in caught] == (
        []
        if name == "manifest.json"
        else [
            f"shardsafe: removed the manifest of {local / STEP7 / RANK0} so that it is never "
            f"restored, but left the directory in place: it holds [{name!r}], which shardsafe "
            "did not write; delete it yourself"
        ]
    )
    assert not node.committed(7, 0)


def test_a_fifo_in_place_of_a_step_directory_is_passed_over(tmp_path: Path) -> None:
    local = tmp_path / "l"
    local.mkdir()
    os.mkfifo(local / STEP7)
    node = NodeDir(str(local))
    with fifo_reader_probe(local / STEP7) as probe:
        assert node.steps() == [] and node.ranks_in(7) == [] and list(node.held()) == []
        node.remove(7, 0, prune=True)
        with pytest.raises(CheckpointCorruptError, match="is a named pipe"):
            node.rank_storage(7, 0, create=True)
    assert probe["readers_seen"] == 0
    assert sorted(os.listdir(local)) == [STEP7]


# ------------------------------------------------------------------ retention


class Counted:
    """A store's count of the ranks that replicated each step: ``steps`` are complete;
    ``written``: the steps every rank has written (by default, the same)."""

    def __init__(self, steps: set[int], written: set[int] | None = None) -> None:
        self.steps = steps
        self.written = steps if written is None else written

    def everywhere(self, step: int, save: int) -> bool:
        return step in self.steps

    def written_everywhere(self, step: int, save: int) -> bool:
        return step in self.written

    def mark(self, step: int, save: int) -> None:
        pass

    def withdraw(self, step: int, save: int) -> bool:
        return step not in self.steps and step not in self.written


def test_a_written_step_not_yet_replicated_never_pushes_a_replicated_one_out(
    tmp_path: Path,
) -> None:
    """keep_local=1: the writer has written step 3 while step 2 is being replicated, and
    step 1 is the newest every rank counted. Retention after step 2 keeps step 2 (its
    window ends at the step it follows); only retention after step 3 may delete it."""
    node = NodeDir(str(tmp_path))
    for step in (1, 2, 3):
        node.rank_storage(step, 0, create=True).close()
    replicator = Replicator(node, 0, 2, Peers([1], []), None, 1, Counted({1}))
    replicator.record.written[:] = [1, 2, 3]
    replicator.record.replicated[:] = [1, 2]
    try:
        replicator._retain(2)
        assert node.steps() == [1, 2, 3]
        replicator._retain(3)
        assert node.steps() == [1, 3]
    finally:
        replicator.close()
    assert retained([1, 2, 3], 1, 1, upto=2) == {1, 2}
    assert retained([1, 2, 3], 2, None, upto=3) == {2, 3}
    assert retained([3], 2, None, upto=3) is None


def test_after_a_restore_the_restored_step_is_kept_until_a_newer_one_is_counted(
    tmp_path: Path,
) -> None:
    """Steps 2 and 3 found at a restore of step 3 (keep_local=1): a new step 4 the store
    has not counted everywhere leaves step 3 in place and deletes step 2; once step 5 is
    counted, step 3 goes too."""
    node = NodeDir(str(tmp_path))
    for step in (2, 3, 4, 5):
        node.rank_storage(step, 0, create=True).close()
    replicator = Replicator(node, 0, 2, Peers([1], []), None, 1, Counted(set()))
    try:
        replicator.resumed_from(3)
        assert replicator.record.everywhere == 3
        replicator.record.written.append(4)
        replicator._retain(4)
        assert node.steps() == [3, 4, 5]
        replicator.tally = Counted({5})
        replicator.record.written.append(5)
        replicator._retain(5)
        assert node.steps() == [5]
    finally:
        replicator.close()


def test_before_any_step_is_replicated_everywhere_the_newest_written_everywhere_is_kept(
    tmp_path: Path,
) -> None:
    """keep_local=1: every rank wrote step 1, then rank 1 was killed before replicating
    it; rank 0 wrote step 2 alone. Before, retention after step 2 deleted step 1 (no step
    counted everywhere: only the window was kept), and the restarted job found no
    complete step on any node. Now step 1 stays until a step is replicated everywhere."""
    node = NodeDir(str(tmp_path))
    for step in (1, 2):
        node.rank_storage(step, 0, create=True).close()
    replicator = Replicator(node, 0, 2, Peers([1], []), None, 1, Counted(set(), {1}))
    try:
        replicator.record.written[:] = [1, 2]
        replicator._retain(2)
        assert node.steps() == [1, 2]
        replicator.tally = Counted({2})
        replicator._retain(2)
        assert node.steps() == [2]
    finally:
        replicator.close()


def test_a_step_saved_again_no_longer_protects_itself_until_counted_again(
    tmp_path: Path,
) -> None:
    """keep_local=1, steps 2 and 3 counted everywhere, then step 3 saved again. Before,
    step 3 stayed "the newest step every rank replicated" though its new copies were on
    no other node yet, and retention after it deleted step 2: a node lost then left no
    complete step in memory. Now step 2 is kept until the new step 3 is counted."""
    node = NodeDir(str(tmp_path))
    for step in (2, 3):
        node.rank_storage(step, 0, create=True).close()
    replicator = Replicator(node, 0, 2, Peers([1], []), None, 1, Counted({2, 3}))
    try:
        replicator.record.written[:] = [2, 3]
        replicator.record.replicated[:] = [2, 3]
        replicator._save_of.update({2: 1, 3: 2})
        assert replicator._replicated_everywhere() == 3
        replicator.tally = Counted({2})  # the new save of step 3: not counted yet
        replicator._saved_again(3)
        assert replicator.record.everywhere == 2
        replicator.record.written.append(3)
        replicator._retain(3)
        assert node.steps() == [2, 3]
        replicator.tally = Counted({2, 3})
        replicator._retain(3)
        assert node.steps() == [3]
    finally:
        replicator.close()


def test_the_restored_step_saved_again_leaves_nothing_older_protected_but_counted(
    tmp_path: Path,
) -> None:
    """Restored step 3, then counted step 4 and saved it again: the restored step is the
    newest older one known complete everywhere, so it is kept until the new step 4 is."""
    node = NodeDir(str(tmp_path))
    for step in (3, 4):
        node.rank_storage(step, 0, create=True).close()
    replicator = Replicator(node, 0, 2, Peers([1], []), None, 1, Counted({4}))
    try:
        replicator.resumed_from(3)
        replicator.record.written.append(4)
        replicator._save_of[4] = 1
        assert replicator._replicated_everywhere() == 4
        replicator.tally = Counted(set())
        replicator._saved_again(4)
        assert replicator.record.everywhere == 3
        replicator.record.written.append(4)
        replicator._retain(4)
        assert node.steps() == [3, 4]
    finally:
        replicator.close()


def test_a_step_whose_local_write_failed_is_saved_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first save of step 7 fails to write (a full disk); saving step 7 again raised a
    raw ``KeyError: 7`` from ``save`` whenever its replication was still in flight: the
    retention that ends it forgets the save number of a step not written, which the
    second save then looked up. (Held up here by a job ahead of it on its thread.)"""
    write = rank_checkpoint.write_uncommitted
    failures = [OSError(errno.ENOSPC, "No space left on device (simulated)")]

    def failing_once(storage: Any, items: Any, **options: Any) -> Any:
        if failures:
            raise failures.pop()
        return write(storage, items, **options)

    monkeypatch.setattr(rank_checkpoint, "write_uncommitted", failing_once)
    manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0)
    state = trained(0)
    held = manager._replicator._sender.submit(time.sleep, 0.3)
    with pytest.warns(UserWarning, match="could not write its local checkpoint of step 7"):
        manager.save(7, state)
    assert not held.done()  # the failed save's replication and retention: still to come
    manager.save(7, state)
    with pytest.raises(CheckpointError, match=r"step 7: \[Errno 28\] No space left"):
        manager.wait()
    live = trained(1)
    assert manager.load_latest(live) is not None
    manager.close()
    assert manager.restored is not None and manager.restored.step == 7
    assert same(snapshot(live), snapshot(state))


def test_a_full_disk_does_not_stop_a_copy_being_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deletion writes the record of what it deletes first; on a full disk that write
    failed (ENOSPC), and nothing could be deleted (retention, a restore's later steps), so
    the disk stayed full. Here the disk is full until the manifest's block is freed (as on
    a real 100%-full tmpfs, checked by hand): the copy is deleted whole."""
    node = NodeDir(str(tmp_path / "local"))
    with node.rank_storage(3, 0, create=True) as storage:
        state = {"w": torch.arange(8.0)}
        rank_checkpoint.write(storage, collect(state, 0, 1), rank=0, world_size=1, step=3)
    copy = tmp_path / "local" / "step-000000003" / "rank-00000"
    commit = LocalStorage.commit

    def full(self: LocalStorage, name: str, data: bytes) -> None:
        if (Path(self.directory) / "manifest.json").exists():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.where(name))
        commit(self, name, data)

    monkeypatch.setattr(LocalStorage, "commit", full)
    node.remove(3, 0, prune=True)
    assert not copy.exists() and os.listdir(tmp_path / "local") == []
    # A failed receipt's files (no manifest) took the last room: no record fits at all.
    with node.rank_storage(4, 1, create=True) as storage:
        sink = storage.create("shard-00000-of-00001.safetensors")
        sink.write(memoryview(b"x" * 100))
        sink.abort()

    def no_room(self: LocalStorage, name: str, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.where(name))

    monkeypatch.setattr(LocalStorage, "commit", no_room)
    node.remove(4, 1, prune=True)
    assert os.listdir(tmp_path / "local") == []


def test_the_same_failure_at_every_step_is_warned_at_its_first_10th_and_100th_step(
    tmp_path: Path,
) -> None:
    """A node whose disk stays full warned at every step (each warning new by its step
    number: one line a second for a whole run); a failure of another kind is warned at
    once, and a warning a filter makes an error is recorded for ``wait()``."""
    replicator = Replicator(NodeDir(str(tmp_path)), 0, 2, Peers([1], [1]), None, 1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, 121):
                replicator._warn(
                    f"rank 0 could not write its local checkpoint of step {step}: "
                    f"{tmp_path}/step-{step:09d}/rank-00000: [Errno 28] No space left on device"
                )
                if step == 50:
                    replicator._warn("rank 0 stopped replicating: the send of step 50 failed")
        said = [str(w.message) for w in caught]
        full = "shardsafe: rank 0 could not write its local checkpoint of step {0}: {1}/"
        full += "step-{0:09d}/rank-00000: [Errno 28] No space left on device"
        assert said == [
            full.format(1, tmp_path),
            full.format(10, tmp_path) + " (the same at 10 steps so far; said again at 100)",
            "shardsafe: rank 0 stopped replicating: the send of step 50 failed",
            full.format(100, tmp_path) + " (the same at 100 steps so far; said again at 1000)",
        ]
        assert replicator.record.errors == []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            replicator._warn("rank 0 does not keep rank 1's replica of step 3: it arrived damaged")
        [raised] = replicator.record.errors
        assert isinstance(raised, UserWarning)
        assert str(raised) == (
            "shardsafe: rank 0 does not keep rank 1's replica of step 3: it arrived damaged"
        )
    finally:
        replicator.close()


def test_the_writer_and_the_sender_warning_at_once_count_every_warning(tmp_path: Path) -> None:
    """The writer's and the sender's threads warn alike; each count is read and bumped
    under a lock, so none is lost and no repeat is said twice. Threads switched every
    microsecond, so that the two steps of a count would interleave without it."""
    import sys
    import threading

    replicator = Replicator(NodeDir(str(tmp_path)), 0, 2, Peers([1], [1]), None, 1)
    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")

            def warn(thread: int) -> None:
                for step in range(thread * 1000, thread * 1000 + 500):
                    replicator._warn(f"rank 0 could not write step {step}: disk full")

            threads = [threading.Thread(target=warn, args=(t,)) for t in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert replicator._warned == {"rank 0 could not write step N: disk full": 2000}
        repeats = sorted(str(w.message).partition(" (")[2] for w in caught)
        assert repeats == [
            "",
            "the same at 10 steps so far; said again at 100)",
            "the same at 100 steps so far; said again at 1000)",
            "the same at 1000 steps so far; said again at 10000)",
        ]
    finally:
        sys.setswitchinterval(switching)
        replicator.close()


def test_a_copy_whose_node_mate_reported_another_file_says_why_it_is_passed_over(
    tmp_path: Path,
) -> None:
    """A node-mate's report of the file it received for this rank's copy (another rank's
    payload: hostile input) that names no such file, or one whose size or checksums
    differ from this copy's manifest, passed the copy over in silence; now it is warned."""
    from shardsafe.tiers import transfer

    fetcher = Fetcher.__new__(Fetcher)
    fetcher.rank, fetcher.node = 1, NodeDir(str(tmp_path))
    fetcher._said = DeferredWarnings()
    name = "shard-00000-of-00001.safetensors"
    arrived = transfer.Arrived(None, None, b"", set(), {name}, None)  # type: ignore[arg-type]
    arrived.__dict__["fingerprints"] = {name: (1024, "0a1b")}
    reports = [
        {"ok": True, "files": {}},
        {"ok": True, "files": {name: [1, 2, "1024", "0a1b"]}},
        {"ok": True, "files": {name: [1, 2, 1024, "ffff"]}},
        {"ok": True, "files": {name: [1, 2, 2048, "0a1b"]}},
    ]
    said = []
    for report in reports:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fetcher._said:  # said as the restore ends
                assert fetcher._complete(3, arrived, {name: 0}, [report, None]) == "own"
                assert caught == []
        [warning] = caught
        said.append(str(warning.message))
    prefix = "shardsafe: restoring step 3: rank 1's copy is passed over: "
    differs = (
        f"the file {name} that rank 0 received for it is not the one its manifest names "
        "(their sizes or checksums differ)"
    )
    assert said == [
        f"{prefix}rank 0, which was to receive its file {name}, reported none",
        prefix + differs,
        prefix + differs,
        prefix + differs,
    ]
    assert arrived.linked == set()


def test_a_restores_warnings_are_said_as_it_ends_and_an_agreed_error_stays_the_one_raised() -> None:
    """Said where they arise, a restore's warnings were raised on one rank alone under a
    filter that makes them errors, and the other ranks waited for it until the timeout;
    now they are kept until the outermost block ends. Raised there by such a filter, the
    first is raised; but while an error is raised, that error stays the one raised."""
    said = DeferredWarnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with said:
            said.warn("first")
            with said:  # drop_newer inside load_latest: said by the outer block only
                said.warn(RuntimeWarning("second"))
            assert caught == []
        assert [(w.category, str(w.message)) for w in caught] == [
            (UserWarning, "first"),
            (RuntimeWarning, "second"),
        ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=r"^kept$"), said:
            said.warn("kept")
        with pytest.raises(CheckpointError, match=r"^agreed$"), said:
            said.warn("passed over")
            raise CheckpointError("agreed")
        with said:  # nothing kept from before
            pass
        # A warning the filter raised inside a deletion is kept, and said at the end.
        with pytest.raises(UserWarning, match=r"^left in place$"), said:
            with said.keeping():
                warnings.warn("left in place", stacklevel=1)
            reached = True
        assert reached


# ------------------------------------------------------------------------ agreements


def test_a_local_loads_warning_points_at_the_caller_of_load_latest(tmp_path: Path) -> None:
    """A load from the local tier warns through the restore (said as ``load_latest``
    returns), pointing at its caller; it pointed at ``tiers/restore.py``."""
    model = nn.Linear(3, 3)
    saving = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0)
    saving.save(7, {"model": model})
    saving.close()
    manager = TieredCheckpointManager(tmp_path / "p", tmp_path / "l", replicas=0)
    with pytest.warns(UserWarning, match=r"strict=False leaves state\['ema'\]") as seen:
        manager.load_latest({"model": model, "ema": nn.Linear(3, 3)}, strict=False)
    manager.close()
    assert [w.filename for w in seen] == [__file__]
    assert manager.restored is not None and manager.restored.tiers == ["local"]


def test_a_load_that_opens_its_directory_closes_it_and_agrees_on_an_open_that_fails(
    tmp_path: Path,
) -> None:
    """``loading.load_opening`` (the tiered manager's local loads): the directory is
    opened inside the load's plan phase and closed as the load ends; an opener that
    fails is the load's error (agreed on every rank, as any plan failure is)."""
    import shardsafe

    model = nn.Linear(3, 3)
    shardsafe.save(str(tmp_path / "ckpt"), {"model": model})
    expected = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    opened: list[LocalStorage] = []

    def opener() -> LocalStorage:
        opened.append(LocalStorage(str(tmp_path / "ckpt")))
        return opened[-1]

    options = LoadOptions.of()
    loading.load_opening(opener, "test", lambda manifest: {"model": model}, options)
    assert torch.equal(model.weight, expected)
    assert len(opened) == 1 and opened[0]._fd is None  # opened once, and closed

    def gone() -> LocalStorage:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "rank-00001")

    with pytest.raises(CheckpointError, match=r"^FileNotFoundError: \[Errno 2\] No such file"):
        loading.load_opening(gone, "test", lambda manifest: {"model": model}, options)


def _replicator_counting_in(store: Any, tmp_path: Path, rank: int) -> Replicator:
    """Rank ``rank`` of 2 (keep_local=1, no peers) whose steps 1-3 are written here, counted
    in ``store`` (a real one) as saves 1-3, and step 1 counted by the other rank too."""
    node = NodeDir(str(tmp_path))
    for step in (1, 2, 3):
        node.rank_storage(step, rank, create=True).close()
    tally = Tally(store, "t", 2)
    replicator = Replicator(node, rank, 2, Peers([], []), None, 1, tally)
    replicator.record.written[:] = [1, 2, 3]
    replicator.record.replicated[:] = [1, 2, 3]
    replicator._save_of.update({1: 1, 2: 2, 3: 3})
    for step in (1, 2, 3):  # this rank counted each of its steps
        tally.mark(step, step)
        tally.mark_written(step, step)
    tally.mark(1, 1)  # and rank 0 step 1: the newest step complete
    tally.mark_written(1, 1)
    return replicator


def test_a_step_another_rank_may_see_complete_is_kept_though_this_ranks_count_lags(
    tmp_path: Path,
) -> None:
    """keep_local=1, rank 1 after step 3: step 1 is the newest step every rank replicated
    (rank 0's count of step 2 is late), but every rank has written step 2, so rank 0 may
    see it complete at any moment. Before, it deleted step 2; rank 0 then counted it, saw it
    complete, deleted step 1, and no step was whole on any node (the review's retention race)."""
    replicator = _replicator_counting_in(dist.HashStore(), tmp_path, 1)
    tally = replicator.tally
    assert tally is not None
    tally.mark_written(2, 2)  # rank 0 has written step 2, not yet replicated it
    try:
        replicator._retain(3)
        assert replicator.node.steps() == [1, 2, 3]
        assert tally.everywhere(2, 2) is False  # the counts were put back as they were
        assert tally.written_everywhere(2, 2) is True
    finally:
        replicator.close()


class _AddsSeen:
    """A real store whose ``add`` requests are kept, to count them."""

    def __init__(self) -> None:
        self.inner, self.adds = dist.HashStore(), []

    def add(self, key: str, value: int) -> int:
        self.adds.append((key, value))
        return int(self.inner.add(key, value))

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))


def test_a_step_found_complete_is_kept_at_later_retentions_without_asking_again(
    tmp_path: Path,
) -> None:
    """A step kept because it had just become complete had its counts taken back and put
    back again at each later retention (four store requests each), until this rank's
    count caught up; it is now remembered as complete."""
    store = _AddsSeen()
    replicator = _replicator_counting_in(store, tmp_path, 1)
    tally = replicator.tally
    assert tally is not None
    tally.mark_written(2, 2)  # rank 0 has written step 2: complete as written everywhere
    try:
        replicator._retain(3)
        assert [a for a in store.adds if a[1] == -1] == [("t/2/2", -1), ("t/w/2/2", -1)]
        store.adds.clear()
        replicator._retain(3)
        replicator._retain(3)
        assert replicator.node.steps() == [1, 2, 3]
        assert [a for a in store.adds if a[0].endswith("/2/2") and a[1] != 0] == []
    finally:
        replicator.close()


def test_a_step_deleted_ahead_of_the_counts_can_never_be_counted_complete(
    tmp_path: Path,
) -> None:
    """keep_local=1, rank 1 after step 3, step 1 complete, step 2 counted by rank 1 alone:
    step 2 is deleted, and its counts taken back, so rank 0's late counts of it leave it
    incomplete: rank 0 keeps step 1, the newest step whole on the nodes."""
    replicator = _replicator_counting_in(dist.HashStore(), tmp_path, 1)
    tally = replicator.tally
    assert tally is not None
    try:
        replicator._retain(3)
        assert replicator.node.steps() == [1, 3]
        tally.mark_written(2, 2)  # rank 0, late
        tally.mark(2, 2)
        assert (tally.everywhere(2, 2), tally.written_everywhere(2, 2)) == (False, False)
        assert (tally.everywhere(1, 1), tally.written_everywhere(1, 1)) == (True, True)
    finally:
        replicator.close()


def test_a_local_directory_another_run_filled_is_refused_not_resumed_from(
    tmp_path: Path,
) -> None:
    """Run B, given run A's local directory (another run_dir, the same local one), resumed
    from A's newest local step by its number alone: A's weights, optimizer and losses."""
    local = tmp_path / "l"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = TieredCheckpointManager(tmp_path / "a", local, replicas=0, persist_every=None)
        for step in (1, 2, 3):
            a.save(step, {"w": torch.full((4,), float(step))})
        a.close()
        shardsafe.CheckpointManager(tmp_path / "b").save(2, {"w": torch.zeros(4)})
        for _ in range(2):  # refused, and refused again: nothing was deleted
            with pytest.raises(shardsafe.CheckpointError) as e:
                TieredCheckpointManager(tmp_path / "b", local, replicas=0, persist_every=None)
            assert str(e.value) == (
                f"the local directory {local} holds step 3 of another run, whose persistent "
                f"tier is {tmp_path}/a (this run's is {tmp_path}/b): give this run a local "
                "directory of its own, or delete that run's steps there if it is over; "
                "shardsafe will not delete them for you"
            )
        a = TieredCheckpointManager(f"{tmp_path}/x/../a", local, replicas=0, persist_every=None)
        live = {"w": torch.zeros(4)}
        a.load_latest(live)  # its own run, spelled otherwise
        a.close()
    assert torch.equal(live["w"], torch.full((4,), 3.0))


@pytest.mark.parametrize("swapped", ["fifo", "symlink"])
def test_a_newest_copy_whose_manifest_is_no_file_is_named_when_the_step_before_is_restored(
    tmp_path: Path, swapped: str
) -> None:
    """A copy whose ``manifest.json`` is a FIFO or a link (no write of shardsafe's leaves
    one) was taken for an interrupted write: the restore went back a step in silence
    (found in review). It is refused by the survey and named, as a damaged copy is."""
    states = {step: trained(step) for step in (1, 2)}
    manager = TieredCheckpointManager(
        tmp_path / "p", tmp_path / "l", persist_every=None, keep_local=2
    )
    for step, state in states.items():
        manager.save(step, state)
    manager.close()
    copy = tmp_path / "l" / "step-000000002" / "rank-00000"
    (copy / "manifest.json").unlink()
    if swapped == "fifo":
        os.mkfifo(copy / "manifest.json")
    else:
        (copy / "manifest.json").symlink_to(
            tmp_path / "l" / "step-000000001" / "rank-00000" / "manifest.json"
        )
    what = "a named pipe (FIFO)" if swapped == "fifo" else "a symbolic link"
    state = trained(9)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        resumed = TieredCheckpointManager(
            tmp_path / "p", tmp_path / "l", persist_every=None, keep_local=2
        )
        resumed.load_latest(state)
        resumed.close()
    assert resumed.restored is not None and resumed.restored.step == 1
    assert same(snapshot(state), snapshot(states[1]))
    passed = [str(w.message) for w in said if "passing over local checkpoints" in str(w.message)]
    assert passed == [
        "shardsafe: restored step 1, passing over local checkpoints of later steps that would "
        f"not load (step 2 of rank 0: its manifest.json is {what}, not a regular file); they "
        "are deleted with the other copies of later steps"
    ]
