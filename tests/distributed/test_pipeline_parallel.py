"""Pipeline-parallel state (stages split as torchtitan splits them, each with its own
optimizer and scheduler) saved once and loaded at other layouts, bitwise.

Before the ownership model merged every rank's metadata, a PP=2 save succeeded and loaded
nowhere: the manifest held rank 0's module keys and optimizer groups only.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.errors import CheckpointError
from tests.distributed import layouts as L
from tests.harness import RankFailed, run_ranks

pytestmark = pytest.mark.timeout(180)


def _save_pp(rank: int, world: int, path: str, steps: int) -> dict[str, Any]:
    """Train PP=``world`` for ``steps`` steps and save; return this stage's snapshot."""
    stage = L.stage_of(L.Net(), rank, world)
    opt = L.adamw(stage)
    sched = L.scheduler(opt)
    L.train_pipeline(stage, rank, world, opt, sched, steps)
    shardsafe.save(path, {"model": stage, "optimizer": opt, "scheduler": sched})
    return L.snapshot(stage, opt) | {"scheduler": sched.state_dict()}


def _load_pp(rank: int, world: int, path: str) -> dict[str, Any]:
    stage = L.stage_of(L.Net(seed=1), rank, world)
    opt = L.adamw(stage)
    sched = L.scheduler(opt)
    shardsafe.load(path, {"model": stage, "optimizer": opt, "scheduler": sched})
    return L.snapshot(stage, opt) | {"scheduler": sched.state_dict()}


def _load_whole(path: Path) -> dict[str, Any]:
    model = L.Net(seed=1)
    opt = L.adamw(model)
    sched = L.scheduler(opt)
    shardsafe.load(path, {"model": model, "optimizer": opt, "scheduler": sched})
    return L.snapshot(model, opt) | {"scheduler": sched.state_dict()}


@pytest.fixture(scope="module")
def pp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    path = tmp_path_factory.mktemp("pp2") / "ckpt"
    return path, run_ranks(_save_pp, 2, str(path), 3)


def test_pp2_checkpoint_records_every_stages_keys_and_groups(
    pp2: tuple[Path, list[dict[str, Any]]],
) -> None:
    path, _ = pp2
    values = json.loads((path / "manifest.json").read_text())["values"]
    names = set(values["model"]["meta"]["tensors"])
    assert {"tok.weight", "layers.0.lin.weight", "layers.3.lin.weight", "out.bias"} <= names
    assert {"layers.0.seen", "layers.3.seen"} <= names
    (group,) = values["optimizer"]["meta"]["param_groups"]  # equal hyperparameters: one group
    assert len(group["params"]) == 2 + 4 * 2 + 2


def test_pp2_loads_into_one_process_bitwise(pp2: tuple[Path, list[dict[str, Any]]]) -> None:
    path, stages = pp2
    loaded = _load_whole(path)
    expected = L.merged(*stages)
    scheduler = expected.pop("scheduler")
    assert_scheduler = loaded.pop("scheduler")
    L.assert_same(expected, loaded)
    assert set(loaded) == set(expected)  # nothing more: every key came from a stage
    assert assert_scheduler == scheduler


def test_pp2_loads_back_into_its_own_stages_and_into_pp4(
    pp2: tuple[Path, list[dict[str, Any]]],
) -> None:
    path, stages = pp2
    expected = L.merged(*stages)
    scheduler = expected.pop("scheduler")
    for world in (2, 4):
        loaded = run_ranks(_load_pp, world, str(path))
        for snap in loaded:
            assert snap.pop("scheduler") == scheduler  # the stages' schedulers are alike
            L.assert_same(expected, snap, only=set(snap))
        assert set(L.merged(*loaded)) == set(expected)


def _save_pp4(rank: int, world: int, path: str) -> dict[str, Any]:
    return _save_pp(rank, world, path, 2)


def test_pp4_saves_and_loads_into_pp2_and_one_process(tmp_path: Path) -> None:
    path = tmp_path / "pp4"
    stages = run_ranks(_save_pp4, 4, str(path))
    expected = L.merged(*stages)
    for snap in stages:
        snap.pop("scheduler")
    expected.pop("scheduler")
    loaded = run_ranks(_load_pp, 2, str(path))
    for snap in loaded:
        snap.pop("scheduler")
        L.assert_same(expected, snap, only=set(snap))
    whole = _load_whole(path)
    whole.pop("scheduler")
    L.assert_same(expected, whole)


def _load_stage_with_a_foreign_key(rank: int, world: int, path: str) -> None:
    stage = L.stage_of(L.Net(seed=1), rank, world)
    shardsafe.load(path, {"model": stage})


def test_a_key_no_stage_holds_is_still_unexpected(tmp_path: Path) -> None:
    """Stage 0 and stage 1 each hold half; a key neither holds is refused on every rank."""
    path = tmp_path / "c"
    model = L.Net(layers=6)  # layers.4 and layers.5: in the checkpoint, in no stage of 4
    shardsafe.save(path, {"model": model})
    with pytest.raises(RankFailed) as info:
        run_ranks(_load_stage_with_a_foreign_key, 2, str(path))
    text = info.value.text
    assert "unexpected in the checkpoint (held by no rank)" in text
    assert "model/layers.4.lin.weight" in text or "model/layers.4.lin.bias" in text
    assert "model/layers.0" not in text.split("unexpected")[1].split("\n")[0]


def _load_leaving_out_on_stage_1(rank: int, world: int, path: str, left_out: str) -> None:
    stage = L.stage_of(L.Net(seed=1), rank, world)
    opt = L.adamw(stage)
    state = {"model": stage, "optimizer": opt, "scheduler": L.scheduler(opt)}
    if rank == 1:
        state = {} if left_out == "everything" else {k: state[k] for k in state if k != left_out}
    shardsafe.load(path, state)


@pytest.mark.parametrize("left_out", ["optimizer", "everything"])
def test_a_stage_that_leaves_an_entry_out_of_a_strict_load_is_refused_on_every_rank(
    pp2: tuple[Path, list[dict[str, Any]]], left_out: str
) -> None:
    """Found in review: stage 1 passing no optimizer (or ``{}``) made the strict load
    succeed on every rank, stage 1's saved Adam state (or its weights too) held by no rank
    and skipped in silence: stage 1's empty list of unexpected keys emptied the
    intersection of the ranks' lists. An entry no rank passes still loads nothing."""
    path, _ = pp2
    with pytest.raises(RankFailed) as info:
        run_ranks(_load_leaving_out_on_stage_1, 2, str(path), left_out)
    text = info.value.text
    held, said = {
        "optimizer": ("(6): optimizer/layers.2.lin.bias;", "rank(s) 1 passed no 'optimizer'"),
        "everything": (
            "(14): model/layers.2.lin.bias;",
            "rank(s) 1 passed no 'model'; rank(s) 1 passed no 'optimizer'",
        ),
    }[left_out]
    assert (
        "load failed on rank 0: the checkpoint does not match the objects being loaded:\n"
        f"  unexpected in the checkpoint (held by no rank) {held}"
    ) in text, text
    assert (
        f"  ({said} to this load: pass each entry on every rank whose objects hold part of it)"
    ) in text


def _tiered(base: str) -> shardsafe.TieredCheckpointManager:
    local = os.path.join(base, "local")
    return shardsafe.TieredCheckpointManager(base, local, local_every=1, persist_every=None)


def _save_stage_to_the_local_tier(rank: int, world: int, base: str) -> None:
    stage = L.stage_of(L.Net(), rank, world)
    opt = L.adamw(stage)
    with contextlib.closing(_tiered(base)) as manager:
        manager.save(1, {"model": stage, "optimizer": opt})
        manager.wait()


def _restore_stage_from_the_local_tier(rank: int, world: int, base: str, case: str) -> None:
    stage = L.stage_of(L.Net(seed=1), rank, world)
    if case == "a layer gone" and rank == 0:
        del stage.layers["0"]
    opt = L.adamw(stage)
    state = {"model": stage, "optimizer": opt}
    if case == "optimizer left out" and rank == 1:
        state = {"model": stage}
    with contextlib.closing(_tiered(base)) as manager:
        manager.load_latest(state)


@pytest.mark.parametrize("case", ["optimizer left out", "a layer gone"])
def test_a_stage_restoring_less_than_its_own_local_copy_holds_is_refused(
    tmp_path: Path, case: str
) -> None:
    """Found in review: each rank restores its own local copy, so a key of rank 0's copy
    is never listed by rank 1, and intersecting the ranks' unexpected keys skipped it in
    silence: a stage's saved Adam state (or a layer's weights) dropped by a strict
    ``load_latest`` that ``shardsafe.load`` refuses."""
    base = str(tmp_path)
    run_ranks(_save_stage_to_the_local_tier, 2, base)
    with pytest.raises(RankFailed) as info:
        run_ranks(_restore_stage_from_the_local_tier, 2, base, case)
    said = {
        "optimizer left out": (
            "(rank 1 passed no 'optimizer': each rank restores its own copy, which holds "
            "that entry; pass it on every rank, or on none)"
        ),
        "a layer gone": (
            "unexpected in the checkpoint (held by no rank) (5): model/layers.0.lin.bias "
            "(rank 0); model/layers.0.lin.weight (rank 0);"
        ),
    }[case]
    assert said in info.value.text, info.value.text


def _save_conflicting_shapes(rank: int, world: int, path: str) -> None:
    model = L.Net(layers=2)
    if rank == 1:  # the same name, another tensor: no single checkpoint describes both
        model.layers["1"].lin = torch.nn.Linear(L.D, L.D + 1)
    shardsafe.save(path, {"model": model})


def _save_conflicting_groups(rank: int, world: int, path: str) -> None:
    model = L.Net(layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2 * (rank + 1))
    shardsafe.save(path, {"model": model, "optimizer": opt})


def _save_stage_lr_tensors(rank: int, world: int, path: str) -> None:
    """Stages with tensor-valued learning rates of their own: the groups' metadata is
    equal (a reference to the key ``optimizer/@groups/0/lr``), the tensors are not."""
    stage = L.stage_of(L.Net(), rank, world)
    opt = torch.optim.Adam(stage.parameters(), lr=torch.tensor(0.01 * (rank + 1)))
    shardsafe.save(path, {"model": stage, "optimizer": opt})


@pytest.mark.parametrize(
    ("save", "message"),
    [
        (_save_conflicting_shapes, "ranks disagree about tensor 'model/layers.1.lin.weight'"),
        (
            _save_conflicting_groups,
            "is in param group 0 on rank 1 and in param group 0 on rank 0, with other "
            "hyperparameters (lr=0.02 against lr=0.01)",
        ),
        (_save_stage_lr_tensors, "the copies of 'optimizer/@groups/0/lr' differ between ranks"),
    ],
)
def test_state_that_cannot_be_described_is_refused_before_anything_is_written(
    tmp_path: Path, save: Any, message: str
) -> None:
    path = tmp_path / "c"
    with pytest.raises(RankFailed) as info:
        run_ranks(save, 2, str(path))
    assert message in info.value.text
    assert not path.exists() or sorted(p.name for p in path.iterdir()) == []


def _save_per_stage_schedulers(rank: int, world: int, path: str) -> dict[str, Any]:
    stage = L.stage_of(L.Net(), rank, world)
    opt = L.adamw(stage)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5 + 0.1 * rank)
    L.train_pipeline(stage, rank, world, opt, sched, 2)
    shardsafe.save(path, {"model": stage, "optimizer": opt, "scheduler": sched})
    return {"scheduler": sched.state_dict(), "lr": opt.param_groups[0]["lr"]}


def _load_per_stage_schedulers(rank: int, world: int, path: str) -> dict[str, Any]:
    stage = L.stage_of(L.Net(seed=1), rank, world)
    opt = L.adamw(stage)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.0)
    shardsafe.load(path, {"model": stage, "optimizer": opt, "scheduler": sched})
    return {"scheduler": sched.state_dict(), "lr": opt.param_groups[0]["lr"]}


def _load_with_a_new_group(rank: int, world: int, path: str) -> list[tuple[float, float]]:
    """Stage 1 adds a head in a param group of its own (lr 0.5, no weight decay), loaded
    with strict=False: each group's (lr, weight_decay)."""
    import warnings

    stage = L.stage_of(L.Net(seed=1), rank, world)
    groups = [{"params": list(stage.parameters()), "lr": 1.0, "weight_decay": 0.1}]
    if rank == 1:
        stage.head2 = torch.nn.Linear(4, 3)
        groups.append({"params": list(stage.head2.parameters()), "lr": 0.5, "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # head2 is not in the checkpoint
        shardsafe.load(path, {"model": stage, "optimizer": opt}, strict=False)
    return [(g["lr"], g["weight_decay"]) for g in opt.param_groups]


def test_per_stage_schedulers_and_learning_rates_come_back_as_they_were(tmp_path: Path) -> None:
    """Stages with their own decay: two param groups in the manifest, one scheduler
    record per rank; each stage gets its own back, and a single process is refused the
    per-rank scheduler with a message saying why (the rest of the state loads)."""
    path = tmp_path / "c"
    saved = run_ranks(_save_per_stage_schedulers, 2, str(path))
    assert saved[0]["lr"] != saved[1]["lr"]
    assert run_ranks(_load_per_stage_schedulers, 2, str(path)) == saved
    # A group none of whose parameters were saved keeps its own hyperparameters: the two
    # saved groups are the two stages', and the new one took stage 1's, second by position.
    grouped = run_ranks(_load_with_a_new_group, 2, str(path))
    assert [lr for lr, _ in grouped[0]] == [saved[0]["lr"]]
    assert grouped[1] == [(saved[1]["lr"], 0.1), (0.5, 0.0)]
    model = L.Net(seed=1)
    opt = L.adamw(model)
    with pytest.raises(CheckpointError, match="saved with a different value on each of 2 ranks"):
        shardsafe.load(path, {"model": model, "optimizer": opt, "scheduler": L.scheduler(opt)})
    # Live groups built from both stages' parameters: the two saved groups differ.
    with pytest.raises(CheckpointError, match="which have different hyperparameters"):
        shardsafe.load(path, {"model": model, "optimizer": opt})
    # Other formats hold one value per entry: the per-rank scheduler is refused by name,
    # and the rest converts.
    with pytest.raises(CheckpointError, match="'scheduler' was saved with a different value"):
        shardsafe.convert(path, tmp_path / "c.pt", to="torch")
    shardsafe.convert(path, tmp_path / "c.pt", to="torch", only=["model", "optimizer"])


def _save_stage_loss(rank: int, world: int, path: str) -> None:
    shardsafe.save(path, {"model": L.stage_of(L.Net(), rank, world), "loss": 0.5 + rank})


def test_a_plain_value_that_differs_per_stage_keeps_rank_0s_and_loads_anywhere(
    tmp_path: Path,
) -> None:
    """Plain values are returned by every load, asked or not: a per-rank record would make
    the checkpoint unloadable at any other world size, so rank 0's is kept, as always."""
    path = tmp_path / "c"
    run_ranks(_save_stage_loss, 2, str(path))
    assert shardsafe.load(path, {"model": L.Net(seed=1)}) == {"loss": 0.5}


def _tied_in_groups_at_other_positions(rank: int, world: int, path: str, named: bool) -> list[str]:
    """A tied embedding on the first and last stage, in its own param group: group 1 on
    stage 0 (after the stage's own layer), group 0 on stage 1 (before it). ``named``:
    the usual decay / no-decay groups of ``named_parameters()`` instead (torch keeps each
    group's ``param_names``, which differ between the stages: the weights' group holds
    ``embed.weight`` and ``first.weight`` on one, ``embed.weight`` and ``last.weight`` on
    the other)."""

    def stage() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.embed = torch.nn.Linear(2, 2)
        own = torch.nn.Linear(2, 2)
        setattr(model, "first" if rank == 0 else "last", own)
        groups: list[dict[str, Any]] = [
            {"params": list(own.parameters())},
            {"params": list(model.embed.parameters())},
        ]
        if named:
            pairs = list(model.named_parameters())
            groups = [
                {"params": [(n, p) for n, p in pairs if n.endswith("weight")]},
                {"params": [(n, p) for n, p in pairs if n.endswith("bias")], "weight_decay": 0},
            ]
        elif rank == 1:
            groups.reverse()
        return model, torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01)

    model, opt = stage()
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    shardsafe.save(path, {"model": model, "optimizer": opt})
    fresh, fresh_opt = stage()
    shardsafe.load(path, {"model": fresh, "optimizer": fresh_opt})
    loaded, saved = fresh_opt.state_dict(), opt.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    assert loaded["state"].keys() == saved["state"].keys()
    for index, state in saved["state"].items():
        assert torch.equal(loaded["state"][index]["momentum_buffer"], state["momentum_buffer"])
    weights = dict(model.named_parameters())
    return sorted(name for name, p in fresh.named_parameters() if torch.equal(p, weights[name]))


@pytest.mark.parametrize("named", [False, True], ids=["groups", "named groups"])
def test_a_replica_in_param_groups_at_other_positions_saves_and_loads_by_name(
    tmp_path: Path, named: bool
) -> None:
    """A parameter held by two ranks in groups at different positions, with the same
    hyperparameters (a tied embedding; a router beside experts one rank lacks), was
    refused as "in a param group with other hyperparameters ... (lr=0.1 against lr=0.1)"
    (found in review); so was one in groups that differ only in their ``param_names``. A
    load finds each parameter's group by its name."""
    loaded = run_ranks(_tied_in_groups_at_other_positions, 2, str(tmp_path / "c"), named)
    assert loaded == [
        ["embed.bias", "embed.weight", "first.bias", "first.weight"],
        ["embed.bias", "embed.weight", "last.bias", "last.weight"],
    ]


def _save_locally_named_stage(rank: int, world: int, path: str) -> tuple[str, str]:
    """Each stage a ModuleList numbered from 0 (stage 1's ``layers.0`` is global layer 2),
    trained one AdamW step with this rank's own gradients, then saved."""
    torch.manual_seed(100 + rank)
    stage = torch.nn.Module()
    stage.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    for p in stage.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    try:
        shardsafe.save(path, {"model": stage, "optimizer": opt})
    except CheckpointError as e:
        return ("CheckpointError", str(e))
    return ("saved", "")


def test_stages_that_name_different_layers_alike_are_refused_not_mixed(tmp_path: Path) -> None:
    """Before, the save committed: one stage's layers.0 under the name (the other's lost),
    and AdamW's exp_avg from one stage beside exp_avg_sq from the other; loading it back
    into the same two stages gave each other stages' weights, with no error."""
    path = tmp_path / "ckpt"
    outcomes = run_ranks(_save_locally_named_stage, 2, str(path))
    said = (
        "save failed on rank 0: the copies of 'model/layers.0.weight' differ between ranks: "
        "rank 0 holds one version, rank 1 another (sampled elements). It is saved as one "
        "tensor replicated on all of them. If the ranks hold different tensors under one "
        "name (pipeline stages that number their layers from 0, experts numbered per "
        "rank), name them by their global index (stage s's layer i as "
        "layers.{s * layers_per_stage + i}), as a checkpoint loaded at another split "
        "needs; if they are replicas, they have diverged (e.g. a gradient not all-reduced, "
        "or a rank-dependent update). Nothing was written"
    )
    assert outcomes == [("CheckpointError", said)] * 2
    assert not path.exists() or not (path / "manifest.json").exists()
