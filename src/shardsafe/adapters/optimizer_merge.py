"""Every rank's optimizer metadata merged, by parameter name, into what the manifest records.

Under DDP every rank holds the same param groups and state; under ZeRO/OSS every rank
holds the same groups and the state of the parameters it owns; under pipeline or expert
parallelism each rank holds only its own parameters, in groups of its own. Merging by
name serves all of them:

* ``state``: each parameter's state once (ranks that hold the same parameter must hold
  the same state structure);
* ``param_shapes``: every parameter's shape;
* ``param_groups``: the ranks' groups combined position by position, a group's
  parameters the union of every rank's group at that position with the same
  hyperparameters. A stage whose group at that position has other hyperparameters
  (a per-stage learning rate) becomes a group of its own; loading finds each live
  parameter's group by its name (``optimizer.match_groups``).

What cannot be described exactly is refused here, on rank 0 while the save is being
planned, so nothing is written: one parameter in groups with different hyperparameters,
or with different state, on two ranks.
"""

from __future__ import annotations

import json
from typing import Any

from .. import _tree
from ..errors import CheckpointError
from ..protocol import JSON

NAMES = "param_names"
"""A param group's names of its parameters (an optimizer built on ``named_parameters()``):
they describe the live group's own parameters, matched by name here, so a load keeps the
live group's own (see ``optimizer.py``)."""


def merge_optimizer_metas(metas: list[JSON]) -> JSON:
    """One optimizer entry from every rank's ``metas`` (rank order)."""
    if all(meta == metas[0] for meta in metas[1:]):  # DDP: every rank alike, one pass
        return metas[0]
    state: dict[str, Any] = {}
    state_rank: dict[str, int] = {}
    shapes: dict[str, Any] = {}
    groups = _Groups()
    for rank, meta in enumerate(metas):
        for fqn, param_state in meta["state"].items():
            if fqn not in state:
                state[fqn], state_rank[fqn] = param_state, rank
            elif state[fqn] != param_state:
                raise CheckpointError(
                    f"ranks {state_rank[fqn]} and {rank} both hold optimizer state for "
                    f"parameter {fqn!r}, but not the same "
                    f"({_state_difference(state[fqn], param_state)}): replicas of a "
                    "parameter must have stepped alike; nothing was written"
                )
        for fqn, shape in meta["param_shapes"].items():
            if shapes.setdefault(fqn, shape) != shape:
                raise CheckpointError(
                    f"ranks disagree about the shape of parameter {fqn!r} ({shapes[fqn]} and "
                    f"{shape} on rank {rank}): each parameter name must mean one tensor; "
                    "nothing was written"
                )
        if rank and meta["param_groups"] == metas[0]["param_groups"]:
            continue  # ZeRO, OSS, a stage's replicas: the same groups as rank 0's
        for index, group in enumerate(meta["param_groups"]):
            groups.add(rank, index, group)
    merged = {"param_groups": groups.merged(), "param_shapes": shapes, "state": state}
    classes = {meta.get("class") for meta in metas}
    if len(classes) == 1 and None not in classes:  # stages of one optimizer class
        merged["class"] = classes.pop()
    qualified = {n: own for meta in metas for n, own in meta.get("qualified", {}).items()}
    if qualified:  # every rank's (a ZeRO rank records the names of its own shard)
        merged["qualified"] = qualified
    extras = [meta.get("extra") for meta in metas]  # optimizer.EXTRA
    other = next((r for r, extra in enumerate(extras) if extra != extras[0]), None)
    if other is not None:
        raise CheckpointError(
            f"ranks 0 and {other} hold different values in their optimizer's state_dict() "
            f"beside 'state' and 'param_groups' ({_shown(extras[0])} and "
            f"{_shown(extras[other])}), which is saved once for every rank; nothing was written"
        )
    if extras[0] is not None:
        merged["extra"] = extras[0]
    return merged


def _shown(extra: JSON) -> str:
    text = "none" if extra is None else json.dumps(extra, sort_keys=True)
    return text if len(text) <= 200 else text[:200] + "..."


class _Groups:
    """Param groups merged position by position (see the module docstring)."""

    def __init__(self) -> None:
        self._groups: list[tuple[int, JSON, list[str]]] = []  # (position, hyper, params)
        self._at: dict[int, list[int]] = {}  # position -> its merged groups
        self._group_of: dict[str, tuple[int, int]] = {}  # fqn -> (merged group, rank)

    def add(self, rank: int, position: int, group: JSON) -> None:
        """Add a rank's group at ``position``. A parameter already merged from another
        rank's group with the same hyperparameters stays where it is, whatever that
        group's position (a replicated router beside experts a rank lacks, a tied
        embedding on the first and last stage): a load finds each parameter's group by
        its name. Refused, only where they differ, and the group made only for
        parameters not merged yet (or for a group that holds none)."""
        hyper = group["hyper"]
        target = None if group["params"] else self._find(position, hyper)
        for fqn in group["params"]:
            seen = self._group_of.get(fqn)
            if seen is not None:
                there, seen_position = self._groups[seen[0]][1], self._groups[seen[0]][0]
                if without_names(there) != without_names(hyper):
                    raise CheckpointError(
                        f"parameter {fqn!r} is in param group {position} on rank {rank} and "
                        f"in param group {seen_position} on rank {seen[1]}, with other "
                        "hyperparameters "
                        f"({_difference(without_names(hyper), without_names(there))}): "
                        "replicas must be "
                        "optimized alike; nothing was written"
                    )
                continue
            if target is None:
                target = self._find(position, hyper)
            self._group_of[fqn] = (target, rank)
            self._groups[target][2].append(fqn)

    def _find(self, position: int, hyper: JSON) -> int:
        """The merged group for ``position`` with these hyperparameters (a new one if
        none): a lookup among that position's groups only, usually one."""
        same_position = self._at.setdefault(position, [])
        for i in same_position:
            if self._groups[i][1] == hyper:
                return i
        if same_position and _tree.tensor_refs(hyper):
            raise CheckpointError(
                f"param group {position} holds tensor-valued hyperparameters that differ "
                "between ranks; shardsafe stores such a group once, so every rank must "
                "hold the same values (nothing was written)"
            )
        self._groups.append((position, hyper, []))
        same_position.append(len(self._groups) - 1)
        return len(self._groups) - 1

    def merged(self) -> list[JSON]:
        return [{"params": params, "hyper": hyper} for _, hyper, params in self._groups]


def _state_difference(first: JSON, other: JSON) -> str:
    """How two ranks' state of one parameter differ: which state names each holds (an
    optimizer built with ``amsgrad`` on one rank only), or the first value that differs
    (a step count kept as a number)."""
    if not (isinstance(first, dict) and isinstance(other, dict)):
        return f"{_tree.describe(first)} and {_tree.describe(other)}"
    if first.keys() != other.keys():
        return f"state names {sorted(first)} and {sorted(other)}"
    name = next(k for k in sorted(first) if first[k] != other[k])
    return f"{name!r}: {_short(first[name])} and {_short(other[name])}"


def _short(value: JSON) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def without_names(hyper: JSON) -> JSON:
    """A group's hyperparameters but the names of its parameters (``param_names``, which
    torch keeps in a group built from ``named_parameters()``): each rank's lists its own."""
    return {k: v for k, v in hyper.items() if k != NAMES} if isinstance(hyper, dict) else hyper


def _difference(first: JSON, other: JSON) -> str:
    """How two groups' hyperparameters differ: the first that does (``lr=0.1 against
    lr=0.01``), else the two described."""
    if isinstance(first, dict) and isinstance(other, dict):
        for name in sorted(first.keys() | other.keys()):
            if first.get(name) != other.get(name):
                missing = "(none)"
                a = _short(first[name]) if name in first else missing
                b = _short(other[name]) if name in other else missing
                return f"{name}={a} against {name}={b}"
    return f"{_tree.describe(first)} against {_tree.describe(other)}"
