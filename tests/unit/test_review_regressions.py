"""Regressions for bugs found in review: each test failed before its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.checkpoint.storage.leftovers import marker_bytes
from shardsafe.distributed import Coordinator
from tests.fake_store import FakeStore


def test_a_failure_posted_between_two_reads_is_never_missed() -> None:
    """Rank 1 waits; rank 0 posts an error between rank 1's reads of the two counters."""
    store = FakeStore(multi_get=True)
    coord = Coordinator("save", "/x", timeout=5)
    coord.rank, coord.world_size, coord._store = 1, 2, store
    store.set("commit/ok/1", "null")

    def rank0_fails() -> None:  # exactly what _exchange does on rank 0, in this order
        store.set("commit/error/0", json.dumps({"type": "CheckpointError", "message": "disk full"}))
        slot = store.add("commit/failing", 1)
        store.set(f"commit/failing/{slot}", "0")
        store.add("commit/failed", 1)
        store.add("commit/posted", 1)

    store.add("commit/posted", 1)  # rank 1 posted first
    store.on_first_read = rank0_fails
    with pytest.raises(shardsafe.CheckpointError, match=r"rank 0.*disk full"):
        coord._wait("commit", 5, None)


def _model_and_adam() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_keys_do_not_change_when_a_parameterless_module_joins_the_state(
    tmp_path: Path,
) -> None:
    model, opt = _model_and_adam()
    shardsafe.save(tmp_path / "a", {"model": model, "optimizer": opt})
    shardsafe.save(tmp_path / "b", {"model": model, "loss": nn.MSELoss(), "optimizer": opt})
    keys_a = set(shardsafe.read_manifest(tmp_path / "a").tensors)
    keys_b = set(shardsafe.read_manifest(tmp_path / "b").tensors)
    assert "optimizer/weight/exp_avg" in keys_a and keys_a == keys_b


def test_a_non_strict_load_matching_no_optimizer_parameter_is_an_error(tmp_path: Path) -> None:
    model, opt = _model_and_adam()
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    other, other_opt = _model_and_adam()
    wrapper = nn.Sequential(other)  # every name is now "0.weight": nothing would load
    with pytest.raises(shardsafe.CheckpointMismatchError, match="none of the 2 parameter names"):
        shardsafe.load(tmp_path / "ckpt", {"model": wrapper, "optimizer": other_opt}, strict=False)


def test_save_never_deletes_files_it_did_not_write(tmp_path: Path) -> None:
    target = tmp_path / "hf-model"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"someone else's weights")
    model, _ = _model_and_adam()
    with pytest.raises(shardsafe.CheckpointError, match="not empty"):
        shardsafe.save(target, {"model": model})
    assert (target / "model.safetensors").read_bytes() == b"someone else's weights"
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]


def test_leftovers_of_an_interrupted_save_are_cleared(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    # What an interrupted save leaves: its marker, recording the file it was writing.
    (target / ".shardsafe-incomplete").write_bytes(
        marker_bytes(["shard-00000-of-00004.safetensors"])
    )
    (target / "shard-00000-of-00004.safetensors").write_bytes(b"half written")
    model, _ = _model_and_adam()
    shardsafe.save(target, {"model": model})
    assert sorted(p.name for p in target.iterdir()) == [
        "manifest.json",
        "shard-00000-of-00001.safetensors",
    ]


def test_saving_behind_a_newer_checkpoint_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    model, opt = _model_and_adam()
    state = {"model": model, "optimizer": opt}
    manager = shardsafe.CheckpointManager(tmp_path, keep_last=2)
    for step in (100, 200, 300):
        manager.save(step, state)
    with pytest.raises(shardsafe.CheckpointError, match="already holds step 300, newer than"):
        manager.save(120, state)
    assert manager.complete_steps() == [200, 300]
    assert manager.latest() == str(tmp_path / "step-000000300")
