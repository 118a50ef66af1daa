"""Where a run starts: a new run, the newest checkpoint, or a given one.

Without a local tier, the checkpoint is found before any process builds a model
(:func:`find_checkpoint`) and loaded once the state exists (:func:`restore`).

With ``local_checkpoint_dir`` (:func:`restore_tiered`), ``resume="latest"`` asks the
tiered manager for the newest step any tier holds in full: each rank's own node-local
checkpoint (``local``), a copy a peer node kept (``peer``), or ``run_dir/checkpoints``
(``persistent``). That step may be newer than any persistent checkpoint; rank 0 says
which tier it came from. A new run (``resume=None``) or a given checkpoint is refused
when the local tier holds a newer step than the run starts from, as a newer persistent
checkpoint is: going on would leave two histories in one directory, and a later
``resume="latest"`` would pick the wrong one; shardsafe does not delete them for you.
"""

from __future__ import annotations

import os
from typing import Any

from ..checkpoint.api import load
from ..checkpoint.loading import read_manifest
from ..checkpoint.manager import CheckpointManager, step_of
from ..errors import CheckpointError, CheckpointMismatchError
from ..tiers import Restored, TieredCheckpointManager
from .config import TrainerConfig
from .data import DataPosition
from .metrics import say


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


def interrupted_message(config: TrainerConfig) -> str:
    """What a run stopped by Ctrl-C tells its user: the newest checkpoint that would load
    (found on disk now, so an interrupted save is not it) and how to continue from it."""
    latest = CheckpointManager(config.checkpoint_dir, warn_if_not_empty=False).latest()
    if latest is None:
        none = "" if config.checkpoint_every else " (this run saves none: --checkpoint-every N)"
        return (
            f"interrupted before any checkpoint was saved in {config.checkpoint_dir}{none}; "
            "running the same command again starts at step 0"
        )
    local = config.local_checkpoint_dir
    newer = "" if local is None else f" (or from a newer step in the local tier, {local})"
    return (
        f"interrupted. The last good checkpoint is step {step_of(os.path.basename(latest))}: "
        f"{latest}. To continue from it{newer}, run the same command with --resume latest "
        "(Trainer.fit: resume='latest')"
    )


def restore(
    checkpoint: str | None, state: dict[str, Any], leader: bool
) -> tuple[int, DataPosition]:
    """Load ``checkpoint`` into ``state``; return the step and data position it holds."""
    if checkpoint is None:
        return 0, DataPosition()
    step, position = progress_of(load(checkpoint, state), checkpoint)
    if leader:
        say(f"resuming from {checkpoint} (step {step})")
    return step, position


def progress_of(values: dict[str, Any], source: str) -> tuple[int, DataPosition]:
    """The step and data position a Trainer's checkpoint holds (``source`` names it)."""
    progress = values.get("trainer")
    if not isinstance(progress, dict) or not all(
        isinstance(progress.get(k), int) for k in ("step", "epoch", "position")
    ):
        raise CheckpointMismatchError(
            f"{source} was not written by shardsafe.Trainer (it has no 'trainer' entry "
            "with the step and data position), so training cannot resume from it"
        )
    return progress["step"], DataPosition(progress["epoch"], progress["position"])


def restore_tiered(
    tiered: TieredCheckpointManager,
    config: TrainerConfig,
    resume: str | None,
    checkpoint: str | None,
    state: dict[str, Any],
    leader: bool,
) -> tuple[int, DataPosition]:
    """:func:`restore` for a run with a local tier (collective; see the module docstring)."""
    if resume != "latest":
        start, position = restore(checkpoint, state, leader)
        _refuse_newer(tiered, config, start, resume)
        return start, position
    values = tiered.load_latest(state)
    restored = tiered.restored
    if values is None or restored is None:
        if leader:
            say(
                f"no checkpoint in {config.checkpoint_dir} or {config.local_checkpoint_dir} "
                "yet: starting at step 0"
            )
        return 0, DataPosition()
    path = tiered.persistent.path_for(restored.step)
    local = f"step {restored.step} of the local tier in {config.local_checkpoint_dir}"
    step, position = progress_of(values, path if restored.tier == "persistent" else local)
    if leader:
        say(f"resuming from step {step}, from {describe(restored, path)}")
    return step, position


def describe(restored: Restored, persistent_path: str) -> str:
    """Which tier each rank restored from, for the run's log: ``the local tier (every
    rank, 0.02 s)``, ``the local tier for rank(s) 0-1 and the peer tier for rank(s) 2-3
    (...)`` or ``the persistent tier, <path> (...)``."""
    seconds = f"{restored.seconds:.2f} s"
    if all(t == "persistent" for t in restored.tiers):
        return f"the persistent tier, {persistent_path} ({seconds})"
    ranks: dict[str, list[int]] = {}
    for rank, tier in enumerate(restored.tiers):
        ranks.setdefault(tier, []).append(rank)
    if len(ranks) == 1:
        return f"the {restored.tiers[0]} tier (every rank, {seconds})"
    parts = [f"the {tier} tier for rank(s) {_spans(r)}" for tier, r in ranks.items()]
    return f"{' and '.join(parts)} ({seconds})"


def _spans(ranks: list[int]) -> str:
    """``0-3, 6`` for ``[0, 1, 2, 3, 6]``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _refuse_newer(
    tiered: TieredCheckpointManager, config: TrainerConfig, start: int, resume: str | None
) -> None:
    """A new run or a given checkpoint must not start behind the local tier (collective)."""
    newest = tiered.latest()
    if newest is None or (resume is not None and newest <= start):
        return
    how = "this is a new run" if resume is None else f"this run resumes from step {start}"
    raise CheckpointError(
        f"the local tier of this run ({config.local_checkpoint_dir}) or {config.checkpoint_dir} "
        f"holds step {newest}, but {how}. Continue from it with resume='latest' "
        "(--resume latest), or give this run another local_checkpoint_dir (or empty that "
        "one); shardsafe will not delete it for you"
    )
