"""Bridges to torch's own optimizer format, for code that expects it.

* :func:`gather_optimizer_state_dict` returns, on one rank, exactly what
  ``optimizer.state_dict()`` returns for a plain optimizer (integer-indexed state, param
  groups with hyperparameters) — also for ZeRO and OSS, whose own route to it is
  ``consolidate_state_dict()``, which pickles every rank's shard and broadcasts it to all
  ranks. Here shards travel as raw tensors to the receiving rank only.
* :func:`load_optimizer_state_dict` loads such an index-keyed dict into any optimizer
  (plain, ZeRO, OSS) at any world size; each rank keeps only the state it owns.
* :func:`import_torch_checkpoint` reads a file written the old way
  (``consolidate_state_dict()`` + ``torch.save(zero.state_dict())``, or a Lightning
  ``.ckpt``) and loads it. shardsafe calls ``torch.load`` only here and in the converters
  (``shardsafe.converters``), always with ``weights_only=True``, so no arbitrary object is
  unpickled.

Indices follow torch's convention: the position of a parameter in the optimizer's
(global) param groups, flattened in order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _tree, dtypes
from .adapters.optimizer import GROUPS
from .adapters.registry import adapter_for
from .checkpoint.plan.load_plan import request_problem
from .checkpoint.storage.files import open_named_file
from .distributed import Coordinator, Phase, comm_device, world
from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from .pickles import load_torch
from .protocol import Adapter, LoadContext, SavedValue, param_names

_NAME = "optimizer"


def _adapter_and_context(optimizer: Any, model: nn.Module) -> tuple[Adapter, Any, LoadContext]:
    """The optimizer's adapter, the optimizer it works on (inside a wrapper that only
    delegates, ``adapter_for``), and a context that serves both its save and load sides
    (the state dict handled here is whole: every rank's view of it is the same)."""
    rank, world_size = world()
    adapter, optimizer = adapter_for(optimizer, _NAME)
    if adapter.kind != "optimizer":
        raise TypeError(f"expected an optimizer, got {type(optimizer).__qualname__}")
    ctx = LoadContext(
        name=_NAME,
        rank=rank,
        world_size=world_size,
        param_names=param_names({"model": model}),
        saved_world_size=world_size,
    )
    return adapter, optimizer, ctx


def gather_optimizer_state_dict(
    optimizer: Any, model: nn.Module, *, to: int = 0, timeout: float = 600.0
) -> dict[str, Any] | None:
    """torch's ``optimizer.state_dict()`` of the whole (possibly sharded) optimizer, on ``to``.

    Call it on every rank. Returns the dict on rank ``to`` and ``None`` elsewhere. Other
    ranks send their state as raw tensors (no pickling) to ``to`` alone.
    """
    adapter, optimizer, ctx = _adapter_and_context(optimizer, model)
    if not isinstance(to, int) or isinstance(to, bool) or not 0 <= to < ctx.world_size:
        raise ValueError(f"to={to!r} is not a rank of this job (world size {ctx.world_size})")
    coord = Coordinator("gather_optimizer_state_dict", "<interop>", timeout=timeout)
    coord.enter(timeout)
    try:
        return _gather(coord, adapter, ctx, optimizer, to)
    finally:
        coord.close()


def _gather(
    coord: Coordinator, adapter: Adapter, ctx: LoadContext, optimizer: Any, to: int
) -> dict[str, Any] | None:
    offer: dict[str, Any] | None = None
    error: BaseException | None = None
    try:
        item = adapter.save(optimizer, ctx)
        if any(c.global_shape != tuple(c.tensor.shape) for c in item.chunks):
            raise CheckpointError(
                "gather_optimizer_state_dict handles optimizers whose state is whole on some "
                "rank (plain, ZeRO, OSS), not DTensor shards (FSDP2): use "
                "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict there"
            )
        offer = {
            "meta": item.meta,
            "keys": [c.key for c in item.chunks if not c.replicated],
            "shapes": {
                c.key: [list(c.tensor.shape), dtypes.dtype_name(c.tensor.dtype)]
                for c in item.chunks
            },
        }
    except Exception as e:  # agreed on every rank instead of hanging the others
        error = e
    offers = coord.exchange(Phase.OFFER, offer, error)
    meta = adapter.merge([o["meta"] for o in offers])
    tensors = {c.key: c.tensor for c in item.chunks} if ctx.rank == to else {}
    device = comm_device()  # NCCL moves CUDA tensors only
    for src, o in enumerate(offers):
        if src == to:
            continue
        for key in o["keys"]:
            if ctx.rank == src:
                chunk = item.chunks[_index(item.chunks, key)]
                dist.send(chunk.tensor.detach().contiguous().to(device), dst=to)
            elif ctx.rank == to:
                shape, dtype = o["shapes"][key]
                buf = torch.empty(shape, dtype=dtypes.any_from_name(dtype), device=device)
                dist.recv(buf, src=src)
                tensors[key] = buf.cpu()
    coord.exchange(Phase.DONE, None, None)
    if ctx.rank != to:
        return None
    return _to_torch_format(meta, tensors)


def _index(chunks: list[Any], key: str) -> int:
    return next(i for i, c in enumerate(chunks) if c.key == key)


def _to_torch_format(meta: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    order = [fqn for group in meta["param_groups"] for fqn in group["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    state = {
        index[fqn]: _tree.decode(raw, tensors)
        for fqn, raw in sorted(meta["state"].items(), key=lambda kv: index[kv[0]])
    }
    groups = []
    for group in meta["param_groups"]:
        hyper = _tree.decode(group["hyper"], tensors)
        groups.append({**hyper, "params": [index[fqn] for fqn in group["params"]]})
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(
    optimizer: Any, model: nn.Module, state_dict: Mapping[str, Any]
) -> None:
    """Load torch's index-keyed ``state_dict`` format into any optimizer, at any world size.

    Parameters are matched by position in the live optimizer's param groups (torch's own
    rule), then by name internally, so ZeRO/OSS ranks each keep only what they own. No
    collective is needed; call it on every rank that holds a part of the optimizer.
    """
    _prepared(optimizer, model, state_dict)()


def _prepared(
    optimizer: Any, model: nn.Module, state_dict: Mapping[str, Any]
) -> Callable[[], None]:
    """Check ``state_dict`` against ``optimizer`` without changing either (its groups, the
    shape of each state tensor against its parameter's, what the optimizer's own load
    would refuse); return the restore. Before, a state tensor of the wrong shape (an
    ``exp_avg`` of 5 elements for a 2x2 weight) loaded, and the next ``step()`` failed
    inside torch."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(
            f"state_dict must be an optimizer's state_dict() (a dict), not "
            f"{type(state_dict).__name__}"
        )
    adapter, optimizer, ctx = _adapter_and_context(optimizer, model)
    groups = list(optimizer.param_groups)
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
        raise CheckpointMismatchError(
            f"the state dict has {len(saved_groups) if isinstance(saved_groups, list) else 'no'} "
            f"param group(s); the optimizer has {len(groups)}"
        )
    tensors: dict[str, torch.Tensor] = {}
    fqn_of: dict[int, str] = {}
    meta_groups = []
    for i, (group, saved) in enumerate(zip(groups, saved_groups)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
            raise CheckpointMismatchError(  # was a raw KeyError or TypeError (review)
                f"param group {i} of the state dict is not a dict with a 'params' list, as "
                "an optimizer's state_dict() gives"
            )
        ids = list(saved["params"])
        if len(ids) != len(group["params"]):
            raise CheckpointMismatchError(
                f"param group {i} holds {len(ids)} parameters in the state dict and "
                f"{len(group['params'])} in the optimizer"
            )
        names = [ctx.param_fqn(p) for p in group["params"]]
        fqn_of.update(zip(ids, names))
        hyper = {k: v for k, v in saved.items() if k != "params"}
        meta_groups.append({"params": names, "hyper": _encode(hyper, ctx, tensors, GROUPS, str(i))})
    state = {}
    saved_state = state_dict.get("state", {})
    if not isinstance(saved_state, dict) or not all(
        isinstance(v, dict) for v in saved_state.values()
    ):
        raise CheckpointMismatchError(  # was a raw AttributeError (review)
            "the state dict's 'state' is not a dict of each parameter's state (dicts), as an "
            "optimizer's state_dict() gives"
        )
    for index, param_state in saved_state.items():
        if index not in fqn_of:
            raise CheckpointMismatchError(
                f"the state dict has state for parameter index {index}, which no param group lists"
            )
        fqn = fqn_of[index]
        state[fqn] = {name: _encode(v, ctx, tensors, fqn, name) for name, v in param_state.items()}
    shapes = {ctx.param_fqn(p): list(p.shape) for g in groups for p in g["params"]}
    saved_value = SavedValue(
        _NAME,
        "optimizer",
        {"param_groups": meta_groups, "param_shapes": shapes, "state": state},
        where="the state dict given",
    )
    plan = adapter.plan_load(optimizer, saved_value, ctx)
    problems = list(plan.mismatched)
    for req in plan.requests:
        given = tensors.get(req.key)
        if given is not None:
            problem = request_problem(req, given.dtype, tuple(given.shape))
            if problem is not None:
                problems.append(problem)
    if problems:
        raise CheckpointMismatchError("; ".join(problems))
    adapter.validate(optimizer, saved_value, tensors, ctx)
    return lambda: adapter.restore(optimizer, saved_value, tensors, ctx)


def _encode(value: Any, ctx: LoadContext, tensors: dict[str, torch.Tensor], *prefix: str) -> Any:
    def sink(path: tuple[str, ...], tensor: torch.Tensor) -> str:
        key = ctx.key(*prefix, *path)
        tensors[key] = tensor
        return key

    return _tree.encode(value, "the state dict", sink)


def read_torch_file(file: str | os.PathLike[str]) -> dict[str, Any]:
    """The dict in a ``torch.save`` file, read on CPU through the pickle gate
    (``pickles.load_torch``: the pickle scanned, then ``torch.load(weights_only=True)``),
    so a file can neither run code nor crash, hang or change this process as it is read.
    It is opened once; what is checked is what is loaded."""
    where = os.fspath(file)
    with open(open_named_file(where), "rb") as stream:
        raw = load_torch(stream, where)
    if not isinstance(raw, dict):
        raise CheckpointCorruptError(f"{where} does not hold a dict")
    return raw


def import_torch_checkpoint(
    file: str | os.PathLike[str],
    optimizer: Any,
    model: nn.Module,
    *,
    optimizer_index: int = 0,
    model_prefix: str | None = None,
) -> None:
    """Load a checkpoint written the old way into ``optimizer`` (and optionally ``model``).

    ``file`` holds either ``torch.save(zero.state_dict())`` after
    ``consolidate_state_dict()`` (or any optimizer's ``state_dict()``), or a Lightning
    ``.ckpt`` (its ``optimizer_states[optimizer_index]``). With ``model_prefix`` (e.g.
    ``"model."`` for a LightningModule that stores its network as ``self.model``), the
    Lightning ``state_dict`` entries under that prefix are loaded into ``model`` too.
    Read with ``torch.load(weights_only=True)``: plain data and tensors only.
    """
    if not isinstance(optimizer_index, int) or isinstance(optimizer_index, bool):
        raise ValueError(f"optimizer_index={optimizer_index!r} must be an int, 0 or more")
    if optimizer_index < 0:  # -1 took the last optimizer, -3 raised a raw IndexError
        raise ValueError(f"optimizer_index={optimizer_index!r} must be an int, 0 or more")
    raw = read_torch_file(file)
    weights: dict[str, Any] | None = None
    if "optimizer_states" in raw:
        states = raw["optimizer_states"]
        if not isinstance(states, list) or optimizer_index >= len(states):
            raise CheckpointError(f"{file} has no optimizer_states[{optimizer_index}]")
        optimizer_sd = states[optimizer_index]
        if model_prefix is not None:
            weights = _prefixed_weights(raw, model_prefix, model, file)
    elif "state" in raw and "param_groups" in raw:
        optimizer_sd = raw
    else:
        raise CheckpointError(
            f"{file} is neither an optimizer state_dict nor a Lightning checkpoint"
        )
    restore = _prepared(optimizer, model, optimizer_sd)  # checked before the model changes
    if weights is not None:
        model.load_state_dict(weights)
    restore()


def _prefixed_weights(
    raw: Mapping[str, Any], prefix: str, model: nn.Module, file: Any
) -> dict[str, Any]:
    """The Lightning ``state_dict`` entries under ``prefix``, checked against ``model``'s
    keys and shapes before anything is loaded: torch's ``load_state_dict`` copied the
    weights that fit, then raised a raw ``RuntimeError`` for the rest (and the optimizer's
    refusal came after the model had changed)."""
    saved = raw.get("state_dict", {})
    if not isinstance(saved, Mapping):
        raise CheckpointCorruptError(f"{file}: its 'state_dict' is not a dict")
    weights = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
    live = model.state_dict()
    problems = [f"{prefix}{k} is not in the model" for k in weights if k not in live]
    problems += [f"{prefix}{k} is missing from {file}" for k in live if k not in weights]
    for key in weights.keys() & live.keys():
        got, want = weights[key], live[key]
        tensors = isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
        if tensors and got.shape != want.shape:
            problems.append(
                f"{prefix}{key}: {file} holds shape {list(got.shape)}, the model {list(want.shape)}"
            )
    if problems:
        raise CheckpointMismatchError(
            "the model does not match the checkpoint's weights (nothing was loaded): "
            + "; ".join(sorted(problems))
        )
    return weights


__all__ = ["gather_optimizer_state_dict", "import_torch_checkpoint", "load_optimizer_state_dict"]
