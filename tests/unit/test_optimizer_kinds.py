"""Optimizers whose state is not one tensor per parameter shaped like it, in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe


def lbfgs(seed: int, steps: int) -> tuple[nn.Module, torch.optim.LBFGS, list[float]]:
    """A model and its LBFGS after ``steps`` steps on fixed data; the losses of those steps."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.LBFGS(model.parameters(), history_size=3, max_iter=4)
    return model, opt, lbfgs_steps(model, opt, steps)


def lbfgs_steps(model: nn.Module, opt: torch.optim.LBFGS, steps: int) -> list[float]:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(7))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    return [float(opt.step(closure)) for _ in range(steps)]


def assert_same_lbfgs_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        other = got[name]
        if isinstance(value, list):
            assert [type(v) for v in other] == [type(v) for v in value], name
            pairs = [(a, b) for a, b in zip(other, value) if isinstance(b, torch.Tensor)]
            assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs), name
        elif isinstance(value, torch.Tensor):
            assert other.dtype == value.dtype and torch.equal(other, value), name
        else:
            assert type(other) is type(value) and other == value, name


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
def test_lbfgs_history_round_trips_into_a_fresh_or_stepped_lbfgs(
    tmp_path: Path, stepped: bool
) -> None:
    # LBFGS keeps flat vectors over all parameters (here 23 elements) under its first
    # parameter (3 x 4): the save was accepted, the load refused them as not "shaped like"
    # that parameter.
    model, opt, _ = lbfgs(0, 2)
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    model2, opt2, _ = lbfgs(1, 1 if stepped else 0)
    shardsafe.load(tmp_path / "ckpt", {"model": model2, "optimizer": opt2})

    assert_same_lbfgs_state(opt2.state_dict()["state"][0], opt.state_dict()["state"][0])
    assert lbfgs_steps(model2, opt2, 3) == lbfgs_steps(model, opt, 3)
