"""Parallel layouts built from torch's own pieces, for the resharding tests.

A small transformer-shaped model (``tok`` -> ``layers.0`` .. ``layers.N-1`` -> ``out``)
trained under pipeline parallelism the way torchtitan splits it: each stage is a deep
copy of the whole model with the other stages' layers deleted and ``tok``/``out`` set to
``None`` where they do not belong, so parameter names stay the model's own
(``layers.2.lin.weight`` on stage 1). Stages run with ``torch.distributed.pipelining``
(``PipelineStage`` + ``ScheduleGPipe``) over gloo; data parallelism across a stage's
replicas is an all-reduce of its gradients over the mesh's ``dp`` group (what DDP does),
or ``fully_shard`` over it.

``snapshot`` takes what a user would compare after a resume: every parameter and buffer,
and every optimizer state tensor keyed by parameter name, whole (DTensors gathered).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

D = 8
LAYERS = 4
MICROBATCHES = 2


class Block(nn.Module):
    """A layer with a buffer that counts the rows it has seen (a stand-in for BatchNorm
    statistics: state that is not a parameter and differs between stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.seen += x.shape[0]
        return torch.relu(self.lin(x))


class Net(nn.Module):
    def __init__(self, seed: int = 0, layers: int = LAYERS) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok: nn.Module | None = nn.Linear(D, D)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
        self.out: nn.Module | None = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.out is not None:
            x = self.out(x)
        return x


def stage_of(model: Net, stage: int, stages: int) -> Net:
    """Stage ``stage`` of ``stages``, split as torchtitan splits a model."""
    part = copy.deepcopy(model)
    per = len(part.layers) // stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok = None
    if stage != stages - 1:
        part.out = None
    return part


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def scheduler(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def fsdp(model: Net, mesh: Any = None) -> Net:
    """FSDP2 as torchtitan applies it: ``fully_shard`` on each Block, then the whole model
    (``mesh``: a 1-D mesh, or a 2-D ``("replicate", "shard")`` one for HSDP)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_pipeline(
    stage_module: Net,
    stage: int,
    stages: int,
    opt: torch.optim.Optimizer,
    sched: Any,
    steps: int,
    *,
    pp_group: Any = None,
    dp_group: Any = None,
    replica: int = 0,
) -> None:
    """``steps`` steps of GPipe over ``stages`` stages; gradients averaged over
    ``dp_group`` (the stage's data-parallel replicas) unless it is sharded by FSDP2."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pipe = PipelineStage(stage_module, stage, stages, torch.device("cpu"), group=pp_group)
    schedule = ScheduleGPipe(pipe, MICROBATCHES, loss_fn=loss_fn)
    for step in range(steps):
        x, y = batch(step, replica)
        opt.zero_grad()
        if stage == 0:
            schedule.step(x)
        elif stage == stages - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        if dp_group is not None:
            for p in stage_module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad /= dist.get_world_size(dp_group)
        opt.step()
        sched.step()


def train_whole(
    model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int, replica: int = 0
) -> None:
    """Plain (or FSDP2: gradients reduced by its hooks) training of the whole model."""
    for step in range(steps):
        x, y = batch(step, replica)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        sched.step()


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor's full value (a DTensor gathered: a collective on its mesh)."""
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().clone()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Every parameter and buffer, and every optimizer state tensor by parameter name."""
    state: dict[str, Any] = {f"model/{k}": whole(v) for k, v in model.state_dict().items()}
    if opt is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for group in opt.param_groups:
            for p in group["params"]:
                for k, v in opt.state.get(p, {}).items():
                    state[f"optimizer/{names[id(p)]}/{k}"] = whole(v)
                state[f"lr/{names[id(p)]}"] = group["lr"]
    return state


def assert_same(
    expected: dict[str, Any], actual: dict[str, Any], only: set[str] | None = None
) -> None:
    """Bitwise equal, key for key (``only``: just these keys of ``expected``)."""
    keys = set(expected) if only is None else only
    missing = sorted(keys - set(actual))
    assert not missing, f"not restored: {missing[:5]}"
    for key in sorted(keys):
        a, b = expected[key], actual[key]
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert torch.equal(a, b), f"{key} differs"
        else:
            assert a == b, f"{key}: {a!r} != {b!r}"


def merged(*snapshots: dict[str, Any]) -> dict[str, Any]:
    """The union of several ranks' snapshots (replicas' keys agree, so any copy will do)."""
    out: dict[str, Any] = {}
    for snap in snapshots:
        out.update(snap)
    return out


class AppState:
    """DCP's tutorial wrapper around a model and its optimizer: ``get_state_dict`` hands
    out DTensors under FSDP2, and ``set_state_dict`` wants DTensors back."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
