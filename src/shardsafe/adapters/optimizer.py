"""Optimizer state keyed by parameter name, never by position.

torch's ``optimizer.state_dict()`` numbers parameters by their position in the param
groups, which changes as soon as a model is refactored or the optimizer is sharded
differently. Here every state tensor is keyed ``<name>/<param fqn>/<state name>`` and
param groups list parameter names, with their hyperparameters stored exactly (tuples
stay tuples, floats are bit-exact). One format serves plain optimizers, ZeRO and OSS
(see ``partitioned.py``) and FSDP2, so a checkpoint written by one loads into another.

Restoring goes through the optimizer's own ``load_state_dict`` (with positions rebuilt
from names), so torch's rules for dtype and device placement of state still apply, and
parameters are never touched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from .. import _names, _tree
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
)
from . import dtensor, fsdp1
from .module import uninitialized
from .optimizer_merge import NAMES, merge_optimizer_metas, without_names

CLASS = "class"
"""The optimizer's class name (``Adam``) in its metadata: a checkpoint of one optimizer
class is refused up front by another (an SGD's ``momentum_buffer`` cannot drive an Adam,
whose ``load_state_dict`` or first ``step`` would fail inside torch after the model was
restored). Checkpoints written before it, and converted ones, have none and are not
checked."""

QUALIFIED = "qualified"
"""Optimizer metadata: each parameter name the save qualified by its state key -> the
module's own name (``protocol.load_names``), so that a load maps it to the live name."""

EXTRA = "extra"
"""Optimizer metadata: what the optimizer's own ``state_dict()`` holds beside ``state`` and
``param_groups`` (``PostLocalSGDOptimizer``'s averager ``step``, a subclass's counter, a
value a ``register_state_dict_post_hook`` adds), as JSON, handed back to its
``load_state_dict``. Absent when there is none (every torch optimizer): they were dropped
in silence, and a subclass whose ``load_state_dict`` reads its own key failed after the
model was restored (found in review)."""

GROUPS = _names.Reserved("@groups")
"""Key segment for tensors inside param-group hyperparameters: reserved, so stored as it
is, while an FQN spelled the same is encoded (``%40groups``) and never meets it."""


def export_state(
    groups: list[dict[str, Any]],
    local: torch.optim.Optimizer,
    ctx: SaveContext,
    *,
    replicated: bool,
    copies: bool = False,
) -> SaveItem:
    """Encode ``local``'s state and the hyperparameters of the (global) ``groups``.

    ``copies`` (a partitioned optimizer's): a parameter's state that is no DTensor may be
    held alike by several ranks, stored once (``Chunk.copies_allowed``): ZeRO sharded
    within each node's group and replicated across them (``process_group=``, under DDP
    over every rank) was refused as shards that "overlap or leave holes" (review)."""
    _refuse_fsdp1(groups, ctx, "save")
    chunks: list[Chunk] = []
    where = f"state[{ctx.name!r}]"

    def sink_under(
        *prefix: str, same_on_every_rank: bool = replicated, verify: bool = False
    ) -> _tree.TensorSink:
        def sink(path: tuple[str, ...], tensor: torch.Tensor) -> str:
            key = ctx.key(*prefix, *path)
            fsdp1.refuse_sharded_tensor(key, tensor, "save")
            found = dtensor.chunks_of(key, tensor, replicated=same_on_every_rank)
            if copies and not same_on_every_rank and not dtensor.is_dtensor(tensor):
                found = [replace(c, copies_allowed=True) for c in found]
            chunks.extend(replace(c, always_verify=True) if verify else c for c in found)
            return key

        return sink

    local_params = [p for g in local.param_groups for p in g["params"]]
    state: dict[str, Any] = {}
    full = local.state_dict()
    for index, param_state in full["state"].items():
        fqn = ctx.param_fqn(local_params[index])
        _check_state_names(param_state, fqn, where)
        state[fqn] = {
            # Named down to the parameter and the entry: "state['optimizer']" alone left a
            # model of thousands of parameters to guess whose state held the bad value.
            name: _tree.encode(value, f"{where}.state[{fqn!r}][{name!r}]", sink_under(fqn, name))
            for name, value in param_state.items()
        }
    groups_meta = []
    for i, group in enumerate(groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups_meta.append(
            {
                "params": [ctx.param_fqn(p) for p in group["params"]],
                # Hyperparameters are global (every rank has every group), even under ZeRO.
                "hyper": _tree.encode(
                    hyper,
                    f"{where}.param_groups[{i}]",
                    # Keyed by position, so pipeline stages share keys: compared on
                    # every save, so stages whose values differ are refused, not merged.
                    sink_under(GROUPS, str(i), same_on_every_rank=True, verify=True),
                ),
            }
        )
    shapes = {ctx.param_fqn(p): list(p.shape) for g in groups for p in g["params"]}
    meta = {
        "param_groups": groups_meta,
        "param_shapes": shapes,
        "state": state,
        CLASS: type(local).__qualname__,
    }
    qualified = {n: ctx.param_unqualified[n] for n in shapes if n in ctx.param_unqualified}
    if qualified:  # a model beside its EMA copy: each name the state key qualified
        meta[QUALIFIED] = qualified
    extra = {k: v for k, v in full.items() if k not in ("state", "param_groups")}
    if extra:
        meta[EXTRA] = _encoded_extra(extra, where)
    return SaveItem("optimizer", meta, chunks)


def _encoded_extra(extra: dict[Any, Any], where: str) -> JSON:
    """The optimizer's other ``state_dict()`` entries (:data:`EXTRA`) as JSON; a tensor
    among them is refused, naming it (only ``state`` and ``param_groups`` hold tensors)."""

    def refuse(path: tuple[str, ...], tensor: torch.Tensor) -> str:
        raise CheckpointError(
            f"{where}.state_dict() holds a tensor at {'/'.join(map(str, path))} beside its "
            "'state' and 'param_groups', which shardsafe cannot save there; keep tensors in "
            "the optimizer's per-parameter state, or register an adapter for "
            "this optimizer (shardsafe.register_adapter)"
        )

    return _tree.encode(extra, f"{where}.state_dict()", refuse)


def _refuse_fsdp1(groups: list[dict[str, Any]], ctx: SaveContext, action: fsdp1.Action) -> None:
    """Refuse an optimizer of an FSDP1 model before its state is looked at: each rank's
    state of a flat parameter is its own shard under one name (``fsdp1``)."""
    params = (p for g in groups for p in g["params"])
    fsdp1.refuse_flat_params(params, lambda p: ctx.param_names.get(id(p)), ctx.name, action)


def _check_state_names(param_state: Mapping[Any, Any], fqn: str, where: str) -> None:
    """Refuse per-parameter state names that would not come back as they were.

    The state is stored as a JSON object keyed by name, so a name must be a string: an
    int key would come back as ``"0"`` (a subtly different state). A name spelled like
    one of the encoding's tags (``__float__``) would, alone, be read as that tag."""
    for name in param_state:
        if not isinstance(name, str) or _tree.is_tag(name):
            raise CheckpointError(
                f"cannot save {where}: the state of parameter {fqn!r} has the entry {name!r} "
                f"({type(name).__qualname__}); per-parameter optimizer state is stored by "
                "name, so its names must be strings, and not one of "
                f"{', '.join(_tree.TAGS)}. Rename the entry in the optimizer's state "
                "(nothing was written)"
            )


def plan_import(
    groups: list[dict[str, Any]], local: torch.optim.Optimizer, saved: SavedValue, ctx: LoadContext
) -> LoadRequests:
    """Requests for the state of ``local``'s parameters; mismatches against ``groups``.

    Parameters are found by name, whichever saved group holds them (a checkpoint of
    pipeline stages holds every stage's parameters; a stage loads its own). Names in the
    checkpoint that this rank does not hold are reported as unexpected; the load counts
    one as unexpected only if no rank holds it (``loading.py``).
    """
    _refuse_fsdp1(groups, ctx, "load")
    plan = LoadRequests()
    meta = _meta(saved, ctx, groups)
    saved_groups = meta["param_groups"]
    shapes = meta["param_shapes"]
    saved_class, live_class = meta.get(CLASS), type(local).__qualname__
    if saved_class is not None and saved_class != live_class:
        plan.mismatched.append(
            f"{ctx.name}: the checkpoint holds the state of optimizer class {saved_class}, "
            f"the live optimizer's is {live_class}; build the same optimizer class as when "
            f"saving, or leave {ctx.name!r} out of the state you load to start it afresh"
        )
        return plan
    live_names = {ctx.param_fqn(p) for g in groups for p in g["params"]}
    saved_names = {n for g in saved_groups for n in g["params"]}
    if saved_names and not saved_names & live_names:
        # Even with strict=False this is no partial load: nothing at all would be restored.
        plan.mismatched.append(
            f"{ctx.name}: none of the {len(saved_names)} parameter names in the checkpoint "
            f"(e.g. {min(saved_names)!r}) matches the live optimizer's (e.g. "
            f"{min(live_names) if live_names else 'none'!r}); pass the model under the same "
            "structure and state key as when saving"
        )
        return plan
    _, problems = match_groups(groups, saved_groups, ctx)
    plan.mismatched += problems
    for i, group in enumerate(groups):
        live = {ctx.param_fqn(p): p for p in group["params"]}
        if ctx.strict:
            plan.missing += [
                f"{ctx.name}/{n} (param group {i})" for n in live if n not in saved_names
            ]
        for fqn, p in live.items():
            if fqn in shapes and not uninitialized(p) and tuple(shapes[fqn]) != tuple(p.shape):
                plan.mismatched.append(
                    f"{ctx.name}/{fqn}: parameter shape {shapes[fqn]} in the "
                    f"checkpoint, {list(p.shape)} live"
                )
    plan.unexpected += [f"{ctx.name}/{n}" for n in sorted(saved_names - live_names)]
    factored = _keeps_factored_state(local)
    flat = _flat_history_shape(local)
    shaped = _keeps_param_shaped_state(local)
    for p in (p for g in local.param_groups for p in g["params"]):
        live_state = local.state.get(p, {})
        for name, raw in meta["state"].get(ctx.param_fqn(p), {}).items():
            live = live_state.get(name)
            for ref in _tree.tensor_refs(raw):
                if flat is not None and not isinstance(live, torch.Tensor):
                    plan.requests.append(ReadRequest(ref, within=flat))
                    continue
                if not (shaped or isinstance(live, torch.Tensor) or dtensor.is_dtensor(p)):
                    plan.requests.append(ReadRequest(ref))  # as saved, within the budget
                    continue
                plan.requests.append(
                    _request_for(ref, p, live, factored, ctx, shapes.get(ctx.param_fqn(p)))
                )
    for saved_group in saved_groups:
        plan.requests += [ReadRequest(ref) for ref in _tree.tensor_refs(saved_group["hyper"])]
    return plan


def match_groups(
    groups: list[dict[str, Any]], saved_groups: list[Any], ctx: LoadContext
) -> tuple[list[int | None], list[str]]:
    """For each live group, the saved group whose hyperparameters it takes, and the
    problems found.

    A live group takes the hyperparameters of the saved group(s) holding its parameters,
    found by name; several saved groups are fine if their hyperparameters are equal (a
    checkpoint merged from pipeline stages), otherwise the group cannot be restored
    exactly and is a mismatch. A live group none of whose parameters were saved takes
    the saved group at its position if both have as many groups and every other live
    group found its parameters at its own position, else keeps its own: a checkpoint
    merged from pipeline stages with their own learning rates holds one group per stage,
    and a stage's new group, second on that stage, took the other stage's group.
    """
    chosen: list[int | None] = []
    problems = []
    taken = _taken(groups, saved_groups, ctx)
    aligned = len(groups) == len(saved_groups) and all(
        found == [i] for i, found in enumerate(taken) if found
    )
    for i, found in enumerate(taken):
        if not found:
            chosen.append(i if aligned else None)
            continue
        first = _compared(saved_groups[found[0]]["hyper"], ctx)
        differing = [j for j in found if _compared(saved_groups[j]["hyper"], ctx) != first]
        if differing:
            problems.append(_differing(ctx, i, found[0], differing[0]))
        chosen.append(found[0])
    return chosen, problems


def _taken(
    groups: list[dict[str, Any]], saved_groups: list[Any], ctx: LoadContext
) -> list[list[int]]:
    """For each live group, the saved groups holding its parameters (by name), in order."""
    where = {n: j for j, g in enumerate(saved_groups) for n in g["params"]}
    return [
        sorted({where[n] for n in map(ctx.param_fqn, group["params"]) if n in where})
        for group in groups
    ]


def _differing(ctx: LoadContext, live: int, first: int, other: int) -> str:
    return (
        f"{ctx.name}: live param group {live} holds parameters that were saved in param "
        f"groups {first} and {other}, which have different hyperparameters; group the "
        "parameters as they were grouped when saving"
    )


def _check_tensor_hyper(
    groups: list[dict[str, Any]], saved_groups: list[Any], hyper: list[Any], ctx: LoadContext
) -> None:
    """What :func:`match_groups` could not compare before the data was read: the values of
    tensor hyperparameters (a tensor ``lr``) of the saved groups one live group takes."""
    for i, found in enumerate(_taken(groups, saved_groups, ctx)):
        for j in found[1:]:
            if not _same(without_names(hyper[found[0]]), without_names(hyper[j])):
                raise CheckpointMismatchError(
                    "the checkpoint does not match the objects being loaded:\n  "
                    f"mismatched (1): {_differing(ctx, i, found[0], j)}"
                )


def _same(a: Any, b: Any) -> bool:
    """Whether the tensors of two decoded trees, whose structure and other values
    :func:`match_groups` found equal, are equal: by dtype, shape and value, as it compares
    floats (a NaN equals a NaN, -0.0 equals 0.0)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and _equal_values(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return all(_same(a[k], b[k]) for k in a if k in b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return all(map(_same, a, b))
    return True


def _equal_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    wide = torch.complex128 if a.is_complex() else torch.float64  # exact for every float
    a, b = a.to(wide), b.to(wide)
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _compared(hyper: JSON, ctx: LoadContext) -> JSON:
    """A saved group's hyperparameters as they must agree across the saved groups one
    live group takes: all but :data:`NAMES`, each tensor by dtype and shape (its values
    are compared once read, :func:`_check_tensor_hyper`; each group's tensor has a key
    of its own)."""

    def masked(obj: JSON) -> JSON:
        if isinstance(obj, dict):
            ref = obj.get("__tensor__") if len(obj) == 1 else None
            if isinstance(ref, str):
                dtype, shape = ctx.saved_tensors.get(ref, (None, None))
                return ["__tensor__", str(dtype), list(shape or ())]
            return {k: masked(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [masked(v) for v in obj]
        return obj

    return masked(without_names(hyper))


def _keeps_factored_state(optimizer: torch.optim.Optimizer) -> bool:
    """Adafactor keeps row and column factors of its state: ``[rows, 1]`` and
    ``[1, cols]`` (torch's), ``[rows]`` and ``[cols]`` (transformers', timm's)."""
    return type(optimizer).__name__ == "Adafactor"


def _keeps_param_shaped_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether each state tensor of ``optimizer`` is a scalar or shaped like its
    parameter (Adafactor's factors, LBFGS's flat history: see the two above): torch's own
    optimizers, whose state of another shape in a checkpoint (forged, or another model's)
    failed inside torch at the first step after the model was restored.

    Another class may keep state of any shape (Shampoo's ``[rows, rows]`` and
    ``[cols, cols]`` preconditioners, a quantizing optimizer's per-block scales): a fresh
    one loads it as saved, its size bounded like every size only the checkpoint gives
    (``untrusted_bytes_limit``). Its save was accepted and its resume refused ("it must be
    a scalar or shaped like it"), unless the optimizer had stepped first (found in review).
    """
    return type(optimizer).__module__.startswith("torch.optim") or _keeps_factored_state(optimizer)


def _flat_history_shape(optimizer: torch.optim.Optimizer) -> tuple[int, ...] | None:
    """LBFGS keeps its history (``d``, ``old_dirs``, ``prev_flat_grad``, ...) as flat
    vectors over all its parameters, under its first one: each such state tensor must be
    a scalar or of this shape, not shaped like that parameter."""
    if not isinstance(optimizer, torch.optim.LBFGS):
        return None
    return (sum(p.numel() for g in optimizer.param_groups for p in g["params"]),)


def _request_for(
    ref: str,
    param: torch.Tensor,
    live: object,
    factored: bool,
    ctx: LoadContext,
    saved_shape: list[int] | None = None,
) -> ReadRequest:
    """State of a parameter, checked whatever key the metadata names: against the live
    state if the optimizer has stepped, else it must be a scalar or shaped like the
    parameter (a lazy module's parameter, not shaped yet: like the checkpoint says it
    was, ``saved_shape``). Sharded state of a DTensor parameter is read for this rank's
    shard only."""
    if uninitialized(param):
        within = tuple(saved_shape) if saved_shape is not None else None
        return ReadRequest(ref, within=within, factored=factored)
    saved = ctx.saved_tensors.get(ref)
    whole = tuple(param.shape)
    box: tuple[tuple[int, ...] | None, tuple[int, ...] | None] = (None, None)
    if saved is not None and dtensor.is_dtensor(param) and saved[1] == whole:
        box = dtensor.local_box(param)
    if isinstance(live, torch.Tensor):
        return ReadRequest(ref, *box, dtype=live.dtype, global_shape=tuple(live.shape))
    return ReadRequest(ref, *box, within=whole, factored=factored)


def live_targets(
    groups: list[dict[str, Any]], local: torch.optim.Optimizer, saved: SavedValue, ctx: LoadContext
) -> dict[str, torch.Tensor]:
    """The live state tensors (a DTensor's local shard) the saved state of ``local``'s
    parameters is read into: ``load_state_dict`` then adopts them as they are."""
    meta = _meta(saved, ctx, groups)
    found: dict[str, torch.Tensor] = {}
    for p in (p for g in local.param_groups for p in g["params"]):
        live_state = local.state.get(p, {})
        for name, raw in meta["state"].get(ctx.param_fqn(p), {}).items():
            live = live_state.get(name)
            refs = _tree.tensor_refs(raw)
            if isinstance(live, torch.Tensor) and len(refs) == 1 and raw == {"__tensor__": refs[0]}:
                found[refs[0]] = dtensor.local_of(live)
    return found


def state_dict_for(
    groups: list[dict[str, Any]],
    local: torch.optim.Optimizer,
    saved: SavedValue,
    tensors: Mapping[str, torch.Tensor],
    ctx: LoadContext,
) -> dict[str, Any]:
    """The index-keyed ``state_dict`` for ``local`` built from a checkpoint's state."""
    meta = _meta(saved, ctx, groups)
    local_params = [p for g in local.param_groups for p in g["params"]]
    named = {n for g in meta["param_groups"] for n in g["params"]}.union(meta["state"])
    state: dict[int, Any] = {}
    for index, p in enumerate(local_params):
        fqn = ctx.param_fqn(p)
        raw = meta["state"].get(fqn)
        if raw is not None:
            state[index] = _tree.decode(raw, _shaped_like(p, raw, tensors))
        elif fqn not in named and local.state.get(p):
            # Not in the checkpoint at all (strict=False): it keeps its state, as a module
            # keeps such a parameter's weights. One the checkpoint names without state
            # had none when saved, and has none after the load.
            state[index] = local.state[p]
    hyper = checked_hyper([_tree.decode(g["hyper"], tensors) for g in meta["param_groups"]], saved)
    chosen, _ = match_groups(groups, meta["param_groups"], ctx)
    _check_tensor_hyper(groups, meta["param_groups"], hyper, ctx)
    position = {id(p): i for i, p in enumerate(local_params)}
    # The local optimizer's groups mirror the global ones position by position (ZeRO,
    # OSS keep one local group per global group); a group nothing was saved for keeps
    # its own hyperparameters.
    # Each live group gets its own copy: two live groups that take one saved group must
    # not share its tensors and lists (a tensor lr a scheduler then sets for both).
    local_groups = []
    for i, g in enumerate(local.param_groups):
        j = chosen[i] if i < len(chosen) else None
        taken = copy.deepcopy(hyper[j]) if j is not None else {}
        taken = {k: v for k, v in taken.items() if k != NAMES}
        # A hyperparameter the saved group lacks keeps its live value (a checkpoint of a
        # ZeRO group saved right after add_param_group, or of an older torch's optimizer).
        kept = {k: v for k, v in g.items() if k != "params" and (k == NAMES or k not in taken)}
        local_groups.append({**taken, **kept, "params": [position[id(p)] for p in g["params"]]})
    extra = _tree.decode(meta[EXTRA], {}) if EXTRA in meta else {}
    return {**extra, "state": state, "param_groups": local_groups}


def check_adoptable(
    local: torch.optim.Optimizer, state_dict: dict[str, Any], saved: SavedValue
) -> None:
    """Refuse, before anything is restored, a built ``state_dict`` that the optimizer's
    own ``__setstate__`` (what ``load_state_dict`` ends with) would reject: a forged
    ``step`` of ``"abc"`` or none at all made torch's Adam raise there, after the model
    had been restored. Run on a stand-in of the optimizer's class holding shallow copies
    (``__setstate__`` edits the dicts it gets), so the live optimizer is untouched; only
    where the load is torch's own through and through (torch's ``__setstate__``, no
    ``load_state_dict`` of the class's or load hooks, which may rename what they are
    given): elsewhere the stand-in would refuse state the real load takes."""
    kind = type(local)
    if (
        not getattr(kind.__setstate__, "__module__", "").startswith("torch.optim")
        or kind.load_state_dict is not torch.optim.Optimizer.load_state_dict
        or getattr(local, "_optimizer_load_state_dict_pre_hooks", None)
        or getattr(local, "_optimizer_load_state_dict_post_hooks", None)
    ):
        return
    params = [p for g in local.param_groups for p in g["params"]]
    state = {params[i]: dict(v) for i, v in state_dict["state"].items() if i < len(params)}
    groups = [{**g, "params": [params[i] for i in g["params"]]} for g in state_dict["param_groups"]]
    stand_in = object.__new__(type(local))
    stand_in.__dict__["defaults"] = dict(local.defaults)
    try:
        type(local).__setstate__(stand_in, {"state": state, "param_groups": groups})
    except Exception as e:  # any: whatever the class's own code raises on this state
        raise CheckpointCorruptError(
            f"the optimizer state in {saved.entry} is not valid "
            f"state for the live {type(local).__qualname__}: {type(e).__name__}: {e}"
        ) from e


def import_state(
    groups: list[dict[str, Any]],
    local: torch.optim.Optimizer,
    saved: SavedValue,
    tensors: Mapping[str, torch.Tensor],
    ctx: LoadContext,
) -> None:
    """Load the saved state of ``local``'s parameters through ``local.load_state_dict``."""
    local.load_state_dict(state_dict_for(groups, local, saved, tensors, ctx))


def _shaped_like(
    param: torch.Tensor, raw: Any, tensors: Mapping[str, torch.Tensor]
) -> Mapping[str, torch.Tensor]:
    """State of a DTensor parameter, as DTensors sharded like it.

    A state tensor shaped like the parameter arrives either as this rank's shard (read
    for its box) or whole (from ``interop``); a whole one is cut to the shard first.
    Anything else (``step``, factored state) stays a plain tensor.
    """
    if not dtensor.is_dtensor(param):
        return tensors
    offsets, local = dtensor.local_box(param)
    whole = tuple(param.shape)
    # ``step`` stays a plain tensor, as torch keeps it; told apart by its name where the
    # parameter is 0-dim too (its moments, left plain, failed the next step inside torch).
    steps = {ref for name, ref in _direct_refs(raw) if name == "step"}
    out = {}
    for ref in _tree.tensor_refs(raw):
        t = tensors[ref]
        if tuple(t.shape) == whole and whole != local:
            t = t[tuple(slice(o, o + n) for o, n in zip(offsets, local))]
        shaped = tuple(t.shape) == local and (t.dim() > 0 or ref not in steps)
        out[ref] = dtensor.like(param, t) if shaped else t
    return out


def _direct_refs(raw: Any) -> list[tuple[str, str]]:
    """``(state name, tensor key)`` of each entry of a parameter's state that is a tensor."""
    if not isinstance(raw, dict):
        return []
    return [
        (name, enc["__tensor__"])
        for name, enc in raw.items()
        if isinstance(enc, dict) and len(enc) == 1 and isinstance(enc.get("__tensor__"), str)
    ]


def _meta(saved: SavedValue, ctx: LoadContext, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The optimizer metadata of a manifest entry, its structure checked, its parameter
    names as the live modules give them (:func:`_renamed`), for the live optimizer whose
    global param groups are ``groups``."""
    meta = check_optimizer_meta(saved)
    meta = _renamed(meta, _as_qualified_live(meta.get(QUALIFIED), ctx))
    meta = _renamed(meta, fqn_without_wrappers)
    meta = _renamed(meta, lambda name: ctx.param_aliases.get(name, name))
    qualified = _qualified_names(groups, ctx)
    return _renamed(meta, lambda name: qualified.get(name, name))


def check_optimizer_meta(saved: SavedValue) -> dict[str, Any]:
    """An optimizer entry's metadata, its structure checked, or what a load raises for it:
    the check every load of it runs first, needing no live optimizer, so that ``verify``
    runs it too (with :func:`checked_hyper`) and never passes a checkpoint that no load
    accepts."""
    meta: dict[str, Any] = saved.meta
    problem = _meta_problem(meta)
    if problem is not None:
        raise CheckpointCorruptError(f"{saved.entry} is not valid optimizer metadata: {problem}")
    return meta


def checked_hyper(hyper: list[Any], saved: SavedValue) -> list[Any]:
    """The decoded hyperparameters of each saved param group, or what a load raises when
    one is no dict of hyperparameters (checked before anything is restored)."""
    for i, h in enumerate(hyper):
        if not isinstance(h, dict) or "params" in h:
            raise CheckpointCorruptError(
                f"{saved.entry}: param group {i} holds no valid hyperparameters"
            )
    return hyper


def _as_qualified_live(recorded: Any, ctx: LoadContext) -> Callable[[str], str]:
    """Each saved name its save qualified by the state key (``QUALIFIED``: a model saved
    beside its EMA copy) as the live state names that parameter: the same qualified name
    where the live state qualifies it so too, else the module's own name. Compared as
    saved, ``model.norm.weight`` (the model's own ``norm``, qualified) matched the live
    parameter whose own name it is (the ``norm`` of a child called ``model``), which took
    the other's state without a word under ``strict=False``."""
    if not isinstance(recorded, dict):
        return lambda name: name  # saved with nothing qualified, or before this record

    def live(name: str) -> str:
        own = recorded.get(name)
        if not isinstance(own, str) or ctx.param_unqualified.get(name) == own:
            return name
        return own

    return live


def _qualified_names(groups: list[dict[str, Any]], ctx: LoadContext) -> dict[str, str]:
    """The module's own name of each of this optimizer's parameters that the live state
    qualifies by its state key (an EMA copy beside the model: ``fc.weight`` ->
    ``model.fc.weight``), where it names one of them only."""
    found: dict[str, str | None] = {}
    for p in (p for g in groups for p in g["params"]):
        live = ctx.param_fqn(p)
        plain = ctx.param_unqualified.get(live)
        if plain is not None:
            found[plain] = live if found.get(plain, live) == live else None
    return {plain: live for plain, live in found.items() if live is not None}


def _renamed(meta: dict[str, Any], rename_one: Callable[[str], str]) -> dict[str, Any]:
    """``meta`` with each parameter name renamed. Checkpoints written before
    ``param_names`` dropped ``_checkpoint_wrapped_module`` keep loading, into a model
    with activation checkpointing or without; a tied weight saved under another of its
    names (its modules registered in another order) is found under the live one. The
    tensor keys stay as saved. Names that would merge into one are left as they are."""
    names = {n for g in meta["param_groups"] for n in g["params"]}
    names.update(meta["state"], meta["param_shapes"])
    rename = {n: rename_one(n) for n in names}
    if all(a == b for a, b in rename.items()) or len(set(rename.values())) < len(rename):
        return meta
    return {
        **meta,
        "param_groups": [
            {**g, "params": [rename[n] for n in g["params"]]} for g in meta["param_groups"]
        ],
        "state": {rename[n]: v for n, v in meta["state"].items()},
        "param_shapes": {rename[n]: v for n, v in meta["param_shapes"].items()},
    }


def _meta_problem(meta: Any) -> str | None:
    if not (
        isinstance(meta, dict)
        and isinstance(meta.get("param_groups"), list)
        and isinstance(meta.get("state"), dict)
        and isinstance(meta.get("param_shapes"), dict)
    ):
        return "'param_groups', 'state' or 'param_shapes' is missing"
    if CLASS in meta and not (isinstance(meta[CLASS], str) and 0 < len(meta[CLASS]) <= 256):
        return "its optimizer class is not a name"
    if EXTRA in meta:
        _tree.check_structure(meta[EXTRA], "its other state_dict() entries")
        decoded = _tree.decode(meta[EXTRA], {}) if not _tree.tensor_refs(meta[EXTRA]) else None
        if not isinstance(decoded, dict) or {"state", "param_groups"} & set(decoded):
            return "its other state_dict() entries are not an object of plain values"
    recorded = meta.get(QUALIFIED, {})
    if not (
        isinstance(recorded, dict)
        and all(isinstance(n, str) and isinstance(own, str) for n, own in recorded.items())
    ):
        return "its qualified parameter names are not a map of names"
    for i, g in enumerate(meta["param_groups"]):
        if not (
            isinstance(g, dict)
            and isinstance(g.get("params"), list)
            and all(isinstance(n, str) for n in g["params"])
            and "hyper" in g
        ):
            return f"param group {i} has no list of parameter names or no 'hyper'"
        _tree.check_structure(g["hyper"], f"param group {i}'s hyperparameters")
    for fqn, shape in meta["param_shapes"].items():
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            return f"the shape of parameter {fqn!r} is not a list of non-negative ints"
    for fqn, state in meta["state"].items():
        if not isinstance(state, dict) or (len(state) == 1 and _tree.is_tag(next(iter(state)))):
            return f"the state of parameter {fqn!r} is not an object of named entries"
        _tree.check_structure(state, f"the state of parameter {fqn!r}")
    return None


class OptimizerAdapter(Adapter):
    """Any ``torch.optim.Optimizer`` whose state is complete on every rank (DDP, single)."""

    kind = "optimizer"

    def handles(self, obj: object) -> bool:
        return isinstance(obj, torch.optim.Optimizer)

    def save(self, obj: torch.optim.Optimizer, ctx: SaveContext) -> SaveItem:
        return export_state(obj.param_groups, obj, ctx, replicated=True)

    def merge(self, metas: list[JSON]) -> JSON:
        return merge_optimizer_metas(metas)

    def plan_load(
        self, obj: torch.optim.Optimizer, saved: SavedValue, ctx: LoadContext
    ) -> LoadRequests:
        return plan_import(obj.param_groups, obj, saved, ctx)

    def targets(
        self, obj: torch.optim.Optimizer, saved: SavedValue, ctx: LoadContext
    ) -> dict[str, torch.Tensor]:
        return live_targets(obj.param_groups, obj, saved, ctx)

    def validate(
        self,
        obj: torch.optim.Optimizer,
        saved: SavedValue,
        tensors: Mapping[str, torch.Tensor],
        ctx: LoadContext,
    ) -> None:
        check_adoptable(obj, state_dict_for(obj.param_groups, obj, saved, tensors, ctx), saved)

    def restore(
        self,
        obj: torch.optim.Optimizer,
        saved: SavedValue,
        tensors: Mapping[str, torch.Tensor],
        ctx: LoadContext,
    ) -> None:
        import_state(obj.param_groups, obj, saved, tensors, ctx)
