"""``ShardsafeDDPStrategy``: Lightning's DDP, with every checkpoint saved by shardsafe.

Why a strategy and not a ``CheckpointIO`` plugin: Lightning calls the checkpoint IO on
rank 0 only, with a dict it has already gathered, and gathers a ``ZeroRedundancyOptimizer``
or fairscale ``OSS`` by ``consolidate_state_dict()``, which pickles every rank's shard and
broadcasts it to every rank. A strategy owns the hooks around that: it hands shardsafe
the optimizer *objects* (whose adapters read each rank's shard directly), saves on every
rank, and restores at any world size.

Hooks overridden, and why:

* ``optimizer_state``: an empty placeholder instead of consolidating; the optimizers
  themselves are saved (:mod:`.state`).
* ``lightning_module_state_dict``: Lightning's own, recorded, so that the save can tell
  whether a hook edited it (then the edited dict is saved instead of the module).
* ``save_checkpoint``: ``shardsafe.save`` on every rank, replacing a checkpoint of the
  same name atomically (``last.ckpt``; :mod:`shardsafe.checkpoint.placement`).
* ``setup``: checks that the checkpoints can be saved (:mod:`.checks`) and makes
  Lightning's gathering agree its errors (:func:`.state.guard_dump`).
* ``restore_checkpoint_after_setup``/``load_checkpoint``/``load_model_state_dict``/
  ``load_optimizer_state_dict``: one shardsafe load once the optimizers exist, or an
  ordinary ``.ckpt`` file (:mod:`.restore`).
* ``remove_checkpoint``: deletes only what shardsafe wrote (:mod:`.cleanup`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer

from ..checkpoint.options import DEFAULT_BUFFER_BYTES, DEFAULT_TIMEOUT_S, LoadOptions, SaveOptions
from ..checkpoint.placement import save_replacing
from ..errors import CheckpointError
from . import checks, cleanup, restore, state
from ._namespace import lightning

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy
    from pytorch_lightning.trainer.states import TrainerFn
else:
    pl = lightning()
    DDPStrategy = pl.strategies.DDPStrategy
    TrainerFn = pl.trainer.states.TrainerFn


class ShardsafeDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose checkpoints are shardsafe checkpoints.

    ``Trainer(strategy=ShardsafeDDPStrategy(layout="sharded"), accelerator=..., devices=N)``.
    ``trainer.save_checkpoint(path)`` and ``ModelCheckpoint`` write the directory ``path``
    (``.../epoch=0-step=5.ckpt``) on every rank; ``fit(ckpt_path=...)`` resumes from such a
    directory at any world size, or from an ordinary Lightning ``.ckpt`` file.

    ``layout``, ``entry_timeout``, ``checkpoint_timeout`` (the ``timeout`` of
    ``shardsafe.save``/``load``; DDP's own ``timeout`` is the process group's) and
    ``buffer_bytes`` are shardsafe's save options; every other keyword goes to
    ``DDPStrategy``.
    """

    def __init__(
        self,
        *,
        layout: str = "sharded",
        entry_timeout: float = 60.0,
        checkpoint_timeout: float = DEFAULT_TIMEOUT_S,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("checkpoint_io") is not None:
            raise ValueError(
                "ShardsafeDDPStrategy writes checkpoints with shardsafe on every rank, so a "
                "checkpoint_io plugin would never be called; leave checkpoint_io out"
            )
        self.save_options = SaveOptions(
            layout=layout,
            entry_timeout=entry_timeout,
            timeout=checkpoint_timeout,
            buffer_bytes=buffer_bytes,
        )
        self.load_options = LoadOptions(entry_timeout=entry_timeout, timeout=checkpoint_timeout)
        super().__init__(**kwargs)
        self._state_dict_record = state.StateDictRecord()
        self._restored = restore.Restored()

    # -- saving ------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        state.guard_dump(trainer._checkpoint_connector)
        if trainer.state.fn == TrainerFn.FITTING:
            checks.check_savable(trainer)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """A placeholder: the optimizer object itself is saved, each rank its own shard."""
        return {}

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._state_dict_record.record(super().lightning_module_state_dict())

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` as the shardsafe checkpoint directory ``filepath``. Every rank."""
        if storage_options is not None:
            raise TypeError(
                "storage_options are for CheckpointIO plugins; ShardsafeDDPStrategy takes its "
                "save options (layout, timeouts) as its own arguments"
            )
        path = _local_path(filepath)
        if isinstance(checkpoint, state.FailedDump):
            to_save = state.failed_state(checkpoint.error)
        else:
            module = self.lightning_module
            assert module is not None
            to_save = state.save_state(checkpoint, module, self.optimizers, self._state_dict_record)
        save_replacing(path, to_save, self.save_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete an old checkpoint (``ModelCheckpoint``'s ``save_top_k``), on rank 0."""
        if self.is_global_zero:
            cleanup.remove(_local_path(filepath))

    # -- loading -----------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """True: the optimizers must exist before one load restores them with the model."""
        return True

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = _local_path(checkpoint_path)
        module = self.lightning_module
        assert module is not None
        if not restore.is_shardsafe_checkpoint(path):
            self._restored = restore.Restored()
            return restore.load_file(path)
        trainer = module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        strict = bool(getattr(module, "strict_loading", True))
        options = LoadOptions.of(
            strict=strict,
            entry_timeout=self.load_options.entry_timeout,
            timeout=self.load_options.timeout,
        )
        optimizers = self.optimizers if fitting else None
        checkpoint, self._restored = restore.load_directory(path, module, optimizers, options)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._restored.model:
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._restored.optimizers:
            return
        module = self.lightning_module
        assert module is not None
        restore.load_optimizers_from_file(checkpoint, self.optimizers, module)


def _local_path(path: Any) -> str:
    """``path`` as a local filesystem path; a URL (``s3://...``) is refused."""
    text = str(os.fspath(path))
    if "://" in text:
        raise CheckpointError(
            f"{text} is a URL; ShardsafeDDPStrategy saves to and loads from local (or "
            "shared POSIX) paths only"
        )
    return text
