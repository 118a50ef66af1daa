"""Each rank's part of the save plan survives its JSON trip from rank 0 unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from shardsafe.checkpoint.plan import plan_parts
from shardsafe.checkpoint.plan.save_plan import plan_save
from tests.unit.test_planner import offers_of


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_a_ranks_part_is_its_share_of_the_plan_after_a_json_round_trip(layout: str) -> None:
    offers = offers_of(
        3,
        {"model/w": (4, 4), "model/b": (4,)},
        {"optimizer/w/exp_avg": [(0, (0, 0), (2, 4)), (1, (2, 0), (1, 4)), (2, (3, 0), (1, 4))]},
        dtype=torch.bfloat16,
    )
    plan = plan_save(offers, layout, ["model", "optimizer"])
    for rank in range(3):
        part = plan_parts.from_part(json.loads(json.dumps(plan_parts.part_of(plan, rank))))
        assert (part.layout, part.world_size, part.tensors) == (layout, 3, {})
        expected = plan.files_of(rank) if layout == "sharded" else plan.files
        assert part.files == expected  # entries, names, dtypes and every source chunk


def test_replicas_are_sampled_alike_whatever_their_memory_layout() -> None:
    """A copy held channels_last (or transposed) sampled other elements than a contiguous
    one, and equal replicas were refused as differing."""
    from shardsafe.checkpoint.plan.offer import sample_checksums

    conv = torch.randn(8, 3, 5, 5)
    table = torch.randn(40, 30)
    alike = [
        (conv, conv.to(memory_format=torch.channels_last)),
        (table, table.t().contiguous().t()),
        (torch.arange(100.0)[::3].clone(), torch.arange(100.0)[::3]),
    ]
    for one, other in alike:
        assert sample_checksums([one]) == sample_checksums([other]), (one.stride(), other.stride())
    assert sample_checksums([table])[0] != sample_checksums([table + 1])[0]
    assert sample_checksums([torch.tensor(2.0), torch.zeros(0), None])[2] is None
