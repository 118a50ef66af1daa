"""FSDP2 (``fully_shard``) model and optimizer state: each rank writes its own DTensor shards,
and the checkpoint loads at any world size, without FSDP, and across strategies."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from tests.distributed import zero_setup
from tests.distributed.layouts import AppState
from tests.distributed.zero_setup import assert_same_optimizer_state
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)
LAYOUTS = ["sharded", "consolidated"]


def net(seed: int) -> nn.Module:
    # Odd sizes: 10, 5 and 3 rows do not divide evenly over 3 or 4 ranks.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 5), nn.ReLU(), nn.Linear(5, 3))


def fsdp(seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = net(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def train(
    model: nn.Module, opt: torch.optim.Optimizer, start: int, steps: int, rank: int
) -> list[float]:
    return zero_setup.train(model, opt, start, steps, rank, batch_of=batch)


def full_state(
    model: nn.Module, opt: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """torch's own gathered view: the reference every load is compared with."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=options)
    return copy.deepcopy(msd), copy.deepcopy(osd)


def save_run(rank: int, world: int, path: str, layout: str) -> Any:
    model = fsdp(0)
    opt = adamw(model)
    train(model, opt, 0, 3, rank)
    shardsafe.save(path, {"model": model, "optimizer": opt}, layout=layout)
    msd, osd = full_state(model, opt)
    return msd, osd, train(model, opt, 3, 5, rank)


def load_run(rank: int, world: int, path: str, steps: int) -> Any:
    model = fsdp(1)
    opt = adamw(model)
    shardsafe.load(path, {"model": model, "optimizer": opt})
    msd, osd = full_state(model, opt)
    return msd, osd, train(model, opt, 3, steps, rank)


def plain_run(rank: int, world: int, path: str) -> Any:
    assert not torch.distributed.is_initialized()
    model = net(1)
    opt = adamw(model)
    shardsafe.load(path, {"model": model, "optimizer": opt})
    return {k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict())


def assert_same_model(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def fqn_optimizer_state(osd: dict[str, Any]) -> dict[str, Any]:
    """get_state_dict keys optimizer state by FQN; turn it into positions for comparison."""
    names = [n for g in osd["param_groups"] for n in g["params"]]
    index = {n: i for i, n in enumerate(names)}
    return {
        "state": {index[n]: s for n, s in osd["state"].items()},
        "param_groups": [
            {**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]
        ],
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp_round_trip_same_and_other_world_sizes_and_plain(tmp_path: Path, layout: str) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_run, 2, path, layout)
    msd, osd, _ = saved[0]

    resumed = run_ranks(load_run, 2, path, 5)
    assert [r[2] for r in resumed] == [s[2] for s in saved]  # next losses bitwise, per rank
    assert_same_model(resumed[0][0], msd)

    for world in (3, 4):
        got_msd, got_osd, _ = run_ranks(load_run, world, path, 0)[0]
        assert_same_model(got_msd, msd)
        assert_same_optimizer_state(fqn_optimizer_state(got_osd), fqn_optimizer_state(osd))

    weights, plain_osd = run_ranks(plain_run, 1, path, init_process_group=False)[0]
    assert_same_model(weights, msd)
    assert_same_optimizer_state(plain_osd, fqn_optimizer_state(osd))


def test_sharded_layout_records_each_ranks_shard_with_offsets(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_ranks(save_run, 2, str(path), "sharded")
    record = shardsafe.read_manifest(path).tensors["model/0.weight"]
    assert record.shape == (10, 6)
    assert sorted((c.file, c.offsets, c.shape) for c in record.chunks) == [
        ("shard-00000-of-00002.safetensors", (0, 0), (5, 6)),
        ("shard-00001-of-00002.safetensors", (5, 0), (5, 6)),
    ]


def test_consolidated_fsdp_model_loads_with_plain_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = tmp_path / "ckpt"
    msd = run_ranks(save_run, 2, str(path), "consolidated")[0][0]
    model = net(5)
    model.load_state_dict(load_file(path / "model.safetensors"))
    assert_same_model(model.state_dict(), msd)


def ddp_run(rank: int, world: int, path: str, save: bool) -> Any:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = net(0 if save else 1)
    wrapped = DDP(model)
    opt = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1
    )
    if save:
        train(wrapped, opt, 0, 3, rank)
        shardsafe.save(path, {"model": wrapped, "optimizer": opt})
    else:
        shardsafe.load(path, {"model": wrapped, "optimizer": opt})
    opt.consolidate_state_dict(to=0)
    state = copy.deepcopy(opt.state_dict()) if rank == 0 else None
    return {k: v.clone() for k, v in model.state_dict().items()}, state


def test_fsdp_save_loads_into_ddp_with_zero(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    msd, osd, _ = run_ranks(save_run, 2, path, "sharded")[0]
    weights, state = run_ranks(ddp_run, 2, path, False)[0]
    assert_same_model(weights, msd)
    assert_same_optimizer_state(state, fqn_optimizer_state(osd))


def test_zero_save_loads_into_fsdp(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    weights, state = run_ranks(ddp_run, 2, path, True)[0]
    for world in (2, 3):
        got_msd, got_osd, _ = run_ranks(load_run, world, path, 0)[0]
        assert_same_model(got_msd, weights)
        assert_same_optimizer_state(fqn_optimizer_state(got_osd), state)


def resharded_run(rank: int, world: int, root: str) -> str:
    """One DTensor saved as Shard(0), then the same values as Shard(1) and replicated:
    each save must write the geometry the tensor has now, not the one seen first."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    rows = distribute_tensor(full, mesh, [Shard(0)])
    for name, value in [
        ("rows", rows),
        ("cols", rows.redistribute(mesh, [Shard(1)])),
        ("whole", rows.redistribute(mesh, [Replicate()])),
        ("rows-again", rows),
    ]:
        shardsafe.save(f"{root}/{name}", {"values": {"t": value}})
    partial = DTensor.from_local(full / world, mesh, [Partial()])
    try:
        shardsafe.save(f"{root}/partial", {"values": {"t": partial}})
    except shardsafe.CheckpointError as e:
        return str(e)
    return "saved"


def test_each_save_writes_the_dtensor_geometry_it_has_now(tmp_path: Path) -> None:
    message = run_ranks(resharded_run, 2, str(tmp_path))[0]
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for name in ("rows", "cols", "whole", "rows-again"):
        got = run_ranks(plain_load_run, 1, str(tmp_path / name))[0]
        assert torch.equal(got, full), name
    assert "is a DTensor with a Partial placement" in message
    assert "'values/t'" in message


def plain_load_run(rank: int, world: int, path: str) -> torch.Tensor:
    values: torch.Tensor = shardsafe.load(path, {})["values"]["t"]
    return values


def app_run(rank: int, world: int, path: str, save: bool) -> Any:
    model = fsdp(0 if save else 1)
    opt = adamw(model)
    if save:
        train(model, opt, 0, 3, rank)
        shardsafe.save(path, {"app": AppState(model, opt)})
    else:
        shardsafe.load(path, {"app": AppState(model, opt)})
    return full_state(model, opt)


def test_a_stateful_wrapper_of_an_fsdp2_model_loads_its_shards_as_dtensors(
    tmp_path: Path,
) -> None:
    """A stateful object whose state holds DTensors (DCP's ``AppState`` pattern) gets each
    rank's shards back as DTensors placed like its live ones, at any world size: it used
    to get every tensor whole and plain, and ``set_state_dict`` failed with torch's "got
    mixed torch.Tensor and DTensor"."""
    path = str(tmp_path / "ckpt")
    msd, osd = run_ranks(app_run, 2, path, True)[0]
    for world in (2, 3):
        got_msd, got_osd = run_ranks(app_run, world, path, False)[0]
        assert_same_model(got_msd, msd)
        assert_same_optimizer_state(fqn_optimizer_state(got_osd), fqn_optimizer_state(osd))


TABLE = torch.arange(21, dtype=torch.float32).reshape(7, 3)
"""7 rows: uneven over 2 and 3 ranks."""


def table_run(rank: int, world: int, path: str, save: bool) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    if save:
        shardsafe.save(path, {"table": distribute_tensor(TABLE, mesh, [Shard(0)])})
        return True
    live = distribute_tensor(torch.zeros(7, 3), mesh, [Shard(1)])
    shardsafe.load(path, {"table": live})
    return torch.equal(live.full_tensor(), TABLE)


def test_a_dtensor_passed_as_a_plain_entry_is_filled_in_place_with_its_shard(
    tmp_path: Path,
) -> None:
    """``{"table": dtensor}``: each rank reads its own box into its live shard (it used to
    read the whole tensor and fail copying it into the DTensor, "got mixed torch.Tensor
    and DTensor")."""
    path = str(tmp_path / "ckpt")
    run_ranks(table_run, 2, path, True)
    for world in (2, 3):
        assert run_ranks(table_run, world, path, False) == [True] * world


def tied_fsdp_strategy_run(rank: int, world: int, path: str) -> list[float]:
    from shardsafe.strategies.base import Environment
    from shardsafe.strategies.fsdp import FSDPStrategy
    from tests.unit.test_optimizer_kinds import Tied, tied_steps

    torch.manual_seed(0)
    model = FSDPStrategy(Environment(rank=rank, world_size=world)).wrap_model(Tied(True))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    losses = tied_steps(model, opt, 2)  # the same batches on every rank
    shardsafe.save(path, {"model": model, "optimizer": opt})
    return losses


def untied_into_tied_fsdp_run(rank: int, world: int, path: str) -> tuple[str, bool]:
    """Save an FSDP2 model whose head is untied from its embedding, then load it into
    the tied model: the refusal's text, and whether the live weights stayed as they were."""
    from shardsafe.strategies.base import Environment
    from shardsafe.strategies.fsdp import FSDPStrategy
    from tests.unit.test_optimizer_kinds import Tied

    strategy = FSDPStrategy(Environment(rank=rank, world_size=world))
    torch.manual_seed(0)
    untied = Tied(True)
    untied.head.weight = nn.Parameter(untied.emb.weight.detach() + 1)
    shardsafe.save(path, {"model": strategy.wrap_model(untied)})
    tied = strategy.wrap_model(Tied(True))
    before = {k: v.full_tensor() for k, v in tied.state_dict().items()}
    try:
        shardsafe.load(path, {"model": tied})
    except shardsafe.CheckpointMismatchError as e:
        said = str(e)
    else:
        said = "loaded"
    after = tied.state_dict()
    return said, all(torch.equal(after[k].full_tensor(), v) for k, v in before.items())


def test_an_untied_fsdp2_checkpoint_is_refused_by_the_tied_model_on_every_rank(
    tmp_path: Path,
) -> None:
    """Each rank holds a shard of the tied weight; the keys' chunks are the same boxes
    with other checksums, so every rank refuses the same way and restores nothing."""
    results = run_ranks(untied_into_tied_fsdp_run, 2, str(tmp_path / "ckpt"))
    said = (
        "the checkpoint holds different values for 'model/emb.weight' and "
        "'model/head.weight', which the objects being loaded tie"
    )
    # Whichever rank's refusal the agreement reports first, both ranks refused.
    first = results[0][0].split("): ", 1)
    assert first[0] in (
        "load failed on rank 0 (rank(s) 1 failed too",
        "load failed on rank 1 (rank(s) 0 failed too",
    )
    assert [(text, kept) for text, kept in results] == [(results[0][0], True)] * 2
    assert first[1].split(" (one tensor")[0] == said


def test_the_fsdp_strategy_shards_a_model_with_tied_weights(tmp_path: Path) -> None:
    # Embedding and output layer share one weight: wrapping each module that owns
    # parameters put it in two FSDP units, and fully_shard refused it ("shared with a
    # parameter already managed by another FSDP group"), so no tied LM could train.
    from tests.unit.test_optimizer_kinds import tied, tied_steps

    results = run_ranks(tied_fsdp_strategy_run, 2, str(tmp_path / "ckpt"))
    model, opt = tied(0, emb_first=True, steps=0)
    want = tied_steps(model, opt, 2)  # one process, the same batches
    assert results[0] == results[1] == pytest.approx(want, rel=1e-5)
    loaded, loaded_opt = tied(1, emb_first=True, steps=0)
    shardsafe.load(tmp_path / "ckpt", {"model": loaded, "optimizer": loaded_opt})
    assert loaded.emb.weight is loaded.head.weight
    for name, value in model.state_dict().items():
        assert torch.allclose(loaded.state_dict()[name], value, atol=1e-6), name
    assert sorted(loaded_opt.state[loaded.emb.weight]) == ["exp_avg", "exp_avg_sq", "step"]


def dcp_style_run(rank: int, world: int, path: str, save: bool) -> Any:
    """DCP's own idiom: ``get_state_dict``'s dicts in a plain dict, filled in place (the
    DTensor shards, and the learning rate and step beside them), then handed to
    ``set_state_dict``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    model = fsdp(0 if save else 1)
    opt = adamw(model)
    if save:
        train(model, opt, 0, 3, rank)
        opt.param_groups[0]["lr"] = 0.00125  # as a scheduler leaves it
        msd, osd = get_state_dict(model, opt)
        shardsafe.save(path, {"model": msd, "optim": osd, "step": 3})
        return full_state(model, opt), 3
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    values = shardsafe.load(path, state)
    assert all(values["model"][k] is msd[k] for k in msd)  # the live DTensors, handed back
    assert all(isinstance(v, DTensor) for v in values["model"].values())
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    return full_state(model, opt), state["step"]


def test_a_sharded_state_dict_in_a_plain_dict_is_filled_shard_by_shard(tmp_path: Path) -> None:
    """``shardsafe.load(path, {"model": msd, "optim": osd})`` of ``get_state_dict``'s
    dicts returned the values and left the live DTensors as they were: the model and
    optimizer restored nothing, in silence. Each rank's shards are now read into them,
    at any world size, and the dicts' other values (the learning rate, a step) set from
    the checkpoint, as ``dcp.load`` sets them."""
    path = str(tmp_path / "ckpt")
    (msd, osd), _ = run_ranks(dcp_style_run, 2, path, True)[0]
    for world in (2, 3):
        (got_msd, got_osd), step = run_ranks(dcp_style_run, world, path, False)[0]
        assert_same_model(got_msd, msd)
        assert_same_optimizer_state(fqn_optimizer_state(got_osd), fqn_optimizer_state(osd))
        assert got_osd["param_groups"][0]["lr"] == 0.00125 and step == 3
