"""The local tier of a Lightning run (``local_checkpoint_dir``): frequent node-local saves,
and a resume from them where Lightning would otherwise start from nothing or from its
``last`` checkpoint.

Saving. Every ``local_every`` optimizer steps, in ``on_train_batch_end`` (where
``ModelCheckpoint`` saves, so the loops' state is the same as in its checkpoints), each
rank saves the checkpoint Lightning would save into the node-local directory through a
:class:`~shardsafe.TieredCheckpointManager` (its local tier, replicated to peer nodes
when the run spans several): staged on the step, written in the background. It holds
the live module and optimizers (each rank its own state) and, as ``lightning``, the rest
of Lightning's dict (loops, callbacks, schedulers, ...). ``on_save_checkpoint`` hooks run
as for any save, but an edited ``checkpoint["state_dict"]`` is not used: the local tier
restores the live module as it was, which is what a crash needs.

``ModelCheckpoint`` stays the persistent tier, untouched: its checkpoints, names,
``save_top_k``, ``last`` and ``best`` are Lightning's. The tiered manager's own
persistent tier is never written (``persist_every=None``) and points at a directory that
never exists (:data:`NO_PERSISTENT`), so it never offers a step.

Resuming (:meth:`LocalTier.resolve`, in front of Lightning's ``resume_start``, which
every restore passes through with the path Lightning resolved):

* ``fit(ckpt_path=None)``, and ``"last"`` when Lightning finds no last checkpoint (it
  passes ``None`` then): the newest step the local tier holds in full, if any, as
  Lightning itself resumes from an HPC checkpoint on SLURM. A local tier belongs to one
  run: give a new run its own ``local_checkpoint_dir``. Where its only steps were saved
  at another world size, refused (as ``load_latest`` refuses them), not a fresh start.
* ``"last"`` (or a path to a ``last*.ckpt`` of a ``ModelCheckpoint`` or an
  ``OnExceptionCheckpoint``'s file): the newer of that checkpoint and the local tier's
  newest step; the local tier on a tie (it is the faster), or when the step of the
  ``last`` checkpoint cannot be read from its manifest (a ``.ckpt`` file). If the tier
  then restores an older step than the ``last`` checkpoint's, or none (its steps would
  not load), that checkpoint is loaded over it.
* Any other path (``"best"``, ``"hpc"``, an explicit one): exactly that checkpoint; local
  steps newer than it are deleted afterwards, with a warning: they belong to the history
  this fit abandons, and a later resume must not pick them.

Every rank follows rank 0's choice. ``validate``/``test``/``predict`` never use the tier.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

from .. import _warnings
from ..checkpoint.loading import read_manifest_from
from ..checkpoint.manager import step_dir_name
from ..checkpoint.options import LoadOptions
from ..checkpoint.storage.locations import is_url, local_path, open_storage
from ..checkpoint.storage.object_placement import committed_copy
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..tiers import Restored, TieredCheckpointManager
from . import hparams, restore, state
from ._namespace import lightning
from .rank_zero import rank_zero_decides

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback
    from pytorch_lightning.trainer.states import TrainerFn
else:
    pl = lightning()
    Callback = pl.callbacks.Callback
    TrainerFn = pl.trainer.states.TrainerFn

NO_PERSISTENT = ".shardsafe-no-persistent-tier"
"""The tiered manager's persistent root, under the local directory: never created."""
_RESOLVING = "_shardsafe_local_tier"


class LocalTier:
    """One strategy's local tier: the options, and the manager while a fit runs."""

    def __init__(self, directory: str | os.PathLike[str], every: int, keep: int) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"local_every={every!r} must be a positive int (steps)")
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep_local={keep!r} must be a positive int (steps)")
        written = os.fspath(directory)
        refusal = (
            f"local_checkpoint_dir={written!r} must be a directory on each node's own disk, "
            "e.g. '/dev/shm/run1' (ModelCheckpoint's dirpath is the persistent tier)"
        )
        if not written or is_url(written):
            raise ValueError(refusal)
        try:
            # As every load reads it (``file:/p``, ``file:///p`` are ``/p``): kept as
            # written, a resume's chosen path never matched the one loaded, and the local
            # step was loaded as an ordinary checkpoint, "without manifest.json" (review).
            self.directory = local_path(written)
        except CheckpointError as e:
            raise ValueError(f"{refusal}: {e}") from None
        self.every, self.keep = every, keep
        self.manager: TieredCheckpointManager | None = None
        self.chosen: str | None = None
        """The path Lightning was given for a resume from this tier."""
        self.instead: tuple[str, int] | None = None
        """The last checkpoint (path, step) a resume chose this tier over: what it loads if
        the tier restores an older step (its newest ones were damaged)."""
        self.restored: Restored | None = None
        self._saved_step = -1

    # -- the fit's lifetime -------------------------------------------------------------------

    def open(self, trainer: Any) -> None:
        """At ``setup`` of a fit (collective): the manager, the saving callback, the resume."""
        self.manager = TieredCheckpointManager(
            os.path.join(self.directory, NO_PERSISTENT),
            self.directory,
            local_every=self.every,
            keep_local=self.keep,
            persist_every=None,
            # Not the path: a node-local directory may be spelt differently on each node.
            name="lightning-local-tier",
        )
        self.chosen, self.restored, self._saved_step = None, None, -1
        self.instead = None
        if not any(isinstance(c, LocalSaves) for c in trainer.callbacks):
            trainer.callbacks.append(LocalSaves(self))
        _guard_resume(trainer._checkpoint_connector, self)

    def close(self) -> None:
        """At ``teardown``: finish the writes in flight (a failed one was warned about)."""
        manager, self.manager = self.manager, None
        if manager is None:
            return
        try:
            manager.wait()
        except CheckpointError as e:
            _warnings.warn(f"shardsafe: the local tier missed a step: {e}")
        finally:
            manager.close()

    # -- saving --------------------------------------------------------------------------------

    def save(self, trainer: pl.Trainer, module: nn.Module, optimizers: Sequence[Optimizer]) -> None:
        """Save the step just taken if it is due (every rank; in ``on_train_batch_end``).

        A local save is each rank's own, with nothing to agree on: a failure to gather
        Lightning's dict (a callback's ``state_dict`` raising) is raised on the rank it
        happened on, which ends the run as any exception in a training step does."""
        step = trainer.global_step
        if self.manager is None or step == self._saved_step or step % self.every:
            return
        self._saved_step = step
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if isinstance(checkpoint, state.FailedDump):
            raise checkpoint.error
        # A state_dict a hook edited (Lightning's WeightAveraging puts the average there and
        # the live weights beside it) is kept as it is, as a checkpoint's: dropped, that
        # callback's resume failed with KeyError: 'state_dict' (found in review).
        record = getattr(trainer.strategy, "_state_dict_record", None)
        edited = record is not None and not record.unchanged(checkpoint.get(state.STATE_DICT))
        dropped = (
            (state.OPTIMIZER_STATES,) if edited else (state.STATE_DICT, state.OPTIMIZER_STATES)
        )
        rest = {k: v for k, v in hparams.plain(checkpoint).items() if k not in dropped}
        saved: dict[str, Any] = {state.MODEL: module, state.LIGHTNING: rest}
        real = state.real_optimizers(optimizers)
        saved.update(zip(state.optimizer_names(len(real)), real))
        self.manager.async_save(step, saved)

    # -- resuming ------------------------------------------------------------------------------

    def resolve(self, path: str | None, trainer: Any, strategy: Any) -> str | None:
        """The path Lightning restores from: ``path``, or this tier's marker (module
        docstring). Collective; rank 0 decides."""
        assert self.manager is not None
        newest = self.manager.latest()
        use_local = newest is not None
        self.instead = None
        if newest is not None and path is not None and _is_last(path, trainer):
            # The same branch on every rank (``latest`` is agreed, ``path`` is Lightning's).
            last = path
            saved = rank_zero_decides(strategy, lambda: _step_of(last), f"reading {last}")
            use_local = saved is None or newest >= saved
            self.instead = None if saved is None else (last, saved)
        elif path is not None:
            use_local = False
        elif newest is None:  # a fresh start, unless that abandons another world's steps
            self.manager._start_afresh(
                "Lightning found no checkpoint to resume from (ckpt_path=None, or 'last' "
                "with no last checkpoint)",
                "resume from a ModelCheckpoint checkpoint with fit(ckpt_path=...), which "
                "reshards, ",
            )
        if not use_local:
            return path
        assert newest is not None
        self.chosen = os.path.join(self.directory, step_dir_name(newest))
        return self.chosen

    def load(
        self, module: nn.Module, optimizers: Sequence[Optimizer], options: LoadOptions
    ) -> tuple[dict[str, Any], restore.Restored] | None:
        """Restore the newest complete step of the tier; Lightning's dict without the module
        and optimizers (as :func:`.restore.load_directory` returns it).

        ``None`` when the step restored is older than the last checkpoint this tier was
        chosen over (:attr:`instead`; its newer steps were damaged, and the manager fell
        back to an older one): the caller loads that checkpoint over it, so ``"last"``
        still resumes from the newest step there is."""
        assert self.manager is not None
        loaded: dict[str, Any] = {state.MODEL: module}
        real = state.real_optimizers(optimizers)
        loaded.update(zip(state.optimizer_names(len(real)), real))
        try:
            values = self.manager.load_latest(
                loaded,
                strict=options.strict,
                entry_timeout=options.entry_timeout,
                timeout=options.timeout,
            )
        except CheckpointCorruptError as e:  # agreed: every rank takes this branch
            if self.instead is None:
                raise
            self._load_instead(f"could restore no step ({e})")
            return None
        self.restored = self.manager.restored
        if self._older_than_instead():
            return None
        if values is None or self.restored is None or self.restored.tier == "persistent":
            raise CheckpointError(
                f"the local tier in {self.directory} could not be restored (see the warning "
                "above: the module's or optimizers' state does not fit what was saved); "
                "resume from a ModelCheckpoint checkpoint with fit(ckpt_path=...)"
            )
        checkpoint = dict(values.get(state.LIGHTNING) or {})
        checkpoint[state.OPTIMIZER_STATES] = [{} for _ in optimizers]
        # An edited state_dict saved with it: Lightning loads it into the module (after
        # the hooks that edited it have read it), as from a checkpoint directory.
        edited = state.STATE_DICT in checkpoint
        return checkpoint, restore.Restored(model=not edited, optimizers=True)

    def _older_than_instead(self) -> bool:
        """Whether the step just restored is older than :attr:`instead` (said on rank 0)."""
        restored = self.restored
        if self.instead is None or restored is None or restored.step >= self.instead[1]:
            return False
        self._load_instead(f"restored only step {restored.step} (its newer steps would not load)")
        return True

    def _load_instead(self, what: str) -> None:
        """Say on rank 0 that the fit resumes from :attr:`instead`, not from this tier."""
        assert self.manager is not None and self.instead is not None
        self.restored = None
        path, step = self.instead
        if self.manager.rank == 0:
            _warnings.warn(
                f"shardsafe: the local tier in {self.directory} {what}, older than step {step} "
                f"in {path}: resuming from {path}",
            )

    def forget_after(self, step: object) -> None:
        """After a resume from another checkpoint at ``step``: drop newer local steps."""
        assert self.manager is not None
        newest = self.manager.latest()
        if not isinstance(step, int) or newest is None or newest <= step:
            return
        if self.manager.rank == 0:
            _warnings.warn(
                f"shardsafe: deleting the local checkpoints in {self.directory} newer than "
                f"step {step} (up to step {newest}): this fit resumed from an older checkpoint, "
                "so they belong to a history it abandons",
            )
        self.manager._drop_newer(step)  # what load_latest does after any restore


def describe_tiers(restored: Restored) -> str:
    """``local on every rank (0.02 s)``, or ``local for rank(s) [0, 1], peer for rank(s)
    [2, 3] (...)``: where each rank's state came from."""
    ranks: dict[str, list[int]] = {}
    for rank, tier in enumerate(restored.tiers):
        ranks.setdefault(tier, []).append(rank)
    if len(ranks) == 1:
        where = f"{restored.tiers[0]} on every rank"
    else:
        where = ", ".join(f"{tier} for rank(s) {r}" for tier, r in ranks.items())
    return f"{where} ({restored.seconds:.2f} s)"


class LocalSaves(Callback):
    """Saves to the local tier in ``on_train_batch_end`` (added by the strategy)."""

    def __init__(self, tier: LocalTier) -> None:
        self.tier = tier

    def on_train_start(self, trainer: Any, pl_module: pl.LightningModule) -> None:
        # The step the fit starts at (0, or the one it resumed from) is not saved again,
        # as Lightning's ModelCheckpoint does not: with accumulate_grad_batches, the first
        # batch ends before any optimizer step, and its save was a fresh run's "step 0"
        # holding half a window, or a resumed step saved over its good copy mid-window.
        self.tier._saved_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: pl.LightningModule, *args: Any) -> None:
        if not trainer.sanity_checking and not trainer.fast_dev_run:
            self.tier.save(trainer, pl_module, trainer.optimizers)


def _guard_resume(connector: Any, tier: LocalTier) -> None:
    """Put :meth:`LocalTier.resolve` in front of ``connector.resume_start`` (once per
    connector; the tier of the fit that set it up is used)."""
    setattr(connector, _RESOLVING, tier)
    if getattr(connector.resume_start, _RESOLVING, False):
        return
    resume_start = connector.resume_start

    @functools.wraps(resume_start)
    def resolving(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> None:
        current: LocalTier | None = getattr(connector, _RESOLVING, None)
        trainer = connector.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        if current is not None and current.manager is not None and fitting:
            path = None if checkpoint_path is None else str(checkpoint_path)
            checkpoint_path = current.resolve(path, trainer, trainer.strategy)
        resume_start(checkpoint_path, *args, **kwargs)

    setattr(resolving, _RESOLVING, True)
    setattr(connector, "resume_start", resolving)  # noqa: B010 - an instance attribute


def _is_last(path: str, trainer: Any) -> bool:
    """Whether ``path`` is what ``ckpt_path="last"`` resolves to (Lightning's own test)."""
    stem, extension = os.path.splitext(os.path.basename(os.path.normpath(path)))
    for callback in trainer.callbacks:
        if isinstance(callback, pl.callbacks.OnExceptionCheckpoint) and path == str(
            callback.ckpt_path
        ):
            return True
        if isinstance(callback, pl.callbacks.ModelCheckpoint):
            last = rf"^{callback.CHECKPOINT_NAME_LAST}(-(\d+))?"
            if extension == callback.FILE_EXTENSION and re.match(last, stem):
                return True
    return False


def _step_of(path: str) -> int | None:
    """The global step a shardsafe checkpoint holds, from its manifest (on a disk or an
    object store: the committed copy an interrupted replacement left, if the name has
    none); else ``None``, with a warning if it could not be read. Rank 0 alone calls it
    (:func:`.rank_zero.rank_zero_decides`)."""
    if not (is_url(path) or restore.is_shardsafe_checkpoint(path)):
        return None
    try:
        if is_url(path):
            path = committed_copy(path) or path
        with open_storage(path) as storage:
            saved = read_manifest_from(storage).values.get(state.LIGHTNING)
    except CheckpointNotFoundError:
        return None
    except Exception as e:  # a store's client raises more than OSError: the step is unknown
        _warnings.warn(
            f"shardsafe: could not read which step {path} holds ({type(e).__name__}: {e}); "
            "resuming from the local tier's newest step",
        )
        return None
    meta = saved.meta if saved is not None else None
    step = meta.get("global_step") if isinstance(meta, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None
