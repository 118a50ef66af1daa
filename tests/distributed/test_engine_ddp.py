"""Two real gloo ranks training a plain DDP model with AdamW: save and load in both layouts.

What a user checks: after ``load`` every rank holds bitwise the state it saved (DDP
parameters, rank 0's buffers, every AdamW tensor, param groups, scheduler, its own RNG
streams) and training continues with the very same losses; the sharded layout writes
each replicated tensor once in total (one copy on disk, not one per rank), spread over
both ranks; the consolidated layout is plain weights files; and a checkpoint saved on 2
ranks loads in a single process.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import shardsafe
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)

LAYOUTS = ["sharded", "consolidated"]
SAVED_STEPS = 3
MORE_STEPS = 3


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(32, 8),
    )


def make_training(seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = DDP(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.85, 0.97), weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    return model, opt, sched


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: range) -> list[float]:
    """Data depends on (rank, step); dropout and the loss weight on each rank's RNGs."""
    rank = dist.get_rank()
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        weight = float(np.random.uniform(0.5, 1.5)) * random.uniform(0.5, 1.5)
        loss = ((model(x) - y) ** 2).mean() * weight
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def seed_rank(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def snapshot(model: DDP, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "model": model.module.state_dict(),
            "optimizer": opt.state_dict(),
            "sched": sched.state_dict(),
        }
    )


def draws() -> tuple[torch.Tensor, list[float], float]:
    return torch.rand(4), np.random.rand(3).tolist(), random.random()


def save_then_resume(rank: int, world_size: int, root: str, layout: str) -> dict[str, Any]:
    model, opt, sched = make_training(seed=0, lr=0.05)
    seed_rank(10 + rank)  # each rank has its own random streams
    train(model, opt, sched, range(SAVED_STEPS))
    state = {
        "model": model,
        "optimizer": opt,
        "sched": sched,
        "rng": shardsafe.RNGState(),
        "step": SAVED_STEPS,
    }
    shardsafe.save(os.path.join(root, "full"), state, layout=layout)
    # For the byte accounting: the same model and optimizer, nothing else.
    shardsafe.save(
        os.path.join(root, "model-opt"), {"model": model, "optimizer": opt}, layout=layout
    )
    saved = snapshot(model, opt, sched)
    # The uninterrupted continuation (saving must not have changed anything).
    expected_draws = draws()
    expected_losses = train(model, opt, sched, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))

    # A restarted job: other weights, other hyperparameters, other RNG states.
    model2, opt2, sched2 = make_training(seed=77, lr=0.5)
    seed_rank(99 + rank)
    assert not torch.equal(model2.module[0].weight, saved["model"]["0.weight"])
    returned = shardsafe.load(
        os.path.join(root, "full"),
        {"model": model2, "optimizer": opt2, "sched": sched2, "rng": shardsafe.RNGState()},
    )
    loaded = snapshot(model2, opt2, sched2)
    got_draws = draws()
    got_losses = train(model2, opt2, sched2, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
    return {
        "saved": saved,
        "loaded": loaded,
        "returned": returned,
        "draws": (expected_draws, got_draws),
        "losses": (expected_losses, got_losses),
    }


@pytest.fixture(scope="module", params=LAYOUTS)
def ddp_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One 2-rank run per layout, shared by the tests below: (layout, root, per-rank results)."""
    layout = request.param
    root = tmp_path_factory.mktemp(f"ddp-{layout}")
    return layout, root, run_ranks(save_then_resume, 2, str(root), layout, timeout=150)


# ------------------------------------------------------------------ checks in the parent


def assert_tensors_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(got)
    for k in expected:
        assert expected[k].dtype == got[k].dtype, k
        assert torch.equal(expected[k], got[k]), k


def assert_optimizer_equal(expected: dict[str, Any], got: dict[str, Any]) -> None:
    assert sorted(expected["state"]) == sorted(got["state"])
    assert len(expected["state"]) == 6  # every parameter has AdamW state
    for index, per_param in expected["state"].items():
        assert sorted(per_param) == ["exp_avg", "exp_avg_sq", "step"]
        assert_tensors_equal(per_param, got["state"][index])
    assert got["param_groups"] == expected["param_groups"]
    assert type(got["param_groups"][0]["betas"]) is tuple
    assert got["param_groups"][0]["betas"] == (0.85, 0.97)


def is_buffer(name: str) -> bool:
    return name.startswith("1.running_") or name == "1.num_batches_tracked"


def data_bytes(path: Path) -> tuple[int, list[str]]:
    """Bytes of tensor data in a safetensors file, and its tensor names (read independently)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return len(raw) - 8 - n, [k for k in header if k != "__metadata__"]


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_every_rank_resumes_bitwise(ddp_run: Any) -> None:
    _, _, results = ddp_run
    rank0 = results[0]["saved"]
    # The setup is meaningful: ranks saw different data, so their BatchNorm statistics
    # differ, while DDP kept their parameters identical.
    other = results[1]["saved"]["model"]
    assert not torch.equal(rank0["model"]["1.running_mean"], other["1.running_mean"])
    assert torch.equal(rank0["model"]["0.weight"], other["0.weight"])

    for rank, r in enumerate(results):
        saved, loaded = r["saved"], r["loaded"]
        params = {k: v for k, v in saved["model"].items() if not is_buffer(k)}
        assert_tensors_equal(params, {k: loaded["model"][k] for k in params})
        # Buffers: rank 0's, the ones DDP broadcasts, on every rank.
        buffers = {k: v for k, v in rank0["model"].items() if is_buffer(k)}
        assert_tensors_equal(buffers, {k: loaded["model"][k] for k in buffers})
        assert_optimizer_equal(saved["optimizer"], loaded["optimizer"])
        assert loaded["sched"] == saved["sched"]
        assert loaded["sched"]["last_epoch"] == SAVED_STEPS
        assert r["returned"] == {"step": SAVED_STEPS}
        (e_torch, e_np, e_py), (g_torch, g_np, g_py) = r["draws"]
        assert torch.equal(e_torch, g_torch) and e_np == g_np and e_py == g_py, rank
        expected_losses, got_losses = r["losses"]
        assert got_losses == expected_losses, rank  # bitwise: floats compared with ==
    assert results[0]["draws"][0][2] != results[1]["draws"][0][2]  # per-rank RNG streams


def test_saved_on_two_ranks_loads_in_one_process(ddp_run: Any) -> None:
    _, root, results = ddp_run
    rank0 = results[0]["saved"]
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(0.5, 0.5), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    out = shardsafe.load(root / "full", {"model": model, "optimizer": opt, "sched": sched})
    assert out == {"step": SAVED_STEPS}
    assert_tensors_equal(rank0["model"], model.state_dict())
    assert_optimizer_equal(rank0["optimizer"], opt.state_dict())
    assert sched.state_dict() == rank0["sched"]


def test_replicated_state_is_written_once_in_total(ddp_run: Any) -> None:
    layout, root, results = ddp_run
    rank0 = results[0]["saved"]
    one_copy = nbytes(rank0["model"].values()) + nbytes(
        t for per_param in rank0["optimizer"]["state"].values() for t in per_param.values()
    )
    ckpt = root / "model-opt"
    manifest = shardsafe.read_manifest(ckpt)
    assert manifest.layout == layout and manifest.world_size == 2

    assert sorted(k for k in manifest.tensors if k.startswith("model/")) == sorted(
        f"model/{k}" for k in rank0["model"]
    )
    for key, rec in manifest.tensors.items():
        assert len(rec.chunks) == 1, key  # one copy, not one per rank
        (chunk,) = rec.chunks
        assert chunk.shape == rec.shape and set(chunk.offsets) <= {0}, key

    files = sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".safetensors"))
    assert sorted(manifest.files) == files
    per_file = {name: data_bytes(ckpt / name) for name in files}
    names = [n for _, tensor_names in per_file.values() for n in tensor_names]
    assert len(names) == len(set(names)) == len(manifest.tensors)
    assert sum(b for b, _ in per_file.values()) == one_copy  # one copy of the state, not two
    assert sum(manifest.files.values()) < 1.5 * one_copy  # headers included

    if layout == "sharded":
        assert files == ["shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
        # Both ranks write, neither much more than the other.
        largest = max(rec.nbytes for rec in manifest.tensors.values())
        (b0, names0), (b1, _) = per_file.values()
        assert b0 > 0 and b1 > 0 and abs(b0 - b1) <= largest
        # Buffers are written by rank 0.
        assert {"model/1.running_mean", "model/1.running_var"} <= set(names0)
    else:
        assert files == ["model.safetensors", "optimizer.safetensors"]


def test_files_on_disk(ddp_run: Any) -> None:
    layout, root, results = ddp_run
    assert sorted(p.name for p in root.iterdir()) == ["full", "model-opt"]
    files = sorted(p.name for p in (root / "full").iterdir())
    if layout == "sharded":
        assert files == [
            "manifest.json",
            "shard-00000-of-00002.safetensors",
            "shard-00001-of-00002.safetensors",
        ]
        return
    assert files == [
        "manifest.json",
        "model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
    ]
    weights = load_file(str(root / "full" / "model.safetensors"))
    # Plain weights: the module's own names (no "module." prefix from DDP), rank 0's
    # buffers, bitwise, loadable by torch alone.
    assert_tensors_equal(results[0]["saved"]["model"], weights)
    make_model().load_state_dict(weights)
    # Both ranks' RNG states travelled to rank 0 as raw bytes and were written once each.
    rng = load_file(str(root / "full" / "rng.safetensors"))
    assert {k.split("/")[0] for k in rng} == {"rank-00000", "rank-00001"}
    assert not torch.equal(rng["rank-00000/torch"], rng["rank-00001/torch"])


def load_expecting_error(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model, opt, sched = make_training(seed=5, lr=0.1)
    before = copy.deepcopy(model.module.state_dict())
    state = {"model": model, "optimizer": opt, "sched": sched, "rng": shardsafe.RNGState()}
    try:
        shardsafe.load(path, state)
    except shardsafe.CheckpointError as e:
        error: tuple[str, str] | None = (type(e).__name__, str(e))
    else:
        error = None
    after = model.module.state_dict()
    untouched = all(torch.equal(before[k], after[k]) for k in before) and not opt.state
    return {"error": error, "untouched": untouched}


def test_damage_only_one_rank_reads_fails_every_rank_alike(ddp_run: Any, tmp_path: Path) -> None:
    layout, root, _ = ddp_run
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "full", ckpt)
    # Rank 1's RNG state is read by rank 1 only; flip one byte of it.
    victim = "shard-00001-of-00002.safetensors" if layout == "sharded" else "rng.safetensors"
    name = "rng/rank-00001/torch" if layout == "sharded" else "rank-00001/torch"
    raw = bytearray((ckpt / victim).read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    raw[8 + n + (begin + end) // 2] ^= 0x01
    (ckpt / victim).write_bytes(raw)

    results = run_ranks(load_expecting_error, 2, str(ckpt), timeout=120)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} loaded a damaged checkpoint"
        cls, msg = r["error"]
        assert cls == "CheckpointCorruptError", (rank, cls, msg)
        assert "load failed on rank 1" in msg, msg
        assert f"checksum mismatch in {victim}, tensor 'rng/rank-00001/torch'" in msg, msg
        assert r["untouched"], f"rank {rank} restored state from a checkpoint that failed"
    assert results[0]["error"] == results[1]["error"]
