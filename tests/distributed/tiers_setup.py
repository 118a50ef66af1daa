"""A small DDP run under ``TieredCheckpointManager``, shared by the tiered tests: 4 ranks
as 2 simulated nodes of 2 (``SHARDSAFE_NODE``), each node with its own local directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import shardsafe
from shardsafe.tiers import TieredCheckpointManager

PER_NODE = 2


def local_dir(base: str, node: int) -> str:
    return os.path.join(base, f"local-node{node}")


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)))
    model.register_comm_hook(None, _each_gradient_alone)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _each_gradient_alone(_, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """DDP's all-reduce, one gradient at a time. DDP regroups its buckets after a
    process's first step, and 4 ranks' sums over a regrouped bucket round differently (1
    ulp): a resumed run, whose first step is not the run's first, would then differ from
    an uninterrupted one for a reason that has nothing to do with checkpoints."""
    world = dist.get_world_size()
    for grad in bucket.gradients():
        dist.all_reduce(grad)
        grad.div_(world)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and optimizer-state tensor, copied, in a fixed order."""
    found = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        found += [v.clone() for _, v in sorted(opt.state[p].items())]
    return found


def train(
    rank: int,
    world: int,
    base: str,
    steps: int,
    options: dict[str, Any] | None = None,
    per_node: int = PER_NODE,
) -> dict[str, Any]:
    """Resume (if anything is there), train to ``steps`` saving every step; what happened."""
    os.environ["SHARDSAFE_NODE"] = str(rank // per_node)
    model, opt = build()
    state = {"model": model, "optimizer": opt, "rng": shardsafe.RNGState()}
    kwargs = {"local_every": 1, "persist_every": 2, "replicas": 1, **(options or {})}
    manager = TieredCheckpointManager(
        os.path.join(base, "persistent"), local_dir(base, rank // per_node), **kwargs
    )
    try:
        manager.load_latest(state)
        restored = manager.restored
        start = restored.step if restored else 0
        at = {start: tensors(model, opt)}
        losses = []
        for step in range(start + 1, steps + 1):
            gen = torch.Generator().manual_seed(step * 1000 + rank)
            loss = model(torch.randn(4, 8, generator=gen) + torch.rand(1)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            manager.async_save(step, state)
            at[step] = tensors(model, opt)
        manager.wait()
        record = manager._replicator.record
        return {
            "start": start,
            "tiers": restored.tiers if restored else None,
            "losses": losses,
            "at": at,
            "written": list(record.written),
            "replicated": list(record.replicated),
            "received": {k: list(v) for k, v in record.received.items()},
        }
    finally:
        manager.close()


def rank_dirs(base: str, node: int) -> dict[str, list[str]]:
    """``step-...: [rank-...]`` of a node's local directory."""
    root = Path(local_dir(base, node))
    if not root.exists():
        return {}
    return {s.name: sorted(r.name for r in s.iterdir()) for s in sorted(root.iterdir())}
