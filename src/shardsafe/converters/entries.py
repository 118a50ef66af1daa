"""Nested state (what ``dcp.save`` and ``torch.save`` were given) <-> shardsafe entries.

Readers of other formats rebuild the nested tree their format flattened
(``{"model": {fqn: tensor}, "optim": {"state": ..., "param_groups": [...]}}``), with
tensors standing in for their data (meta tensors, or memory-mapped ones); this module
turns each top-level entry into a shardsafe entry, the way shardsafe's adapters would
have saved the live object:

* a dict of tensors -> ``module`` (keys ``<name>/<fqn>``);
* ``{"state": {fqn: {...}}, "param_groups": [{"params": [fqn, ...], ...}]}`` (the
  FQN-keyed optimizer state dict of ``get_optimizer_state_dict``) -> ``optimizer``
  (keys ``<name>/<fqn>/<state name>``, hyperparameters exact);
* anything else -> ``value`` (plain data; tensors keyed by their path).

Keys are made exactly as ``save`` makes them (``shardsafe._names``: each segment
encoded), so a converted checkpoint is the one ``save`` would have written, and two
paths that would share a key are refused.

Writers of other formats go the other way with :func:`nested`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import _names, _tree
from ..adapters.module import check_module_meta
from ..adapters.optimizer import GROUPS
from ..errors import CheckpointCorruptError
from ..protocol import SavedValue
from .source import Source, SourceTensor, TensorRef, decoded

MakeTensor = Callable[[str, torch.Tensor], SourceTensor]
"""Given a tensor key and the stand-in found in the tree, the source tensor to record."""


def is_module(sub: Any) -> bool:
    """A module's state dict: tensors by name, one at least not a scalar, and the extra
    state of its submodules (``<fqn>._extra_state``, what ``get_extra_state`` returned:
    plain data, as the module adapter saves it). A dict of scalars alone
    (``train_state={"step": tensor(5)}``, as older torchtitan saved it) is plain data,
    which ``load`` returns as a value, not weights to load into a module."""
    return (
        isinstance(sub, Mapping)
        and bool(sub)
        and all(
            isinstance(k, str) and (isinstance(v, torch.Tensor) or is_extra_state(k, v))
            for k, v in sub.items()
        )
        and any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in sub.values())
    )


def is_extra_state(name: str, value: Any) -> bool:
    """``value`` under ``name`` is a submodule's extra state that is not a tensor (a dict
    of settings, say): what ``nn.Module.state_dict`` puts under ``<prefix>_extra_state``,
    holding no tensor (the module adapter keeps such state as JSON)."""
    return (name == _EXTRA or name.endswith("." + _EXTRA)) and not _holds_tensor(value)


_EXTRA = "_extra_state"  # torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(k) or _holds_tensor(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v) for v in value)
    return False


def is_optimizer(sub: Any) -> bool:
    if not (isinstance(sub, Mapping) and set(sub) == {"state", "param_groups"}):
        return False
    state, groups = sub["state"], sub["param_groups"]
    return (
        isinstance(state, Mapping)
        and all(isinstance(k, str) and isinstance(v, Mapping) for k, v in state.items())
        and isinstance(groups, list)
        and all(
            isinstance(g, Mapping)
            and isinstance(g.get("params"), list)
            and all(isinstance(p, str) for p in g["params"])
            for g in groups
        )
    )


def to_entries(
    tree: Mapping[str, Any], make: MakeTensor
) -> tuple[dict[str, SavedValue], dict[str, SourceTensor]]:
    """The shardsafe entries and tensors of a nested state tree (see the module docstring)."""
    values: dict[str, SavedValue] = {}
    tensors: dict[str, SourceTensor] = {}
    claims = _names.Claims()

    def sink_under(name: str, *prefix: str) -> _tree.TensorSink:
        """Keys as ``save`` makes them (``_names.join``); two paths to one key refused."""

        def sink(path: tuple[str, ...], tensor: torch.Tensor) -> str:
            parts = (*prefix, *path)
            key = _names.join(name, *parts)
            claims.claim(key, parts, f"[{name!r}]")
            tensors[key] = make(key, tensor)
            return key

        return sink

    for name, sub in tree.items():
        if is_module(sub):
            module_sink = sink_under(name)
            names, extra = [], {}
            for fqn, t in sub.items():
                if isinstance(t, torch.Tensor):
                    module_sink((fqn,), t)
                    names.append(fqn)
                else:  # extra state: JSON, as the module adapter saves it
                    extra[fqn] = _tree.encode(t, f"the entry {name!r}", module_sink)
            values[name] = SavedValue(name, "module", {"tensors": names, "extra": extra})
        elif is_optimizer(sub):
            values[name] = SavedValue(name, "optimizer", _optimizer_meta(name, sub, sink_under))
        else:
            meta = _tree.encode(sub, f"the entry {name!r}", sink_under(name))
            values[name] = SavedValue(name, "value", meta)
    _add_param_shapes(values, tensors)
    return values, tensors


def _optimizer_meta(
    name: str, sub: Mapping[str, Any], sink_under: Callable[..., _tree.TensorSink]
) -> dict[str, Any]:
    where = f"the optimizer entry {name!r}"
    state = {
        fqn: {s: _tree.encode(v, where, sink_under(name, fqn, s)) for s, v in per.items()}
        for fqn, per in sub["state"].items()
    }
    groups = []
    for i, group in enumerate(sub["param_groups"]):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append(
            {
                "params": list(group["params"]),
                "hyper": _tree.encode(hyper, where, sink_under(name, GROUPS, str(i))),
            }
        )
    return {"param_groups": groups, "param_shapes": {}, "state": state}


def _add_param_shapes(values: dict[str, SavedValue], tensors: dict[str, SourceTensor]) -> None:
    """An optimizer's parameter shapes (checked on load), from a module entry that holds
    the parameter or else from the parameter's own state (``exp_avg`` is shaped like it)."""
    module_shapes: dict[str, tuple[int, ...]] = {}
    for v in values.values():
        if v.kind == "module":
            key = _names.module_keys(v.name, v.meta["tensors"], tensors)
            for fqn in v.meta["tensors"]:
                module_shapes.setdefault(fqn, tensors[key(fqn)].shape)
    for v in values.values():
        if v.kind != "optimizer":
            continue
        shapes = v.meta["param_shapes"]
        for group in v.meta["param_groups"]:
            for fqn in group["params"]:
                shape = module_shapes.get(fqn) or _state_shape(v.meta["state"].get(fqn), tensors)
                if shape is not None:
                    shapes[fqn] = list(shape)


def _state_shape(state: Any, tensors: dict[str, SourceTensor]) -> tuple[int, ...] | None:
    shapes = [tensors[k].shape for k in _tree.tensor_refs(state or {}) if k in tensors]
    shaped = [s for s in shapes if len(s)]
    return shaped[0] if shaped else None


def nested(source: Source) -> dict[str, Any]:
    """The nested state tree of ``source`` (tensors as :class:`TensorRef`): modules as
    ``{fqn: tensor}``, optimizers as FQN-keyed state dicts (what
    ``get_optimizer_state_dict`` returns and ``set_optimizer_state_dict`` takes)."""
    out: dict[str, Any] = {}
    for name, value in source.values.items():
        if value.kind == "module":
            out[name] = _module_tree(value, source)
        elif value.kind == "optimizer":
            meta = decoded(value.meta, name)
            groups = [{**g["hyper"], "params": list(g["params"])} for g in meta["param_groups"]]
            out[name] = {"state": meta["state"], "param_groups": groups}
        else:
            out[name] = decoded(value.meta, name)
    return out


def _module_tree(value: SavedValue, source: Source) -> dict[str, Any]:
    """A module entry as its state dict: tensors by name, then its extra state, which
    must not reuse a tensor's name (one of the two would be lost)."""
    check_module_meta(value)  # a forged tensor reference in extra state, among others
    names = value.meta["tensors"]
    key = _names.module_keys(value.name, names, source.tensors)
    sub: dict[str, Any] = {fqn: TensorRef(key(fqn)) for fqn in names}
    extra = decoded(value.meta.get("extra", {}))
    both = sorted(set(sub) & set(extra))
    if both:
        raise CheckpointCorruptError(
            f"{source.where}: the module entry {value.name!r} names {both[0]!r} both as a "
            "tensor and as extra state"
        )
    sub.update(extra)
    return sub
