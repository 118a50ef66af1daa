"""How the ranks of a node split the data-parallel tensors they write once between them
(``tiers/node_share.py``): which pieces qualify, and a split every rank computes alike.
On real ranks: ``tests/distributed/test_tiers_node_share.py``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardsafe import CheckpointError
from shardsafe.checkpoint.plan.collecting import collect
from shardsafe.checkpoint.plan.save_plan import FileEntry, FilePlan, SavePlan, split_into_parts
from shardsafe.protocol import Chunk
from shardsafe.tiers import node_share
from shardsafe.tiers.node_dir import NodeDir
from shardsafe.tiers.node_share import NodeShare, _next_split, split
from shardsafe.tiers.rank_checkpoint import candidate

BIG = torch.zeros(512, 512)  # 1 MiB


def test_only_large_replicated_pieces_that_every_rank_holds_alike_are_candidates() -> None:
    assert candidate(Chunk.whole("w", BIG, replicated=True)) == (
        "w",
        "float32",
        (512, 512),
        (0, 0),
        (512, 512),
    )
    assert candidate(Chunk.whole("w", BIG, replicated=False)) is None  # a shard
    assert candidate(Chunk.whole("w", torch.zeros(10), replicated=True)) is None  # small
    buffer = Chunk("w", BIG, (512, 512), (0, 0), replicated=True, lowest_rank_wins=True)
    assert candidate(buffer) is None  # each rank restores its own
    own = Chunk("w", BIG, (512, 512), (0, 0), replicated=True, per_rank_if_different=True)
    assert candidate(own) is None


def test_the_split_is_the_same_in_any_order_and_balances_bytes_largest_first() -> None:
    sizes = {(f"k{i}", "float32", (n,), (0,), (n,)): 4 * n for i, n in enumerate([9, 7, 5, 3, 3])}
    reordered = dict(reversed(list(sizes.items())))
    first, second = split(sizes, 2), split(reordered, 2)
    assert first is not None and first == second
    loads = [sum(n for c, n in sizes.items() if first.part_of[c] == p) for p in (0, 1)]
    assert loads == [4 * 15, 4 * 12]  # 9+3+3 and 7+5: each to the lighter part, in turn
    assert split(sizes, 1) is None and split({}, 2) is None


def test_the_next_split_is_of_the_pieces_every_rank_holds_and_none_if_one_is_unknown() -> None:
    a, b, c = (("a", "float32", (4,), (0,), (4,)), ("b", "float32", (4,), (0,), (4,)),
               ("c", "float32", (4,), (0,), (4,)))  # fmt: skip
    mine = {a: 16, b: 16}
    lists = [
        [[["a", "float32", [4], [0], [4]], 16], [["b", "float32", [4], [0], [4]], 16]],
        [[["a", "float32", [4], [0], [4]], 16], [["c", "float32", [4], [0], [4]], 16]],
    ]
    common = _next_split(mine, ["x", "y"], lists, 2)
    assert common is not None and set(common.part_of) == {a}
    assert _next_split(mine, ["x", None], None, 2) is None  # a rank's write failed early
    assert _next_split(None, ["x", "x"], None, 2) is None
    same = _next_split(mine, ["x", "x"], None, 2)
    assert same is not None and set(same.part_of) == {a, b}
    assert c not in same.part_of


def test_a_rank_stages_its_own_part_and_every_piece_that_is_not_shared(tmp_path: object) -> None:
    state = {"model": torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))}
    items = collect(state, 0, 2)
    share = NodeShare(NodeDir(str(tmp_path)), 1, [0, 1])
    assert share.keep(items) is None  # the first save: every piece
    share.split = split(node_share.candidates(items), 2)
    kept = share.keep(items)
    assert share.split is not None and kept is not None
    keys = [c.key for _, item in items.values() for c in item.chunks]
    staged = {keys[i] for i in kept}
    # The two weights are shared, one each; the biases are small: every rank's own.
    assert staged == {"model/0.bias", "model/1.bias", *[
        k[0] for k, p in share.split.part_of.items() if p == 1
    ]}  # fmt: skip
    assert len([k for k in staged if k.endswith("weight")]) == 1


def test_a_plan_moves_each_shared_entry_to_its_parts_file_in_plan_order() -> None:
    def entry(index: int) -> FileEntry:
        from shardsafe.checkpoint.plan.offer import ChunkOffer

        offer = ChunkOffer(0, index, f"k{index}", torch.float32, (4,), (0,), (4,), False)
        return FileEntry(f"k{index}", f"k{index}", torch.float32, (0,), (4,), (offer,))

    plan = SavePlan("sharded", 1, {}, [FilePlan("shard-00000-of-00001.safetensors", 0,
                                                [entry(i) for i in range(4)])])  # fmt: skip
    parted = split_into_parts(plan, {1: 0, 2: 1, 3: 0}, 2)
    assert [(f.name, [e.key for e in f.entries]) for f in parted.files] == [
        ("shard-00000-of-00001.safetensors", ["k0"]),
        ("part-00000-of-00002.safetensors", ["k1", "k3"]),
        ("part-00001-of-00002.safetensors", ["k2"]),
    ]


def test_a_node_mates_part_file_gone_before_the_link_is_named(tmp_path: Path) -> None:
    """A node-mate reported its part, then its directory (or the file) went: its write
    failed after the exchange and was removed, or the step is being saved again. Linking
    it raised a raw ``FileNotFoundError: [Errno 2] ... 'part-...' -> 'part-...'``."""
    node = NodeDir(str(tmp_path))
    share = NodeShare(node, 0, [0, 1])
    part = "part-00001-of-00002.safetensors"
    record = {"bytes": 10, "crc": {"k": [1]}, "header_crc32": 1}
    messages = [{}, {"ok": True, "files": {part: record}, "inodes": {part: [1, 2]}}]
    written = SimpleNamespace(elsewhere={part: ["k"]})
    gone = tmp_path / "step-000000003" / "rank-00001" / part
    for mate_dir in (False, True):  # its directory gone, or only the file
        if mate_dir:
            node.rank_storage(3, 1, create=True).close()
        storage = node.rank_storage(3, 0, create=True)
        with storage, pytest.raises(CheckpointError) as caught:
            share._link(3, written, storage, messages)  # type: ignore[arg-type]
        assert str(caught.value) == (
            f"{gone}, the part file rank 1 wrote, is gone since it reported it (its write of "
            "the step failed after the exchange, or the step is being saved again)"
        )
