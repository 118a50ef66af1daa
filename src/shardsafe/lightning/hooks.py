"""The Strategy hooks that make a Lightning strategy save and load through shardsafe.

Why a strategy and not a ``CheckpointIO`` plugin: Lightning calls the checkpoint IO on
rank 0 only, with a dict it has already gathered, and gathers a ``ZeroRedundancyOptimizer``
or fairscale ``OSS`` by ``consolidate_state_dict()``, which pickles every rank's shard and
broadcasts it to every rank. A strategy owns the hooks around that: it hands shardsafe
the optimizer *objects* (whose adapters read each rank's shard, or FSDP2's DTensors,
directly), saves on every rank, and restores at any world size.

:class:`ShardsafeCheckpointing` overrides, on top of a Lightning strategy (``strategy.py``
puts it on ``DDPStrategy`` and ``ModelParallelStrategy``):

* ``optimizer_state``: an empty placeholder instead of gathering; the optimizers
  themselves are saved (:mod:`.state`).
* ``lightning_module_state_dict``: the module's own ``state_dict()`` (no gathering),
  recorded, so that the save can tell whether a hook edited it.
* ``save_checkpoint``: ``shardsafe.save`` on every rank, replacing a checkpoint of the
  same name (``last.ckpt``): on a filesystem atomically
  (:mod:`shardsafe.checkpoint.storage.placement`), on an object store by a staged save
  and a copy (:mod:`shardsafe.checkpoint.storage.object_placement`).
* ``setup``: checks that the checkpoints can be saved (:mod:`.checks`) and makes
  Lightning's gathering agree its errors (:func:`.state.guard_dump`).
* ``restore_checkpoint_after_setup``/``load_checkpoint``/``load_model_state_dict``/
  ``load_optimizer_state_dict``: one shardsafe load once the optimizers exist, or an
  ordinary ``.ckpt`` file (:mod:`.restore`).
* ``remove_checkpoint``: deletes only what shardsafe wrote (:mod:`.cleanup`).
* with ``async_save=True``: ``save_checkpoint`` during a fit stages the state and returns;
  the checkpoint is written, committed and given its name in the background. The next
  save, a load, and the fit's end wait for it (raising its error on every rank), and a
  ``remove_checkpoint`` that arrives meanwhile (``save_top_k`` rotating out the previous
  best) waits until the new checkpoint is committed, so a complete one always exists.
* with ``local_checkpoint_dir``: ``setup`` opens the local tier (:mod:`.local_tier`: a
  callback that saves every ``local_every`` steps, and the choice of what a fit resumes
  from), ``load_checkpoint`` restores from it when chosen, ``teardown`` closes it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from torch.optim import Optimizer

from ..checkpoint.background import SaveHandle
from ..checkpoint.format.manifest_format import Layout
from ..checkpoint.io.staging import Stager
from ..checkpoint.options import DEFAULT_BUFFER_BYTES, DEFAULT_TIMEOUT_S, LoadOptions, SaveOptions
from ..checkpoint.replacing import async_save_replacing, save_replacing
from ..checkpoint.storage import locations
from ..checkpoint.storage.locations import is_url
from ..errors import CheckpointError
from ..tiers import Restored as TierRestored
from ..tiers.manager import LOCAL_DEFAULTS, refuse_without_local_tier
from . import checks, cleanup, restore, state
from ._namespace import lightning
from .local_tier import LocalTier, describe_tiers
from .rank_zero import rank_zero_decides

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import Strategy
    from pytorch_lightning.trainer.states import TrainerFn
    from pytorch_lightning.utilities import rank_zero_info
else:
    pl = lightning()
    Strategy = pl.strategies.Strategy
    TrainerFn = pl.trainer.states.TrainerFn
    rank_zero_info = pl.utilities.rank_zero_info


class ShardsafeCheckpointing(Strategy):
    """Saves and loads every checkpoint of the strategy it is mixed into through shardsafe.

    ``layout``, ``entry_timeout``, ``checkpoint_timeout`` (the ``timeout`` of
    ``shardsafe.save``/``load``; a strategy's own ``timeout`` is the process group's) and
    ``buffer_bytes`` are shardsafe's save options; every other keyword goes to the
    Lightning strategy.

    ``local_checkpoint_dir`` (a node-local directory, e.g. ``/dev/shm/run1``) adds a local
    tier: every ``local_every`` optimizer steps each rank saves its own state there in
    the background, and a fit resumes from it when it holds a newer step than the
    checkpoint Lightning would resume from (``None`` or ``"last"``; never instead of an
    explicit path); each node keeps its ``keep_local`` newest steps there. See
    :mod:`.local_tier` for the exact rules.

    ``async_save=True`` writes the checkpoints a fit saves in the background (see the
    module docstring): training waits only for the copy of the state to host memory.
    """

    reads_ckpt_files: ClassVar[bool] = True
    """Whether ``fit(ckpt_path=...)`` also takes an ordinary Lightning ``.ckpt`` file."""

    def __init__(
        self,
        *,
        layout: Layout = "sharded",
        entry_timeout: float = 60.0,
        checkpoint_timeout: float = DEFAULT_TIMEOUT_S,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        local_checkpoint_dir: str | os.PathLike[str] | None = None,
        local_every: int = LOCAL_DEFAULTS["local_every"],
        keep_local: int = LOCAL_DEFAULTS["keep_local"],
        async_save: bool = False,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("checkpoint_io") is not None:
            raise ValueError(
                f"{type(self).__name__} writes checkpoints with shardsafe on every rank, so a "
                "checkpoint_io plugin would never be called; leave checkpoint_io out"
            )
        self.save_options = SaveOptions(
            layout=layout,
            entry_timeout=entry_timeout,
            timeout=checkpoint_timeout,
            buffer_bytes=buffer_bytes,
        )
        self.load_options = LoadOptions(entry_timeout=entry_timeout, timeout=checkpoint_timeout)
        if local_checkpoint_dir is None:
            refuse_without_local_tier({"local_every": local_every, "keep_local": keep_local})
        self._local = (
            None
            if local_checkpoint_dir is None
            else LocalTier(local_checkpoint_dir, local_every, keep_local)
        )
        super().__init__(**kwargs)
        self._state_dict_record = state.StateDictRecord()
        self._restored = restore.Restored()
        self.async_save = bool(async_save)
        self._fitting = False
        self._in_flight: SaveHandle | None = None
        self._removals: list[str] = []
        """Checkpoints to remove once the save in flight has committed (rank 0)."""
        self._stager = Stager()

    # -- saving ------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        state.guard_dump(trainer._checkpoint_connector)
        if trainer.state.fn == TrainerFn.FITTING:
            self._fitting = True
            checks.check_savable(trainer)
            if trainer.is_global_zero:
                cleanup.clear_interrupted(trainer)
            if self._local is not None:
                self._local.open(trainer)

    def teardown(self) -> None:
        self._fitting = False
        # Lightning tears down from its exception handler when a fit fails: then the
        # background save's own error must not replace the one that ended the fit.
        failing = sys.exc_info()[0] is not None
        try:
            self._finish_in_flight()
        except Exception as e:
            if not failing:
                raise
            rank_zero_info(f"shardsafe: the checkpoint being written also failed: {e}")
        finally:
            if self._local is not None:
                self._local.close()
            super().teardown()

    def _finish_in_flight(self) -> None:
        """Wait for the background save, then remove what ``remove_checkpoint`` deferred."""
        handle, self._in_flight = self._in_flight, None
        if handle is not None:
            try:
                handle.wait()
            except BaseException:
                self._removals.clear()  # the older checkpoints are all there is: keep them
                raise
        removals, self._removals = self._removals, []
        for path in removals:
            cleanup.remove(path)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._remove_once_committed()

    def _remove_once_committed(self) -> None:
        """On rank 0, once the save in flight has committed, remove what ``save_top_k``
        rotated out meanwhile: left for the next save, a kill before it (a preemption
        between two saves) left the older checkpoint behind for good, the restored
        callback no longer naming it (found in review). A save that failed is left for
        the next save or the end of the fit to raise on every rank, and its removals
        with it (the older checkpoints are then all there is)."""
        handle = self._in_flight
        if not self._removals or handle is None or not handle.done():
            return
        try:
            handle.wait(timeout=0)
        except CheckpointError:
            return
        removals, self._removals = self._removals, []
        for path in removals:
            cleanup.remove(path)

    @property
    def local_restored(self) -> TierRestored | None:
        """What the last fit restored from the local tier (step, each rank's tier,
        seconds), or ``None`` if it did not resume from it."""
        return None if self._local is None else self._local.restored

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """A placeholder: the optimizer object itself is saved, each rank its own shard."""
        return {}

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's ``state_dict()`` as it is on this rank (DTensor shards unchanged)."""
        module = self.lightning_module
        assert module is not None
        return self._state_dict_record.record(module.state_dict())

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` as the shardsafe checkpoint directory ``filepath``. Every rank."""
        if storage_options is not None:
            raise TypeError(
                f"storage_options are for CheckpointIO plugins; {type(self).__name__} takes "
                "its save options (layout, timeouts) as its own arguments"
            )
        path = path_text(filepath)
        self._finish_in_flight()  # one save at a time; its error, if any, is raised here
        if isinstance(checkpoint, state.FailedDump):
            to_save = state.failed_state(checkpoint.error)
        else:
            module = self.lightning_module
            assert module is not None
            to_save = state.save_state(checkpoint, module, self.optimizers, self._state_dict_record)
        if self.async_save and self._fitting and not isinstance(checkpoint, state.FailedDump):
            if self.is_global_zero:
                cleanup.hold_name(path)  # taken from now, as a blocking save's would be
            self._in_flight = async_save_replacing(path, to_save, self.save_options, self._stager)
        else:
            save_replacing(path, to_save, self.save_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete an old checkpoint (``ModelCheckpoint``'s ``save_top_k``), on rank 0; with
        a save in flight, once that one has committed. Only inside a checkpoint callback's
        directory: the paths come from that callback's state, which a resume loads."""
        if self.is_global_zero:
            path = path_text(filepath)
            module = self.lightning_module
            if module is not None and not cleanup.inside_run(path, module.trainer):
                return
            if self._in_flight is not None:
                self._removals.append(path)
            else:
                cleanup.remove(path)

    # -- loading -----------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """True: the optimizers must exist before one load restores them with the model."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self._finish_in_flight()
        path = path_text(checkpoint_path)
        module = self.lightning_module
        assert module is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        options = LoadOptions.of(
            strict=bool(getattr(module, "strict_loading", True)),
            entry_timeout=self.load_options.entry_timeout,
            timeout=self.load_options.timeout,
        )
        local = self._local if fitting and self._local is not None else None
        if local is not None and local.chosen == path:
            loaded = local.load(module, self.optimizers, options)
            if loaded is not None:
                checkpoint, self._restored = loaded
                self._say_restored(local)
                return checkpoint
            assert local.instead is not None
            path = local.instead[0]  # the tier restored an older step: the last one is newer
        checkpoint = self._load_path(path, module, options, fitting)
        if local is not None:
            local.forget_after(checkpoint.get("global_step"))
        return checkpoint

    def _load_path(
        self, path: str, module: pl.LightningModule, options: LoadOptions, fitting: bool
    ) -> dict[str, Any]:
        """A shardsafe checkpoint directory, or a ``.ckpt`` file."""
        if is_url(path):
            path = self._agreed_url(path)
        elif not restore.is_shardsafe_checkpoint(path):
            self._restored = restore.Restored()
            if not self.reads_ckpt_files:
                restore.refuse_other_than_a_file(path)
                raise CheckpointError(
                    f"{path} is not a shardsafe checkpoint; {type(self).__name__} resumes from "
                    "the checkpoint directories it writes only"
                )
            return restore.load_file(path)
        optimizers = self.optimizers if fitting else None
        checkpoint, self._restored = restore.load_directory(path, module, optimizers, options)
        return checkpoint

    def _agreed_url(self, url: str) -> str:
        """Rank 0 reads the store (:func:`.restore.committed_url`) and every rank loads
        what it found, or raises its error: ranks probing on their own could disagree."""
        return str(rank_zero_decides(self, lambda: restore.committed_url(url), f"reading {url}"))

    def _say_restored(self, local: LocalTier) -> None:
        restored = local.restored
        if restored is not None:
            rank_zero_info(
                f"shardsafe: resumed from step {restored.step} of the local tier in "
                f"{local.directory}: {describe_tiers(restored)}"
            )

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._restored.model:
            return
        module = self.lightning_module
        assert module is not None
        module.load_state_dict(checkpoint[state.STATE_DICT], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._restored.optimizers:
            return
        module = self.lightning_module
        assert module is not None
        restore.load_optimizers_from_file(checkpoint, self.optimizers, module)


def path_text(path: Any) -> str:
    """``path`` as text: a local path (``file://`` stripped) or an object-store URL."""
    text = str(os.fspath(path))
    return text if is_url(text) else locations.local_path(text)
