"""The adapter protocol: what every adapter implements and what the engine hands it.

This module sits below both the engine (``shardsafe.checkpoint``) and the adapters
(``shardsafe.adapters``): the engine knows adapters only through it and the registry,
never a concrete one. Plain data, no I/O, no process group.

An adapter knows one kind of object (a module, an optimizer, a ZeRO optimizer, ...). On
save it turns the object into a :class:`SaveItem`: JSON metadata plus the tensor
:class:`Chunk` s this rank holds, each placed in its global tensor. On load it says which
regions it needs (:class:`LoadRequests`), checks the data it got (``validate``), and puts
it back (``restore``). Contexts tell it where it stands: :class:`SaveContext` on save,
:class:`LoadContext` (which adds what the checkpoint holds) on load.

Parameter naming lives here too, because both sides need it: optimizer state is keyed by
the fully qualified name of its parameter (:func:`param_names`), never by position.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import _names
from .errors import CheckpointError

JSON = Any
"""What ``json`` can hold: metadata is plain data, never a pickle."""


@dataclass(frozen=True)
class Chunk:
    """A piece of a (possibly sharded) tensor that this rank holds and can write.

    ``offsets`` place the piece inside the global tensor of ``global_shape``. A
    ``replicated`` chunk is an identical copy held by every rank that has its key (DDP
    weights on every rank, a pipeline stage's weights on its data-parallel group): the
    planner picks one of those ranks to write it, so it is stored once in total.
    ``lowest_rank_wins`` marks replicated copies that may legitimately differ (buffers
    such as BatchNorm statistics, which DDP takes from rank 0 at each forward): the copy
    of the lowest rank holding the key is saved, and ``verify_replicas`` leaves it alone.
    """

    key: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    replicated: bool = False
    lowest_rank_wins: bool = False
    copies_allowed: bool = False
    """A DTensor shard other ranks may hold copies of (a ``Replicate`` mesh dimension, as
    HSDP has; a shard over a sub-mesh, as TP x FSDP2 has for parameters TP leaves whole):
    equal boxes are then one shard, stored once. Any other box two ranks offer is refused
    (two ranks' own state under one key would otherwise lose one silently)."""
    always_verify: bool = False
    """Compared across the ranks holding it on every save, not only with
    ``verify_replicas``: tiny tensors whose divergence nothing else would reveal (an
    optimizer's tensor-valued hyperparameters, which ranks key by group position)."""
    per_rank_if_different: bool = False
    """A replicated copy that may legitimately be each rank's own (a small tensor of a
    stateful object: a per-rank sampler's generator state). Compared across its holders
    on every save; when the copies differ, each rank's is stored under a key of its own
    (``plan/per_rank.py``) and the entry recorded per rank, instead of one copy."""

    @staticmethod
    def whole(key: str, tensor: torch.Tensor, *, replicated: bool) -> Chunk:
        """A chunk that is the entire tensor."""
        shape = tuple(tensor.shape)
        return Chunk(key, tensor, shape, (0,) * len(shape), replicated)


@dataclass
class SaveItem:
    """What an adapter produces for one state entry on one rank."""

    kind: str
    meta: JSON
    chunks: list[Chunk] = field(default_factory=list)


@dataclass(frozen=True)
class SavedValue:
    """One state entry as the manifest records it: its name, kind and metadata."""

    name: str
    kind: str
    meta: JSON
    where: str = ""
    """What the entry came from, for messages, where it is not a checkpoint's manifest
    (``shardsafe.interop`` builds one from a ``state_dict()`` in memory)."""

    @property
    def entry(self) -> str:
        """The entry as messages name it: ``the manifest entry for 'name'`` by default."""
        return self.where or f"the manifest entry for {self.name!r}"


@dataclass(frozen=True)
class ReadRequest:
    """A region of a saved tensor that this rank wants.

    ``offsets``/``shape`` select a box of the global tensor; ``None`` means all of it.
    ``dtype``/``global_shape``, when given, are checked against the checkpoint and a
    difference is reported as a mismatch: give both for a tensor that goes into a live
    one. ``within`` (the shape of a live tensor, e.g. a parameter for its optimizer
    state) requires the saved tensor to be a scalar or exactly that shape; with
    ``factored`` also that shape with some dimensions 1 or one dimension left out (row
    and column factors, as Adafactor keeps). An ``optional`` request that the checkpoint
    cannot satisfy is skipped instead of being reported as missing.
    """

    key: str
    offsets: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    global_shape: tuple[int, ...] | None = None
    optional: bool = False
    within: tuple[int, ...] | None = None
    factored: bool = False

    @property
    def checked_against_live(self) -> bool:
        """Its size is bounded by a live tensor (dtype and shape both checked)."""
        return self.dtype is not None and self.global_shape is not None


@dataclass
class LoadRequests:
    """One adapter's answer to "what do you need?": read requests, plus the problems it
    found (keys missing from or unexpected in the checkpoint, mismatched shapes)."""

    requests: list[ReadRequest] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class SaveContext:
    """What an adapter may know about the save it takes part in."""

    name: str
    """The key of this entry in the user's state dict: the prefix of all its tensor keys."""
    rank: int
    world_size: int
    param_names: Mapping[int, str] = field(default_factory=dict)
    """``id(parameter)`` -> fully qualified name, from the modules in the same state dict."""
    param_unqualified: Mapping[str, str] = field(default_factory=dict)
    """Each name :attr:`param_names` qualifies by its state key -> the module's own name
    (:func:`load_names`)."""
    claims: _names.Claims = field(
        default_factory=_names.Claims, init=False, repr=False, compare=False
    )
    """The path each key of this entry was made for (see :meth:`key`)."""

    def key(self, *parts: str) -> str:
        """The tensor key for the path ``parts`` under this entry, e.g.
        ``optimizer/fc.weight/exp_avg``: each part encoded (``shardsafe._names``), so
        that different paths get different keys. A key made for two different paths
        (two NaN dict keys) is refused, naming both."""
        key = _names.join(self.name, *parts)
        self.claims.claim(key, parts, f"state[{self.name!r}]")
        return key

    def param_fqn(self, param: torch.Tensor) -> str:
        fqn = self.param_names.get(id(param))
        if fqn is None and not self.param_names:
            raise CheckpointError(
                f"state[{self.name!r}] holds a parameter of shape {list(param.shape)} that is "
                "not in any module of the same state dict, so it has no name to be saved "
                f"under. Pass the model alongside it, e.g. {{'model': model, {self.name!r}: "
                f"{self.name}}}."
            )
        if fqn is None:
            # The model was passed: the optimizer holds parameters it no longer has.
            raise CheckpointError(
                f"state[{self.name!r}] holds a parameter of shape {list(param.shape)} that is "
                "none of the parameters of the modules in the same state dict, so it has no "
                "name. Was the optimizer built for another instance of the model, or before "
                "its parameters were replaced (fully_shard, or loading with assign=True, "
                "after the optimizer was created)? Build the optimizer from the model's "
                "parameters as they are now, or pass the module that holds this parameter "
                "in the same state dict."
            )
        return fqn


@dataclass(frozen=True, kw_only=True)
class LoadContext(SaveContext):
    """What an adapter may know about the load it takes part in: also what was saved."""

    saved_world_size: int
    """The world size the checkpoint was written with."""
    strict: bool = True
    saved_tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    """Every tensor key in the checkpoint with its dtype and global shape."""
    param_aliases: Mapping[str, str] = field(default_factory=dict)
    """Every other name of a parameter shared by several modules (a tied weight) -> the
    name :attr:`param_names` gives it (:func:`load_names`)."""


class Adapter(ABC):
    """Saves and restores one kind of object. Subclass it and call ``register_adapter``."""

    kind: ClassVar[str]
    """Recorded in the manifest; an entry loads only into an adapter of the same kind."""
    returns_value: ClassVar[bool] = False
    """True if ``load`` hands :meth:`restore`'s result back to its caller, and restores
    entries of this kind that the caller did not pass (plain data)."""

    @abstractmethod
    def handles(self, obj: object) -> bool:
        """True if this adapter knows how to save and load ``obj``."""

    @abstractmethod
    def save(self, obj: Any, ctx: SaveContext) -> SaveItem:
        """This rank's metadata and chunks for ``obj``. Must not communicate."""

    def merge(self, metas: list[JSON]) -> JSON:
        """Combine the metadata every rank produced into what the manifest records.

        The default keeps rank 0's, right for replicated state. Sharded state (each rank
        knowing only its part) overrides this.
        """
        return metas[0]

    @abstractmethod
    def plan_load(self, obj: Any, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        """The tensor regions this rank needs to restore ``obj``, plus any mismatches."""

    def targets(self, obj: Any, saved: SavedValue, ctx: LoadContext) -> Mapping[str, torch.Tensor]:
        """Live tensors the loaded data of a tensor key belongs in, to be read straight into.

        So a load needs no second copy of the state: the engine fills each target (CPU
        or CUDA, any layout) with the box it requested for that key, CRC-checked, and
        then hands the target itself to :meth:`validate` and :meth:`restore` under that
        key. :meth:`validate` sees it before it is filled (its old values), so it may
        check only its dtype and shape. A target must have the dtype of the saved
        tensor and the shape of the box requested (for a DTensor: its local shard);
        anything else is ignored and read into a new tensor. The default: none.
        """
        return {}

    def validate(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: LoadContext
    ) -> None:
        """Check, without changing ``obj``, that :meth:`restore` will accept this data.

        Runs on every entry after every rank has read and verified its tensors (those
        read in place, see :meth:`targets`, are then still the live ones: with
        ``verify="inline"`` they are read only after this), and before anything is
        restored anywhere, so a checkpoint that would fail half-way through restoring
        fails here instead, with nothing modified. Raise
        ``CheckpointCorruptError`` (malformed metadata) or ``CheckpointMismatchError``
        (does not fit ``obj``). The default checks nothing.
        """
        return None

    @abstractmethod
    def restore(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: LoadContext
    ) -> Any:
        """Put the loaded tensors (CPU, keyed by tensor key) back into ``obj``.

        Returns the value to hand back to the caller of ``load`` (see ``returns_value``).
        """


# ---------------------------------------------------------------------------- naming


def unwrap(module: nn.Module) -> nn.Module:
    """The module whose parameter names a user sees: inside DDP and ``torch.compile``."""
    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
            continue
        orig = getattr(module, "_orig_mod", None)
        if isinstance(orig, nn.Module) and _compiled(module):
            module = orig
            continue
        return module


def _compiled(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (an ``OptimizedModule``), known by
    its class: a module of a user's own with a child named ``_orig_mod`` is not one, and
    taken for one, its other parameters were silently left out of every save and load.
    One exists only once ``torch._dynamo`` is imported (not imported here: it is slow)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return isinstance(optimized, type) and isinstance(module, optimized)


def param_names(state: Mapping[str, Any]) -> dict[int, str]:
    """``id(param)`` -> FQN for every parameter of every module in a state dict.

    Names are the module's own (``fc.weight``), so adding a loss module or an EMA copy to
    the state never renames an optimizer's keys. Only a name that two different modules
    both use is qualified by the state key (``generator.fc.weight``) to keep it unique.
    A parameter shared by several modules keeps the first name it is found under.
    """
    return load_names(state)[0]


def load_names(
    state: Mapping[str, Any],
) -> tuple[dict[int, str], dict[str, str], dict[str, str]]:
    """What a load needs to find a checkpoint's parameter names, from one walk over the
    modules: :func:`param_names`; every other name of a parameter shared by several
    modules -> the name it has (``lm_head.weight`` -> ``embed.weight``: which of a tied
    weight's names comes first depends on the order the modules were registered in);
    and each name qualified by its state key -> the module's own name
    (``model.fc.weight`` -> ``fc.weight`` beside an EMA copy: a checkpoint saved before
    the copy was added names it ``fc.weight``; ``optimizer._meta`` finds it there)."""
    found = _all_names(state)
    names: dict[int, str] = {}
    for name, _, p in found:
        names.setdefault(id(p), name)
    aliases = {name: names[id(p)] for name, _, p in found if name != names[id(p)]}
    unqualified = {name: plain for name, plain, _ in found if name != plain}
    return names, aliases, unqualified


def _all_names(state: Mapping[str, Any]) -> list[tuple[str, str, nn.Parameter]]:
    """Every (name, module's own name, parameter) of every module in ``state``, shared
    ones once per name; FSDP2 modules resharded first (:func:`reshard_fsdp`)."""
    reshard_fsdp(state)
    found: list[tuple[str, str, nn.Parameter]] = [
        (key, fqn, p)
        for key, value in state.items()
        if isinstance(value, nn.Module)
        for fqn, p in without_wrappers(list(unwrap(value).named_parameters(remove_duplicate=False)))
    ]
    names = [fqn for _, fqn, _ in found]
    while True:
        # A name two parameters have is qualified by the state key; a qualified name may
        # be another module's own (``model.fc.weight`` of a module with a child ``model``
        # beside a model and its EMA copy), which is then qualified in turn. Until every
        # name is unique, or the names left alike are all qualified (state keys holding
        # ``.``: the optimizer refuses them, naming the key).
        owners: dict[str, set[int]] = {}
        for name, (_, _, p) in zip(names, found):
            owners.setdefault(name, set()).add(id(p))
        renamed = [
            f"{key}.{fqn}" if len(owners[name]) > 1 else name
            for name, (key, fqn, _) in zip(names, found)
        ]
        if renamed == names:
            return [(name, fqn, p) for name, (_, fqn, p) in zip(names, found)]
        names = renamed


_FSDP_MODULES = (
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed._composable.fsdp.fully_shard",  # torch 2.4, 2.5
)


def reshard_fsdp(state: Mapping[str, Any]) -> None:
    """Reshard every FSDP2 module (``fully_shard``) of every module in ``state``, as its
    ``state_dict()`` pre-hook does for DCP. Unsharded (after an eval forward of a root
    holding parameters, or any forward with ``reshard_after_forward=False``), its
    ``named_parameters()`` are plain tensors, not the DTensors its optimizer holds: every
    rank refused the save or load as if the optimizer were another model's (review).
    ``reshard()`` frees the gathered copies without communicating and does nothing to a
    sharded module; the next forward gathers again. Looked up once FSDP2 is imported."""
    fsdp_module = _fsdp_module_class()
    if fsdp_module is None:
        return
    for value in state.values():
        if isinstance(value, nn.Module):
            for module in value.modules():
                if isinstance(module, fsdp_module):
                    module.reshard()


def _fsdp_module_class() -> type[Any] | None:
    """FSDP2's ``FSDPModule`` once the program has imported it, else ``None``."""
    return next(filter(None, (loaded_class(m, "FSDPModule") for m in _FSDP_MODULES)), None)


def loaded_class(module: str, name: str) -> type[Any] | None:
    """The class ``module.name`` if the program has imported ``module``, else ``None``: no
    object of it exists before, and importing it (parts of torch.distributed) costs."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})
"""Name segments that wrappers of single blocks insert: activation checkpointing's
``checkpoint_wrapper`` (whose ``state_dict`` hook drops it from the module's keys) and
``torch.compile`` of a block (``_orig_mod``; torchtitan compiles block by block). Keys
drop them (module and optimizer alike), so a checkpoint loads whether or not, and
wherever, blocks were wrapped, as DCP's do."""


def fqn_without_wrappers(fqn: str) -> str:
    """``layers.0._checkpoint_wrapped_module.weight`` -> ``layers.0.weight``."""
    if not any(segment in fqn for segment in WRAPPER_SEGMENTS):
        return fqn
    return ".".join(part for part in fqn.split(".") if part not in WRAPPER_SEGMENTS)


def without_wrappers(named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    """``named`` with :data:`WRAPPER_SEGMENTS` dropped from the names, unless that would
    give two different parameters one name (then every name stays as it is)."""
    renamed = [(fqn_without_wrappers(fqn), p) for fqn, p in named]
    owners: dict[str, int] = {}
    for fqn, p in renamed:
        if owners.setdefault(fqn, id(p)) != id(p):
            return named
    return renamed
