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
from collections.abc import Mapping
from typing import Any

from ..checkpoint.api import load
from ..checkpoint.finding import where_checkpoints_are
from ..checkpoint.loading import read_manifest
from ..checkpoint.manager import CheckpointManager, step_of
from ..checkpoint.options import LoadOptions
from ..distributed.coordinator import rank_zero_answer
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from ..protocol import SavedValue
from ..tiers import Restored, TieredCheckpointManager
from .config import TrainerConfig
from .data import DataPosition
from .metrics import MetricsLog, say


def find_checkpoint(
    config: TrainerConfig, resume: str | None, manager: CheckpointManager | None = None
) -> str | None:
    """The checkpoint a run starts from; refuses to start over an existing run by accident.

    ``manager``: the one the run saves through, if built already (its bucket is then
    checked once, here, not again at the first save)."""
    if manager is None:
        manager = CheckpointManager(config.checkpoint_dir, warn_if_not_empty=False)
    # A missing bucket, a read-only root (for a run that saves): before any training.
    manager.require_writable_root(saves=config.checkpoint_every is not None)
    if resume is None:
        steps = manager.complete_steps()
        if steps:
            raise CheckpointError(
                f"{config.checkpoint_dir} already holds checkpoints (the newest is step "
                f"{steps[-1]}); pass resume='latest' (--resume latest) to continue that run, "
                "or choose another run_dir to start a new one"
            )
        return None
    checkpoint = manager.latest() if resume == "latest" else resume
    if checkpoint is not None:
        # Clear errors now, before any process has built a model (the launcher's too).
        try:
            values = read_manifest(checkpoint).values
        except CheckpointNotFoundError as e:  # a folder of checkpoints, a run directory
            raise CheckpointNotFoundError(f"{e}{where_checkpoints_are(checkpoint)}") from None
        check_seed(values, config, checkpoint)
        step = saved_progress(values).get("step")
        if resume != "latest" and isinstance(step, int):
            manager.check_not_behind(step)  # as the workers would, after loading it
    return checkpoint


def agreed_checkpoint(
    config: TrainerConfig,
    resume: str | None,
    world_size: int,
    manager: CheckpointManager | None = None,
) -> str | None:
    """:func:`find_checkpoint` on rank 0; its answer, or its error, is every rank's.

    Each rank looking on its own could see the store differently (a request that failed
    on one rank only) and start from another checkpoint than the others, or raise the
    store's error alone while the others built their models and waited for it in a
    collective (on a run with an ``s3://`` run_dir: gloo's 'Connection closed by peer')."""
    if world_size == 1:
        return find_checkpoint(config, resume, manager)
    defaults = LoadOptions()
    return rank_zero_answer(
        "load",
        f"{config.checkpoint_dir}#resume",
        lambda: find_checkpoint(config, resume, manager),
        timeout=defaults.timeout,
        entry_timeout=defaults.entry_timeout,
    )


def agreed_start(
    manager: CheckpointManager, config: TrainerConfig, start: int, world_size: int
) -> MetricsLog | None:
    """Rank 0 checks that ``run_dir`` holds no checkpoint newer than ``start`` and opens
    the run's metrics log (returned on rank 0, ``None`` elsewhere); its error is every
    rank's.

    Each rank listing the checkpoints on its own could see them differently (a node-local
    ``run_dir``, a listing that failed on one rank only, a checkpoint committed in
    between), and a ``metrics.jsonl`` that rank 0 refuses is rank 0's alone: that rank
    raised alone while the others went on into the first step's collective, and failed
    there with gloo's 'Connection closed by peer' or waited for it until the process
    group's timeout (30 minutes). Rank 0 decides, as it does at each save."""
    opened: list[MetricsLog] = []

    def check() -> None:
        manager.check_not_behind(start)
        opened.append(MetricsLog(config.metrics_path, after_step=start))

    if world_size == 1:
        check()
    else:
        defaults = LoadOptions()
        rank_zero_answer(
            "fit",
            f"{manager.root}#start",
            check,
            timeout=defaults.timeout,
            entry_timeout=defaults.entry_timeout,
        )
    return opened[0] if opened else None


def saved_progress(values: Mapping[str, Any]) -> dict[str, Any]:
    """The ``trainer`` entry of a manifest's values or of what ``load`` returned
    (``{}`` if it has none)."""
    progress = values.get("trainer")
    if isinstance(progress, SavedValue):
        progress = progress.meta if progress.kind == "value" else None
    return progress if isinstance(progress, dict) else {}


def check_seed(values: Mapping[str, Any], config: TrainerConfig, source: str) -> None:
    """Refuse to continue a run saved with another ``seed``.

    The seed fixes each epoch's data order (and the built-in example's data): the saved
    position counts samples of *that* order, so a resume with another seed (a forgotten
    ``--seed``) would train on a different order, or different data, from mid-epoch on,
    silently. ``values`` maps names to a manifest's saved values or to what ``load``
    returned; a checkpoint that did not record its seed (older ones) is not checked.
    """
    saved = saved_progress(values).get("seed")
    if isinstance(saved, int) and saved != config.seed:
        raise CheckpointMismatchError(
            f"{source} was saved by a run with seed={saved}, but this run has "
            f"seed={config.seed}: the data order (and data made from the seed) would change "
            f"in the middle of the run. Pass seed={saved} (--seed {saved}) to continue it"
        )


def interrupted_message(config: TrainerConfig) -> str:
    """What a run stopped by Ctrl-C tells its user: the newest checkpoint that would load
    (found on disk now, so an interrupted save is not it) and how to continue from it."""
    latest = CheckpointManager(config.checkpoint_dir, warn_if_not_empty=False).latest()
    local = config.local_checkpoint_dir
    if latest is None and local is not None:
        # The local tier may hold steps: the same command without --resume is refused.
        return (
            f"interrupted before any checkpoint was saved in {config.checkpoint_dir}; the local "
            f"tier ({local}) may hold newer steps. To continue from them, run the same command "
            "with --resume latest (Trainer.fit: resume='latest')"
        )
    if latest is None:
        none = "" if config.checkpoint_every else " (this run saves none: --checkpoint-every N)"
        return (
            f"interrupted before any checkpoint was saved in {config.checkpoint_dir}{none}; "
            "running the same command again starts at step 0"
        )
    newer = "" if local is None else f" (or from a newer step in the local tier, {local})"
    return (
        f"interrupted. The last good checkpoint is step {step_of(os.path.basename(latest))}: "
        f"{latest}. To continue from it{newer}, run the same command with --resume latest "
        "(Trainer.fit: resume='latest')"
    )


def restore(
    checkpoint: str | None, state: dict[str, Any], config: TrainerConfig, leader: bool
) -> tuple[int, DataPosition]:
    """Load ``checkpoint`` into ``state``; return the step and data position it holds."""
    if checkpoint is None:
        return 0, DataPosition()
    try:
        values = load(checkpoint, state)
    except CheckpointCorruptError as e:
        raise damaged(checkpoint, e, config) from e
    step, position = progress_of(values, checkpoint, config)
    if leader:
        say(f"resuming from {checkpoint} (step {step})")
    return step, position


def damaged(checkpoint: str, error: Exception, config: TrainerConfig) -> CheckpointCorruptError:
    """The error of a resume from a damaged checkpoint, saying which and how to go on.

    The load's own error names a file inside the checkpoint only; and ``resume=PATH`` of
    the previous checkpoint is refused while the damaged, newer one is in the run's
    directory, which left the user between two refusals. shardsafe deletes nothing, so
    moving it aside is the user's step.
    """
    return CheckpointCorruptError(
        f"cannot resume from {checkpoint}: {error}. To continue from the checkpoint before "
        f"it, move {checkpoint} out of {config.checkpoint_dir} (shardsafe deletes nothing "
        "for you) and resume with resume='latest' (--resume latest)"
    )


def progress_of(
    values: dict[str, Any], source: str, config: TrainerConfig
) -> tuple[int, DataPosition]:
    """The step and data position a Trainer's checkpoint holds (``source`` names it),
    checked against the run's ``config`` (:func:`check_seed`)."""
    progress = values.get("trainer")
    if not isinstance(progress, dict) or not all(
        isinstance(progress.get(k), int) for k in ("step", "epoch", "position")
    ):
        raise CheckpointMismatchError(
            f"{source} was not written by shardsafe.Trainer (it has no 'trainer' entry "
            "with the step and data position), so training cannot resume from it"
        )
    out_of_range = [
        f"{k}={progress[k]!r:.40}"
        for k in ("step", "epoch", "position")
        if isinstance(progress[k], bool) or not 0 <= progress[k] < PROGRESS_LIMIT
    ]
    if out_of_range:
        # A negative position trained on an empty batch (torch's bare IndexError from
        # collate), a huge epoch overflowed torch's seed, a negative step trained steps
        # that no save could name: each after the checkpoint had been loaded.
        raise CheckpointMismatchError(
            f"{source} holds {', '.join(out_of_range)} in its 'trainer' entry, where a "
            "step and data position are whole numbers from 0 to 2**63 - 1: it is damaged "
            "or was not written by shardsafe.Trainer, so training cannot resume from it"
        )
    check_seed(values, config, source)
    return progress["step"], DataPosition(progress["epoch"], progress["position"])


PROGRESS_LIMIT = 2**63
"""Above every step and data position a run reaches; ``seed + epoch`` stays a seed that
torch takes (below 2**64)."""


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
        start, position = restore(checkpoint, state, config, leader)
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
    source = path if restored.tier == "persistent" else local
    step, position = progress_of(values, source, config)
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
