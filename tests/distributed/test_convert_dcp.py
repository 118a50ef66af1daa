"""DCP <-> shardsafe conversion on real gloo process groups.

FSDP2 and DDP+Adam checkpoints written by ``dcp.save`` on 2 ranks are converted (in one
process, no process group) and loaded with ``shardsafe.load`` on 1 and 3 ranks: the
state must be bitwise what DCP's own ``dcp.load`` restores on the same ranks. And back:
a shardsafe checkpoint converted to DCP loads with ``dcp.load`` bitwise equal to what
``shardsafe.load`` restores from the original.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from tests.distributed.test_fsdp import adamw, fsdp, net, train
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(300)


def build(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2, DDP, or (one process, no process group) a plain model; AdamW."""
    if kind == "fsdp":
        model = fsdp(seed)
    elif kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net(seed))
    else:
        model = net(seed)
    return model, adamw(model)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    distributed = torch.distributed.is_initialized()
    options = StateDictOptions(full_state_dict=distributed, cpu_offload=distributed)
    return copy.deepcopy(get_state_dict(model, opt, options=options))


def dcp_save_run(rank: int, world: int, kind: str, path: str) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = build(kind, 0)
    train(model, opt, 0, 3, rank)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd, "step": 3}, checkpoint_id=path)
    return full_state(model, opt)


def shardsafe_save_run(rank: int, world: int, kind: str, path: str) -> Any:
    model, opt = build(kind, 0)
    train(model, opt, 0, 3, rank)
    shardsafe.save(path, {"model": model, "optimizer": opt, "step": 3})
    return full_state(model, opt)


def shardsafe_load_run(rank: int, world: int, kind: str, path: str) -> Any:
    model, opt = build(kind, 1)
    train(model, opt, 0, 1, rank)  # optimizer state exists, and differs from the saved one
    plain = shardsafe.load(path, {"model": model, "optimizer": opt})
    return full_state(model, opt), plain


def dcp_load_run(rank: int, world: int, kind: str, path: str) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = build(kind, 1)
    train(model, opt, 0, 1, rank)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd, "step": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return full_state(model, opt), {"step": state["step"]}


def on(world: int, fn: Any, kind: str, path: str) -> Any:
    """rank 0's result of ``fn`` on ``world`` ranks (1 rank of a plain model: no group)."""
    if world == 1 and kind == "plain":
        return run_ranks(fn, 1, kind, path, init_process_group=False, timeout=240)[0]
    return run_ranks(fn, world, kind, path, timeout=240)[0]


def assert_bitwise(got: Any, want: Any, path: str = "state") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (path, got, want)
        for k in want:
            assert_bitwise(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_bitwise(g, w, f"{path}[{i}]")
    else:
        assert got == want and type(got) is type(want), (path, got, want)


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_dcp_checkpoint_converts_and_loads_like_dcp_load_at_other_world_sizes(
    tmp_path: Path, kind: str
) -> None:
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "converted")
    saved = run_ranks(dcp_save_run, 2, kind, src, timeout=240)[0]
    result = shardsafe.convert(src, dst, progress=False)
    assert result.source_format == "dcp" and result.destination_format == "shardsafe"
    assert sorted(shardsafe.read_manifest(dst).values) == ["model", "optimizer", "step"]

    for world, load_kind in ((1, "plain"), (1, kind), (3, kind)):
        got, plain = on(world, shardsafe_load_run, load_kind, dst)
        want, dcp_plain = on(world, dcp_load_run, load_kind, src)
        assert_bitwise(got, want)
        assert plain == dcp_plain == {"step": 3}
    assert_bitwise(got[0], saved[0])  # and what was trained


def test_shardsafe_fsdp_checkpoint_converts_to_dcp_that_dcp_load_restores(tmp_path: Path) -> None:
    src, dst = str(tmp_path / "shardsafe"), str(tmp_path / "dcp")
    saved = run_ranks(shardsafe_save_run, 2, "fsdp", src, timeout=240)[0]
    shardsafe.convert(src, dst, to="dcp", progress=False)

    for world, kind in ((1, "plain"), (3, "fsdp"), (2, "ddp")):
        got, step = on(world, dcp_load_run, kind, dst)
        want, _ = on(world, shardsafe_load_run, kind, src)
        assert_bitwise(got, want)
        assert step == {"step": 3}
    assert_bitwise(got[0], saved[0])


def test_dcp_round_trip_through_shardsafe_keeps_every_key_and_byte(tmp_path: Path) -> None:
    """DCP -> shardsafe -> DCP: ``dcp.load`` of the result equals ``dcp.load`` of the source."""
    src = str(tmp_path / "dcp")
    run_ranks(dcp_save_run, 2, "fsdp", src, timeout=240)
    shardsafe.convert(src, tmp_path / "ss", progress=False)
    shardsafe.convert(tmp_path / "ss", tmp_path / "back", to="dcp", progress=False)
    got = on(3, dcp_load_run, "fsdp", str(tmp_path / "back"))
    want = on(3, dcp_load_run, "fsdp", src)
    assert_bitwise(got, want)


def test_converted_dcp_checkpoint_loads_into_ddp_with_zero(tmp_path: Path) -> None:
    from tests.distributed.test_fsdp import assert_same_model, ddp_run, fqn_optimizer_state
    from tests.distributed.zero_setup import assert_same_optimizer_state

    src, dst = str(tmp_path / "dcp"), str(tmp_path / "converted")
    run_ranks(dcp_save_run, 2, "ddp", src, timeout=240)
    shardsafe.convert(src, dst, progress=False)
    weights, state = run_ranks(ddp_run, 2, dst, False, timeout=240)[0]
    (msd, osd), _ = on(1, dcp_load_run, "plain", src)
    assert_same_model(weights, msd)
    assert_same_optimizer_state(state, fqn_optimizer_state(osd))


# -- torchtitan's flat layout: weights at the top level, optimizer state flattened


def titan_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=options)
    return {**msd, "optimizer": osd, "train_state": {"step": 3}}


def titan_save_run(rank: int, world: int, kind: str, path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    model, opt = build(kind, 0)
    train(model, opt, 0, 3, rank)
    dcp.save(titan_state(model, opt), checkpoint_id=path)
    return full_state(model, opt)


def titan_load_run(rank: int, world: int, kind: str, path: str) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model, opt = build(kind, 1)
    train(model, opt, 0, 1, rank)
    state = titan_state(model, opt)
    state["train_state"] = {"step": 0}
    dcp.load(state, checkpoint_id=path)
    msd = {k: v for k, v in state.items() if k not in ("optimizer", "train_state")}
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    set_state_dict(
        model, opt, model_state_dict=msd, optim_state_dict=state["optimizer"], options=options
    )
    return full_state(model, opt), state["train_state"]


def test_torchtitan_flat_layout_converts_both_ways(tmp_path: Path) -> None:
    src, ss, back = str(tmp_path / "titan"), str(tmp_path / "ss"), str(tmp_path / "back")
    saved = run_ranks(titan_save_run, 2, "fsdp", src, timeout=240)[0]
    shardsafe.convert(src, ss, progress=False)
    manifest = shardsafe.read_manifest(ss)
    assert {v.name: v.kind for v in manifest.values.values()} == {
        "model": "module", "optimizer": "optimizer", "train_state": "value",
    }  # fmt: skip
    got, plain = on(3, shardsafe_load_run, "fsdp", ss)
    want, _ = on(3, titan_load_run, "fsdp", src)
    assert_bitwise(got, want)
    assert_bitwise(got, saved)
    assert plain == {"train_state": {"step": 3}}

    shardsafe.convert(ss, back, to="dcp", dcp_layout="flat", progress=False)
    got, train_state = on(1, titan_load_run, "plain", back)
    assert_bitwise(got, on(1, titan_load_run, "plain", src)[0])
    assert train_state == {"step": 3}
