"""Bridges to torch's optimizer format: a pickle-free gather, and importing files written the
old way (consolidate_state_dict + torch.save, or a Lightning checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.interop import gather_optimizer_state_dict, import_torch_checkpoint
from tests.distributed.zero_setup import (
    assert_same_optimizer_state,
    build,
    torch_consolidated,
    train,
)
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def gather_run(rank: int, world: int, kind: str) -> Any:
    model, wrapped, opt = build(kind, seed=0)
    train(wrapped, opt, 0, 3, rank)
    ours = gather_optimizer_state_dict(opt, model, to=0)
    return ours, torch_consolidated(opt, rank)


@pytest.mark.parametrize("kind", ["zero", "oss"])
def test_gather_equals_torch_consolidation_on_one_rank_only(kind: str) -> None:
    (ours, theirs), (other, _) = run_ranks(gather_run, 2, kind)
    assert other is None
    assert_same_optimizer_state(ours, theirs)


def old_way_save(rank: int, world: int, directory: str) -> Any:
    model, wrapped, opt = build("zero", seed=0)
    train(wrapped, opt, 0, 3, rank)
    reference = torch_consolidated(opt, rank)  # consolidates on rank 0
    if rank == 0:
        torch.save(opt.state_dict(), f"{directory}/zero.pt")
        lightning = {
            "epoch": 0,
            "global_step": 3,
            "pytorch-lightning_version": "2.4.0",
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "optimizer_states": [opt.state_dict()],
            "lr_schedulers": [],
        }
        torch.save(lightning, f"{directory}/lightning.ckpt")
        return reference, {k: v.clone() for k, v in model.state_dict().items()}
    return None


def old_way_import(rank: int, world: int, file: str, prefix: str | None) -> Any:
    model, _, opt = build("zero", seed=1)
    import_torch_checkpoint(file, opt, model, model_prefix=prefix)
    return torch_consolidated(opt, rank), {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world", [2, 3])
def test_import_of_torch_save_and_lightning_checkpoints(tmp_path: Path, world: int) -> None:
    reference, weights = run_ranks(old_way_save, 2, str(tmp_path))[0]
    state, _ = run_ranks(old_way_import, world, str(tmp_path / "zero.pt"), None)[0]
    assert_same_optimizer_state(state, reference)
    state, loaded = run_ranks(old_way_import, world, str(tmp_path / "lightning.ckpt"), "model.")[0]
    assert_same_optimizer_state(state, reference)
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


class NotPlainData:
    pass


def test_import_refuses_files_that_need_unpickling_of_objects(tmp_path: Path) -> None:
    file = tmp_path / "evil.pt"
    torch.save({"state": {}, "param_groups": [], "payload": NotPlainData()}, file)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(shardsafe.CheckpointError, match="weights_only=True"):
        import_torch_checkpoint(file, opt, model)


def test_gather_in_a_single_process_is_the_optimizers_own_state_dict() -> None:
    """No process group: the helper still works (rank 0 of 1) and returns exactly what
    ``optimizer.state_dict()`` returns, so code written for a job runs in a notebook."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters(), "lr": 0.01}, {"params": model[1].parameters()}],
        lr=0.1,
        weight_decay=0.05,
    )
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert_same_optimizer_state(gather_optimizer_state_dict(opt, model), opt.state_dict())
    with pytest.raises(ValueError, match=r"to=1 is not a rank of this job \(world size 1\)"):
        gather_optimizer_state_dict(opt, model, to=1)


def _adam(seed: int) -> tuple[torch.nn.Linear, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    return model, opt


def test_a_state_tensor_that_does_not_fit_its_parameter_is_refused_and_nothing_changes() -> None:
    """An exp_avg of 5 elements for a 2x2 weight loaded, and the next step() failed
    inside torch (with ZeRO, a rank kept it)."""
    from shardsafe.interop import load_optimizer_state_dict

    model, opt = _adam(0)
    bad = opt.state_dict()
    bad["state"][0] = {**bad["state"][0], "exp_avg": torch.zeros(5)}
    before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    with pytest.raises(shardsafe.CheckpointMismatchError) as caught:
        load_optimizer_state_dict(opt, model, bad)
    assert (
        str(caught.value) == "optimizer/weight/exp_avg: checkpoint float32[5], live float32[2, 2]"
    )
    assert all(torch.equal(v, before[k]) for k, v in opt.state[model.weight].items())
    with pytest.raises(ValueError, match=r"^state_dict must be an optimizer's state_dict"):
        load_optimizer_state_dict(opt, model, None)  # type: ignore[arg-type]
    # Refused by the optimizer's own load: the message names the dict given, not a
    # "manifest entry for 'optimizer'" that no checkpoint holds.
    bad = opt.state_dict()
    bad["state"][0] = {**bad["state"][0], "step": "x"}
    with pytest.raises(shardsafe.CheckpointCorruptError) as refused:
        load_optimizer_state_dict(opt, model, bad)
    assert str(refused.value) == (
        "the optimizer state in the state dict given is not valid state for the live Adam: "
        "ValueError: could not convert string to float: 'x'"
    )
    assert all(torch.equal(v, before[k]) for k, v in opt.state[model.weight].items())


def test_an_import_that_will_fail_changes_neither_the_model_nor_the_optimizer(
    tmp_path: Path,
) -> None:
    """With model_prefix, the weights were loaded first: a refused optimizer state (two
    groups against one) left the model changed; a weight of another shape raised torch's
    raw RuntimeError with the others already copied in."""
    model, opt = _adam(0)
    two_groups = opt.state_dict()
    two_groups["param_groups"] = [
        {**two_groups["param_groups"][0], "params": [0]},
        {**two_groups["param_groups"][0], "params": [1]},
    ]
    weights = {f"net.{k}": torch.full_like(v, 7.0) for k, v in model.state_dict().items()}
    torch.save({"optimizer_states": [two_groups], "state_dict": weights}, tmp_path / "a.ckpt")
    wide = {**weights, "net.weight": torch.zeros(3, 2)}
    torch.save({"optimizer_states": [opt.state_dict()], "state_dict": wide}, tmp_path / "b.ckpt")
    live, live_opt = _adam(1)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(shardsafe.CheckpointMismatchError, match="2 param group"):
        import_torch_checkpoint(tmp_path / "a.ckpt", live_opt, live, model_prefix="net.")
    with pytest.raises(shardsafe.CheckpointMismatchError) as caught:
        import_torch_checkpoint(tmp_path / "b.ckpt", live_opt, live, model_prefix="net.")
    assert str(caught.value) == (
        "the model does not match the checkpoint's weights (nothing was loaded): net.weight: "
        f"{tmp_path / 'b.ckpt'} holds shape [3, 2], the model [2, 2]"
    )
    assert all(torch.equal(v, before[k]) for k, v in live.state_dict().items())
    for index in (-1, "0"):
        with pytest.raises(ValueError, match="must be an int, 0 or more"):
            import_torch_checkpoint(tmp_path / "a.ckpt", live_opt, live, optimizer_index=index)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^to='0' is not a rank of this job"):
        gather_optimizer_state_dict(live_opt, live, to="0")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("saved", "said"),
    [
        ({"state": {}, "param_groups": [{"lr": 0.1}]}, "param group 0 of the state dict is not"),
        ({"state": {}, "param_groups": [1]}, "param group 0 of the state dict is not"),
        ({"state": [1], "param_groups": [{"params": [0, 1]}]}, "the state dict's 'state' is not"),
        (
            {"state": {0: 5}, "param_groups": [{"params": [0, 1]}]},
            "the state dict's 'state' is not",
        ),
    ],
    ids=["group-without-params", "group-not-a-dict", "state-not-a-dict", "state-of-an-int"],
)
def test_a_malformed_optimizer_state_dict_is_refused_by_name(
    tmp_path: Path, saved: dict[str, Any], said: str
) -> None:
    """A file whose optimizer state is not shaped as state_dict() gives: raw KeyError,
    TypeError and AttributeError before, from inside the import."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    torch.save(saved, tmp_path / "opt.pt")
    with pytest.raises(shardsafe.CheckpointMismatchError, match=said):
        import_torch_checkpoint(tmp_path / "opt.pt", optimizer, model)
    assert optimizer.state_dict()["state"] == {}
