"""``LightningModule.load_from_checkpoint`` for shardsafe checkpoints.

Lightning's own classmethod opens its path as one file (``torch.load``), so it fails on
the directory a shardsafe strategy saves (``IsADirectoryError``), and Lightning has no
hook to hand it another loader. :func:`load_from_checkpoint` does what it does, the same
way: the module is built from the saved hyper-parameters (updated by the keyword
arguments given, filtered to what ``__init__`` takes unless it takes ``**kwargs``), its
``configure_model`` builds the layers it makes there, its ``on_load_checkpoint`` hook
sees the rest of Lightning's checkpoint, and the weights are loaded with ``strict``
(default: the module's ``strict_loading``). Differences, both for the better or
unavoidable: the weights are read straight into the new module, by name,
with every byte's checksum verified, and never unpickled; so edits an
``on_load_checkpoint`` hook makes to ``checkpoint["state_dict"]`` are not applied (the
hook sees the new module's own state dict), except for a checkpoint whose state dict an
``on_save_checkpoint`` hook edited: that one is saved as a dict, and loaded as Lightning
does, after the hook. One process, no process group; any path
``shardsafe.load`` takes, ``s3://`` included. The module stays on the CPU unless
``map_location`` names a device (Lightning's moves it to the device its tensors were saved
from); hyper-parameters LightningCLI wrote for its instantiator (``_instantiator``) are
not followed. A ``.ckpt`` file is handed to Lightning's own ``load_from_checkpoint``.
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..checkpoint import loading
from ..checkpoint.format.manifest import Manifest
from ..checkpoint.loading import read_manifest_from
from ..checkpoint.options import LoadOptions
from ..checkpoint.storage.locations import is_url, open_storage
from ..checkpoint.storage.protocol import Storage
from ..errors import CheckpointError, CheckpointNotFoundError
from . import hparams as saved_hparams
from ._namespace import lightning
from .restore import committed_url, is_shardsafe_checkpoint, uncommitted_directory
from .state import LIGHTNING, MODEL, OPTIMIZER_STATES, STATE_DICT, optimizer_names

Module = TypeVar("Module")


@dataclass(frozen=True)
class _Keys:
    """Where Lightning's checkpoint holds the hyper-parameters of ``cls``: a module's, or
    a datamodule's (``datamodule_hyper_parameters``, ...), each class naming its own."""

    hparams: str
    name: str
    kind: str

    @classmethod
    def of(cls, owner: type[Any]) -> _Keys:
        return cls(
            getattr(owner, "CHECKPOINT_HYPER_PARAMS_KEY", "hyper_parameters"),
            getattr(owner, "CHECKPOINT_HYPER_PARAMS_NAME", "hparams_name"),
            getattr(owner, "CHECKPOINT_HYPER_PARAMS_TYPE", "hparams_type"),
        )


def load_from_checkpoint(
    cls: type[Module],
    checkpoint_path: str | os.PathLike[str],
    map_location: str | torch.device | None = None,
    hparams_file: str | os.PathLike[str] | None = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> Module:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` that also reads shardsafe
    checkpoint directories: ``MyModule`` built from the saved hyper-parameters, with the
    saved weights; ``map_location`` moves it to a device (``"cuda:0"``)."""
    path = os.fspath(checkpoint_path)
    if not (is_url(path) or is_shardsafe_checkpoint(path)):
        if os.path.isdir(path):
            raise CheckpointNotFoundError(uncommitted_directory(path))
        loader = getattr(cls, "load_from_checkpoint", None)
        if loader is None:
            raise TypeError(f"{cls.__qualname__} is not a LightningModule")
        loaded: Module = loader(
            path, map_location=map_location, hparams_file=hparams_file, strict=strict, **kwargs
        )
        return loaded
    if map_location is not None and not isinstance(map_location, (str, torch.device)):
        raise TypeError(
            "map_location must be a device (a string such as 'cuda:0' or a torch.device) for a "
            "shardsafe checkpoint: its tensors are read into the new module, then moved"
        )
    if is_url(path):
        path = committed_url(path)  # the staged copy, if a crash interrupted a replacement
    # Opened once, and every read goes through it: a name replaced meanwhile (a training
    # job's last.ckpt, exchanged at each save) gave the hyper-parameters and the dict
    # on_load_checkpoint sees from one checkpoint and the weights from the next.
    with open_storage(path) as storage:
        return _build(cls, storage, map_location, hparams_file, strict, kwargs)


def _build(
    cls: type[Module],
    storage: Storage,
    map_location: str | torch.device | None,
    hparams_file: str | os.PathLike[str] | None,
    strict: bool | None,
    kwargs: dict[str, Any],
) -> Module:
    """:func:`load_from_checkpoint` of the opened shardsafe checkpoint ``storage``."""
    checkpoint = _lightning_part(storage)
    keys = _Keys.of(cls)
    hparams = dict(checkpoint.get(keys.hparams) or {})
    configs = checkpoint.get(saved_hparams.CONFIG_ENTRIES)
    if isinstance(configs, dict):  # Hydra's dict of configs: each a config again
        hparams = saved_hparams.rebuild_entries(hparams, configs.get(keys.hparams))
    if hparams_file is not None:
        hparams = _hparams_from_file(os.fspath(hparams_file))
    hparams.update(kwargs)
    checkpoint[keys.hparams] = hparams
    config = saved_hparams.rebuild(hparams, checkpoint.get(keys.kind))
    init = _init_kwargs(cls, hparams, config, checkpoint.get(keys.name), kwargs)
    module: Any = cls(**init)
    if isinstance(module, lightning().LightningDataModule):
        datamodule: Module = _datamodule_state(module, checkpoint)
        return datamodule
    strict = _strict(cls, module, strict)
    edited = STATE_DICT in checkpoint  # an on_save_checkpoint hook edited it: saved as such
    saved = set(checkpoint[STATE_DICT]) if edited else _saved_weights(storage)
    _configure_model(module, saved)
    if not edited:
        checkpoint[STATE_DICT] = module.state_dict()  # what the hook sees; loaded in place
    module.on_load_checkpoint(checkpoint)
    if edited:  # as Lightning does: what the hook left in the dict
        saved = set(checkpoint[STATE_DICT])
        module.load_state_dict(checkpoint[STATE_DICT], strict=strict)
    else:  # the usual case: the module itself was saved, as entry "model"
        loading.load(storage, {MODEL: module}, LoadOptions.of(strict=strict))
    if not strict:
        _warn_unmatched(module, saved)
    result: Module = module.to(map_location) if map_location is not None else module
    return result


def _strict(cls: type[Module], module: Any, strict: bool | None) -> bool:
    """``strict``, or the module's ``strict_loading``; refused where they conflict, with
    Lightning's error (a ``strict=False`` beside ``strict_loading=True`` set by the module
    loaded in silence, found in review)."""
    own = getattr(module, "_strict_loading", None)
    if own is not None and strict is not None and strict != own:
        raise ValueError(
            f"You set `.load_from_checkpoint(..., strict={strict!r})` which is in conflict "
            f"with `{cls.__name__}.strict_loading={own!r}. Please set the same value for both "
            "of them."
        )
    return bool(getattr(module, "strict_loading", True)) if strict is None else strict


def _warn_unmatched(module: Any, saved: set[str]) -> None:
    """After a non-strict load, Lightning's warnings for the weights that did not match
    (shardsafe's load said nothing of them, found in review)."""
    own = list(module.state_dict())
    missing = [k for k in own if k not in saved]
    unexpected = sorted(saved - set(own))
    warn = lightning().utilities.rank_zero_warn
    if missing:
        warn(f"Found keys that are in the model state dict but not in the checkpoint: {missing}")
    if unexpected:
        warn(f"Found keys that are not in the model state dict but in the checkpoint: {unexpected}")


def _datamodule_state(datamodule: Module, checkpoint: dict[str, Any]) -> Module:
    """A datamodule gets the state its ``state_dict()`` saved (under its class's name), as
    Lightning's ``LightningDataModule.load_from_checkpoint`` gives it; it has no weights."""
    saved = checkpoint.get(type(datamodule).__qualname__)
    if saved is not None:
        getattr(datamodule, "load_state_dict")(saved)  # noqa: B009 - typed as Module
    return datamodule


def _configure_model(module: Any, saved: set[str]) -> None:
    """Build the layers a module makes in ``configure_model`` (Lightning's advice for large
    models), as Lightning's ``load_from_checkpoint`` does before loading: without them the
    saved weights have nowhere to go (``strict=False`` returned a module without them).

    Only when the module lacks a weight the checkpoint holds: a ``configure_model`` that
    shards layers made in ``__init__`` (FSDP2, with the strategy's ``device_mesh``) cannot
    run in one process without a strategy, and that module already has every weight."""
    configure = getattr(module, "configure_model", None)
    if callable(configure) and not saved <= set(module.state_dict()):
        configure()


def _saved_weights(storage: Storage) -> set[str]:
    """The names of the module's weights in the checkpoint ``storage`` (its ``model`` entry)."""
    tensors = read_manifest_from(storage).tensors
    prefix = f"{MODEL}/"
    return {key[len(prefix) :] for key in tensors if key.startswith(prefix)}


def _lightning_part(storage: Storage) -> dict[str, Any]:
    """Lightning's checkpoint dict without the module and optimizers (plain values only)."""
    saved: list[str] = []

    def names(manifest: Manifest) -> dict[str, Any]:  # the manifest, read once
        saved.extend(manifest.values)
        return {}

    values = loading.load_chosen(storage, names, LoadOptions())
    part = values.get(LIGHTNING)
    if not isinstance(part, dict):
        raise CheckpointError(
            f"{storage.directory} is a shardsafe checkpoint, but not one a Lightning strategy "
            f"saved (it has no {LIGHTNING!r} entry); load it with "
            "shardsafe.load(path, {'model': module})"
        )
    checkpoint = dict(part)
    # What on_load_checkpoint sees, as in a fit and in Lightning's own load: one
    # placeholder per optimizer saved (their state is not read here).
    stored = [n for n in optimizer_names(len(saved)) if n in saved]
    if stored:
        checkpoint[OPTIMIZER_STATES] = [{} for _ in stored]
    return checkpoint


def _hparams_from_file(path: str) -> dict[str, Any]:
    saving = importlib.import_module(f"{lightning().__name__}.core.saving")
    if path.lower().endswith(".csv"):
        return dict(saving.load_hparams_from_tags_csv(path))
    if path.lower().endswith((".yml", ".yaml")):
        return dict(saving.load_hparams_from_yaml(path))
    raise ValueError(".csv, .yml or .yaml is required for `hparams_file`")


def _init_kwargs(
    cls: type[Any], hparams: dict[str, Any], config: Any, name: Any, given: dict[str, Any]
) -> dict[str, Any]:
    """What Lightning passes to ``cls.__init__``: every hyper-parameter (all under one
    argument if the module saved them as one, ``hparams_name``: then as ``config``, the
    ``DictConfig`` they were, see :mod:`.hparams`), then the keyword
    arguments given; only those ``__init__`` names unless it takes ``**kwargs``."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]  # not self
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    named = {p.name for p in parameters if p.kind not in variadic}
    init = {name: config} if isinstance(name, str) and name in named else dict(hparams)
    init.update(given)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return init
    return {k: v for k, v in init.items() if k in named}
