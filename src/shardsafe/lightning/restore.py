"""Resuming a Lightning run: from a shardsafe checkpoint directory, or a ``.ckpt`` file.

A shardsafe checkpoint is loaded in one ``shardsafe.load`` on every rank, once Lightning
has built the optimizers (the strategy asks to be restored after setup): the module and
optimizers in place, at whatever world size this run has, and the rest of Lightning's
dict returned for Lightning's own restore (loops, callbacks, schedulers, precision,
datamodule). The module and optimizers are then marked as restored, so Lightning's
``load_model_state_dict``/``load_optimizer_state_dict`` skip them.

A ``.ckpt`` file (an ordinary Lightning checkpoint) is read with
``torch.load(weights_only=True)`` and restored the way Lightning does, except that
optimizers go through :func:`shardsafe.interop.load_optimizer_state_dict`, which loads a
consolidated ZeRO/OSS state into a ZeRO/OSS optimizer of any world size.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.optim import Optimizer

from .. import _warnings, interop
from ..checkpoint import loading
from ..checkpoint.finding import hint_for
from ..checkpoint.format.manifest import MANIFEST_NAME, Manifest
from ..checkpoint.options import LoadOptions
from ..checkpoint.storage import placement
from ..checkpoint.storage.locations import directory_name, open_storage
from ..checkpoint.storage.object_placement import committed_copy, split
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from .state import (
    LIGHTNING,
    MODEL,
    OPTIMIZER_STATES,
    STATE_DICT,
    optimizer_names,
    real_optimizers,
)


@dataclass(frozen=True)
class Restored:
    """Which live objects the last shardsafe load has already restored."""

    model: bool = False
    optimizers: bool = False


def is_shardsafe_checkpoint(path: str) -> bool:
    """A directory (or a link to one) holding a ``manifest.json``: what the strategy writes."""
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, MANIFEST_NAME))


def committed_url(url: str) -> str:
    """The committed checkpoint at the object-store ``url``: the URL itself, or the staged
    copy a crash left while it was being replaced (``object_placement``), said aloud."""
    copy = committed_copy(url)
    if copy is None:
        if _single_object(url):
            raise CheckpointError(
                f"{url} is a single object (a Lightning .ckpt file?), not a shardsafe "
                "checkpoint; the shardsafe strategies read .ckpt files from local paths "
                "only: download it, then pass its local path"
            )
        return url  # committed, or missing: the load says which
    _warnings.warn(
        f"shardsafe: {url} has no manifest (the save that replaced it was interrupted while "
        f"being published); loading its committed copy {copy}",
    )
    return copy


def _single_object(url: str) -> bool:
    parent, name = split(url)
    with open_storage(parent) as root:
        return root.kind(name) == "file"


def load_directory(
    path: str,
    module: nn.Module,
    optimizers: Sequence[Optimizer] | None,
    options: LoadOptions,
) -> tuple[dict[str, Any], Restored]:
    """Restore ``module`` (and ``optimizers``, when given: a fit) from a shardsafe checkpoint;
    return Lightning's checkpoint dict without them."""
    saved_optimizers: list[str] = []
    chosen: dict[str, Any] = {}
    live = None if optimizers is None else real_optimizers(optimizers)

    def choose(manifest: Manifest) -> dict[str, Any]:
        saved = manifest.values
        _check_lightning_part(path, saved.get(LIGHTNING))
        saved_optimizers.extend(n for n in optimizer_names(len(saved)) if n in saved)
        part = saved.get(LIGHTNING)
        edited = part is not None and isinstance(part.meta, dict) and STATE_DICT in part.meta
        if MODEL in saved and (live is not None or not edited):
            # Not for validate/test/predict from an edited state dict: Lightning loads only
            # that dict, and keys a hook dropped keep the live module's values (restored
            # from the module saved beside it for the optimizers' names, they did not).
            chosen[MODEL] = module
        if live is not None and saved_optimizers:
            _check_count(path, len(saved_optimizers), len(live))
            chosen.update(zip(optimizer_names(len(live)), live))
        return chosen

    # A local directory (a link followed) or a URL, opened inside the load (agreed).
    opener = functools.partial(open_storage, path)
    values = loading.load_opening(opener, directory_name(path), choose, options, hint=hint_for)
    checkpoint = dict(values.get(LIGHTNING) or {})
    if saved_optimizers:  # Lightning checks that a full checkpoint has them
        checkpoint[OPTIMIZER_STATES] = [{} for _ in saved_optimizers]
    restored_optimizers = len(chosen) > (MODEL in chosen)
    if optimizers is not None and not live and checkpoint.get(OPTIMIZER_STATES) == []:
        # A full checkpoint of a module without optimizers (state.real_optimizers): the
        # stand-ins Lightning keeps for one have nothing to restore.
        checkpoint[OPTIMIZER_STATES] = [{} for _ in optimizers]
        restored_optimizers = True
    # An edited state dict (saved beside the module for the optimizers' names) is what
    # Lightning loads into the module after on_load_checkpoint: the module is not done.
    model_done = MODEL in chosen and STATE_DICT not in checkpoint
    return checkpoint, Restored(model=model_done, optimizers=restored_optimizers)


def _check_lightning_part(path: str, part: Any) -> None:
    """Refuse, before anything is restored (inside the load's plan, on every rank), a
    checkpoint without Lightning's dict: one ``shardsafe.save`` wrote directly (or
    ``shardsafe.accelerate``, or shardsafe's own Trainer), which ended in a bare
    ``KeyError: 'pytorch-lightning_version'`` from Lightning after the module and
    optimizers were restored; or one whose ``lightning`` entry is not a dict (a bare
    ``ValueError`` from ``dict()``)."""
    if part is None:
        raise CheckpointMismatchError(
            f"{path} is a shardsafe checkpoint, but not one a Lightning strategy saved (it has "
            f"no {LIGHTNING!r} entry: no epoch, step or loops to resume). Load its weights with "
            "shardsafe.load(path, {'model': module}) instead, then call fit, validate, test or "
            "predict without ckpt_path"
        )
    if part.kind != "value" or not isinstance(part.meta, dict):
        raise CheckpointCorruptError(
            f"{path} holds a {LIGHTNING!r} entry that is not Lightning's checkpoint dict (it is "
            f"a {part.kind} of {type(part.meta).__name__}), so a shardsafe Lightning strategy "
            "did not write it as it is; nothing was restored"
        )


def _check_count(path: str, saved: int, live: int) -> None:
    if saved != live:
        raise CheckpointMismatchError(
            f"{path} holds the state of {saved} optimizer(s), but configure_optimizers() "
            f"returned {live}; return the same optimizers as the run that saved it"
        )


def load_file(path: str) -> dict[str, Any]:
    """An ordinary Lightning ``.ckpt`` file, read without running any pickled code."""
    refuse_other_than_a_file(path)
    return interop.read_torch_file(path)


def refuse_other_than_a_file(path: str) -> None:
    """Refuse, saying which, a path that is neither a shardsafe checkpoint nor a file: a
    missing one, a folder of checkpoints, a DCP directory, a background save's held name.
    A strategy that reads no ``.ckpt`` files says this too before refusing a file: it
    said "not a shardsafe checkpoint" for all of them alike (found in review)."""
    if not os.path.lexists(path):
        raise CheckpointNotFoundError(
            f"no checkpoint at {path}: neither a shardsafe checkpoint directory nor a "
            "Lightning .ckpt file"
        )
    if os.path.isdir(path):
        raise CheckpointNotFoundError(uncommitted_directory(path))


DCP_METADATA = ".metadata"
"""What torch.distributed.checkpoint writes last, in every checkpoint directory it saves."""


def uncommitted_directory(path: str) -> str:
    """Why the directory ``path``, which has no manifest, is refused as a checkpoint.

    Lightning's own FSDP and ModelParallel strategies save a DCP directory under the same
    ``epoch=0-step=5.ckpt`` names: a run switched to a shardsafe strategy must hear that,
    not that a save may have been interrupted, which sends it looking for a crash."""
    held = _checkpoints_in(path)
    if held:
        return (
            f"{path} is a folder of checkpoints (it holds {', '.join(held[-3:])}"
            f"{' ...' if len(held) > 3 else ''}), not one checkpoint: pass one of them, or "
            "ckpt_path='last' for the newest one ModelCheckpoint saved"
        )
    if os.path.lexists(os.path.join(path, DCP_METADATA)):
        return (
            f"{path} is a torch.distributed.checkpoint (DCP) directory (it holds "
            f"{DCP_METADATA} and no {MANIFEST_NAME}), as Lightning's own FSDP and "
            "ModelParallel strategies save, not a shardsafe checkpoint: resume from it with "
            "the strategy that saved it; the shardsafe strategies resume from the checkpoint "
            "directories they write"
        )
    with contextlib.suppress(OSError):
        if not os.listdir(path):
            return _never_committed(path)
    return (
        f"{path} is a directory without {MANIFEST_NAME}, so it is not a committed "
        "shardsafe checkpoint (a save into it may have been interrupted)"
    )


def _never_committed(path: str) -> str:
    """Why an empty directory is refused: the name a background save holds from its start
    (``cleanup.hold_name``), left empty by a run stopped (or a save failed) before the
    checkpoint took it, and which the ``last.ckpt`` link of ``save_last="link"`` may point
    at. Names the checkpoint to resume from instead: the save's own, if it committed
    before the stop (its staging directory, kept whole), else the newest beside it."""
    target = os.path.realpath(path)
    folder, name = os.path.split(target)
    staged = placement.committed_staging(folder, name)
    if staged is not None:
        return (
            f"{path} is an empty directory, not a checkpoint: a background save "
            f"(async_save=True) holds its name from the start, and the run stopped after "
            f"the save committed but before it took the name. The whole checkpoint is at "
            f"{staged}: resume from it (ckpt_path=...)"
        )
    beside = [os.path.join(folder, n) for n in _checkpoints_in(folder)]
    newest = max(beside, key=_written_at, default=None)
    instead = (
        f"; the newest complete checkpoint beside it is {newest}: resume from it (ckpt_path=...)"
        if newest is not None
        else ""
    )
    return (
        f"{path} is an empty directory, not a checkpoint: a background save "
        f"(async_save=True) holds its name from the start, and this one never committed "
        f"(the run stopped, or the save failed, while it was written){instead}"
    )


def _written_at(checkpoint: str) -> float:
    """When ``checkpoint`` was committed (its manifest's time; a ``.ckpt`` file's own)."""
    manifest = os.path.join(checkpoint, MANIFEST_NAME)
    try:
        return os.stat(manifest if os.path.isdir(checkpoint) else checkpoint).st_mtime
    except OSError:
        return 0.0


def _checkpoints_in(path: str) -> list[str]:
    """The ``.ckpt`` checkpoints (directories or files) directly in ``path``, by name: a
    ``ModelCheckpoint`` ``dirpath`` passed where one of them was meant."""
    try:
        names = sorted(n for n in os.listdir(path) if n.endswith(".ckpt"))
    except OSError:
        return []
    return [
        n
        for n in names
        if os.path.isfile(os.path.join(path, n)) or is_shardsafe_checkpoint(os.path.join(path, n))
    ]


def load_optimizers_from_file(
    checkpoint: Mapping[str, Any], optimizers: Sequence[Optimizer], module: nn.Module
) -> None:
    """Lightning's ``optimizer_states`` (torch's index-keyed format) into live optimizers of
    any kind and world size."""
    states = checkpoint[OPTIMIZER_STATES]
    if not isinstance(states, list) or len(states) != len(optimizers):
        count = len(states) if isinstance(states, list) else "no"
        raise CheckpointError(
            f"the checkpoint holds {count} optimizer state(s), but configure_optimizers() "
            f"returned {len(optimizers)} optimizer(s)"
        )
    real = real_optimizers(optimizers)
    for optimizer, state in zip(optimizers, states):
        if optimizer in real:  # Lightning's stand-in for none has no state to take
            interop.load_optimizer_state_dict(optimizer, module, state)
