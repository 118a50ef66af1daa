"""Refusing, before the first step, a run whose checkpoints could not be saved.

A shardsafe checkpoint holds tensors and JSON data, never pickles, so a value JSON cannot
hold (most often a hyper-parameter: a function, a module, a config object) would make
every save fail. Found at the first save, that is a crash in the middle of a run; so
when ``fit`` starts, the strategy encodes (without writing anything) the parts of
Lightning's checkpoint it can already see: the hyper-parameters of the module and the
datamodule, and the ``state_dict()`` of every callback, LR scheduler, the precision
plugin, the datamodule and the loops. The first problem is reported on every rank,
naming the value and the way out. (What ``on_save_checkpoint`` hooks add can only be
checked when they run, at a save; such a failure is agreed on every rank like any other.)
Rank 0 also asks the store once about each checkpoint callback's object-store ``dirpath``:
a missing bucket, a store it cannot reach, a ``//`` in the URL.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import _names, _tree
from ..checkpoint.storage.locations import is_url, open_storage
from ..checkpoint.storage.store_failures import store_errors
from ..errors import CheckpointError
from . import hparams

_HINT = (
    "(shardsafe's Lightning strategy checks this when fit starts, so that no save fails "
    "mid-run: shardsafe checkpoints hold tensors and JSON data, never pickles.)"
)


@dataclass(frozen=True)
class Part:
    """One piece of the checkpoint to come: what it is, how to get it, how to fix it."""

    label: str
    get: Callable[[], Any]
    way_out: str


def check_savable(trainer: Any) -> None:
    """Raise, on every rank, the first value of the coming checkpoints JSON cannot hold,
    or (rank 0 looks) a checkpoint callback's object-store ``dirpath`` no save could
    write to (:func:`_dirpath_problem`)."""
    problem = next((p for p in map(_problem, parts(trainer)) if p is not None), None)
    if problem is None and trainer.is_global_zero:
        problem = next(filter(None, map(_dirpath_problem, _url_dirpaths(trainer))), None)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        problems: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise CheckpointError(problem)


def _url_dirpaths(trainer: Any) -> list[str]:
    """The object-store ``dirpath`` of each checkpoint callback that has one."""
    dirpaths = (getattr(c, "dirpath", None) for c in trainer.checkpoint_callbacks)
    return [os.fspath(d) for d in dirpaths if d and is_url(os.fspath(d))]


def _dirpath_problem(dirpath: str) -> str | None:
    """Why no checkpoint could be saved under the object-store ``dirpath``, or ``None``:
    a ``//`` or dot segment (refused by every save), a bucket that does not exist, a
    store that cannot be reached. Found at the first save instead, the run had trained
    until then, hours with a real ``every_n_train_steps`` (found in review). One request
    to the store, which writes nothing."""
    try:
        with store_errors(dirpath), open_storage(dirpath, follow=False) as directory:
            directory.make_directory()
    except (CheckpointError, OSError) as e:
        return (
            f"ModelCheckpoint(dirpath={dirpath!r}) cannot hold checkpoints: {e} (shardsafe's "
            "Lightning strategy checks this when fit starts, so that no save fails mid-run)"
        )
    return None


def parts(trainer: Any) -> Iterator[Part]:
    """Every part of Lightning's checkpoint that is known before the first save."""
    for owner in (trainer.lightning_module, trainer.datamodule):
        if owner is not None and getattr(owner, "hparams", None):
            yield from _hyper_parameters(owner)
    for callback in trainer.callbacks:
        yield _state_of(f"callback {type(callback).__qualname__}", callback)
    for config in trainer.lr_scheduler_configs:
        yield _state_of(f"LR scheduler {type(config.scheduler).__qualname__}", config.scheduler)
    yield _state_of(
        f"precision plugin {type(trainer.precision_plugin).__qualname__}", trainer.precision_plugin
    )
    if trainer.datamodule is not None:
        yield _state_of(f"datamodule {type(trainer.datamodule).__qualname__}", trainer.datamodule)
    yield _state_of("the fit loop", trainer.fit_loop)


def _hyper_parameters(owner: Any) -> Iterator[Part]:
    cls = type(owner).__qualname__
    for key, value in dict(hparams.plain_hparams(owner.hparams)).items():
        yield Part(
            f"hyper-parameter {key!r} of {cls}",
            _constant(value),
            f"Leave it out with self.save_hyperparameters(ignore=[{key!r}]), or pass a value "
            "JSON can hold (a number, string, list or dict) and build the object from it.",
        )


def _constant(value: Any) -> Callable[[], Any]:
    return lambda: value


def _state_of(label: str, obj: Any) -> Part:
    return Part(
        f"the state_dict() of {label}",
        obj.state_dict,
        "Return only tensors, numbers, strings, lists and dicts from its state_dict().",
    )


def _problem(part: Part) -> str | None:
    try:
        value = part.get()
    except Exception:  # not ready before training: the save itself will tell
        return None
    found = unsavable(value)
    if found is None:
        return None
    path, what = found
    where = f" holds {path}, {what}," if path else f" is {what},"
    return f"{part.label}{where} which a checkpoint cannot hold. {part.way_out} {_HINT}"


def unsavable(value: Any, path: str = "") -> tuple[str, str] | None:
    """``(path, "a <type>")`` of the innermost value shardsafe cannot encode, or ``None``."""
    if _encodes(value):
        return None
    children: Iterator[tuple[object, Any]] = iter(())
    if isinstance(value, Mapping):
        children = iter(value.items())
    elif isinstance(value, (list, tuple)):
        children = enumerate(value)
    for key, child in children:
        found = unsavable(child, f"{path}[{key!r}]")
        if found is not None:
            return found
    return path, _describe(value)


def _describe(value: Any) -> str:
    """What a value is, for a person: ``the class torch.nn.ReLU``, ``a Config``."""
    if isinstance(value, type):
        return f"the class {value.__module__}.{value.__qualname__}"
    if inspect.isroutine(value):
        return f"the function {getattr(value, '__module__', None) or '?'}.{value.__qualname__}"
    return f"a {type(value).__qualname__}"


def _encodes(value: Any) -> bool:
    try:
        _tree.encode(value, "", _discard)
    except CheckpointError:
        return False
    return True


def _discard(path: tuple[str, ...], tensor: torch.Tensor) -> str:
    return _names.join("check", *path)
