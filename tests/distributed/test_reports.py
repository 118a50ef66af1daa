"""``shardsafe.inspect`` and ``shardsafe.verify`` on a 2-rank pipeline-style checkpoint:
each stage's keys are written by its own rank, a replicated tensor by one of its holders,
and a damaged shard is named with the keys it holds."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from tests.distributed import layouts as L
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _save_stage(rank: int, world: int, path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Save pipeline stage ``rank`` (stepped once, with its optimizer) and a module every
    rank holds alike; return the keys this rank saved with their dtypes and shapes."""
    stage = L.stage_of(L.Net(), rank, world)
    opt = L.adamw(stage)
    sum(p.sum() for p in stage.parameters()).backward()
    opt.step()
    torch.manual_seed(7)
    shared = torch.nn.Linear(3, 2)
    shardsafe.save(path, {"model": stage, "optimizer": opt, "shared": shared})
    out = {f"model/{k}": v for k, v in stage.state_dict().items()}
    for i, (name, _) in enumerate(stage.named_parameters()):
        for what, value in opt.state_dict()["state"][i].items():
            out[f"optimizer/{name}/{what}"] = value
    return {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in out.items()}


@pytest.fixture(scope="module")
def pp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    path = tmp_path_factory.mktemp("pp2") / "ckpt"
    return path, run_ranks(_save_stage, 2, str(path))


def test_inspect_says_which_rank_wrote_which_keys(pp2: tuple[Path, list[dict[str, Any]]]) -> None:
    path, stages = pp2
    report = shardsafe.inspect(path)
    assert (report.layout, report.world_size) == ("sharded", 2)
    tensors = {t.key: t for t in report.tensors}
    shared = {"shared/weight", "shared/bias"}
    assert set(tensors) == set(stages[0]) | set(stages[1]) | shared
    assert not set(stages[0]) & set(stages[1])  # stages hold different keys
    for rank, keys in enumerate(stages):
        for key, (dtype, shape) in keys.items():
            t = tensors[key]
            assert (t.dtype, t.shape, t.writers) == (dtype, shape, (rank,)), key
            assert t.files == (f"shard-0000{rank}-of-00002.safetensors",)
    writer = {key: tensors[key].writers for key in shared}
    assert all(len(w) == 1 for w in writer.values())  # one copy, by one holder
    ranks = {w.rank: w for w in report.writers}
    assert set(ranks) == {0, 1}
    for rank in (0, 1):
        mine = len(stages[rank]) + sum(w == (rank,) for w in writer.values())
        assert ranks[rank].tensors == mine
        assert ranks[rank].files == (f"shard-0000{rank}-of-00002.safetensors",)
        assert ranks[rank].bytes == (path / ranks[rank].files[0]).stat().st_size
    assert {v.name: v.kind for v in report.values} == {
        "model": "module",
        "optimizer": "optimizer",
        "shared": "module",
    }


def test_verify_names_the_damaged_shard_and_the_keys_in_it(
    pp2: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    path, stages = pp2
    assert shardsafe.verify(path).ok
    copy = Path(shutil.copytree(path, tmp_path / "ckpt"))
    shard = copy / "shard-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    report = shardsafe.verify(copy)
    assert not report.ok and (report.data_files, report.tensors) == (2, 2 + len(stages[0]) * 2)
    (problem,) = report.problems
    assert problem.startswith(f"data file {shard.name} is ") and "truncated" in problem
    assert "'model/layers.2.lin.bias'" in problem  # a key of stage 1, the rank that wrote it
