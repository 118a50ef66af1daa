"""The flat DCP layout torchtitan writes, read and written.

torchtitan saves the model's state dict at the top level of what it hands ``dcp.save``
(keys ``layers.0.attention.wq.weight``, no ``model.`` prefix) and its optimizer state
flattened, as ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``
returns it: ``{"state.<fqn>.<name>": ..., "param_groups.<fqn>.<hyper>": ...}``.

Reading: top-level tensors become the module ``model`` when they look like a model's
(one of their names at least is a dotted FQN, or a flattened optimizer is beside them)
and no entry has that name already; with them go a submodule's non-tensor extra state
(``<fqn>._extra_state``, what ``get_extra_state`` returned) and a dotless weight beside
the dotted ones (ViT's ``cls_token``). A lone top-level tensor ``w`` stays a plain value,
and so do dotless tensors alone; a tensor value written beside the model (``{"model":
m, "rng": tensor}`` in this layout) cannot be told from a dotless weight and reads back
inside ``model``. An entry made only
of ``state.*``/``param_groups.*`` keys becomes an FQN-keyed optimizer state dict. State
and hyperparameter names hold no dots, so each key splits at its last one. Param groups
are rebuilt from equal hyperparameters in order of appearance
(torch rebuilds them from the live optimizer's groups; two groups with identical
hyperparameters would come back as one).

Writing (``flat=True`` of the DCP writer): the reverse, for ``dcp.load`` of the state dict
torchtitan builds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointError
from .entries import is_extra_state

_STATE, _GROUPS = "state.", "param_groups."


def is_flat_optimizer(sub: Any) -> bool:
    return (
        isinstance(sub, Mapping)
        and bool(sub)
        and all(isinstance(k, str) and k.startswith((_STATE, _GROUPS)) for k in sub)
        and any(k.startswith(_GROUPS) for k in sub)
    )


def unflatten(tree: dict[str, Any]) -> dict[str, Any]:
    """A tree in torchtitan's layout, in the nested form ``entries.to_entries`` reads."""
    out: dict[str, Any] = {}
    tops = {k: v for k, v in tree.items() if isinstance(v, torch.Tensor)}
    flat_optimizer = any(is_flat_optimizer(v) for v in tree.values())
    moved = bool(tops) and "model" not in tree and (flat_optimizer or any("." in k for k in tops))
    # Not when "model" is the tree's own: "rng" beside it stays. Extra state goes with
    # the weights of its module: left at the top level, strict load missed it.
    model = {k: v for k, v in tree.items() if k in tops or is_extra_state(k, v)} if moved else {}
    if moved:
        out["model"] = model
    for name, sub in tree.items():
        if name in model:
            continue
        out[name] = _nested_optimizer(sub) if is_flat_optimizer(sub) else sub
    return out


def _nested_optimizer(flat: Mapping[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    hypers: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        prefix, rest = (_STATE, state) if key.startswith(_STATE) else (_GROUPS, hypers)
        fqn, _, field = key[len(prefix) :].rpartition(".")
        if not fqn:
            raise CheckpointError(f"optimizer key {key!r} names no parameter")
        rest.setdefault(fqn, {})[field] = value
    groups: list[dict[str, Any]] = []
    by_text: dict[str, dict[str, Any]] = {}
    for fqn, hyper in hypers.items():
        # Found by its text, not by comparing with every group: a checkpoint with a group
        # per parameter (or a crafted one) would take quadratic time. Only values that are
        # equal and print alike share a group.
        text = repr(sorted(hyper.items()))
        same = by_text.get(text)
        if same is not None and _hyper(same) == hyper:
            same["params"].append(fqn)
        else:
            groups.append({**hyper, "params": [fqn]})
            by_text.setdefault(text, groups[-1])
    return {"state": state, "param_groups": groups}


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def flatten(tree: dict[str, Any], kinds: Mapping[str, str]) -> dict[str, Any]:
    """``entries.nested`` output (entries of ``kinds``) in torchtitan's layout: the one
    module's state dict at the top level, each optimizer's state flattened."""
    modules = [n for n in tree if kinds.get(n) == "module"]
    if len(modules) != 1:
        raise CheckpointError(
            "the flat (torchtitan) DCP layout puts one model's weights at the top level; "
            f"this checkpoint has {len(modules)} module entries ({', '.join(modules)}): "
            "pick one with --only"
        )
    out: dict[str, Any] = dict(tree[modules[0]])
    for name, sub in tree.items():
        if name == modules[0]:
            continue
        if name in out:
            raise CheckpointError(f"entry {name!r} has the name of a model weight")
        out[name] = _flat_optimizer(sub) if kinds.get(name) == "optimizer" else sub
    return out


def _flat_optimizer(sub: dict[str, Any]) -> dict[str, Any]:
    items = [
        (f"{_STATE}{fqn}.{field}", value, f"['state'][{fqn!r}][{field!r}]")
        for fqn, per in sub["state"].items()
        for field, value in per.items()
    ]
    items += [
        (f"{_GROUPS}{fqn}.{field}", value, f"param {fqn!r}'s group's {field!r}")
        for group in sub["param_groups"]
        for fqn in group["params"]
        for field, value in _hyper(group).items()
    ]
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value, where in items:
        if key in origin:
            raise CheckpointError(
                f"cannot write the flat DCP layout: the optimizer's {origin[key]} and {where} "
                f"would both be stored as {key!r}, so one would be lost; use "
                "dcp_layout='nested'"
            )
        origin[key], out[key] = where, value
    return out
