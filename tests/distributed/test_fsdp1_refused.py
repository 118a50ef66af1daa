"""FSDP1 (``FullyShardedDataParallel``) and ``ShardedTensor`` values, refused on two gloo
ranks before anything is written or restored, with the way out.

Before, a FSDP1 model and its Adam saved without a word (``use_orig_params=False``): each
rank's optimizer state of ``_fsdp_wrapped_module._flat_param`` has one name and shape
and its own values, was taken for a replica and written once, so after a load rank 0
held rank 1's shard. With ``use_orig_params=True`` it was refused with a misleading
message about shapes; FSDP1's SHARDED_STATE_DICT (ShardedTensor values) failed with
torch's "__get__ ... not supported for ShardedTensor!". Every rank sees the same
condition and refuses on its own: the agreed error names both ranks."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)

WAY_OUT = (
    "FSDP1 (FullyShardedDataParallel) is not supported: use FSDP2 "
    "(torch.distributed.fsdp.fully_shard), or save the full state dicts FSDP1 gives under "
    "StateDictType.FULL_STATE_DICT as plain values ({'model': model.state_dict(), "
    "'optimizer': FSDP.optim_state_dict(model, optimizer)}) and restore them with "
    "model.load_state_dict and FSDP.optim_state_dict_to_load, as docs/parallelism.md shows"
)
SHARDED_WAY_OUT = (
    "it is a ShardedTensor (as FSDP1's SHARDED_STATE_DICT and LOCAL_STATE_DICT hold), "
    "which shardsafe does not support: use FSDP2 (torch.distributed.fsdp.fully_shard), "
    "whose state dicts hold DTensors, or take the state dict under "
    "StateDictType.FULL_STATE_DICT"
)


def net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def stepped(use_orig_params: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An FSDP1 model on the CPU and its Adam, one step taken (each rank its own shard)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(net(0), use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 5, generator=torch.Generator().manual_seed(1))).sum().backward()
    opt.step()
    return model, opt


def sharded_linear() -> nn.Linear:
    """A plain module whose weight is a ShardedTensor (``shard_parameter``), no FSDP1."""
    from torch.distributed._shard import shard_parameter
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    torch.manual_seed(2)
    linear = nn.Linear(4, 6)
    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
    shard_parameter(linear, "weight", spec)
    return linear


def snapshot(*objects: Any) -> list[torch.Tensor]:
    """Every tensor of the live objects: parameters, buffers, optimizer state."""
    out: list[torch.Tensor] = []
    for obj in objects:
        if isinstance(obj, nn.Module):
            for value in obj.state_dict(keep_vars=True).values():
                if type(value).__name__ == "ShardedTensor":
                    out += [s.tensor.clone() for s in value.local_shards()]
                else:
                    out.append(value.detach().clone())
        else:
            # By name: a load may give a parameter's state its entries in another order.
            out += [state[k].clone() for state in obj.state.values() for k in sorted(state)]
    return out


def refusals(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Every refusal, on this rank: saves (each to a directory of its own) and loads of the
    checkpoint ``root/saved`` (a plain model's), and whether the live objects changed."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    from shardsafe.accelerate.state import state_of

    flat, flat_opt = stepped(use_orig_params=False)
    orig, orig_opt = stepped(use_orig_params=True)
    with FSDP.state_dict_type(orig, StateDictType.SHARDED_STATE_DICT):
        sharded_state = orig.state_dict()
    linear = sharded_linear()
    saves = {
        "flat model": {"model": flat, "optimizer": flat_opt},
        "flat optimizer": {"optimizer": flat_opt, "model": flat},
        "nested model": {"model": nn.Sequential(orig), "optimizer": orig_opt},
        "orig optimizer": {"optimizer": orig_opt, "model": orig},
        "sharded state dict": {"model": sharded_state},
        "sharded parameter": {"model": linear},
    }
    out: dict[str, Any] = {}
    for name, state in saves.items():
        out[name] = _error(shardsafe.save, os.path.join(root, name), state)
    before = snapshot(flat, flat_opt, orig, orig_opt, linear)
    saved = os.path.join(root, "saved")
    loads = {
        "load flat model": {"model": flat, "optimizer": flat_opt},
        "load orig optimizer": {"optimizer": orig_opt, "model": orig},
        "load sharded parameter": {"linear": linear},
    }
    for name, state in loads.items():
        out[name] = _error(shardsafe.load, saved, state)
    after = snapshot(flat, flat_opt, orig, orig_opt, linear)
    out["unchanged"] = len(before) == len(after) and all(map(torch.equal, before, after))
    accelerator = SimpleNamespace(_models=[nn.Sequential(flat)])
    out["accelerate"] = _error(state_of, accelerator)
    out["way out restores"] = way_out(flat, flat_opt, os.path.join(root, "full"))
    return out


def way_out(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> bool:
    """The way out the refusals name: FSDP1's full state dicts saved as plain values, and
    restored with ``load_state_dict`` and ``optim_state_dict_to_load`` after another step:
    whether each rank's flat parameter and optimizer state came back bitwise."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        state = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, opt)}
    shardsafe.save(path, state)
    saved = snapshot(model, opt)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    values = shardsafe.load(path, {})
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.load_state_dict(values["model"])
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, values["optimizer"]))
    restored = snapshot(model, opt)
    return len(saved) == len(restored) and all(map(torch.equal, saved, restored))


def _error(call: Callable[..., Any], *args: Any) -> tuple[str, str] | None:
    """The class and message of what ``call(*args)`` raised, if anything."""
    try:
        call(*args)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def _agreed(found: tuple[str, str] | None, operation: str) -> str:
    """The refusal both ranks raised on their own (each is named in the agreed error)."""
    assert found is not None
    kind, message = found
    assert kind == "CheckpointError"
    agreed = re.match(rf"{operation} failed on rank (\d) \(rank\(s\) (\d) failed too\): ", message)
    assert agreed is not None, message
    assert {agreed[1], agreed[2]} == {"0", "1"}
    return message[agreed.end() :]


def test_fsdp1_and_sharded_tensors_are_refused_on_every_rank_before_anything_happens(
    tmp_path: Path,
) -> None:
    plain = net(3)
    adam = torch.optim.Adam(plain.parameters())
    plain(torch.randn(2, 5)).sum().backward()
    adam.step()
    shardsafe.save(
        tmp_path / "saved", {"model": plain, "optimizer": adam, "linear": nn.Linear(4, 6)}
    )

    results = run_ranks(refusals, 2, str(tmp_path), timeout=110)

    flat_model = f"cannot save state['model']: it is a FullyShardedDataParallel module. {WAY_OUT}"
    expected_saves = {
        "flat model": f"{flat_model} (nothing was written)",
        "flat optimizer": (
            "cannot save state['optimizer']: it steps parameter "
            "'_fsdp_wrapped_module._flat_param', which FSDP1 (FullyShardedDataParallel) "
            "flattened: its state on each rank is that rank's own flat shard. FSDP1 is not "
            f"supported: {WAY_OUT.split('is not supported: ')[1]} (nothing was written)"
        ),
        "nested model": (
            "cannot save state['model']: its submodule '0' is a FullyShardedDataParallel "
            f"module. {WAY_OUT} (nothing was written)"
        ),
        "orig optimizer": (
            "cannot save state['optimizer']: it steps parameter "
            "'_fsdp_wrapped_module.0.weight', which FSDP1 (FullyShardedDataParallel) "
            "flattened: its state on each rank is that rank's own flat shard. FSDP1 is not "
            f"supported: {WAY_OUT.split('is not supported: ')[1]} (nothing was written)"
        ),
        "sharded state dict": (
            f"cannot save 'model/0.weight': {SHARDED_WAY_OUT} (nothing was written)"
        ),
        "sharded parameter": f"cannot save 'model/weight': {SHARDED_WAY_OUT} (nothing was written)",
    }
    expected_loads = {
        "load flat model": (
            "cannot load state['model']: it is a FullyShardedDataParallel module. "
            f"{WAY_OUT} (nothing was restored)"
        ),
        "load orig optimizer": (
            "cannot load state['optimizer']: it steps parameter "
            "'_fsdp_wrapped_module.0.weight', which FSDP1 (FullyShardedDataParallel) "
            "flattened: its state on each rank is that rank's own flat shard. FSDP1 is not "
            f"supported: {WAY_OUT.split('is not supported: ')[1]} (nothing was restored)"
        ),
        "load sharded parameter": (
            f"cannot load 'linear/weight': {SHARDED_WAY_OUT} (nothing was restored)"
        ),
    }
    for out in results:
        for name, message in expected_saves.items():
            assert _agreed(out[name], "save") == message, name
            assert not (tmp_path / name / "manifest.json").exists(), name
        for name, message in expected_loads.items():
            assert _agreed(out[name], "load") == message, name
        assert out["unchanged"] is True
        assert out["way out restores"] is True
        assert out["accelerate"] == (
            "ValueError",
            "a model is wrapped in FSDP1 (FullyShardedDataParallel), which shardsafe does "
            "not save: use FSDP2, FullyShardedDataParallelPlugin(fsdp_version=2)",
        )
