"""The base of every strategy: the process group, wrapping, and what a checkpoint holds.

A strategy decides how a run uses its processes. The base class does everything that is
the same for all of them, so each strategy is a small sibling class that overrides one
or two methods, never another strategy:

* :meth:`Strategy.setup` creates (or joins) the default process group. It runs *before*
  ``configure_optimizers``, so a module may build a ZeRO or OSS optimizer there itself.
* :meth:`Strategy.wrap_model` is the one method every strategy writes (DDP, FSDP, ...).
* :meth:`Strategy.wrap_optimizer` is identity unless a strategy shards the optimizer.
* :meth:`Strategy.checkpoint_state` hands the *objects* (module, optimizer, scheduler) to
  the checkpoint engine, whose adapters know how each kind of optimizer keeps its state.
  That is why a ZeRO or OSS optimizer built by the user checkpoints correctly under plain
  ``"ddp"``: no strategy ever calls ``optimizer.state_dict()``.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

if TYPE_CHECKING:
    from ..trainer.module import TrainingModule


@dataclass(frozen=True)
class Environment:
    """Where this process sits in the run, as torchrun (or shardsafe's launcher) set it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False
    """True under torchrun or shardsafe's launcher: a failed process exits instead of raising."""


class Strategy(ABC):
    """How a run uses its processes. Subclass it directly; strategies never subclass each other."""

    name: ClassVar[str]
    uses_process_group: ClassVar[bool] = True

    def __init__(self, env: Environment) -> None:
        self.env = env
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
        self.backend = "nccl" if cuda else "gloo"
        self._owns_group = False

    # -- process group ---------------------------------------------------------------------

    def setup(self) -> None:
        """Join the default process group, or create it (from torchrun's environment)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if dist.is_initialized() or not self.uses_process_group:
            return
        if self.env.world_size == 1 and not self.env.launched:
            # One process without a launcher: an in-memory store needs no free port.
            dist.init_process_group(self.backend, store=HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(self.backend, init_method="env://")
        self._owns_group = True

    def teardown(self) -> None:
        """Leave the process group if this strategy created it, after a successful run.

        After a failure the group is left alone: a launched worker exits at once, and the
        first-failure report (``trainer/failures.py``) still needs the group's store.
        """
        if self._owns_group and dist.is_initialized():
            dist.barrier()  # nobody leaves while a peer still needs rank 0's store
            dist.destroy_process_group()
        self._owns_group = False

    def abandon(self) -> None:
        """After a failure, leave the group this strategy made if this process is its only
        member and no launcher started it: nobody else needs its store, and the exception
        goes back to the caller, whose next ``fit`` or ``init_process_group`` in this
        process would otherwise find a stale default group ("trying to initialize the
        default process group twice")."""
        alone = self.env.world_size == 1 and not self.env.launched
        if self._owns_group and alone and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    # -- wrapping ---------------------------------------------------------------------------

    @abstractmethod
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Return what the loop calls for a step; ``model``'s forward runs ``training_step``."""

    def wrap_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer the loop steps; a strategy that shards optimizer state wraps here."""
        return optimizer

    def configure_optimizers(self, module: TrainingModule) -> tuple[Optimizer, LRScheduler | None]:
        """Call ``module.configure_optimizers()`` and wrap its optimizer for this strategy."""
        returned = module.configure_optimizers()
        optimizer, scheduler = returned if isinstance(returned, tuple) else (returned, None)
        if not isinstance(optimizer, Optimizer) or not (
            scheduler is None or isinstance(scheduler, LRScheduler)
        ):
            raise TypeError(
                "configure_optimizers() must return an optimizer or a tuple (optimizer, "
                f"lr_scheduler); it returned {returned!r:.200}"
            )
        if isinstance(scheduler, ReduceLROnPlateau):
            # It is an LRScheduler, but its step() needs a metric: it failed at step 1.
            raise TypeError(
                "configure_optimizers() returned a ReduceLROnPlateau, whose step() needs a "
                "metric; the Trainer steps the scheduler every step without one. Use a "
                "step-based scheduler (StepLR, LambdaLR, CosineAnnealingLR, ...)"
            )
        wrapped = self.wrap_optimizer(optimizer)
        if scheduler is not None and wrapped is not optimizer:
            retarget_scheduler(scheduler, wrapped)
        return wrapped, scheduler

    # -- checkpoints and metrics ------------------------------------------------------------

    def checkpoint_state(
        self, module: TrainingModule, optimizer: Optimizer, scheduler: LRScheduler | None
    ) -> dict[str, Any]:
        """The objects a checkpoint saves and restores, handed as-is to ``shardsafe.save``.

        The engine's adapters find each object's state, sharded or not; override this only
        for state the adapters cannot reach from these objects.
        """
        state: dict[str, Any] = {"model": module, "optimizer": optimizer}
        if scheduler is not None:
            state["scheduler"] = scheduler
        return state

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        """The mean of a scalar over all ranks (every rank gets it)."""
        if self.env.world_size == 1 or not dist.is_initialized():
            return float(value)
        total = value.detach().reshape(1).clone()
        dist.all_reduce(total)
        return float(total / self.env.world_size)


def broadcast_from_rank0(module: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers (what DDP does when it wraps)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)


def retarget_scheduler(scheduler: LRScheduler, optimizer: Optimizer) -> None:
    """Point ``scheduler`` at ``optimizer``, a wrapper replacing the one it was built on.

    The wrapper (ZeRO) adopts the param-group dicts of the optimizer it wraps, so learning
    rates set through either reach the same groups. torch marks an optimizer's ``step`` to
    warn about a scheduler stepped before its optimizer; the wrapper is marked the same way,
    otherwise every run would warn that ``optimizer.step()`` "has been overridden".
    """
    scheduler.optimizer = optimizer
    step = optimizer.step

    @functools.wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked  # type: ignore[method-assign]
