"""Optimizers inside wrappers that only delegate (Accelerate's ``AcceleratedOptimizer``,
Lightning's ``LightningOptimizer``) save and load exactly like the optimizer inside:
a wrapped ZeRO or OSS optimizer is saved sharded, where saving the wrapper through its
``state_dict()`` would fail on every rank with torch's "call consolidate_state_dict"
advice. A wrapper with state of its own beside the inner optimizer's (Lookahead; SAM, whose
stepping optimizer is at .base_optimizer) is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointError
from shardsafe.adapters.registry import adapter_for
from tests.distributed.zero_setup import (
    assert_same_optimizer_state,
    build,
    torch_consolidated,
    train,
)
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)


class Delegating(torch.optim.Optimizer):
    """What Accelerate's ``AcceleratedOptimizer`` is: an Optimizer subclass around the
    real optimizer (``.optimizer``), whose state and groups are the real one's."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # no super().__init__
        self.optimizer = optimizer

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def defaults(self) -> Any:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> Any:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure: Any = None) -> Any:
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


class Lookahead(torch.optim.Optimizer):
    """A wrapper with state of its own (a slow copy of each parameter): not a delegate."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.state: Any = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.state[p] = {"slow": p.detach().clone()}

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups


def wrap(how: str, opt: Any) -> Any:
    if how == "delegating":
        return Delegating(opt)
    from pytorch_lightning.core.optimizer import LightningOptimizer

    return LightningOptimizer(opt)


def save_wrapped(rank: int, world: int, kind: str, how: str, path: str) -> Any:
    _, model, opt = build(kind, seed=0)
    train(model, opt, 0, 3, rank)  # a LightningOptimizer steps only inside a Trainer
    shardsafe.save(path, {"model": model, "optimizer": wrap(how, opt)})
    return torch_consolidated(opt, rank)


def load(rank: int, world: int, kind: str, how: str | None, path: str) -> Any:
    _, model, opt = build(kind, seed=1)
    shardsafe.load(path, {"model": model, "optimizer": wrap(how, opt) if how else opt})
    return torch_consolidated(opt, rank)


@pytest.mark.parametrize(
    ("kind", "how"), [("zero", "delegating"), ("oss", "delegating"), ("zero", "lightning")]
)
def test_a_wrapped_sharded_optimizer_saves_sharded_and_loads_bare_or_wrapped(
    tmp_path: Path, kind: str, how: str
) -> None:
    path = str(tmp_path / "ckpt")
    reference = run_ranks(save_wrapped, 2, kind, how, path)[0]
    assert reference["state"], "the setup must have optimizer state to compare"
    manifest = shardsafe.read_manifest(path)
    assert manifest.values["optimizer"].kind == "optimizer"
    owners = {c.file for k, t in manifest.tensors.items() if "exp_avg" in k for c in t.chunks}
    assert len(owners) == 2, "each rank writes its own share of the optimizer state"

    assert_same_optimizer_state(run_ranks(load, 2, kind, None, path)[0], reference)
    assert_same_optimizer_state(run_ranks(load, 2, kind, how, path)[0], reference)


def test_the_object_an_adapter_gets_is_the_optimizer_inside_a_delegate_only() -> None:
    model = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(model.parameters())
    assert adapter_for(Delegating(adam), "o")[1] is adam
    assert adapter_for(Delegating(Delegating(adam)), "o")[1] is adam
    scheduler = torch.optim.lr_scheduler.StepLR(adam, step_size=1)
    assert adapter_for(scheduler, "o")[1] is scheduler


def test_a_wrapper_with_state_of_its_own_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(3, 2)
    lookahead = Lookahead(torch.optim.Adam(model.parameters()))
    with pytest.raises(CheckpointError) as refused:
        shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": lookahead})
    assert str(refused.value) == (
        "state['optimizer'] (a Lookahead) wraps an optimizer (Adam, at .optimizer) whose "
        "state it does not share: saved as one optimizer, either the Lookahead's state or "
        "the Adam's would be lost. Register an adapter for Lookahead that saves both "
        "(shardsafe.register_adapter)."
    )
    assert not (tmp_path / "ckpt").exists()


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization as commonly copied (github.com/davda54/sam): its own
    state holds the perturbation, the optimizer that steps (and its momentum) is at
    ``.base_optimizer``, sharing SAM's param groups."""

    def __init__(self, params: Any, base: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        super().__init__(params, {"rho": 0.05, **kwargs})
        self.base_optimizer = base(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups


def test_a_wrapper_keeping_the_stepping_optimizer_elsewhere_is_refused(tmp_path: Path) -> None:
    # Saved through SAM's own state, the SGD momentum at .base_optimizer was silently lost:
    # a resume restarted it from zero.
    model = torch.nn.Linear(3, 2)
    sam = SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    sam.base_optimizer.step()
    with pytest.raises(CheckpointError) as refused:
        shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": sam})
    assert str(refused.value) == (
        "state['optimizer'] (a SAM) wraps an optimizer (SGD, at .base_optimizer) whose state "
        "it does not share: saved as one optimizer, either the SAM's state or the SGD's "
        "would be lost. Register an adapter for SAM that saves both "
        "(shardsafe.register_adapter)."
    )
    assert not (tmp_path / "ckpt").exists()


def post_local_sgd(rank: int, world: int, path: str, save: bool) -> tuple[int, int]:
    """torch's ``PostLocalSGDOptimizer`` (its averager's step in its own ``state_dict()``)
    after 7 steps, saved; or a fresh one, loaded. Its step and the inner SGD's step count."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    averager = PeriodicModelAverager(period=4, warmup_steps=2)
    opt = PostLocalSGDOptimizer(optim=inner, averager=averager)
    if save:
        for _ in range(7):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        shardsafe.save(path, {"model": model, "optimizer": opt})
    else:
        shardsafe.load(path, {"model": model, "optimizer": opt})
    return averager.step, len(inner.state)


def test_a_post_local_sgd_optimizer_resumes_its_averaging_schedule(tmp_path: Path) -> None:
    """Taken for a pure delegate, it was saved as the SGD inside: its averager's step was
    dropped in silence (torch's own load_state_dict restores it), and model averaging
    restarted its warm-up at every resume."""
    path = str(tmp_path / "ckpt")
    assert run_ranks(post_local_sgd, 2, path, True) == [(7, 2), (7, 2)]
    assert run_ranks(post_local_sgd, 2, path, False) == [(7, 2), (7, 2)]
