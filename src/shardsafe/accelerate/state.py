"""The state an ``Accelerator`` holds, as one shardsafe state dict, and its save and load.

Accelerate keeps what ``prepare`` and ``register_for_checkpointing`` gave it in lists
(``_models``, ``_optimizers``, ``_schedulers``, ``_dataloaders``, ``_custom_objects``);
its own ``save_state`` reads the same lists, so this module follows them in the same
order and names the entries as Accelerate names its files (``model``, ``model_1``, ...).
Each object goes to the adapter shardsafe has for it: a prepared model (DDP, or FSDP2
through Accelerate's FSDP plugin) is saved by parameter name, each rank writing its part;
an ``AcceleratedOptimizer`` is looked through to the optimizer inside it (a wrapped
``ZeroRedundancyOptimizer`` saves sharded); schedulers and the scaler by their
``state_dict``; registered objects as the main process's copy, loaded by every process,
as Accelerate saves them (``custom.py``); every rank's RNGs with
:class:`shardsafe.RNGState`.

Accelerate's ``register_save_state_pre_hook``/``register_load_state_pre_hook`` hooks are
refused, not skipped: they write and read files in Accelerate's own directory layout, so
running them beside a shardsafe save would write files the manifest does not cover, and
not running them would lose what they save without a word.
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

from .. import _tree, _warnings
from ..adapters import RNGState
from ..adapters.fsdp1 import fsdp1_path
from ..checkpoint import api, background, loading
from ..checkpoint.background import SaveHandle
from ..checkpoint.finding import newest_checkpoint
from ..checkpoint.format.manifest import MANIFEST_NAME, Manifest
from ..checkpoint.manager import CheckpointManager, step_of
from ..checkpoint.options import LoadOptions, opener_of
from ..checkpoint.refusals import told_if_refused
from ..checkpoint.storage.locations import directory_name, is_url
from ..distributed import world
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from .custom import main_process_copy
from .positions import DataLoaderPosition

STEP = "accelerator_step"
"""The entry holding ``accelerator.step`` (gradient-accumulation steps taken)."""


def state_of(accelerator: Any) -> dict[str, Any]:
    """Everything ``accelerator.save_state()`` would save, as a shardsafe state dict (the
    live objects, not copies): pass it to ``shardsafe.save``, ``async_save``, a
    ``CheckpointManager`` or a ``TieredCheckpointManager``, on every process, and to their
    loads to restore it; then set ``accelerator.step`` from the ``"accelerator_step"``
    value ``load`` returns (``load_state`` does all of this). A registered object that is
    not a module is held wrapped (``custom.MainProcessCopy``, its ``.obj``), so that the
    main process's copy of it is saved, as Accelerate saves it."""
    _refuse_engines(accelerator)
    _refuse_fsdp1(accelerator)
    state: dict[str, Any] = {}
    state.update(_numbered("model", accelerator._models))
    state.update(_numbered("optimizer", accelerator._optimizers))
    state.update(_numbered("scheduler", accelerator._schedulers))
    state.update(
        _numbered(
            "dataloader",
            [DataLoaderPosition(d, accelerator._dataloaders) for d in accelerator._dataloaders],
        )
    )
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    state.update(_registered(accelerator._custom_objects))
    state["rng"] = RNGState()
    state[STEP] = int(accelerator.step)
    return state


@overload
def save_state(
    accelerator: Any,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    async_save: Literal[False] = False,
    **options: Any,
) -> str: ...


@overload
def save_state(
    accelerator: Any,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    async_save: Literal[True],
    **options: Any,
) -> SaveHandle: ...


def save_state(
    accelerator: Any,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    async_save: bool = False,
    **options: Any,
) -> str | SaveHandle:
    """``accelerator.save_state(output_dir)`` as a shardsafe checkpoint; on every process.

    ``output_dir`` may be a local path or a URL (``s3://bucket/run/step-100``). Without
    one, and with ``ProjectConfiguration(automatic_checkpoint_naming=True)``, the
    checkpoint is step ``iteration`` of a :class:`shardsafe.CheckpointManager` over
    ``project_dir/checkpoints`` that keeps ``total_limit`` of them (all if unset), and
    ``iteration`` goes up by one, as Accelerate's does. ``async_save=True`` stages the
    state now, writes it in the background and returns the ``SaveHandle`` (its
    ``wait()`` gives the path); otherwise the path is returned once committed.
    ``options`` are ``shardsafe.save``'s (``layout``, ``storage_options``, ...);
    Accelerate's ``safe_serialization=True`` is taken as what shardsafe always does."""
    _safe_serialization(options.pop("safe_serialization", True))
    _refuse_hooks(accelerator._save_model_state_pre_hook, "register_save_state_pre_hook")
    state = state_of(accelerator)
    if output_dir is None:
        first = accelerator not in _MANAGERS
        manager = _manager(accelerator, options.pop("storage_options", None), "output_dir")
        config = accelerator.project_configuration
        step = int(config.iteration)
        if first:
            _refuse_behind(manager, step, _LOADED_FROM.get(accelerator))
        if async_save:
            handle = manager.async_save(step, state, **options)
        else:
            manager.save(step, state, **options)
        config.iteration = step + 1
        return handle if async_save else manager.path_for(step)
    path = os.fspath(output_dir)
    if async_save:
        return api.async_save(path, state, **options)
    api.save(path, state, **options)
    return path


def _safe_serialization(given: Any) -> None:
    """Accelerate's ``save_state(..., safe_serialization=...)``, as a call ported from it
    passes it: a bare ``TypeError`` from ``shardsafe.save`` before. True is what shardsafe
    always does (safetensors and JSON, nothing pickled); False asks for pickles."""
    if given is not True:
        raise ValueError(
            f"safe_serialization={given!r}: shardsafe writes safetensors and JSON only and "
            "never pickles, as safe_serialization=True does; drop the argument"
        )


def load_state(
    accelerator: Any, input_dir: str | os.PathLike[str] | None = None, **options: Any
) -> dict[str, Any]:
    """``accelerator.load_state(input_dir)`` for a checkpoint :func:`save_state` wrote, on
    every process, at any number of processes (models and optimizers are resharded; each
    process's RNGs come back at the same number of processes). Sets ``accelerator.step``.
    Without ``input_dir``, and with automatic checkpoint naming, loads the newest complete
    checkpoint in ``project_dir/checkpoints`` and sets ``iteration`` to the one after it
    (or after a newer step directory it passed over, damaged or without its manifest), so
    that the next save does not collide with either. A save of this process still in
    flight (``async_save=True``) is waited for first. ``options`` are ``shardsafe.load``'s
    (``strict``, ``verify``, ...); with ``strict`` (the default), a checkpoint holding an
    object the accelerator has nothing to restore into is refused before anything is
    restored. Returns the plain values saved."""
    _refuse_hooks(accelerator._load_model_state_pre_hook, "register_load_state_pre_hook")
    # A save_state(async_save=True) still writing is the newest checkpoint: loaded before
    # it commits, the one before it would be restored (a rollback to the wrong step), and
    # iteration set past the one in flight. Its error, if it failed, is raised here.
    background.drain()
    state = state_of(accelerator)
    choose = _nothing_left_behind(state, options.get("strict", True))
    if input_dir is None:
        manager = _manager(accelerator, options.pop("storage_options", None), "input_dir")
        values = manager._load_latest_chosen(choose, **options)
        if values is None:
            raise CheckpointNotFoundError(_nothing_to_load(manager.root))
        accelerator.project_configuration.iteration = _next_iteration(manager)
    else:
        _refuse_accelerates_own(os.fspath(input_dir))
        values = _load_chosen(os.fspath(input_dir), choose, options)
        _LOADED_FROM[accelerator] = os.fspath(input_dir)
    accelerator.step = int(values.get(STEP, 0))
    return values


def _next_iteration(manager: CheckpointManager) -> int:
    """The step after the one ``load_latest`` just restored, or after a newer step
    directory it passed over (damaged, or without its manifest), whichever is later: a
    save never writes over a directory it would refuse ("not empty ... pick another
    path", which automatic naming gives no way to do), nor over what was passed over."""
    loaded = manager._resumed_from
    assert loaded is not None  # load_latest just loaded it
    newest = next(manager._step_dirs(), (loaded, ""))[0]
    return max(loaded, newest) + 1


_ACCELERATOR_ENTRY = re.compile(
    r"(?:model|optimizer|scheduler|dataloader)(?:_[0-9]+)?|custom_checkpoint_[0-9]+"
)
"""The names :func:`state_of` gives the objects a user prepares or registers. Not the
``scaler``: the accelerator makes it itself for ``mixed_precision="fp16"``, so a resume
without one changed the precision on purpose (fp16 on a GPU to bf16, or to the CPU), and
Accelerate's own ``load_state`` ignores its saved scaler then too."""


def _nothing_left_behind(
    state: dict[str, Any], strict: bool
) -> Callable[[Manifest], dict[str, Any]]:
    """The state to load, once the checkpoint's manifest shows that every object it holds
    has one to go into (under ``strict``).

    ``shardsafe.load`` loads the entries the state names and leaves the checkpoint's
    others alone, so an object registered (or prepared) in the run that saved and
    forgotten in the one that resumes would silently keep its fresh state: a counter at
    0, a learning-rate schedule back at its start. Accelerate's own ``load_state``
    refuses a checkpoint whose registered objects are not as many as the accelerator's;
    this refuses any object left behind, inside the load's plan, so every process raises
    it and nothing is restored."""

    def choose(manifest: Manifest) -> dict[str, Any]:
        _check_step(manifest)
        _check_positions(manifest, state)
        left = [n for n in manifest.values if n not in state and _ACCELERATOR_ENTRY.fullmatch(n)]
        if strict and left:
            raise CheckpointMismatchError(
                f"the checkpoint holds {', '.join(map(repr, left))}, which this accelerator "
                "has nothing to restore into: prepare the same models, optimizers, schedulers "
                "and dataloaders and register the same objects with "
                "accelerator.register_for_checkpointing, in the same order, as the run that "
                "saved it did; or pass strict=False to load only what the accelerator has"
            )
        return _without_positions_of_another_world(manifest, state, strict)

    return choose


def _without_positions_of_another_world(
    manifest: Manifest, state: dict[str, Any], strict: bool
) -> dict[str, Any]:
    """``state``, less the dataloader positions saved per process by another number of
    processes than this run's (a sampler seeded per process: no ``set_seed``, or
    ``set_seed(seed, device_specific=True)``), with ``strict=False``; with ``strict``,
    refused before anything is restored.

    Such a position holds one seed per saving process: a run at another number of
    processes has no seed for its extra processes, or more seeds than processes. The
    load refused it, whatever ``strict`` said, with advice ("leave it out of the state")
    that ``load_state``, which builds the state itself, gives no way to follow: a
    checkpoint saved on 2 processes then loaded nowhere else, not even its model."""
    processes = world()[1]
    others = {
        name: len(records)
        for name, saved in manifest.values.items()
        if isinstance(state.get(name), DataLoaderPosition)
        and saved.kind == "stateful"
        and isinstance(saved.meta, dict)
        and isinstance(records := saved.meta.get(_tree.PER_RANK), list)
        and len(records) != processes
    }
    if not others:
        return state
    names = ", ".join(map(repr, others))
    saved_by = next(iter(others.values()))  # one number: the processes that saved
    them, its, starts = (
        ("that dataloader", "its", "starts")
        if len(others) == 1
        else ("those dataloaders", "their", "start")
    )
    said = (
        f"the checkpoint holds {names} with a sampler seed of each of its {saved_by} "
        "processes (seeded per process: no set_seed, or set_seed(seed, "
        f"device_specific=True)), so it restores at {saved_by} processes only, not at this "
        f"run's {processes}"
    )
    if strict:
        raise CheckpointMismatchError(
            f"{said}: load at {saved_by} processes, or pass strict=False to load everything "
            f"else and start {them} from {its} first epoch; nothing was restored"
        )
    if world()[0] == 0:
        _warnings.warn(
            f"shardsafe: {said}; loading everything else, and {them} {starts} from {its} "
            "first epoch (strict=False)",
        )
    return {name: value for name, value in state.items() if name not in others}


def _check_step(manifest: Manifest) -> None:
    """Refuse, before anything is restored (inside the load's plan, so on every process),
    an ``accelerator_step`` that is not a whole number of steps: ``int()`` of it after the
    restore raised a bare ``ValueError``/``TypeError`` with everything already loaded, or
    cut ``2.5`` and ``true`` to 2 and 1 without a word."""
    saved = manifest.values.get(STEP)
    if saved is None:
        return
    step = saved.meta if saved.kind == "value" else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        shown = step if saved.kind == "value" else f"a {saved.kind}"
        raise CheckpointCorruptError(
            f"the checkpoint's {STEP!r} is {shown!r}, not a number of steps (a whole number, "
            "0 or more) as shardsafe.accelerate.save_state writes it; nothing was restored"
        )


def _check_positions(manifest: Manifest, state: dict[str, Any]) -> None:
    """Refuse, before anything is restored, a dataloader position (``positions.py``) whose
    epoch counter or sampler seed is not a whole number in range: restored as it was, a
    string failed in ``int()`` after every other object was restored, and a seed of
    2**70 only when the next epoch reseeded the sampler, mid-run. A position that
    differed between the processes (a sampler seeded per process) is saved per rank, and
    each rank's is checked."""
    for name, saved in manifest.values.items():
        if not isinstance(state.get(name), DataLoaderPosition) or saved.kind != "stateful":
            continue
        per_rank = _per_rank(saved.meta)
        for rank, meta in enumerate(per_rank or [saved.meta]):
            whose = f"{name!r} holds, for rank {rank}," if per_rank else f"{name!r} holds"
            _check_position(whose, meta if isinstance(meta, dict) else {})


def _per_rank(meta: Any) -> list[Any] | None:
    """The positions of a value saved per rank (``_tree.PER_RANK``: a list of one record
    per rank, or one form whose ``shared`` record differs in tensors only), else None."""
    if not (isinstance(meta, dict) and len(meta) == 1 and _tree.PER_RANK in meta):
        return None
    records = meta[_tree.PER_RANK]
    if isinstance(records, dict):
        return [records.get("shared")]
    return records if isinstance(records, list) else [None]


def _check_position(whose: str, meta: dict[str, Any]) -> None:
    sampler = meta.get("sampler")
    fields = [("iteration", meta.get("iteration"), 0, _MAX_COUNT)]
    if sampler is not None:
        if not isinstance(sampler, dict):
            sampler = {}  # its epoch and seed are then reported missing (None)
        fields += [
            ("sampler epoch", sampler.get("epoch"), 0, _MAX_COUNT),
            ("sampler seed", sampler.get("seed"), -(1 << 63), 1 << 64),
        ]
    for field, value, low, high in fields:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
            raise CheckpointCorruptError(
                f"the checkpoint's {whose} {field} {value!r}, not a whole number from {low} "
                f"to {high - 1} as shardsafe.accelerate.save_state writes it; nothing was "
                "restored"
            )
    if sampler is not None and sampler["seed"] + sampler["epoch"] >= 1 << 64:
        # The sampler seeds each epoch's shuffle with seed + epoch: past this, the next
        # epoch failed inside Accelerate, mid-run.
        raise CheckpointCorruptError(
            f"the checkpoint's {whose} sampler seed {sampler['seed']} and epoch "
            f"{sampler['epoch']}, whose sum, the seed of the epoch's shuffle, is past "
            f"{(1 << 64) - 1}, the largest seed torch takes; nothing was restored"
        )


_MAX_COUNT = 1 << 63
"""An epoch counter past this is no run's (and overflows torch's seeding)."""


def _load_chosen(
    path: str, choose: Callable[[Manifest], dict[str, Any]], options: dict[str, Any]
) -> dict[str, Any]:
    """``shardsafe.load(path, ...)`` with the state chosen from the manifest (the store
    opened inside the load, as ``shardsafe.load`` opens it)."""
    name = directory_name(path)  # what the ranks agree under
    opts = told_if_refused("load", name, lambda: LoadOptions.of(**options))
    opener = opener_of(path, opts.storage, opts.storage_options)
    return loading.load_opening(opener, name, choose, opts)


_MANAGERS: weakref.WeakKeyDictionary[Any, CheckpointManager] = weakref.WeakKeyDictionary()
_LOADED_FROM: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
"""The directory each accelerator last loaded by name (``load_state(accelerator, dir)``),
for :func:`_refuse_behind` to tell a rollback from a script that did not resume."""


def _manager(
    accelerator: Any, storage_options: dict[str, Any] | None, argument: str
) -> CheckpointManager:
    """The accelerator's manager of ``project_dir/checkpoints``, one per accelerator (it
    holds the root's lock, and the save in flight, for the run), made with the
    ``storage_options`` of the first call that names a project directory on a store;
    a later call must not give others. ``argument``: the directory argument the caller
    left out (``output_dir`` of ``save_state``, ``input_dir`` of ``load_state``)."""
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        raise ValueError(
            f"no {argument} given and automatic checkpoint naming is off: pass a directory, "
            "or build the Accelerator with ProjectConfiguration(project_dir=..., "
            "automatic_checkpoint_naming=True)"
        )
    manager = _MANAGERS.get(accelerator)
    if manager is None:
        _check_project(config)
        root = os.path.join(accelerator.project_dir, "checkpoints")
        manager = CheckpointManager(
            root, keep_last=config.total_limit, storage_options=storage_options
        )
        _MANAGERS[accelerator] = manager
    elif storage_options is not None and storage_options != manager.storage_options:
        raise ValueError(
            f"the checkpoints of {manager.root} were opened with other storage_options: "
            "give the same ones to every save_state and load_state of this accelerator "
            "(or none after the first)"
        )
    return manager


def _refuse_behind(manager: CheckpointManager, step: int, loaded: str | None) -> None:
    """Refuse the first save of an accelerator that did not resume from the checkpoints
    already in its project (a script restarted without ``load_state()``: ``iteration``
    back at 0), before anything is written, on every process, with the way out.

    The manager refuses it too, but in its own words: step 0 still there was "already
    holds a committed checkpoint ... or delete it first" (deleting it would not help: step
    1 is next), and a newer step pointed at ``CheckpointManager.load_latest`` and
    shardsafe's Trainer, which an Accelerate script does not use."""
    try:
        steps = manager.complete_steps()
    except Exception:  # a store this process cannot reach: the save itself fails, agreed
        return
    if steps and steps[-1] >= step and loaded is not None:  # loaded by name
        raise CheckpointError(_loaded_by_name(manager.root, steps[-1], step, loaded))
    if steps and steps[-1] >= step:
        raise CheckpointError(
            f"{manager.root} already holds checkpoints up to step {steps[-1]}, and this "
            f"accelerator's first save is step {step} (ProjectConfiguration.iteration): it "
            "did not resume from them. Call shardsafe.accelerate.load_state(accelerator) "
            "without input_dir before training, which restores the newest and sets "
            "iteration past it, or give this run another project_dir; nothing was written"
        )


def _loaded_by_name(root: str, newest: int, step: int, loaded: str) -> str:
    """Why the first save after ``load_state(accelerator, loaded)`` is refused, and the way
    on. A load by name leaves ``iteration`` as it is (a rollback must not save over the
    newer checkpoints), so the way on depends on what was loaded: an older checkpoint of
    ``root`` (a rollback), its newest (a resume that named it, told before that it was
    "not the newest"), or one elsewhere."""
    where, name = os.path.split(loaded.rstrip("/"))
    rolled = step_of(name) if where == root else None
    head = (
        f"{root} already holds checkpoints up to step {newest}, and this accelerator's first "
        f"save is step {step} (ProjectConfiguration.iteration): it loaded {loaded}"
    )
    if rolled == newest:
        return (
            f"{head}, the newest, by name, and a load by name does not set iteration. To "
            f"continue from it, set accelerator.project_configuration.iteration = {newest + 1}, "
            "or load it with shardsafe.accelerate.load_state(accelerator) without input_dir, "
            "which loads the newest and sets iteration past it. Nothing was written"
        )
    back = (
        f"To continue from it, move the checkpoints after step {rolled} out of {root} "
        "(shardsafe deletes none for you) and set "
        f"accelerator.project_configuration.iteration = {rolled + 1}; to save after them "
        "instead, set it"
        if rolled is not None
        else "To save after them, set accelerator.project_configuration.iteration"
    )
    return (
        f"{head}, not the newest. {back} to {newest + 1}; or give this run another "
        "project_dir. Nothing was written"
    )


def _check_project(config: Any) -> None:
    """Refuse, naming Accelerate's own settings, a configuration the manager cannot follow:
    without a ``project_dir`` there is no root (an ``os.path.join`` ``TypeError`` from
    deep inside, otherwise), and ``total_limit`` below 1 would keep no checkpoint (the
    manager's own error names its ``keep_last``, which the user never set)."""
    if config.project_dir is None:
        raise ValueError(
            "automatic checkpoint naming needs a project directory: build the Accelerator "
            "with ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True), or "
            "pass a directory to save_state and load_state"
        )
    limit = config.total_limit
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(
            f"ProjectConfiguration(total_limit={limit!r}) would keep no checkpoint: give the "
            "number of checkpoints to keep, 1 or more, or None to keep them all"
        )


_ACCELERATE_FILES = (
    "random_states_0.pkl",
    "optimizer.bin",
    "model.safetensors",
    "pytorch_model.bin",
)
"""Files ``accelerator.save_state`` writes (``random_states_0.pkl`` always; the model as
``model.safetensors``, or ``pytorch_model.bin`` with ``safe_serialization=False``)."""

_ACCELERATE_FOLDER = re.compile(r"checkpoint_([0-9]+)")
"""The folders Accelerate's own ``save_state`` names under ``project_dir/checkpoints`` with
automatic checkpoint naming (``checkpoint_0``, ...), the root shardsafe's manager uses."""


def _accelerates_files(path: str) -> list[str]:
    """The files of Accelerate's own ``save_state`` in the local directory ``path``."""
    return [name for name in _ACCELERATE_FILES if os.path.lexists(os.path.join(path, name))]


def _nothing_to_load(root: str) -> str:
    """Why ``load_state()`` under automatic naming found nothing to load in ``root``.

    A run switched from Accelerate's own ``save_state`` has its checkpoints in the same
    ``project_dir/checkpoints``, as ``checkpoint_<n>``: "save one first" would send it
    training from scratch, or a script that starts afresh on ``CheckpointNotFoundError``
    would do so without a word, while its checkpoints sit there."""
    own: list[str] = []
    if not is_url(root) and os.path.isdir(root):
        found = (_ACCELERATE_FOLDER.fullmatch(name) for name in os.listdir(root))
        numbered = sorted((int(m.group(1)), m.group(0)) for m in found if m is not None)
        own = [name for _, name in numbered if _accelerates_files(os.path.join(root, name))]
    if not own:
        return f"no complete checkpoint in {root} to load: save one first, or pass input_dir"
    return (
        f"no complete checkpoint shardsafe wrote in {root} to load, but Accelerate's own "
        f"save_state wrote {', '.join(own)} there (no {MANIFEST_NAME}): load the newest with "
        "accelerator.load_state(); shardsafe.accelerate.load_state loads the checkpoints "
        "shardsafe.accelerate.save_state writes"
    )


def _refuse_accelerates_own(path: str) -> None:
    """Refuse a local directory ``accelerator.save_state`` wrote, or the folder of
    automatic checkpoints itself (``project_dir/checkpoints``), saying so.

    shardsafe's own error for them (no ``manifest.json``: "a save into it may have been
    interrupted") sends a user migrating from Accelerate looking for a crash. Every
    process sees the same directory, so every process raises, before any collective."""
    if (
        is_url(path)
        or not os.path.isdir(path)
        or os.path.lexists(os.path.join(path, MANIFEST_NAME))
    ):
        return
    newest = newest_checkpoint(path)
    if newest is not None:
        raise CheckpointNotFoundError(
            f"{path} is a folder of checkpoints, not one checkpoint (the newest committed one "
            f"in it is {newest}): pass one of them, or, with automatic checkpoint naming, call "
            "load_state(accelerator) without input_dir to load the newest"
        )
    found = _accelerates_files(path)
    if found:
        raise CheckpointNotFoundError(
            f"{path} is a checkpoint Accelerate's own save_state wrote (it holds "
            f"{', '.join(found)} and no {MANIFEST_NAME}): load it with "
            "accelerator.load_state; shardsafe.accelerate.load_state loads the checkpoints "
            "shardsafe.accelerate.save_state writes"
        )


def _registered(objects: Sequence[Any]) -> dict[str, Any]:
    """``custom_checkpoint_0``, ...: the registered objects, each saved as the main
    process's copy and loaded by every process, as Accelerate's own ``save_state`` saves
    one file per object from the main process (``custom.py``)."""
    named = {f"custom_checkpoint_{i}": o for i, o in enumerate(objects)}
    return {name: main_process_copy(o, name) for name, o in named.items()}


def _numbered(name: str, objects: Sequence[Any]) -> dict[str, Any]:
    """``model``, ``model_1``, ...: Accelerate's names for its files, as entry names."""
    return {name if i == 0 else f"{name}_{i}": o for i, o in enumerate(objects)}


def _refuse_hooks(hooks: Any, registered_with: str) -> None:
    if hooks:
        raise ValueError(
            f"the accelerator has {len(hooks)} hook(s) registered with {registered_with}: "
            "they save or load files in Accelerate's own layout, which a shardsafe "
            "checkpoint does not have. Register what they save with "
            "accelerator.register_for_checkpointing (any object with state_dict and "
            "load_state_dict), and remove the hooks"
        )


_ENGINES = {"DEEPSPEED": "DeepSpeed", "MEGATRON_LM": "Megatron-LM"}
"""Accelerate's distributed types whose engines own their state (``docs/accelerate.md``)."""


def _refuse_engines(accelerator: Any) -> None:
    """Refuse DeepSpeed and Megatron-LM, as the docs say, on every process before anything
    is written or read: their prepared objects are the engine's (``DeepSpeedEngine``, a
    ZeRO optimizer over flattened fp32 partitions, ZeRO-3's empty parameter
    placeholders), whose state only the engine's own checkpointing saves; they were saved
    as if they were plain torch objects."""
    kind = getattr(getattr(accelerator, "distributed_type", None), "value", None)
    if kind in _ENGINES:
        raise ValueError(
            f"the accelerator runs {_ENGINES[kind]}, which saves its models and optimizers "
            "through its own engine; shardsafe.accelerate does not wrap it: use "
            "accelerator.save_state and accelerator.load_state"
        )


def _refuse_fsdp1(accelerator: Any) -> None:
    """Refuse FSDP1 before anything is written or read, naming Accelerate's way out; the
    core refuses it too (``adapters.fsdp1``, the one check of what FSDP1 is)."""
    for model in accelerator._models:
        if fsdp1_path(model) is not None:
            raise ValueError(
                "a model is wrapped in FSDP1 (FullyShardedDataParallel), which shardsafe "
                "does not save: use FSDP2, FullyShardedDataParallelPlugin(fsdp_version=2)"
            )
