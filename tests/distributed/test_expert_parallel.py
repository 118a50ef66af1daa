"""Expert parallelism, saved at one number of expert ranks and loaded at another, bitwise
(model and AdamW state), both ways experts are held (#26):

* one ``[E, D, D]`` parameter of every expert's weights, a DTensor sharded ``Shard(0)``
  over an ``ep`` mesh (each rank its experts' rows);
* plain per-rank modules named by global expert index (``experts.2`` lives on rank 1 of
  two), each rank with its own AdamW over its experts and the shared ``router``.

The ``router`` is replicated: its gradients are averaged over the ranks, as DDP would.
Each rank computes only its own experts' share of the output (the all-to-all of a real
MoE layer moves activations, not state).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardsafe
from tests.distributed import layouts as L
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)

E = 4
D = L.D


def _gated(x: torch.Tensor, gates: torch.Tensor, first: int, outs: list[torch.Tensor]) -> Any:
    """Experts ``first, first+1, ...`` (outputs ``outs``) weighted by their gates."""
    return sum(gates[:, first + i, None] * out for i, out in enumerate(outs))


class StackedMoE(nn.Module):
    """All experts' weights in one ``[E, D, D]`` parameter, whole or a ``Shard(0)`` DTensor."""

    def __init__(self, seed: int, mesh: Any = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.router = nn.Linear(D, E)
        weights = torch.randn(E, D, D) * 0.3
        if mesh is not None:
            from torch.distributed.tensor import Shard, distribute_tensor

            weights = distribute_tensor(weights, mesh, [Shard(0)])
        self.experts = nn.Parameter(weights)

    def forward(self, x: torch.Tensor) -> Any:
        gates = torch.softmax(self.router(x), dim=-1)
        w = self.experts
        local = w.to_local() if hasattr(w, "to_local") else w
        first = dist.get_rank() * local.shape[0] if local.shape[0] < E else 0
        return _gated(x, gates, first, [x @ local[i] for i in range(local.shape[0])])


class ExpertModules(nn.Module):
    """The experts ``mine`` as modules named by global index, and the shared router."""

    def __init__(self, seed: int, mine: list[int]) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.router = nn.Linear(D, E)
        every = [nn.Linear(D, D) for _ in range(E)]  # the same init for an expert anywhere
        self.experts = nn.ModuleDict({str(e): every[e] for e in mine})

    def forward(self, x: torch.Tensor) -> Any:
        gates = torch.softmax(self.router(x), dim=-1)
        first = min(int(e) for e in self.experts)
        return _gated(x, gates, first, [expert(x) for expert in self.experts.values()])


def _mine(rank: int, world: int) -> list[int]:
    per = E // world
    return list(range(rank * per, (rank + 1) * per))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        x, y = L.batch(step, 0)
        opt.zero_grad()
        L.loss_fn(model(x), y).backward()
        for p in model.router.parameters():  # type: ignore[union-attr]
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()


def _build(kind: str, seed: int, rank: int, world: int) -> nn.Module:
    if kind == "stacked":
        mesh = L.mesh((world,), ("ep",)) if world > 1 else None
        return StackedMoE(seed, mesh)
    return ExpertModules(seed, _mine(rank, world))


def _save(rank: int, world: int, kind: str, path: str) -> dict[str, Any]:
    model = _build(kind, 0, rank, world)
    opt = L.adamw(model)
    _train(model, opt, 2)
    shardsafe.save(path, {"model": model, "optimizer": opt}, verify_replicas=True)
    return L.snapshot(model, opt)


def _load(rank: int, world: int, kind: str, path: str) -> dict[str, Any]:
    model = _build(kind, 1, rank, world)
    opt = L.adamw(model)
    shardsafe.load(path, {"model": model, "optimizer": opt})
    return L.snapshot(model, opt)


@pytest.fixture(scope="module", params=["stacked", "modules"])
def ep2(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind = request.param
    path = tmp_path_factory.mktemp(kind) / "ckpt"
    return kind, path, run_ranks(_save, 2, kind, str(path))


def _expected(kind: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    if kind == "stacked":  # every rank gathered the whole state
        L.assert_same(ranks[0], ranks[1])
        return ranks[0]
    for key in ranks[0].keys() & ranks[1].keys():  # only the router is on both
        assert "router" in key, key
    return L.merged(*ranks)


def test_ep2_stores_each_expert_once_and_the_router_once(ep2: Any) -> None:
    kind, path, _ = ep2
    tensors = shardsafe.read_manifest(path).tensors
    for key in ("model/router.weight", "optimizer/router.weight/exp_avg_sq"):
        assert len(tensors[key].chunks) == 1, key
    if kind == "stacked":
        chunks = tensors["model/experts"].chunks
        assert sorted((c.offsets, c.shape) for c in chunks) == [
            ((0, 0, 0), (2, D, D)),
            ((2, 0, 0), (2, D, D)),
        ]
    else:
        files = {
            e: tensors[f"optimizer/experts.{e}.weight/exp_avg"].chunks[0].file for e in range(E)
        }
        assert files[0] == files[1] != files[2] == files[3]


def test_ep2_loads_into_ep4_one_expert_per_rank(ep2: Any) -> None:
    kind, path, ranks = ep2
    expected = _expected(kind, ranks)
    loaded = run_ranks(_load, 4, kind, str(path))
    if kind == "stacked":
        for snap in loaded:
            L.assert_same(expected, snap)
    else:
        for rank, snap in enumerate(loaded):
            assert {k for k in snap if "experts." in k} == {
                k for k in expected if f"experts.{rank}." in k
            }
            L.assert_same(expected, snap, only=set(snap))


def test_ep2_loads_into_one_process_with_every_expert(ep2: Any) -> None:
    kind, path, ranks = ep2
    expected = _expected(kind, ranks)
    model = _build(kind, 1, 0, 1)
    opt = L.adamw(model)
    shardsafe.load(path, {"model": model, "optimizer": opt})
    loaded = L.snapshot(model, opt)
    L.assert_same(expected, loaded)
    assert set(loaded) == set(expected)
