"""``ShardsafeTrainer``: ``transformers.Trainer`` with shardsafe for the optimizer state.

The Trainer writes a checkpoint folder (``checkpoint-500/``) that ``from_pretrained`` and
``resume_from_checkpoint`` read: the model as safetensors, the optimizer and scheduler as
``torch.save`` pickles (``optimizer.pt`` is twice the model's size for Adam, written by
the main process alone), the RNGs and the trainer's JSON state. This subclass replaces
only the pickles: the optimizer, the scheduler and the gradient scaler go into
``checkpoint-500/shardsafe/``, a shardsafe checkpoint written by every process (each
replicated tensor once), checksummed and committed manifest last; the model is saved
there too, because the optimizer's state is keyed by its parameter names, and so is the
step it was saved at, which a resume compares with the folder's ``trainer_state.json``
before anything is restored. Everything
else is the Trainer's own, so the folder still loads with ``from_pretrained``, and
``save_total_limit`` and ``resume_from_checkpoint=True`` work as always.

It overrides the Trainer's ``_save_optimizer_and_scheduler``, ``_save_scaler``,
``_load_optimizer_and_scheduler`` and ``_load_scaler`` (private hooks: tested against
transformers 5.24). Under DeepSpeed, FSDP, XLA or SageMaker the Trainer's own code runs
(those save through their own engines); a folder without ``shardsafe/`` (one the plain
Trainer wrote) is resumed by the Trainer's own code too.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from transformers import Trainer

from ..checkpoint import loading
from ..checkpoint.format.manifest import Manifest
from ..checkpoint.options import LoadOptions, SaveOptions
from ..checkpoint.plan.load_plan import STRICT_HINT
from ..checkpoint.replacing import save_replacing
from ..checkpoint.storage.local import LocalStorage
from ..checkpoint.storage.locations import open_storage
from ..checkpoint.storage.protocol import Storage
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from ..protocol import SavedValue

SHARDSAFE_DIR = "shardsafe"
"""The shardsafe checkpoint's folder inside each ``checkpoint-N`` folder."""
SCALER = "scaler"
STEP = "trainer_step"
"""The plain value holding the ``global_step`` a ``shardsafe/`` folder was saved at."""
TRAINER_STATE = "trainer_state.json"
MAX_TRAINER_STATE_BYTES = 64 << 20


_RESUME_HINT = (
    "ShardsafeTrainer resumes strictly (a Trainer takes no strict=False): resume with the "
    "optimizer and scheduler that saved this checkpoint, or train without "
    "resume_from_checkpoint."
)


class ShardsafeTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer, scheduler and scaler are saved by
    shardsafe (see the module docstring); every argument is the Trainer's."""

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._handled():
            super()._save_optimizer_and_scheduler(output_dir)
            return
        # A resumed run saves its steps again: the Trainer overwrites its own files, and
        # the shardsafe folder is replaced the same way, atomically (as Lightning's last.ckpt).
        path = os.path.join(output_dir, SHARDSAFE_DIR)
        save_replacing(path, self._checkpointed(), SaveOptions(entry_timeout=self._arrival()))

    def _save_scaler(self, output_dir: str) -> None:
        if not self._handled():
            super()._save_scaler(output_dir)  # with the optimizer otherwise

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._handled() or not _has_shardsafe(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        options = LoadOptions.of(entry_timeout=self._arrival())
        with _unfollowed(os.path.join(checkpoint, SHARDSAFE_DIR)) as storage:
            try:
                restore = functools.partial(self._to_restore, checkpoint=checkpoint)
                loading.load_chosen(storage, restore, options)
            except CheckpointMismatchError as e:  # the same on every process: agreed
                if STRICT_HINT not in str(e):
                    raise
                raise CheckpointMismatchError(str(e).replace(STRICT_HINT, _RESUME_HINT)) from e

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._handled() or not _has_shardsafe(checkpoint):
            super()._load_scaler(checkpoint)

    def _arrival(self) -> float:
        """How long a process waits for the others to enter the shardsafe save or load:
        the Trainer's own ``ddp_timeout`` (30 minutes by default), as its collectives do.

        The main process writes ``model.safetensors`` alone just before the save (the
        others go straight on), so it arrives as late as that write takes: minutes for
        a model of several GB. shardsafe's default of 60 s made the others give up and
        the run die at its first checkpoint."""
        return float(self.args.ddp_timeout)

    def _handled(self) -> bool:
        """Whether this Trainer's optimizer is shardsafe's to save (DDP or one process)."""
        engines = ("is_deepspeed_enabled", "is_fsdp_enabled", "is_fsdp_xla_enabled")
        if any(getattr(self, flag, False) for flag in engines):
            return False
        from transformers.utils.import_utils import is_sagemaker_mp_enabled, is_torch_xla_available

        return not (is_torch_xla_available() or is_sagemaker_mp_enabled())

    def _to_restore(self, manifest: Manifest, checkpoint: str) -> dict[str, Any]:
        """What a resume restores: everything saved, and a gradient scaler only if one was;
        nothing at all if the folder was saved at another step than ``checkpoint``'s
        trainer state (:func:`_check_step`).

        The accelerator makes its scaler for ``fp16``: a run saved in bf16 or fp32 and
        resumed in fp16 has one the checkpoint lacks, and the Trainer's own ``_load_scaler``
        then keeps it fresh (no ``scaler.pt``); a strict load refused the resume. (Saved
        with one and resumed without, the saved one is left unread, as the Trainer
        cannot load it either.)"""
        state = self._checkpointed()
        if SCALER not in manifest.values:
            state.pop(SCALER, None)
        if STEP in manifest.values:
            _check_step(manifest.values[STEP], checkpoint)
        else:  # saved by a shardsafe that did not record it
            state.pop(STEP)
        return state

    def _checkpointed(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer}
        if self.lr_scheduler is not None:
            state["scheduler"] = self.lr_scheduler
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state[SCALER] = scaler
        state[STEP] = int(self.state.global_step)
        return state


def _check_step(saved: SavedValue, checkpoint: str) -> None:
    """Refuse a ``shardsafe/`` folder saved at another step than ``checkpoint``'s
    ``trainer_state.json`` says: one copied in from another checkpoint folder (a link is
    refused as such, :func:`_unfollowed`) restored that step's model, optimizer and
    scheduler under this folder's counters, and the run went on with the wrong learning
    rates, silently. Runs in the load's plan, so every process refuses it alike, before
    anything is restored. A folder without a readable trainer state is left to the
    Trainer, which reads that file next."""
    step = saved.meta
    if type(step) is not int:
        raise CheckpointCorruptError(f"{saved.entry} is not a step number")
    expected = _trainer_state_step(checkpoint)
    if expected is None or expected == step:
        return
    raise CheckpointMismatchError(
        f"{os.path.join(checkpoint, SHARDSAFE_DIR)} holds the model, optimizer and scheduler "
        f"of step {step}, but {os.path.join(checkpoint, TRAINER_STATE)} is at step "
        f"{expected}: the shardsafe folder comes from another checkpoint. Resume from the "
        f"checkpoint of step {step}, or put this checkpoint's own shardsafe folder back "
        "(nothing was restored)"
    )


def _trainer_state_step(checkpoint: str) -> int | None:
    """The ``global_step`` of ``checkpoint``'s ``trainer_state.json``, or ``None`` if it
    has no readable one (read as shardsafe reads its own small files: a link, a FIFO or
    an oversized file is refused, never followed or waited on)."""
    try:
        with LocalStorage(checkpoint) as folder:
            data = folder.read_small(TRAINER_STATE, MAX_TRAINER_STATE_BYTES)
        step = json.loads(data).get("global_step")
    except (CheckpointError, OSError, ValueError, AttributeError):
        return None
    return step if type(step) is int else None


def _unfollowed(directory: str, *, follow: bool = False) -> Storage:
    """The ``shardsafe/`` folder itself, never what a symbolic link there points at.

    The save replaces such a link rather than writing through it; a load that followed
    one would restore another checkpoint's model, optimizer and scheduler under this
    folder's ``trainer_state.json`` (step 10's counters with step 5's weights), silently.
    """
    del follow  # never followed, whoever asks
    return open_storage(directory, follow=False)


def _has_shardsafe(checkpoint: str) -> bool:
    """Whether ``checkpoint`` holds a ``shardsafe/`` entry, complete or not.

    Its presence, not its manifest's, decides: a ``shardsafe/`` folder whose manifest is
    missing (lost in a copy, deleted) handed to the Trainer's own loader would find no
    ``optimizer.pt`` and skip the optimizer and scheduler without a word, so the run would
    go on with fresh moments and the schedule back at step 0. shardsafe's load refuses it
    instead, naming the missing manifest, on every rank.
    """
    return os.path.lexists(os.path.join(checkpoint, SHARDSAFE_DIR))
