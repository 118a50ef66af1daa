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
