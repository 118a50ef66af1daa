"""Values whose structure is the same on every rank but whose contents are not, on real
gloo ranks: a per-rank sampler's generator, a model wrapper's BatchNorm statistics, a
plain tensor, a module's extra state.

A plain value comes back as rank 0's, whichever rank the plan balances writes to; module
extra state that differs between ranks is refused at save, nothing written (before, it
came back as the lowest rank's on every rank). A stateful object's small tensors that
differ between ranks (a per-rank generator; a model wrapper's BatchNorm statistics, DCP's
``AppState`` pattern) are stored per rank and come back to each rank (before, one copy
came back on every rank, silently); larger ones are stored once, and refused only with
``verify_replicas=True``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.errors import CheckpointError
from tests.distributed.layouts import AppState
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


class Sampler:
    """A data sampler keeping its generator's state, as samplers of a rank's shard do."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = 0

    def draw(self) -> list[int]:
        return torch.randint(0, 1000, (4,), generator=self.generator).tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.generator.set_state(state["generator"])


class Stage(nn.Module):
    """A pipeline stage's module reporting which stage it is as extra state."""

    def __init__(self, rank: int, tag: str) -> None:
        super().__init__()
        self.register_parameter(f"w{rank}", nn.Parameter(torch.full((3,), float(rank))))
        self.tag = tag

    def get_extra_state(self) -> dict[str, str]:
        return {"tag": self.tag}

    def set_extra_state(self, state: dict[str, str]) -> None:
        self.tag = state["tag"]


def _refused(path: str, state: dict[str, Any], **options: Any) -> str:
    """The save's error, or ``"saved"``."""
    try:
        shardsafe.save(path, state, **options)
    except CheckpointError as e:
        return str(e)
    return "saved"


def _save_samplers(
    rank: int, world: int, path: str, per_rank: bool, verify_replicas: bool = False
) -> Any:
    """Each rank's draws after the save (what a restored sampler must draw next)."""
    sampler = Sampler(1234 + rank if per_rank else 1234)
    sampler.draw()
    state = {"model": nn.Linear(2, 2), "sampler": sampler}
    shardsafe.save(path, state, verify_replicas=verify_replicas)
    return sampler.draw()


def _load_sampler(rank: int, world: int, path: str) -> list[int]:
    sampler = Sampler(0)
    shardsafe.load(path, {"model": nn.Linear(2, 2), "sampler": sampler})
    return sampler.draw()


@pytest.mark.parametrize("verify_replicas", [False, True])
def test_a_per_rank_sampler_generator_comes_back_as_each_ranks_own(
    tmp_path: Any, verify_replicas: bool
) -> None:
    """Before, one copy was stored and every rank drew rank 0's (or the writer's) numbers
    after a resume, silently; with verify_replicas the save was refused."""
    path = str(tmp_path / "ckpt")
    after_save = run_ranks(_save_samplers, 2, path, True, verify_replicas)
    assert after_save[0] != after_save[1]
    assert run_ranks(_load_sampler, 2, path) == after_save
    manifest = shardsafe.read_manifest(path)
    generator_keys = sorted(k for k in manifest.tensors if k.startswith("sampler/"))
    assert generator_keys == ["sampler/generator/@rank-00000", "sampler/generator/@rank-00001"]
    assert manifest.values["sampler"].meta == {
        "__per_rank__": {
            "shared": {"epoch": 0, "generator": {"__tensor__": "sampler/generator"}},
            "own": ["sampler/generator"],
        }
    }
    assert shardsafe.verify(path).ok


def _async_save_samplers(rank: int, world: int, path: str, layout: str, manager: bool) -> Any:
    sampler = Sampler(1234 + rank)
    sampler.draw()
    state = {"model": nn.Linear(2, 2), "sampler": sampler}
    if manager:  # the Trainer's path: a manager's background save
        checkpoints = shardsafe.CheckpointManager(path)
        checkpoints.async_save(1, state)
        checkpoints.close()
    else:
        shardsafe.async_save(path, state, layout=layout).wait()  # type: ignore[arg-type]
    return sampler.draw()


def _load_manager_sampler(rank: int, world: int, path: str) -> list[int]:
    sampler = Sampler(0)
    checkpoints = shardsafe.CheckpointManager(path)
    checkpoints.load_latest({"model": nn.Linear(2, 2), "sampler": sampler})
    checkpoints.close()
    return sampler.draw()


@pytest.mark.parametrize(
    ("layout", "manager"),
    [("consolidated", False), ("sharded", False), ("sharded", True)],
    ids=["async-consolidated", "async-sharded", "manager-async"],
)
def test_a_background_save_keeps_per_rank_generators_too(
    tmp_path: Any, layout: str, manager: bool
) -> None:
    """A background save may stage before it plans; the staged copies must keep what
    marks a small stateful tensor (once they did not, and one copy was stored)."""
    path = str(tmp_path / "ckpt")
    after_save = run_ranks(_async_save_samplers, 2, path, layout, manager)
    assert after_save[0] != after_save[1]
    load = _load_manager_sampler if manager else _load_sampler
    assert run_ranks(load, 2, path) == after_save


def test_a_per_rank_generator_loaded_at_another_world_size_is_rank_0s_with_a_warning(
    tmp_path: Any,
) -> None:
    path = str(tmp_path / "ckpt")
    after_save = run_ranks(_save_samplers, 2, path, True)
    with pytest.warns(UserWarning) as caught:
        assert _load_sampler(0, 1, path) == after_save[0]
    messages = [str(w.message) for w in caught if str(w.message).startswith("shardsafe: ")]
    assert messages == [
        "shardsafe: state['sampler'] held tensors that differed between the 2 saving ranks "
        "(a per-rank generator or counter); loading at world size 1, every rank restores "
        "saving rank 0's"
    ]
    # A converter's single value is rank 0's record too.
    out = str(tmp_path / "torch.pt")
    shardsafe.convert(path, out, to="torch", only=["sampler"])
    converted = torch.load(out, weights_only=True)
    restored = Sampler(0)
    restored.load_state_dict(converted["sampler"])
    assert restored.draw() == after_save[0]
    # So is a shardsafe checkpoint's: one record, as world size 1 writes it, loadable
    # anywhere (before, the records were copied as they were, and nothing loaded it).
    single = str(tmp_path / "single")
    planned = shardsafe.convert(path, single, to="shardsafe", dry_run=True)
    done = shardsafe.convert(path, single, to="shardsafe")
    # What is reported and planned is what is written: rank 1's copy is left behind.
    assert (planned.tensors, planned.tensor_bytes) == (done.tensors, done.tensor_bytes)
    assert planned.tensors == 3 and planned.files == done.files[:1]
    assert sorted(shardsafe.read_manifest(single).tensors) == [
        "model/bias", "model/weight", "sampler/generator/@rank-00000"
    ]  # fmt: skip
    assert _load_sampler(0, 1, single) == after_save[0]
    assert run_ranks(_load_sampler, 2, single) == [after_save[0]] * 2


class Holder:
    """A stateful object holding a DTensor (here replicated over the ranks)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def state_dict(self) -> dict[str, Any]:
        return {"d": self.tensor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tensor = state["d"]


def _save_replicated_dtensors(rank: int, world: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (world,))
    local = torch.full((4,), float(rank))  # diverged: a Replicate DTensor must be equal
    tensor = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    return _refused(path, {"h": Holder(tensor)}, verify_replicas=True)


def test_a_replicated_dtensor_that_diverged_is_refused_not_stored_per_rank(
    tmp_path: Any,
) -> None:
    """A Replicate DTensor is declared equal on every rank: copies that differ are a
    divergence for verify_replicas to catch, never a rank's own state."""
    path = str(tmp_path / "ckpt")
    errors = run_ranks(_save_replicated_dtensors, 2, path)
    assert errors[0] == errors[1]
    assert "the copies of 'h/d' differ between ranks: rank 0 holds one version" in errors[0]
    assert not os.path.exists(path)


def test_a_sampler_seeded_alike_on_every_rank_saves_once_and_every_rank_gets_it_back(
    tmp_path: Any,
) -> None:
    path = str(tmp_path / "ckpt")
    after_save = run_ranks(_save_samplers, 2, path, False)
    assert after_save[0] == after_save[1]
    assert run_ranks(_load_sampler, 2, path) == after_save
    assert _load_sampler(0, 1, path) == after_save[0]
    manifest = shardsafe.read_manifest(path)
    assert "sampler/generator" in manifest.tensors
    assert "__per_rank__" not in manifest.values["sampler"].meta


class Table:
    """A stateful object holding a tensor too large to be compared on every save."""

    def __init__(self, rank: int) -> None:
        self.table = torch.full((64 << 10,), float(rank))  # 256 KiB

    def state_dict(self) -> dict[str, Any]:
        return {"table": self.table}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.table.copy_(state["table"])


def _save_tables(rank: int, world: int, path: str) -> str:
    return _refused(path, {"table": Table(rank)}, verify_replicas=True)


def test_verify_replicas_refuses_large_stateful_tensors_that_differ_and_says_what_to_do(
    tmp_path: Any,
) -> None:
    path = str(tmp_path / "ckpt")
    errors = run_ranks(_save_tables, 2, path)
    assert errors[0] == errors[1]
    assert "the copies of 'table/table' differ between ranks: rank 0 holds one version, " \
        "rank 1 another" in errors[0]  # fmt: skip
    assert (
        "or it is state each rank keeps for itself, which shardsafe keeps per rank only for "
        "a stateful object's tensors of up to 64 KiB (a sampler's generator): hold larger "
        "per-rank state as a DTensor sharded over the ranks; nothing was written"
    ) in errors[0]
    assert errors[0].endswith("nothing was written")
    assert not os.path.exists(path)


def _save_app(rank: int, world: int, path: str) -> torch.Tensor:
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)  # each rank its own batch: BatchNorm's statistics differ
    ddp(torch.randn(8, 4)).sum().backward()
    opt.step()
    shardsafe.save(path, {"app": AppState(ddp, opt)})
    return ddp.module.state_dict()["1.running_mean"].clone()


def _load_app(rank: int, world: int, path: str) -> torch.Tensor:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shardsafe.load(path, {"app": AppState(model, opt)})
    return model.state_dict()[("module." if world > 1 else "") + "1.running_mean"].clone()


def test_a_model_wrapper_whose_batchnorm_statistics_differ_per_rank_saves(tmp_path: Any) -> None:
    """The pattern of DCP's tutorial and torchtitan: refusing it (as a first version of
    the per-rank check did) would break every such run. Each rank's statistics come back
    to it; at another world size, rank 0's (as DDP's next forward would broadcast)."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_app, 2, path)
    assert not torch.equal(saved[0], saved[1])  # each rank's own statistics
    loaded = run_ranks(_load_app, 2, path)
    assert all(torch.equal(a, b) for a, b in zip(loaded, saved))
    with pytest.warns(UserWarning, match="state\\['app'\\] held tensors that differed"):
        assert torch.equal(_load_app(0, 1, path), saved[0])


def _save_plain(rank: int, world: int, path: str, layout: str) -> None:
    # "big" loads rank 0 first, so a balanced plan would give "loss" to rank 1.
    state = {"big": torch.zeros(100), "loss": torch.tensor([10.0 + rank]), "step": rank}
    shardsafe.save(path, state, layout=layout)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_a_plain_tensor_keeps_rank_0s_value_like_the_rest_of_a_plain_value(
    tmp_path: Any, layout: str
) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(_save_plain, 2, path, layout)
    loaded = shardsafe.load(path, {"big": None, "loss": None, "step": None})
    assert loaded["step"] == 0
    assert torch.equal(loaded["loss"], torch.tensor([10.0]))


def _save_stages(rank: int, world: int, path: str, same: bool) -> str:
    return _refused(path, {"model": Stage(rank, "stage" if same else f"stage{rank}")})


def test_module_extra_state_that_differs_between_stages_is_refused_at_save(
    tmp_path: Any,
) -> None:
    path = str(tmp_path / "ckpt")
    errors = run_ranks(_save_stages, 2, path, False)
    assert errors[0] == errors[1]
    assert (
        "cannot save state['model']: the module's non-tensor state '_extra_state' differs "
        'between ranks 0 and 1 ({"tag": "stage0"} and {"tag": "stage1"}); it is recorded '
        "once, so one rank would get the other's back"
    ) in errors[0]
    assert not os.path.exists(path)
    assert run_ranks(_save_stages, 2, path, True) == ["saved", "saved"]
    manifest = shardsafe.read_manifest(path)
    assert manifest.values["model"].meta["extra"] == {"_extra_state": {"tag": "stage"}}
