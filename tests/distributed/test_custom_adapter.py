"""A user's own sharded state, supported by a complete ``shardsafe.Adapter`` subclass.

The README's recipe, followed to the letter, for state no built-in adapter knows: a table
whose rows are split across ranks (as a row-sharded embedding is), unevenly when the row
count does not divide. Saved by 2 real gloo ranks in both layouts, it loads at 3 ranks
(each asking only for its new rows), in one process, and refuses a table of another size
with a ``CheckpointMismatchError``. Registration refuses an adapter without a ``kind``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe.adapters import (
    Chunk,
    LoadContext,
    LoadRequests,
    ReadRequest,
    SaveContext,
    SavedValue,
    SaveItem,
)
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)

ROWS, DIM = 10, 3


def global_table() -> torch.Tensor:
    return torch.arange(ROWS * DIM, dtype=torch.float32).reshape(ROWS, DIM) / 7


class RowShardedTable:
    """Rows ``[start, stop)`` of a ``rows x dim`` table: this rank's part only."""

    def __init__(self, rank: int, world_size: int, rows: int = ROWS, fill: float | None = None):
        per = -(-rows // world_size)
        self.rows = rows
        self.start, self.stop = min(rank * per, rows), min((rank + 1) * per, rows)
        full = global_table() if fill is None else torch.full((rows, DIM), fill)
        self.local = full[self.start : self.stop].clone()


class RowShardedTableAdapter(shardsafe.Adapter):
    kind = "row-sharded-table"

    def handles(self, obj: object) -> bool:
        return isinstance(obj, RowShardedTable)

    def save(self, obj: RowShardedTable, ctx: SaveContext) -> SaveItem:
        chunk = Chunk(ctx.key("rows"), obj.local, (obj.rows, DIM), (obj.start, 0))
        return SaveItem(self.kind, {"rows": obj.rows}, [chunk] if obj.local.numel() else [])

    def plan_load(self, obj: RowShardedTable, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        if saved.meta["rows"] != obj.rows:
            return LoadRequests(
                mismatched=[f"{ctx.name}: {saved.meta['rows']} rows, live {obj.rows}"]
            )
        if not obj.local.numel():
            return LoadRequests()
        region = ReadRequest(ctx.key("rows"), (obj.start, 0), tuple(obj.local.shape))
        return LoadRequests(requests=[region])

    def restore(
        self,
        obj: RowShardedTable,
        saved: SavedValue,
        tensors: Mapping[str, torch.Tensor],
        ctx: LoadContext,
    ) -> None:
        if obj.local.numel():
            obj.local.copy_(tensors[ctx.key("rows")])


_REGISTERED: list[bool] = []


def register() -> None:
    """Once per process: the test process and each rank's process are separate."""
    if not _REGISTERED:
        shardsafe.register_adapter(RowShardedTableAdapter())
        _REGISTERED.append(True)


def save_table(rank: int, world_size: int, path: str, layout: str) -> None:
    register()
    shardsafe.save(path, {"table": RowShardedTable(rank, world_size), "note": "x"}, layout=layout)


def load_table(rank: int, world_size: int, path: str) -> tuple[int, int, torch.Tensor]:
    register()
    table = RowShardedTable(rank, world_size, fill=-1.0)
    shardsafe.load(path, {"table": table})
    return table.start, table.stop, table.local


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_a_user_adapter_saves_and_reshards_its_own_state(tmp_path: Path, layout: str) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(save_table, 2, path, layout)
    saved = shardsafe.read_manifest(path)
    assert saved.values["table"].kind == "row-sharded-table"
    assert saved.tensors["table/rows"].shape == (ROWS, DIM)
    parts = run_ranks(load_table, 3, path)
    assert [(start, stop) for start, stop, _ in parts] == [(0, 4), (4, 8), (8, 10)]
    for start, stop, local in parts:
        assert torch.equal(local, global_table()[start:stop])
    register()
    start, stop, local = load_table(0, 1, path)  # one process, no process group
    assert (start, stop) == (0, ROWS) and torch.equal(local, global_table())
    with pytest.raises(shardsafe.CheckpointMismatchError, match="table: 10 rows, live 12"):
        shardsafe.load(path, {"table": RowShardedTable(0, 1, rows=12)})


class NoKind(shardsafe.Adapter):
    handles = RowShardedTableAdapter.handles
    save = RowShardedTableAdapter.save
    plan_load = RowShardedTableAdapter.plan_load
    restore = RowShardedTableAdapter.restore


class EmptyKind(RowShardedTableAdapter):
    kind = ""


@pytest.mark.parametrize("adapter", [NoKind, EmptyKind])
def test_an_adapter_without_a_kind_is_refused_at_registration(adapter: type) -> None:
    with pytest.raises(TypeError, match=f"adapter {adapter.__name__} has no 'kind': set a class"):
        shardsafe.register_adapter(adapter())
