"""A training setup with every awkward case a ZeRO/OSS checkpoint must survive.

Two param groups with different learning rates, AdamW with weight decay, a parameter
that never receives a gradient, and a frozen parameter that is still handed to the
optimizer (as `model.parameters()` does in fine-tuning code). Data is a pure function
of (step, rank), so an interrupted and an uninterrupted run see the same batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, 4)
        self.head = nn.Linear(4, 4)
        self.head.requires_grad_(False)  # frozen
        self.unused = nn.Parameter(torch.randn(7))  # never gets a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.hidden(h))
        return self.head(self.out(h))


def param_groups(model: Net) -> list[dict[str, Any]]:
    fast = [
        model.inp.weight,
        model.inp.bias,
        model.out.weight,
        model.out.bias,
        model.unused,
        model.head.weight,
        model.head.bias,
    ]
    slow = [model.hidden.weight, model.hidden.bias]
    return [{"params": fast}, {"params": slow, "lr": 3e-3}]


def build(kind: str, seed: int, distributed: bool = True, width: int = 32) -> tuple[Net, Any, Any]:
    """``(model, wrapped model, optimizer)``; kind is "zero", "oss" or "plain"."""
    torch.manual_seed(seed)
    model = Net(width)
    wrapped: Any = DDP(model, find_unused_parameters=True) if distributed else model
    groups = param_groups(model)
    if kind == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: Any = ZeroRedundancyOptimizer(
            groups, optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1
        )
    elif kind == "oss":
        from fairscale.optim import OSS

        opt = OSS(groups, optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    return model, wrapped, opt


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g)


def train(
    wrapped: Any,
    opt: Any,
    start: int,
    steps: int,
    rank: int,
    batch_of: Callable[[int, int], torch.Tensor] = batch,
) -> list[float]:
    """Steps ``start..start+steps`` on batches that depend only on (step, rank); the losses."""
    losses = []
    for step in range(start, start + steps):
        loss = wrapped(batch_of(step, rank)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def torch_consolidated(opt: Any, rank: int) -> dict[str, Any] | None:
    """What torch's / fairscale's own consolidation reports, on rank 0."""
    if hasattr(opt, "consolidate_state_dict"):
        if type(opt).__name__ == "OSS":
            opt.consolidate_state_dict(recipient_rank=0)
        else:
            opt.consolidate_state_dict(to=0)
        return _clone(opt.state_dict()) if rank == 0 else None
    return _clone(opt.state_dict()) if rank == 0 else None


def _clone(sd: dict[str, Any]) -> dict[str, Any]:
    state = {
        i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in sd["state"].items()
    }
    return {"state": state, "param_groups": [dict(g) for g in sd["param_groups"]]}


def assert_same_optimizer_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Every state tensor bitwise equal, every hyperparameter equal (type included)."""
    assert sorted(got["state"]) == sorted(want["state"]), (
        sorted(got["state"]),
        sorted(want["state"]),
    )
    for index, want_state in want["state"].items():
        got_state = got["state"][index]
        assert sorted(got_state) == sorted(want_state)
        for name, value in want_state.items():
            if isinstance(value, torch.Tensor):
                assert got_state[name].dtype == value.dtype, (index, name)
                assert torch.equal(got_state[name], value), (index, name)
            else:
                assert got_state[name] == value, (index, name)
    assert len(got["param_groups"]) == len(want["param_groups"])
    for g, w in zip(got["param_groups"], want["param_groups"]):
        assert g.keys() == w.keys()
        for key in w:
            assert type(g[key]) is type(w[key]) and g[key] == w[key], (key, g[key], w[key])
