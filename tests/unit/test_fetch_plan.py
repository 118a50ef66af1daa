"""Which rank of a lost node receives each file its ranks need alike
(``tiers/fetch_plan.py``): a plan every rank computes the same, from the senders'
reports. On real ranks: the lost-node restore of
``tests/distributed/test_tiers_node_share.py`` and ``test_tiers_faults.py``."""

from __future__ import annotations

from pathlib import Path

import torch

import shardsafe
from shardsafe.checkpoint.storage.local import LocalStorage
from shardsafe.tiers import fetch_plan, transfer

NODE_OF = [0, 0, 1, 1, 1]  # ranks 2, 3 and 4 share node 1


def test_a_file_several_ranks_of_a_node_need_alike_is_received_by_one_of_them() -> None:
    part0, part1 = (96, "p0"), (64, "p1")
    copies = {
        2: {"part-0": part0, "part-1": part1, "small": (1, "s2")},
        3: {"part-0": part0, "part-1": part1, "small": (1, "s3")},
    }
    plan = fetch_plan.delegate(copies, NODE_OF)
    # largest first, each to the rank with the fewest bytes so far
    assert plan == {2: {"part-1": 3}, 3: {"part-0": 2}}


def test_files_that_differ_or_only_one_rank_needs_are_received_by_each() -> None:
    copies = {
        2: {"data": (8, "a"), "only-2": (8, "x")},
        3: {"data": (8, "b")},  # same name, other bytes
        0: {"data": (8, "a")},  # the same bytes, but on another node
    }
    assert fetch_plan.delegate(copies, NODE_OF) == {0: {}, 2: {}, 3: {}}


def test_three_ranks_balance_the_files_they_share_and_the_plan_ignores_order() -> None:
    shared = {f"part-{i}": (size, f"d{i}") for i, size in enumerate([50, 40, 30, 20, 10])}
    copies = {2: dict(shared), 3: dict(reversed(shared.items())), 4: dict(shared)}
    plan = fetch_plan.delegate(copies, NODE_OF)
    assert plan == fetch_plan.delegate(dict(reversed(copies.items())), NODE_OF)
    receivers = {name: ({2, 3, 4} - {r for r in plan if name in plan[r]}) for name in shared}
    assert all(len(r) == 1 for r in receivers.values())  # each file received once
    loads = {r: sum(shared[n][0] for n, [who] in receivers.items() if who == r) for r in (2, 3, 4)}
    assert loads == {2: 50, 3: 40 + 10, 4: 30 + 20}  # each to the lightest, in turn
    for elsewhere in plan.values():  # each linked from the one that received it
        assert all(receivers[name] == {mate} for name, mate in elsewhere.items())


def test_only_a_node_with_two_receivers_plans_and_reports_are_checked() -> None:
    assert not fetch_plan.together({2: 0}, NODE_OF)
    assert not fetch_plan.together({0: 2, 2: 0}, NODE_OF)
    assert fetch_plan.together({2: 0, 3: 1}, NODE_OF)
    assert fetch_plan.parse_files({"a": [3, "x"], "b": [True, "y"], "c": "z", 4: [1, "w"]}) == {
        "a": (3, "x")
    }
    assert fetch_plan.parse_files(["a"]) == {}


def test_the_fingerprint_tells_apart_files_whose_bytes_or_keys_differ(tmp_path: Path) -> None:
    def fingerprints(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, str]]:
        shardsafe.save(str(tmp_path / name), tensors)
        with LocalStorage(str(tmp_path / name)) as storage:
            manifest = transfer.manifest_of(storage)[1]
        assert manifest is not None
        return transfer.fingerprints(manifest)

    same = fingerprints("a", {"w": torch.ones(64, 64)})
    assert same and same == fingerprints("b", {"w": torch.ones(64, 64)})
    assert same != fingerprints("c", {"w": torch.full((64, 64), 2.0)})  # other bytes
    assert same != fingerprints("d", {"v": torch.ones(64, 64)})  # under another key
