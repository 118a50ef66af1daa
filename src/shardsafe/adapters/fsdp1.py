"""Refusing FSDP1 (``FullyShardedDataParallel``) and ``ShardedTensor`` values, by name.

shardsafe saves FSDP2 (``fully_shard``), whose parameters and optimizer state are
DTensors that say which part of which tensor each rank holds. FSDP1 does not: each
wrapped block's parameters are one flat ``FlatParameter`` per rank, with the same name
and shape on every rank and each rank's own values, and so is the optimizer state of it.
Saved as any optimizer's state it looked replicated and one rank's copy was written, so
a load gave every rank that rank's shard, without a word; with ``use_orig_params=True``
it was refused with a misleading message about shapes. FSDP1's sharded and local state
dicts hold ``ShardedTensor`` values, on which torch's own tensor properties raise.

Both are refused before anything is written or restored, on every rank alike: whether
a model holds FSDP1 and whether an optimizer holds a ``FlatParameter`` depend on how the
model was built, which is the same on every rank, not on any rank's values. Nothing is
imported here: an object of these classes exists only once torch has imported them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import torch
from torch import nn

from ..errors import CheckpointError
from ..protocol import loaded_class

Action = Literal["save", "load"]

WAY_OUT = (
    "use FSDP2 (torch.distributed.fsdp.fully_shard), or save the full state dicts FSDP1 "
    "gives under StateDictType.FULL_STATE_DICT as plain values ({'model': "
    "model.state_dict(), 'optimizer': FSDP.optim_state_dict(model, optimizer)}) and "
    "restore them with model.load_state_dict and FSDP.optim_state_dict_to_load, as "
    "docs/parallelism.md shows"
)
"""How to checkpoint an FSDP1 model all the same (the second way tested on 2 ranks)."""

_FSDP1 = "torch.distributed.fsdp.fully_sharded_data_parallel"

_UNTOUCHED = {"save": "nothing was written", "load": "nothing was restored"}


def fsdp1_path(module: object) -> str | None:
    """The name of the first FSDP1 module in ``module`` (``""``: ``module`` itself), or
    ``None`` if it holds none (or is no module)."""
    fsdp = loaded_class(
        "torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"
    )
    if fsdp is None or not isinstance(module, nn.Module):
        return None
    return next((name for name, sub in module.named_modules() if isinstance(sub, fsdp)), None)


def refuse_fsdp1_module(module: nn.Module, name: str, action: Action) -> None:
    """Refuse ``state[name]`` if it is or holds an FSDP1 module: its parameters are each
    rank's own flat shards under one name (see the module docstring)."""
    path = fsdp1_path(module)
    if path is None:
        return
    what = "it is" if not path else f"its submodule {path!r} is"
    raise CheckpointError(
        f"cannot {action} state[{name!r}]: {what} a FullyShardedDataParallel module. FSDP1 "
        f"(FullyShardedDataParallel) is not supported: {WAY_OUT} ({_UNTOUCHED[action]})"
    )


def refuse_flat_params(
    params: Iterable[torch.Tensor],
    name_of: Callable[[torch.Tensor], str | None],
    name: str,
    action: Action,
) -> None:
    """Refuse the optimizer ``state[name]`` if it steps a parameter of FSDP1: a
    ``FlatParameter``, or (``use_orig_params=True``) a parameter FSDP1 flattened into one
    (torch marks each such parameter). ``name_of`` gives a parameter's name, if it has one."""
    flat = loaded_class("torch.distributed.fsdp._flat_param", "FlatParameter")
    if flat is None:
        return
    for param in params:
        if isinstance(param, flat) or getattr(param, "_fsdp_flattened", False) is True:
            which = name_of(param)
            shown = repr(which) if which is not None else f"of shape {list(param.shape)}"
            raise CheckpointError(
                f"cannot {action} state[{name!r}]: it steps parameter {shown}, which FSDP1 "
                "(FullyShardedDataParallel) flattened: its state on each rank is that rank's "
                f"own flat shard. FSDP1 is not supported: {WAY_OUT} ({_UNTOUCHED[action]})"
            )


def refuse_sharded_tensor(key: str, value: torch.Tensor, action: Action) -> None:
    """Refuse ``value`` (the tensor ``key``) if it is a ``ShardedTensor``, which FSDP1's
    SHARDED_STATE_DICT and LOCAL_STATE_DICT hold: torch's own tensor properties raise on it
    ("not supported for ShardedTensor"), and shardsafe holds sharded tensors as DTensors."""
    sharded = loaded_class("torch.distributed._shard.sharded_tensor.api", "ShardedTensorBase")
    if sharded is None or not isinstance(value, sharded):
        return
    raise CheckpointError(
        f"cannot {action} {key!r}: it is a ShardedTensor (as FSDP1's SHARDED_STATE_DICT and "
        "LOCAL_STATE_DICT hold), which shardsafe does not support: use FSDP2 "
        "(torch.distributed.fsdp.fully_shard), whose state dicts hold DTensors, or take "
        f"the state dict under StateDictType.FULL_STATE_DICT ({_UNTOUCHED[action]})"
    )
