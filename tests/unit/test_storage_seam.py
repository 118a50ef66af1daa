"""``load`` takes ``storage=`` as ``save`` does: what makes the storage layer for the
directory, used for every read."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe.checkpoint.storage import LocalStorage


class _Counting(LocalStorage):
    """A local storage that counts what is asked of it (class-wide: a factory makes one
    per directory)."""

    calls: Counter[str] = Counter()

    def open_reader(self, name: str):  # type: ignore[no-untyped-def]
        _Counting.calls["open_reader"] += 1
        return super().open_reader(name)

    def read_small(self, name: str, limit: int) -> bytes:
        _Counting.calls["read_small"] += 1
        return super().read_small(name, limit)


def test_load_reads_through_the_storage_it_is_passed(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    shardsafe.save(tmp_path / "c", {"model": model, "step": 3}, storage=_Counting)
    _Counting.calls.clear()
    out = torch.nn.Linear(4, 3)
    got = shardsafe.load(tmp_path / "c", {"model": out}, storage=_Counting)
    assert torch.equal(out.weight, model.weight) and got == {"step": 3}
    assert _Counting.calls["read_small"] >= 1  # the manifest
    assert _Counting.calls["open_reader"] >= 1  # the data file


def test_a_storage_passed_to_load_decides_where_it_reads(tmp_path: Path) -> None:
    """The factory, not the path's default: a storage that refuses to open makes the load
    fail with its error."""

    class Refusing(LocalStorage):
        def require_directory(self) -> None:
            raise shardsafe.CheckpointNotFoundError(f"refused: {self.directory}")

    shardsafe.save(tmp_path / "c", {"step": 1})
    with pytest.raises(shardsafe.CheckpointNotFoundError, match="refused: "):
        shardsafe.load(tmp_path / "c", {}, storage=Refusing)
