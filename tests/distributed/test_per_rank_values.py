"""Values whose structure is the same on every rank but whose contents are not, on real
gloo ranks: a per-rank sampler's generator, a model wrapper's BatchNorm statistics, a
plain tensor, a module's extra state.

shardsafe records such a value once. A plain value comes back as rank 0's, whichever
rank the plan balances writes to; module extra state that differs between ranks is
refused at save, nothing written (before, it came back as the lowest rank's on every
rank). A stateful object's tensors are stored once: a per-rank generator is refused only
with ``verify_replicas=True`` (its bytes look like a model wrapper's buffers, which must
save: DCP's ``AppState`` pattern around a DDP model with BatchNorm).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.errors import CheckpointError
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


def _save_samplers(rank: int, world: int, path: str, per_rank: bool) -> Any:
    sampler = Sampler(1234 + rank if per_rank else 1234)
    sampler.draw()
    model = nn.Linear(2, 2)
    if per_rank:
        return _refused(path, {"model": model, "sampler": sampler}, verify_replicas=True)
    shardsafe.save(path, {"model": model, "sampler": sampler})
    return sampler.draw()


def _load_sampler(rank: int, world: int, path: str) -> list[int]:
    sampler = Sampler(0)
    shardsafe.load(path, {"model": nn.Linear(2, 2), "sampler": sampler})
    return sampler.draw()


def test_verify_replicas_refuses_a_per_rank_sampler_generator_and_says_what_to_do(
    tmp_path: Any,
) -> None:
    path = str(tmp_path / "ckpt")
    errors = run_ranks(_save_samplers, 2, path, True)
    assert errors[0] == errors[1]
    assert "the copies of 'sampler/generator' differ between ranks: rank 0 holds one version, " \
        "rank 1 another" in errors[0]  # fmt: skip
    assert "state each rank keeps for itself (a sampler's generator" in errors[0]
    assert errors[0].endswith("nothing was written")
    assert not os.path.exists(path)


def test_a_sampler_seeded_alike_on_every_rank_saves_once_and_every_rank_gets_it_back(
    tmp_path: Any,
) -> None:
    path = str(tmp_path / "ckpt")
    after_save = run_ranks(_save_samplers, 2, path, False)
    assert after_save[0] == after_save[1]
    assert run_ranks(_load_sampler, 2, path) == after_save
    assert _load_sampler(0, 1, path) == after_save[0]


class AppState:
    """DCP's tutorial wrapper: model and optimizer behind one state_dict()."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )


def _save_app(rank: int, world: int, path: str) -> torch.Tensor:
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)  # each rank its own batch: BatchNorm's statistics differ
    ddp(torch.randn(8, 4)).sum().backward()
    opt.step()
    shardsafe.save(path, {"app": AppState(ddp, opt)})
    return ddp.module.state_dict()["1.running_mean"].clone()


def test_a_model_wrapper_whose_batchnorm_statistics_differ_per_rank_saves(tmp_path: Any) -> None:
    """The pattern of DCP's tutorial and torchtitan: refusing it (as a first version of
    the per-rank check did) would break every such run."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_app, 2, path)
    assert not torch.equal(saved[0], saved[1])  # each rank's own statistics
    assert os.path.exists(os.path.join(path, "manifest.json"))


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
