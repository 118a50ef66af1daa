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
from ..checkpoint.manager import CheckpointManager
from ..strategies.base import Strategy
from .config import TrainerConfig
from .data import DataPosition, DataStream, loader_spec
from .metrics import ProgressBar, say
from .module import TrainingModule, TrainingStep
from .resuming import agreed_checkpoint, agreed_start, restore, restore_tiered
from .saving import Saving, TieredSaving, open_tiers


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
    tiered = config.local_checkpoint_dir is not None
    manager = None  # with a local tier, the tiered manager's (built later: a collective)
    if not tiered:  # one manager finds the checkpoint and saves: one look for the bucket
        manager = CheckpointManager(
            config.checkpoint_dir, config.keep_last, warn_if_not_empty=False
        )
    checkpoint = agreed_checkpoint(config, resume, world_size, manager)
    if leader and resume == "latest" and checkpoint is None and not tiered:
        say(f"no checkpoint in {config.checkpoint_dir} yet: starting at step 0")
    seed_everything(config.seed + rank)
    source = data if data is not None else module.train_dataloader()
    spec = loader_spec(source, config.batch_size)
    module.train()
    model = strategy.wrap_model(TrainingStep(module))
    optimizer, scheduler = strategy.configure_optimizers(module)
    state = {**strategy.checkpoint_state(module, optimizer, scheduler), "rng": RNGState()}
    saving, start, position = _restored(config, resume, checkpoint, state, leader, manager)
    saving.forward_changes_state = any(True for _ in module.buffers())

    stream = DataStream(spec, position, rank=rank, world_size=world_size, seed=config.seed)
    # Before the first step, not at the first save; and for a run that saves nothing too:
    # its metrics.jsonl would lose the newer steps' losses, and its history fork.
    metrics = agreed_start(saving.manager, config, start, world_size)
    bar = ProgressBar(total=config.max_steps, initial=start, enabled=leader)

    step, loss = start, math.nan
    try:
        for step in range(start + 1, config.max_steps + 1):
            batch, batch_idx = stream.next_batch()
            loss = _step(model, batch, batch_idx, optimizer, scheduler, strategy, saving)
            if metrics is not None:
                metrics.log(step, loss)
            bar.update(loss)
            if saving.due(step):
                progress = {"step": step, "seed": config.seed, **stream.state()}
                saved = {**state, "trainer": progress}
                checkpoint = saving.save(step, saved) or checkpoint
        checkpoint = saving.finish() or checkpoint
    except BaseException:
        # Where the error returns to the caller, whose process goes on: nothing is still
        # written once fit has raised. (A launched worker exits at once: its threads end
        # with it, and a restart is not kept waiting for a save to a lost peer.)
        if not strategy.env.launched:
            saving.settle()
        raise
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
    saving.close()

    result = FitResult(step, loss, checkpoint, time.monotonic() - started, rank)
    if leader:
        say(summary(result, start, config))
    return result


def _restored(
    config: TrainerConfig,
    resume: str | None,
    checkpoint: str | None,
    state: dict[str, Any],
    leader: bool,
    manager: CheckpointManager | None,
) -> tuple[Saving, int, DataPosition]:
    """How the run saves (through ``manager``, without a local tier), and the step and
    data position it starts from (``resuming.py``)."""
    if manager is not None:
        start, position = restore(checkpoint, state, config, leader)
        return Saving(manager, config), start, position
    tiered = open_tiers(config, leader)
    start, position = restore_tiered(tiered, config, resume, checkpoint, state, leader)
    return TieredSaving(tiered, config), start, position


def _step(
    model: Any,
    batch: Any,
    batch_idx: int,
    optimizer: Any,
    scheduler: Any,
    strategy: Strategy,
    saving: Saving,
) -> float:
    """One optimization step; the loss, averaged over ranks."""
    saving.before_forward()  # a forward that updates buffers waits for an async save's copies
    step_loss = model(to_device(batch, strategy.device), batch_idx)
    step_loss.backward()
    saving.staged()  # else they overlap the forward and backward
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return strategy.mean_over_ranks(step_loss.detach())


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
    if config.checkpoint_every is None:
        # The checkpoint the run resumed from (maybe another run's) is none of this run's.
        saved = "no checkpoint saved (checkpoint_every is not set)"
        every = config.local_every
        if config.local_checkpoint_dir is not None and result.step // every > start // every:
            saved = (
                f"no checkpoint saved in {config.checkpoint_dir} (checkpoint_every is not "
                f"set), only in the local tier {config.local_checkpoint_dir}"
            )
        elif config.local_checkpoint_dir is not None:  # it said "only in the local tier"
            saved = (
                f"no checkpoint saved: checkpoint_every is not set, and no step from "
                f"{start + 1} to {result.step} is a multiple of local_every={every}"
            )
    else:
        saved = f"checkpoint {result.checkpoint or 'none'} (all in {config.checkpoint_dir})"
    return (
        f"done: step {result.step} ({result.step - start} steps in {result.seconds:.1f} s), "
        f"final loss {result.loss:.6g}, {saved}, losses in {config.metrics_path}"
    )
