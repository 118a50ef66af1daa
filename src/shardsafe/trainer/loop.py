"""The training loop, meant to be read straight down.

One process, one rank: the strategy has already joined the process group. Order matters
for an exact resume: RNGs are seeded, the user's data loader, model wrapping and
optimizer are built (any of which may draw random numbers), and only then is a
checkpoint loaded over all of it (weights, optimizer, scheduler, every RNG, the step and
the data position). Nothing after that draws from a global RNG until the first step, so
a resumed run continues exactly as the run that wrote the checkpoint did.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..adapters import RNGState
from ..checkpoint.api import load
from ..checkpoint.background import SaveHandle
from ..checkpoint.loading import read_manifest
from ..checkpoint.manager import CheckpointManager
from ..errors import CheckpointError, CheckpointMismatchError
from ..strategies.base import Strategy
from .config import TrainerConfig
from .data import DataPosition, DataStream, loader_spec
from .metrics import MetricsLog, ProgressBar, say
from .module import TrainingModule, TrainingStep


@dataclass(frozen=True)
class FitResult:
    """What ``Trainer.fit`` returns (on every rank)."""

    step: int
    """The global step the run ended at."""
    loss: float
    """The last step's loss, averaged over ranks (``nan`` if no step ran)."""
    checkpoint: str | None
    """The newest committed checkpoint, if any."""
    seconds: float
    rank: int = 0
    """This process's rank: ``fit`` returns in every worker, so print once with
    ``if result.rank == 0:``."""


def train(
    module: TrainingModule,
    data: object,
    strategy: Strategy,
    config: TrainerConfig,
    resume: str | None,
) -> FitResult:
    started = time.monotonic()
    rank, world_size = strategy.env.rank, strategy.env.world_size
    leader = rank == 0
    checkpoint = find_checkpoint(config, resume)
    if leader and resume == "latest" and checkpoint is None:
        say(f"no checkpoint in {config.checkpoint_dir} yet: starting at step 0")
    seed_everything(config.seed + rank)
    source = data if data is not None else module.train_dataloader()
    spec = loader_spec(source, config.batch_size)
    module.train()
    model = strategy.wrap_model(TrainingStep(module))
    optimizer, scheduler = strategy.configure_optimizers(module)
    state = {**strategy.checkpoint_state(module, optimizer, scheduler), "rng": RNGState()}
    start, position = restore(checkpoint, state, leader)

    stream = DataStream(spec, position, rank=rank, world_size=world_size, seed=config.seed)
    manager = CheckpointManager(config.checkpoint_dir, config.keep_last, warn_if_not_empty=False)
    if config.checkpoint_every:
        manager.check_not_behind(start)  # before the first step, not at the first save
    metrics = MetricsLog(config.metrics_path, after_step=start) if leader else None
    bar = ProgressBar(total=config.max_steps, initial=start, enabled=leader)

    step, loss = start, math.nan
    saving = _Saving(manager, config)
    try:
        for step in range(start + 1, config.max_steps + 1):
            batch, batch_idx = stream.next_batch()
            loss = _step(model, batch, batch_idx, optimizer, scheduler, strategy, saving)
            if metrics is not None:
                metrics.log(step, loss)
            bar.update(loss)
            if config.checkpoint_due(step):
                saved = {**state, "trainer": {"step": step, **stream.state()}}
                checkpoint = saving.save(step, saved) or checkpoint
        checkpoint = saving.finish() or checkpoint
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()

    result = FitResult(step, loss, checkpoint, time.monotonic() - started, rank)
    if leader:
        say(summary(result, start, config))
    return result


def _step(
    model: Any,
    batch: Any,
    batch_idx: int,
    optimizer: Any,
    scheduler: Any,
    strategy: Strategy,
    saving: _Saving,
) -> float:
    """One optimization step; the loss, averaged over ranks."""
    step_loss = model(to_device(batch, strategy.device), batch_idx)
    step_loss.backward()
    saving.staged()  # an async save's copies overlap the forward and backward
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return strategy.mean_over_ranks(step_loss.detach())


class _Saving:
    """The run's checkpoints, blocking or in the background (``async_save``)."""

    def __init__(self, manager: CheckpointManager, config: TrainerConfig) -> None:
        self.manager, self.config = manager, config
        self.pending: SaveHandle | None = None

    def save(self, step: int, state: dict[str, Any]) -> str | None:
        """Save ``step``; return the newest committed checkpoint, if this call knows one."""
        if not self.config.async_save:
            return self.manager.save_with(step, state, self.config.save_options)
        done = self.manager.wait() if self.pending is not None else None  # one in flight
        self.pending = self.manager.async_save_with(
            step, state, self.config.save_options, overlap=True
        )
        return done

    def staged(self) -> None:
        """Before parameters change: an async save's copies must have landed."""
        if self.pending is not None:
            self.pending.wait_staged()

    def finish(self) -> str | None:
        """Wait for the last save; its path once committed (its error otherwise)."""
        self.pending = None
        return self.manager.wait()


def find_checkpoint(config: TrainerConfig, resume: str | None) -> str | None:
    """The checkpoint a run starts from; refuses to start over an existing run by accident."""
    manager = CheckpointManager(config.checkpoint_dir, warn_if_not_empty=False)
    if resume is None:
        steps = manager.complete_steps()
        if steps:
            raise CheckpointError(
                f"{config.checkpoint_dir} already holds checkpoints (the newest is step "
                f"{steps[-1]}); pass resume='latest' (--resume latest) to continue that run, "
                "or choose another run_dir to start a new one"
            )
        return None
    if resume == "latest":
        return manager.latest()
    read_manifest(resume)  # a clear error now, before any process has built a model
    return resume


def restore(
    checkpoint: str | None, state: dict[str, Any], leader: bool
) -> tuple[int, DataPosition]:
    """Load ``checkpoint`` into ``state``; return the step and data position it holds."""
    if checkpoint is None:
        return 0, DataPosition()
    values = load(checkpoint, state)
    progress = values.get("trainer")
    if not isinstance(progress, dict) or not all(
        isinstance(progress.get(k), int) for k in ("step", "epoch", "position")
    ):
        raise CheckpointMismatchError(
            f"{checkpoint} was not written by shardsafe.Trainer (it has no 'trainer' entry "
            "with the step and data position), so training cannot resume from it"
        )
    if leader:
        say(f"resuming from {checkpoint} (step {progress['step']})")
    return progress["step"], DataPosition(progress["epoch"], progress["position"])


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (each rank its own seed)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        return
    np.random.seed(seed)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device`` (a no-op on CPU)."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def summary(result: FitResult, start: int, config: TrainerConfig) -> str:
    """The last line a run prints: where it ended, and where its checkpoints and losses are."""
    if result.step == start:
        return f"nothing to train: the run is at step {start} and max_steps={config.max_steps}"
    return (
        f"done: step {result.step} ({result.step - start} steps in {result.seconds:.1f} s), "
        f"final loss {result.loss:.6g}, checkpoint {result.checkpoint or 'none'} (all in "
        f"{config.checkpoint_dir}), losses in {config.metrics_path}"
    )
