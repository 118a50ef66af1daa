"""A live dict, list or tuple of tensors passed to ``load`` is filled in place, as
``dcp.load`` fills it: ``shardsafe.load(path, {"model": model.state_dict()})`` left the
model as it was, in silence (the values were only returned)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.errors import CheckpointMismatchError
from tests.unit.test_unusual_targets import Tied


def test_a_models_state_dict_in_a_plain_dict_is_filled_in_place(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = nn.Linear(3, 2)
    shardsafe.save(tmp_path / "c", {"model": saved.state_dict(), "step": 7})
    fresh = nn.Linear(3, 2)
    live = fresh.state_dict()
    values = shardsafe.load(tmp_path / "c", {"model": live, "step": 0})
    assert torch.equal(fresh.weight.detach(), saved.weight.detach())
    assert torch.equal(fresh.bias.detach(), saved.bias.detach())
    # Handed back as the live tensors themselves (read straight into, no second copy).
    assert values["model"]["weight"] is live["weight"]
    assert values["step"] == 7


def test_tensors_in_nested_lists_and_tuples_are_filled(tmp_path: Path) -> None:
    a, b, c = torch.arange(4.0), torch.ones(2, 2, dtype=torch.bfloat16), torch.tensor(3)
    shardsafe.save(tmp_path / "c", {"ema": {"w": [a, (b, {"n": c})], "decay": 0.99}})
    la, lb, lc = torch.zeros(4), torch.zeros(2, 2, dtype=torch.bfloat16), torch.tensor(0)
    values = shardsafe.load(tmp_path / "c", {"ema": {"w": [la, (lb, {"n": lc})]}})
    assert torch.equal(la, a) and torch.equal(lb, b) and torch.equal(lc, c)
    assert values["ema"]["decay"] == 0.99
    assert values["ema"]["w"][1][0] is lb


def test_a_tied_models_state_dict_loads_both_names_into_one_tensor(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = Tied()
    shardsafe.save(tmp_path / "c", {"model": saved.state_dict()})
    fresh = Tied()
    shardsafe.load(tmp_path / "c", {"model": fresh.state_dict()})
    assert torch.equal(fresh.embed.weight.detach(), saved.embed.weight.detach())
    assert fresh.head.weight is fresh.embed.weight


def test_a_shape_mismatch_is_refused_before_anything_is_restored(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"model": nn.Linear(3, 2), "sd": nn.Linear(3, 2).state_dict()})
    model, wrong = nn.Linear(3, 2), nn.Linear(4, 2).state_dict()
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"model": model, "sd": wrong})
    assert str(info.value) == (
        "the checkpoint does not match the objects being loaded:\n"
        "  mismatched (1): sd/weight: checkpoint float32[2, 3], live float32[2, 4]"
    )
    assert torch.equal(model.weight.detach(), before)  # nothing restored


def test_a_live_tensor_the_checkpoint_lacks_is_missing_unless_strict_is_off(
    tmp_path: Path,
) -> None:
    saved = {"w": torch.arange(3.0), "n": 1}
    shardsafe.save(tmp_path / "c", {"sd": saved})
    w, extra, n = torch.zeros(3), torch.full((2,), 5.0), torch.zeros(1)
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"sd": {"w": w, "extra": extra, "n": n}})
    assert str(info.value) == (
        "the checkpoint does not match the objects being loaded:\n"
        "  missing from the checkpoint (1): sd/extra\n"
        "  mismatched (1): sd/n: the checkpoint holds an int where the live value is a tensor"
    )
    assert torch.equal(w, torch.zeros(3))
    values = shardsafe.load(tmp_path / "c", {"sd": {"w": w, "extra": extra}}, strict=False)
    assert torch.equal(w, saved["w"]) and torch.equal(extra, torch.full((2,), 5.0))
    assert values["sd"].keys() == {"w", "n"}
    assert values["sd"]["w"] is w and values["sd"]["n"] == 1


def test_one_tensor_passed_as_an_entry_and_inside_a_dict_is_checked_as_tied(
    tmp_path: Path,
) -> None:
    """The entry itself was no read-in-place target: the tied check never saw it, the
    nested copy was filled, then overwritten by the entry's, and the returned dict held
    the entry's values under the other name (found in review)."""
    shardsafe.save(tmp_path / "c", {"w": torch.zeros(3), "sd": {"w": torch.ones(3)}})
    t = torch.full((3,), 7.0)
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"w": t, "sd": {"w": t}})
    assert str(info.value) == (
        "the checkpoint holds different values for 'w' and 'sd/w', which the objects being "
        "loaded tie (one tensor under both names, as a tied embedding and output layer): the "
        "load would keep the values of one and drop the other's. The checkpoint was saved "
        "untied: load it into the model untied as it was saved, or pass strict=False to load "
        "it anyway, the tied tensor holding one of the two"
    )
    assert torch.equal(t, torch.full((3,), 7.0))  # nothing restored


def test_a_view_whose_elements_overlap_is_refused(tmp_path: Path) -> None:
    """torch's copy_ wrote into it without a word: [[0, 1, 2], [1, 2, 5]] came back for
    [[0, 1, 2], [3, 4, 5]] (found in review)."""
    shardsafe.save(tmp_path / "c", {"sd": {"w": torch.arange(6.0).reshape(2, 3)}})
    overlapping = torch.zeros(4).as_strided((2, 3), (1, 1))
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"sd": {"w": overlapping}})
    assert str(info.value) == (
        "state['sd'] at 'sd/w' is a view whose elements overlap in memory (shape [2, 3], "
        "strides [1, 1]), so it cannot hold the checkpoint's values. Give it memory of its "
        "own (.clone()) before loading. Nothing was restored."
    )
    # Interleaved strides that share no element are filled: counted element by element.
    base = torch.zeros(8)
    interleaved = base.as_strided((3, 2), (2, 3))
    shardsafe.save(tmp_path / "d", {"sd": {"w": torch.arange(6.0).reshape(3, 2)}})
    shardsafe.load(tmp_path / "d", {"sd": {"w": interleaved}})
    assert torch.equal(interleaved, torch.arange(6.0).reshape(3, 2))


def test_a_parameter_is_filled_and_handed_back_needing_no_grad(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"p": torch.arange(3.0), "sd": {"q": torch.ones(2)}})
    p, q = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    values = shardsafe.load(tmp_path / "c", {"p": p, "sd": {"q": q}})
    assert torch.equal(p.detach(), torch.arange(3.0)) and torch.equal(q.detach(), torch.ones(2))
    assert p.requires_grad and p.grad_fn is None
    assert not values["p"].requires_grad and values["p"].data_ptr() == p.data_ptr()
    assert not values["sd"]["q"].requires_grad and values["sd"]["q"].data_ptr() == q.data_ptr()


def test_an_optimizers_state_dict_comes_back_whole_as_dcp_load_gives_it(tmp_path: Path) -> None:
    """Its tensors were filled and its learning rate and step left as they were: the
    resumed run trained with the fresh optimizer's lr, in silence (found in review)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt.param_groups[0]["lr"] = 0.02
    saved = opt.state_dict()
    shardsafe.save(tmp_path / "c", {"optim": saved, "step": 7, "extra": {"epoch": 2}})
    fresh = torch.optim.AdamW(nn.Linear(3, 2).parameters(), lr=0.1)
    extra = {"epoch": 0}
    state = {"optim": fresh.state_dict(), "step": 0, "extra": extra}
    live_groups = state["optim"]["param_groups"]
    shardsafe.load(tmp_path / "c", state)
    assert state["step"] == 7  # the top-level number, put back into the dict passed
    assert state["extra"] is extra and extra == {"epoch": 2}
    assert state["optim"]["param_groups"] is live_groups  # the live containers, updated
    fresh.load_state_dict(state["optim"])
    assert fresh.param_groups[0]["lr"] == 0.02
    got, want = fresh.state_dict()["state"], saved["state"]
    assert got.keys() == want.keys() == {0, 1}  # added: the fresh optimizer had none
    for p in want:
        assert all(torch.equal(got[p][k], want[p][k]) for k in want[p])


def test_a_live_tensor_is_never_replaced_by_a_value_that_is_not_one(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"sd": {"w": 3, "t": (torch.ones(2), 5)}})
    w, t0 = torch.zeros(2), torch.zeros(2)
    state = {"sd": {"w": w, "t": (t0, 0)}}
    values = shardsafe.load(tmp_path / "c", state, strict=False)
    assert state["sd"]["w"] is w and torch.equal(w, torch.zeros(2))  # left as it is
    assert state["sd"]["t"][0] is t0 and state["sd"]["t"][1] == 5  # rebuilt around it
    assert torch.equal(t0, torch.ones(2)) and values["sd"]["w"] == 3


def test_what_a_live_dict_or_list_holds_and_the_checkpoint_lacks_is_refused_when_strict(
    tmp_path: Path,
) -> None:
    """Refused, as dcp.load refuses it: the live list [9, 9, 9, 9] came back [1, 2, 9, 9]
    where load returned [1, 2], and a key of a number the checkpoint lacks was kept
    beside the updated ones, in silence (diff review)."""
    shardsafe.save(tmp_path / "c", {"sd": {"h": [1, 2], "n": 3}})
    h, sd = [9, 9, 9, 9], {"h": [9, 9, 9, 9], "n": 0, "note": "mine"}
    sd["h"] = h
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"sd": sd})
    assert str(info.value) == (
        "the checkpoint does not match the objects being loaded:\n"
        "  missing from the checkpoint (3): sd/h/2; sd/h/3; sd/note\n"
        "  Pass strict=False to load only the keys both sides have."
    )
    assert sd == {"h": [9, 9, 9, 9], "n": 0, "note": "mine"}  # nothing changed
    shardsafe.load(tmp_path / "c", {"sd": sd}, strict=False)
    assert sd == {"h": [1, 2, 9, 9], "n": 3, "note": "mine"} and sd["h"] is h


def test_a_live_tree_that_no_checkpoint_can_hold_is_left_whole_with_a_warning(
    tmp_path: Path,
) -> None:
    """Its numbers were updated and its tensors left as they were: half restored, in
    silence (diff review)."""
    shardsafe.save(tmp_path / "c", {"ema": {"w": torch.ones(3), "updates": 500}})
    w = torch.zeros(3)
    ema = {"w": w, "updates": 0, "device": torch.device("cpu")}
    with pytest.warns(UserWarning) as seen:
        values = shardsafe.load(tmp_path / "c", {"ema": ema})
    assert [str(m.message) for m in seen] == [
        "shardsafe: state['ema'] holds a value that no checkpoint can hold, so nothing in it "
        "is filled or updated in place; take the saved values from what load returns"
    ]
    assert ema["updates"] == 0 and torch.equal(w, torch.zeros(3))
    assert values["ema"]["updates"] == 500 and torch.equal(values["ema"]["w"], torch.ones(3))


def test_a_tuple_at_the_top_of_state_is_rebuilt_around_its_live_tensors(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"pair": (torch.ones(2), 5)})
    param = nn.Parameter(torch.zeros(2))
    state = {"pair": (param, 0)}
    shardsafe.load(tmp_path / "c", state)
    assert state["pair"][0] is param and state["pair"][1] == 5
    assert torch.equal(param.detach(), torch.ones(2))


def test_a_live_container_where_the_checkpoint_holds_a_number_is_mismatched(
    tmp_path: Path,
) -> None:
    shardsafe.save(tmp_path / "c", {"x": 5, "sd": {"d": {"a": 1}}})
    x = {"a": 1}
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"x": x})
    assert str(info.value) == (
        "the checkpoint does not match the objects being loaded:\n"
        "  mismatched (1): x: the checkpoint holds an int where the live value is a dict"
    )
    state = {"x": x, "sd": {"d": 7}}  # a number where a dict was saved: replaced by it
    shardsafe.load(tmp_path / "c", state, strict=False)
    assert state == {"x": 5, "sd": {"d": {"a": 1}}}


def test_a_list_at_two_paths_gets_each_paths_saved_values(tmp_path: Path) -> None:
    """A fresh SequentialLR's state_dict() holds one list as its _last_lr and its first
    scheduler's: written into at both paths, the later path's values won at both, and the
    scheduler resumed with its first child's learning rates, in silence (review)."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
    decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[2])
    for _ in range(5):
        opt.step()
        sched.step()
    shardsafe.save(tmp_path / "c", {"s": sched.state_dict()})
    saved = sched.state_dict()
    fresh_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    fresh = torch.optim.lr_scheduler.SequentialLR(
        fresh_opt,
        [
            torch.optim.lr_scheduler.LinearLR(fresh_opt, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(fresh_opt, gamma=0.9),
        ],
        milestones=[2],
    )
    live = fresh.state_dict()
    assert live["_last_lr"] is live["_schedulers"][0]["_last_lr"]  # the aliasing
    shardsafe.load(tmp_path / "c", {"s": live})
    assert live["_last_lr"] == saved["_last_lr"] != saved["_schedulers"][0]["_last_lr"]
    assert live["_schedulers"] == saved["_schedulers"]
    fresh.load_state_dict(live)
    assert fresh.get_last_lr() == sched.get_last_lr()


def test_a_live_namedtuple_stays_one(tmp_path: Path) -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    shardsafe.save(tmp_path / "c", {"sd": {"p": (1, torch.ones(2))}})
    t = torch.zeros(2)
    state = {"sd": {"p": Pair(0, t)}}
    shardsafe.load(tmp_path / "c", state)
    assert isinstance(state["sd"]["p"], Pair) and state["sd"]["p"].a == 1
    assert state["sd"]["p"].b is t and torch.equal(t, torch.ones(2))
