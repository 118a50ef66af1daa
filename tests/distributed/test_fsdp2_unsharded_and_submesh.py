"""Two states torch's own checkpointing copes with: FSDP2 modules left unsharded (after an
eval forward of a root that holds parameters, or any forward with
``reshard_after_forward=False``), and a DTensor on a sub-mesh also held by the ranks
outside its mesh (torch gives them an empty local tensor)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)


class Net(nn.Module):
    """A root holding parameters of its own (as torchtitan's holds the embedding and the
    output head): FSDP2 leaves the root unsharded after a forward under ``no_grad``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Linear(5, 6)
        self.block = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(self.emb(x))))


def fsdp(seed: int, **options: Any) -> Net:
    """``fully_shard`` as torchtitan applies it: by default the root is not resharded
    after a forward (its parameters are needed again at once for the backward)."""
    from torch.distributed.fsdp import fully_shard

    model = Net(seed)
    fully_shard(model.block, **options)
    fully_shard(model, **options)
    return model


def step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def unsharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return not all(isinstance(p, DTensor) for p in model.parameters())


def reshard(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for sub in model.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of every parameter and optimizer state tensor, by name."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = local_of(p)
        for key, value in opt.state[p].items():
            out[f"{name}/{key}"] = local_of(value)
    return out


def local_of(value: torch.Tensor) -> torch.Tensor:
    """A copy of this rank's shard; outside the DTensor's mesh, where torch computes
    nothing, its dtype only (torch gives such a rank an empty local tensor, or, from an
    operation on a 0-dim one, a 0-dim local tensor that is never written)."""
    if not hasattr(value, "to_local"):
        return value.detach().clone()
    local = value.to_local().detach()
    if value.device_mesh.get_coordinate() is None:
        return local.new_empty(0)
    return local.clone()


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def unsharded_run(rank: int, world: int, root: str) -> None:
    model = fsdp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt, 0)
    step(model, opt, 1)
    with torch.no_grad():
        model(torch.randn(3, 5))  # an eval forward: the root stays unsharded
    assert unsharded(model)
    shardsafe.save(f"{root}/eval", {"model": model, "optimizer": opt})
    with torch.no_grad():
        model(torch.randn(3, 5))
    reshard(model)  # what a user had to do before
    assert not unsharded(model)
    shardsafe.save(f"{root}/resharded", {"model": model, "optimizer": opt})
    want = local_state(model, opt)
    if rank == 0:  # the same bytes either way
        for name in ("shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"):
            eval_bytes = Path(root, "eval", name).read_bytes()
            assert eval_bytes == Path(root, "resharded", name).read_bytes(), name
    step(model, opt, 2)  # training goes on after a save that resharded

    # A load into a model left unsharded by a forward with reshard_after_forward=False.
    other = fsdp(1, reshard_after_forward=False)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    step(other, other_opt, 9)
    other(torch.randn(2, 5))
    assert unsharded(other)
    shardsafe.load(f"{root}/eval", {"model": other, "optimizer": other_opt})
    assert_bitwise(local_state(other, other_opt), want)


def test_fsdp2_unsharded_by_a_forward_saves_and_loads_as_if_resharded(tmp_path: Path) -> None:
    run_ranks(unsharded_run, 2, str(tmp_path), timeout=120)


SHAPES = [("rows", (5, 3)), ("whole", (4, 3)), ("scale", ()), ("bias", (4,)), ("cols", (2, 3))]


def submesh_model(seed: int) -> nn.Module:
    """DTensors on the meshes of ranks [0, 1] and [2, 3], every one held by all 4 ranks:
    sharded unevenly (5 rows over 2), replicated, 1-dim, 0-dim."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    low, high = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])
    g = torch.Generator().manual_seed(seed)
    model = nn.Module()
    meshes = [(low, Shard(0)), (low, Replicate()), (low, Replicate()), (high, Replicate())]
    meshes.append((high, Shard(1)))
    for (name, shape), (mesh, placement) in zip(SHAPES, meshes):
        full = torch.randn(shape, generator=g)
        model.register_parameter(name, nn.Parameter(distribute_tensor(full, mesh, [placement])))
    return model


def table(seed: int) -> torch.Tensor:
    """A DTensor passed as a state entry of its own, on the mesh of ranks [2, 3]."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.randn(6, 2, generator=torch.Generator().manual_seed(seed))
    return distribute_tensor(full, DeviceMesh("cpu", [2, 3]), [Shard(0)])


def set_grads(model: nn.Module) -> None:
    from torch.distributed.tensor import distribute_tensor

    for p in model.parameters():
        full = torch.full(p.shape, 0.5)
        p.grad = distribute_tensor(full, p.device_mesh, list(p.placements))


def stepped(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """:func:`submesh_model` and :func:`table` of ``seed``, an AdamW step taken."""
    model, values = submesh_model(seed), table(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    set_grads(model)
    opt.step()
    return model, opt, values


def submesh_run(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    """Saves and loads on 4 ranks; returns the saved parameters of this rank's mesh, whole."""
    model, opt, values = stepped(0)
    shardsafe.save(path, {"model": model, "optimizer": opt, "table": values})
    want = local_state(model, opt)
    want["table"] = local_of(values)
    saved = {
        name: p.detach().full_tensor()
        for name, p in model.named_parameters()
        if p.device_mesh.get_coordinate() is not None
    }

    model, opt, values = stepped(1)
    shardsafe.load(path, {"model": model, "optimizer": opt, "table": values})
    got = local_state(model, opt)
    got["table"] = local_of(values)
    assert_bitwise(got, want)  # outside a mesh: still its empty local tensor
    assert model.rows.to_local().shape == ((3, 3), (2, 3), (0,), (0,))[rank]
    set_grads(model)
    opt.step()  # training goes on, outside the meshes too
    return {**saved, "stray": stray_refused(rank, path)}


def stray_refused(rank: int, path: str) -> str:
    """A module whose DTensor on the mesh of ranks [0, 1] only ranks 2 and 3 hold: no rank
    in its mesh offers it, so no rank stores it. It was saved, named by the module, and
    loaded nowhere; the save refuses it, on every rank."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = nn.Module()
    model.register_buffer("n", torch.ones(1))
    if rank >= 2:
        tensor = distribute_tensor(torch.ones(4, 2), DeviceMesh("cpu", [0, 1]), [Shard(0)])
        model.register_parameter("w", nn.Parameter(tensor))
    else:
        DeviceMesh("cpu", [0, 1])  # a collective: every rank makes it
    with pytest.raises(shardsafe.CheckpointError) as refused:
        shardsafe.save(f"{path}-stray", {"model": model})
    assert not os.path.exists(f"{path}-stray/manifest.json")
    return str(refused.value)


def test_dtensors_on_a_sub_mesh_held_outside_it_save_and_load_bitwise(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    saved = run_ranks(submesh_run, 4, str(path), timeout=120)
    manifest = shardsafe.read_manifest(path)
    rows = manifest.tensors["model/rows"]
    assert sorted((c.offsets, c.shape) for c in rows.chunks) == [((0, 0), (3, 3)), ((3, 0), (2, 3))]
    (whole,) = manifest.tensors["model/whole"].chunks  # once, by a rank in its mesh
    assert whole.file in ("shard-00000-of-00004.safetensors", "shard-00001-of-00004.safetensors")
    strays = {got.pop("stray") for got in saved}
    assert strays == {
        "save failed on rank 0: refusing to save a checkpoint that shardsafe could not load "
        "back: state entry 'model' refers to 1 tensor: 'model/w' that the checkpoint does not "
        "hold (nothing was written)"
    }, strays
    plain = nn.Module()  # one process, no group: every tensor whole
    want = {**saved[0], **saved[2]}
    assert sorted(want) == sorted(name for name, _ in SHAPES)
    for name, value in want.items():
        plain.register_parameter(name, nn.Parameter(torch.zeros_like(value)))
    shardsafe.load(path, {"model": plain}, strict=False)
    assert_bitwise({n: p.detach() for n, p in plain.named_parameters()}, want)
