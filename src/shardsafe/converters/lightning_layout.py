"""A Lightning checkpoint written as ``torch.save`` in Lightning's own layout, so that
Lightning loads the file it gets (``load_from_checkpoint``, ``fit(ckpt_path=...)``).

A checkpoint a shardsafe Lightning strategy saved holds the module (``model``), each
optimizer (``optimizer``, ``optimizer_1``, ... keyed by parameter name) and everything
else of Lightning's dict in one value (``lightning``, with ``pytorch-lightning_version``).
Written as it is, that gives a file Lightning refuses (``KeyError:
'pytorch-lightning_version'``). So its ``torch.save`` form is Lightning's dict again:
``lightning``'s keys at the top, the module's tensors as ``state_dict``, and the
optimizers as ``optimizer_states`` in torch's own index-keyed form (parameters numbered
in the order of their groups, as ``Optimizer.state_dict()`` numbers them). A Lightning
``.ckpt`` converted to shardsafe and back (its ``state_dict`` read as ``model``) gets its
``state_dict`` back the same way. Anything else is written as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._text import terminal_safe
from ..errors import CheckpointCorruptError
from .entries import is_optimizer

VERSION_KEY = "pytorch-lightning_version"
LIGHTNING = "lightning"
MODEL = "model"
STATE_DICT = "state_dict"


def lightning_layout(tree: dict[str, Any], where: str) -> dict[str, Any] | None:
    """``tree`` (a checkpoint's nested entries) as Lightning's checkpoint dict, or ``None``
    if it is not a Lightning checkpoint."""
    part = tree.get(LIGHTNING)
    if isinstance(part, Mapping) and VERSION_KEY in part:  # saved by a shardsafe strategy
        out = dict(part)
        if STATE_DICT not in out:  # not edited by an on_save_checkpoint hook
            out[STATE_DICT] = tree.get(MODEL, {})
        optimizers = _optimizer_entries(tree)
        if optimizers:
            out["optimizer_states"] = [index_keyed(tree[n], f"{where}: {n}") for n in optimizers]
        taken = {LIGHTNING, MODEL, *optimizers}
        clashes = sorted(k for k in tree if k not in taken and k in out)
        if clashes:  # one was dropped in silence (found in review)
            raise CheckpointCorruptError(
                f"{where}: the entry {terminal_safe(clashes[0])!r} is both a top-level entry "
                f"and an entry of {LIGHTNING!r}, and a Lightning checkpoint holds both at its "
                "top level: written as one, one of them would be lost. Leave one out with "
                "only=[...], or rename it"
            )
        out.update({k: v for k, v in tree.items() if k not in taken})
        return out
    if VERSION_KEY in tree and isinstance(tree.get(MODEL), Mapping) and STATE_DICT not in tree:
        # a .ckpt read back (its state_dict read as model; one that held both kept both)
        return {(STATE_DICT if k == MODEL else k): v for k, v in tree.items()}
    return None


def _optimizer_entries(tree: Mapping[str, Any]) -> list[str]:
    """``optimizer``, ``optimizer_1``, ... as far as they go (the strategy's names), each
    an FQN-keyed optimizer state (``entries.is_optimizer``): an entry of that name holding
    anything else (a string, a dict without ``param_groups``) stays a plain value; it was
    read as one, and a crafted checkpoint raised a raw TypeError (found in review)."""
    names: list[str] = []
    while (name := "optimizer" if not names else f"optimizer_{len(names)}") in tree:
        if not is_optimizer(tree[name]):
            break
        names.append(name)
    return names


def index_keyed(optimizer: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict in ``torch.optim.Optimizer.state_dict()``'s form:
    parameters numbered in the order of their groups."""
    groups = optimizer["param_groups"]
    order = [fqn for group in groups for fqn in group["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    unknown = [fqn for fqn in optimizer["state"] if fqn not in index]
    if len(index) != len(order) or unknown:
        raise CheckpointCorruptError(
            f"{where}: the optimizer's state names parameters its groups do not list once "
            f"each ({(unknown or order)[:3]}), so torch's numbered form cannot be written"
        )
    return {
        "state": {index[fqn]: state for fqn, state in optimizer["state"].items()},
        "param_groups": [{**g, "params": [index[fqn] for fqn in g["params"]]} for g in groups],
    }
