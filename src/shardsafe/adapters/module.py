"""``nn.Module`` state: plain, DDP-wrapped, ``torch.compile``-d, or with DTensor parameters.

Keys are the module's own state-dict names (``model/fc.weight``), without the ``module.``
prefix DDP adds and without the segments that wrappers of single blocks add (``_orig_mod``
of a block compiled on its own, ``protocol.WRAPPER_SEGMENTS``), so a checkpoint loads
whether or not the model or its blocks are wrapped. A name with
``/``, ``%`` or a leading ``@`` is encoded (``shardsafe._names``); checkpoints written
before that keep loading.

Who writes what: parameters are identical on every rank that holds them (every rank
under DDP, a pipeline stage's data-parallel group), so they are offered as replicated and
written once in total, by whichever holder has the least to write. Buffers are the
lowest holding rank's: DDP broadcasts rank 0's buffers at each forward, so rank 0's are
the ones an exact resume needs (other ranks' BatchNorm statistics can differ), and a
later pipeline stage's come from its first rank. DTensor values (FSDP2, tensor parallel)
contribute their local shard at its global offsets.

Ranks need not hold the same names: a pipeline stage or a rank's own experts hold only
theirs, and the manifest records the union (:meth:`ModuleAdapter.merge`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .. import _names, _tree
from .._text import terminal_safe
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from ..protocol import (
    JSON,
    Adapter,
    Chunk,
    LoadContext,
    LoadRequests,
    ReadRequest,
    SaveContext,
    SavedValue,
    SaveItem,
    fqn_without_wrappers,
    unwrap,
)
from . import dtensor, fsdp1


class ModuleAdapter(Adapter):
    kind = "module"

    def handles(self, obj: object) -> bool:
        return isinstance(obj, nn.Module)

    def save(self, obj: nn.Module, ctx: SaveContext) -> SaveItem:
        # Before state_dict(), which under FSDP1 may gather from every rank.
        fsdp1.refuse_fsdp1_module(obj, ctx.name, "save")
        module = unwrap(obj)
        params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
        params |= {fqn_without_wrappers(name) for name in params}
        chunks: list[Chunk] = []
        names: list[str] = []
        extra: dict[str, Any] = {}
        state = _state_of(module)
        for name in state:
            if not isinstance(name, str):
                raise CheckpointError(
                    f"cannot save state[{ctx.name!r}]: its state_dict() has the key {name!r} "
                    f"({type(name).__qualname__}); a module's state-dict keys are names "
                    "(strings), as load_state_dict's prefixes assume: rename it (nothing was "
                    "written)"
                )
        for name, value in _without_wrappers(state).items():
            if not isinstance(value, torch.Tensor):
                where = f"state[{ctx.name!r}][{name!r}]"
                extra[name] = _tree.encode(value, where, _refusing_tensors_in(where))
                continue
            names.append(name)
            key = ctx.key(name)
            fsdp1.refuse_sharded_tensor(key, value, "save")
            if dtensor.is_dtensor(value) or name in params:
                chunks += dtensor.chunks_of(key, value, replicated=True)
            else:  # buffers: the lowest holder's (see the module docstring)
                chunks.append(_buffer_chunk(key, value.detach()))
        return SaveItem(self.kind, {"tensors": names, "extra": extra}, chunks)

    def merge(self, metas: list[JSON]) -> JSON:
        """Every rank's names, in order of first appearance (ranks may hold different
        parts of the model: pipeline stages, per-rank experts); each extra-state entry
        once, which every rank holding it must hold with the same value: one record
        cannot give two stages their own, and unlike a buffer (which DDP takes from rank
        0) there is no copy that is right for every rank."""
        names: dict[str, None] = {}
        extra: dict[str, Any] = {}
        held_by: dict[str, int] = {}
        for rank, meta in enumerate(metas):
            names.update(dict.fromkeys(meta["tensors"]))
            for name, value in meta["extra"].items():
                if name not in extra:
                    extra[name], held_by[name] = value, rank
                elif value != extra[name]:
                    raise CheckpointError(
                        f"the module's non-tensor state {name!r} differs between ranks "
                        f"{held_by[name]} and {rank} ({_shown(extra[name])} and "
                        f"{_shown(value)}); it is recorded once, so one rank would get "
                        "the other's back. Make it the same on every rank that holds it, or "
                        "keep rank-specific state out of the module's state_dict (nothing "
                        "was written)"
                    )
        both = sorted(set(names) & set(extra))
        if both:
            raise CheckpointError(
                f"{both[0]!r} is a tensor on some ranks and a non-tensor value on others; "
                "every rank holding a state-dict entry must hold the same kind of value"
            )
        return {"tensors": list(names), "extra": extra}

    def plan_load(self, obj: nn.Module, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        fsdp1.refuse_fsdp1_module(obj, ctx.name, "load")
        module = unwrap(obj)
        live = module.state_dict()
        names, extra = check_module_meta(saved)
        saved_names = set(names)
        key = _keys(saved, ctx)
        as_saved = _as_saved(saved_names | set(extra))
        plan = LoadRequests()
        tied = _tied_names(module)
        extra_state = _ExtraState(module)
        for name, value in live.items():
            if (
                as_saved(name) in extra
                and isinstance(value, torch.Tensor)
                and not extra_state(name, value)
            ):
                # torch's load_state_dict would refuse it after the tensors before it
                # (and other entries) were restored.
                raise CheckpointMismatchError(
                    f"{saved.name}: the checkpoint holds {name!r} as a value that is not a "
                    "tensor, but the live module's is a parameter or buffer; load it into "
                    "the module it was saved from"
                )
            if as_saved(name) not in saved_names:
                # Extra state is missing as a tensor is (torch says "Missing key(s)").
                twins = {as_saved(n) for n in tied.get(name, set())}
                if ctx.strict and as_saved(name) not in extra and not twins & saved_names:
                    plan.missing.append(key(name))
                continue
            if extra_state(name, value):
                # Saved as a tensor (serialized bytes, say): handed to set_extra_state as
                # saved, whatever the live module's extra state is now; not a weight to fill.
                plan.requests.append(ReadRequest(key(name)))
            elif isinstance(value, torch.Tensor):
                fsdp1.refuse_sharded_tensor(key(name), value, "load")
                plan.requests.append(_request(key(name), value))
        held = {as_saved(n) for n in live}
        plan.unexpected = [key(n) for n in sorted((saved_names | set(extra)) - held)]
        return plan

    def targets(
        self, obj: nn.Module, saved: SavedValue, ctx: LoadContext
    ) -> dict[str, torch.Tensor]:
        """Every live parameter and buffer (a DTensor's local shard): ``restore``'s
        ``load_state_dict`` then copies each onto itself, which torch skips, so module
        hooks still run and nothing is copied twice."""
        key = _keys(saved, ctx)
        module = unwrap(obj)
        extra_state = _ExtraState(module)
        return {
            key(name): dtensor.local_of(value)
            for name, value in module.state_dict().items()
            if isinstance(value, torch.Tensor)
            and not uninitialized(value)
            and not extra_state(name, value)
        }

    def validate(
        self,
        obj: nn.Module,
        saved: SavedValue,
        tensors: Mapping[str, torch.Tensor],
        ctx: LoadContext,
    ) -> None:
        """Refuse a live tensor that ``load_state_dict`` would refuse to copy into, before
        anything is restored: else the load would fail part-way, the tensors before it
        (and in other entries) already restored. Only the module's own tensors, in the
        submodules that torch's own code loads: not below a module with a load pre-hook
        or a ``_load_from_state_dict`` of its own, which may give a tensor new memory
        first (a module's runs before its children's)."""
        key_of = _keys(saved, ctx)
        left_alone: set[str] = set()  # modules whose loading code runs before their children's
        for prefix, sub in unwrap(obj).named_modules(remove_duplicate=False):
            parent = prefix.rpartition(".")[0] if prefix else None
            if (parent is not None and parent in left_alone) or not _loaded_by_torch(sub):
                left_alone.add(prefix)
                continue
            owned = [*sub._parameters.items(), *sub._buffers.items()]
            for name, value in owned:
                full = f"{prefix}.{name}" if prefix else name
                if value is not None and not uninitialized(value) and key_of(full) in tensors:
                    check_writable(repr(full), dtensor.local_of(value))

    def restore(
        self,
        obj: nn.Module,
        saved: SavedValue,
        tensors: Mapping[str, torch.Tensor],
        ctx: LoadContext,
    ) -> None:
        module = unwrap(obj)
        live = module.state_dict()
        state: dict[str, Any] = {}
        key_of = _keys(saved, ctx)
        extra_state = _ExtraState(module)
        for name, value in live.items():
            key = key_of(name)
            if key not in tensors:
                continue
            if extra_state(name, value):
                state[name] = tensors[key]
            elif isinstance(value, torch.Tensor):
                state[name] = dtensor.like(value, tensors[key])
        extra = _extra(saved)
        as_saved = _as_saved(set(_saved_names(saved)) | set(extra))
        for name in live:
            if as_saved(name) in extra:
                state[name] = _tree.decode(extra[as_saved(name)], {})
        module.load_state_dict(state, strict=False)


EXTRA_STATE = "_extra_state"
"""The state-dict name torch gives a module's ``get_extra_state()`` (after its prefix)."""


class _ExtraState:
    """Which state-dict entries of ``module`` are extra state (``get_extra_state``), whose
    saved tensor is handed to ``set_extra_state`` as saved rather than filled like a
    weight: the name of a submodule whose class defines ``get_extra_state`` (torch asks
    the class); a name ending in ``_extra_state`` that is no persistent buffer's or
    parameter's (a state-dict hook may have renamed the prefix); and any entry whose live
    value is not a tensor (extra state that is ``None`` before calibration, say)."""

    def __init__(self, module: nn.Module) -> None:
        self.named: set[str] = set()
        self.tensors: set[str] = set()
        for prefix, sub in module.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            own = {*sub._parameters, *(set(sub._buffers) - sub._non_persistent_buffers_set)}
            self.tensors.update(dot + name for name in own)
            defined = getattr(type(sub), "get_extra_state", nn.Module.get_extra_state)
            if defined is not nn.Module.get_extra_state and EXTRA_STATE not in own:
                self.named.add(dot + EXTRA_STATE)

    def __call__(self, name: str, value: object) -> bool:
        if name in self.named or not isinstance(value, torch.Tensor):
            return True
        suffix = name == EXTRA_STATE or name.endswith("." + EXTRA_STATE)
        return suffix and name not in self.tensors


def uninitialized(value: torch.Tensor) -> bool:
    """Whether ``value`` is a lazy module's parameter or buffer, not yet given a shape
    (it gets one when the module first runs or is restored; the optimizer adapter asks
    too)."""
    return isinstance(value, (nn.UninitializedParameter, nn.UninitializedBuffer))


def _loaded_by_torch(module: nn.Module) -> bool:
    """Whether ``load_state_dict`` copies into ``module``'s tensors as torch's own code
    does (``param.copy_(input)``), with nothing of the module's own before it."""
    own = type(module)._load_from_state_dict
    return not module._load_state_dict_pre_hooks and getattr(own, "__module__", "").startswith(
        "torch.nn."
    )


def elements_distinct(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory, by a sufficient test: with its
    dimensions taken by increasing stride, each stride passes the furthest element the
    smaller ones reach (true of every dense or permuted tensor and its slices). A view
    that fails it (``as_strided`` over itself) is left to its object's own copy."""
    reach = 0
    for stride, n in sorted((abs(st), n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= reach:
            return False
        reach += (n - 1) * stride
    return True


def check_writable(name: str, value: torch.Tensor) -> None:
    """Refuse a live tensor (``name``, as the message shows it) that torch would refuse to
    copy a checkpoint's values into."""
    if value.is_meta:
        raise CheckpointMismatchError(
            f"{name} is on the meta device, which holds no data: loading into it loads "
            "nothing (torch only warns). Give the module memory first (module.to_empty("
            "device=...)), then load. Nothing was restored."
        )
    if value.layout != torch.strided:
        raise CheckpointMismatchError(
            f"{name} is a {str(value.layout).removeprefix('torch.')} tensor, which cannot "
            "hold a checkpoint's dense values in place (torch refuses to copy into it as "
            "well): make it dense (.to_dense()) before loading. Nothing was restored."
        )
    if value.is_inference() and not torch.is_inference_mode_enabled():
        raise CheckpointMismatchError(
            f"{name} is an inference tensor (made under torch.inference_mode()), which "
            "torch lets nothing write outside inference mode: load inside `with "
            "torch.inference_mode():`, or create the module outside it. Nothing was "
            "restored."
        )
    strides = zip(value.stride(), value.shape)
    if value.numel() and any(stride == 0 and n > 1 for stride, n in strides):
        raise CheckpointMismatchError(
            f"{name} is an expanded view (shape {list(value.shape)}, strides "
            f"{list(value.stride())}): its elements share memory, so it cannot hold the "
            "checkpoint's values and torch refuses to copy into it. Give it memory of its "
            "own (for a buffer: register_buffer(name, tensor.clone())). Nothing was restored."
        )


def _tied_names(module: nn.Module) -> dict[str, set[str]]:
    """For each parameter shared under several names (tied weights: a language model's
    output layer and its embedding), the other names. A checkpoint that holds one of them
    fills them all, so the others are not missing from it: ``save_pretrained`` writes
    GPT-2 without ``lm_head.weight``."""
    by_param: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(name)
    return {
        name: set(names) - {name} for names in by_param.values() if len(names) > 1 for name in names
    }


def _keys(saved: SavedValue, ctx: LoadContext) -> Callable[[str], str]:
    """The key each live tensor name of the module has in this checkpoint: encoded
    (``ctx.key``), or as written before names were encoded (see ``_names.module_keys``),
    its wrappers' segments dropped unless it was saved with them (:func:`_as_saved`)."""
    names = _saved_names(saved)
    key = _names.module_keys(ctx.name, names, ctx.saved_tensors)
    as_saved = _as_saved(set(names) | set(_extra(saved)))
    return lambda name: key(as_saved(name))


def _as_saved(saved: set[str]) -> Callable[[str], str]:
    """A live state-dict name as the checkpoint names it: itself if saved so (a checkpoint
    written with a block's wrapper segments in its names, before they were dropped), else
    without them (``protocol.WRAPPER_SEGMENTS``)."""
    return lambda name: name if name in saved else fqn_without_wrappers(name)


def _without_wrappers(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` keyed without wrapper segments (``_orig_mod`` of a block compiled on its
    own), unless that would give two entries one name: then as it is."""
    renamed = {fqn_without_wrappers(name): value for name, value in state.items()}
    return renamed if len(renamed) == len(state) else state


def check_module_meta(saved: SavedValue) -> tuple[list[str], dict[str, Any]]:
    """A module entry's tensor names and extra state, or what a load raises for malformed
    metadata: the check ``plan_load`` runs, needing no live module, so that ``verify``
    runs it too and never passes a checkpoint that no load accepts."""
    names, extra = _saved_names(saved), _extra(saved)
    for name, raw in extra.items():
        where = f"the extra state {name!r} of {saved.name!r}"
        _tree.check_structure(raw, where)
        _refuse_tensor_refs(raw, where)
    both = sorted(set(names) & set(extra))
    if both:
        raise CheckpointCorruptError(
            f"{saved.entry} names {both[0]!r} both as a tensor and as extra state"
        )
    return names, extra


def _refuse_tensor_refs(raw: JSON, where: str) -> None:
    """Refuse a tensor reference in a module's extra state. Save never writes one there
    (:func:`_refusing_tensors_in`; a converter keeps extra state holding a tensor out of
    a module entry), so ``restore`` decodes extra state with no tensors; a forged one
    passed the structure check and failed there, after the module's tensors and other
    entries had been restored (and ``verify`` passed it)."""
    refs = _tree.tensor_refs(raw)
    if refs:
        raise CheckpointCorruptError(
            f"{where} is malformed: it refers to tensor {refs[0]!r:.80}, but extra state "
            "is plain data (save refuses a tensor inside it)"
        )


def _saved_names(saved: SavedValue) -> list[str]:
    meta = saved.meta
    names = meta.get("tensors") if isinstance(meta, dict) else None
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise CheckpointCorruptError(
            f"{saved.entry} is not valid module metadata: 'tensors' is not a list of names"
        )
    seen: set[str] = set()
    for name in names:
        if name not in seen:
            seen.add(name)
            continue
        # Else a load called the names it pushed out missing, and verify passed it.
        raise CheckpointCorruptError(
            f"{saved.entry} is not valid module metadata: 'tensors' names {name!r:.80} "
            "twice (a save lists each tensor once)"
        )
    return names


def _extra(saved: SavedValue) -> dict[str, Any]:
    extra = saved.meta.get("extra", {}) if isinstance(saved.meta, dict) else None
    if not isinstance(extra, dict):
        raise CheckpointCorruptError(
            f"{saved.entry} is not valid module metadata: 'extra' is not an object"
        )
    return extra


def _request(key: str, value: torch.Tensor) -> ReadRequest:
    dtensor.refuse_partial_target(key, value)
    if uninitialized(value):  # a lazy module's: load_state_dict gives it the saved shape
        return ReadRequest(key, dtype=value.dtype)
    if dtensor.is_dtensor(value):
        offsets, shape = dtensor.local_box(value)
        return ReadRequest(key, offsets, shape, value.dtype, tuple(value.shape))
    return ReadRequest(key, dtype=value.dtype, global_shape=tuple(value.shape))


def _buffer_chunk(key: str, tensor: torch.Tensor) -> Chunk:
    """A buffer as every rank holding it offers it. Built directly, not with
    ``dataclasses.replace`` (~14 us): an asynchronous save stalls training while every
    buffer of the model passes here. A nested buffer is refused as a nested value is
    (its shape raised torch's "Internal error ... Please file an issue", found in review)."""
    if tensor.is_nested:
        dtensor.refuse_nested(key, tensor)
    shape = tuple(tensor.shape)
    return Chunk(key, tensor, shape, (0,) * len(shape), replicated=True, lowest_rank_wins=True)


def _refusing_tensors_in(where: str) -> _tree.TensorSink:
    """The sink of a module's non-tensor state-dict value: a tensor inside it is refused,
    by the entry's name and its place in the value (torch's dynamically quantized
    ``Linear`` keeps a tuple of tensors there: ``_packed_params._packed_params``)."""

    def refuse(path: tuple[str, ...], tensor: torch.Tensor) -> str:
        inside = "".join(f"[{p!r}]" for p in path)
        raise CheckpointError(
            f"cannot save {where}{inside}: a tensor inside a value that is not a tensor (a "
            "tuple, list or dict in the module's state_dict(); a dynamically quantized "
            "module's packed parameters, say), which shardsafe cannot store as a "
            "state-dict entry; return each tensor as an entry of its own, or save the "
            "float module (nothing was written)"
        )

    return refuse


def _state_of(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()``; with ``keep_vars=True`` (the parameters themselves, not a
    detached copy of each: for a DTensor, detach is a dispatched op, ~10 us) unless the
    class overrides ``state_dict`` (it may not take the argument). ``chunks_of`` detaches
    the local tensors it keeps."""
    if type(module).state_dict is nn.Module.state_dict:
        return module.state_dict(keep_vars=True)
    return module.state_dict()


def _shown(value: JSON, limit: int = 60) -> str:
    """An encoded value as an error message shows it: its JSON, cut short."""
    text = json.dumps(value, sort_keys=True)
    return terminal_safe(text if len(text) <= limit else text[: limit - 3] + "...")
