"""Optimizers whose state is not one tensor per parameter shaped like it, in one process."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe


def lbfgs(seed: int, steps: int) -> tuple[nn.Module, torch.optim.LBFGS, list[float]]:
    """A model and its LBFGS after ``steps`` steps on fixed data; the losses of those steps."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.LBFGS(model.parameters(), history_size=3, max_iter=4)
    return model, opt, lbfgs_steps(model, opt, steps)


def lbfgs_steps(model: nn.Module, opt: torch.optim.LBFGS, steps: int) -> list[float]:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(7))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    return [float(opt.step(closure)) for _ in range(steps)]


def assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        other = got[name]
        if isinstance(value, list):
            assert [type(v) for v in other] == [type(v) for v in value], name
            pairs = [(a, b) for a, b in zip(other, value) if isinstance(b, torch.Tensor)]
            assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs), name
        elif isinstance(value, torch.Tensor):
            assert other.dtype == value.dtype and torch.equal(other, value), name
        else:
            assert type(other) is type(value) and other == value, name


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
def test_lbfgs_history_round_trips_into_a_fresh_or_stepped_lbfgs(
    tmp_path: Path, stepped: bool
) -> None:
    # LBFGS keeps flat vectors over all parameters (here 23 elements) under its first
    # parameter (3 x 4): the save was accepted, the load refused them as not "shaped like"
    # that parameter.
    model, opt, _ = lbfgs(0, 2)
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    model2, opt2, _ = lbfgs(1, 1 if stepped else 0)
    shardsafe.load(tmp_path / "ckpt", {"model": model2, "optimizer": opt2})

    assert_same_state(opt2.state_dict()["state"][0], opt.state_dict()["state"][0])
    assert lbfgs_steps(model2, opt2, 3) == lbfgs_steps(model, opt, 3)


class Tied(nn.Module):
    """A language-model head tied to its embedding; which of the two is registered first
    (and so which name ``named_parameters()`` gives the shared weight) is ``emb_first``."""

    def __init__(self, emb_first: bool) -> None:
        super().__init__()
        if emb_first:
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight
        else:
            self.head = nn.Linear(4, 10, bias=False)
            self.emb = nn.Embedding(10, 4)
            self.emb.weight = self.head.weight
        self.mid = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(x))))


def tied(seed: int, emb_first: bool, steps: int) -> tuple[Tied, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tied(emb_first)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    tied_steps(model, opt, steps)
    return model, opt


def tied_steps(model: Tied, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        x = torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("strict", [True, False])
def test_a_tied_weight_keeps_its_optimizer_state_whichever_module_comes_first(
    tmp_path: Path, strict: bool
) -> None:
    # Saved as "emb.weight" (found first), looked for as "head.weight": strict refused
    # the load ("missing optimizer/head.weight", "unexpected optimizer/emb.weight") and
    # strict=False silently dropped the shared weight's state, while the model loaded.
    model, opt = tied(0, emb_first=True, steps=2)
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    model2, opt2 = tied(1, emb_first=False, steps=0)
    shardsafe.load(tmp_path / "ckpt", {"model": model2, "optimizer": opt2}, strict=strict)

    want = {n: opt.state[p] for n, p in model.named_parameters(remove_duplicate=False)}
    got = {n: opt2.state[p] for n, p in model2.named_parameters(remove_duplicate=False)}
    assert sorted(got) == sorted(want) == ["emb.weight", "head.weight", "mid.bias", "mid.weight"]
    for name, state in want.items():
        assert sorted(got[name]) == sorted(state) == ["exp_avg", "exp_avg_sq", "step"], name
        assert all(torch.equal(got[name][k], v) for k, v in state.items()), name
    assert tied_steps(model2, opt2, 3) == tied_steps(model, opt, 3)


def hf_adafactor(seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = transformers.optimization.Adafactor(model.parameters(), lr=None)
    return model, opt, plain_steps(model, opt, steps)


def plain_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        loss = model(torch.randn(5, 4, generator=torch.Generator().manual_seed(step)))
        loss = loss.pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
def test_transformers_adafactor_factors_round_trip(tmp_path: Path, stepped: bool) -> None:
    # transformers' Adafactor keeps a [3, 4] weight's factors as [3] and [4] (torch's as
    # [3, 1] and [1, 4]): a resume into a fresh one was refused ("must be a scalar or
    # shaped like it").
    model, opt, _ = hf_adafactor(0, 2)
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    model2, opt2, _ = hf_adafactor(1, 1 if stepped else 0)
    shardsafe.load(tmp_path / "ckpt", {"model": model2, "optimizer": opt2})

    want, got = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert [tuple(want[0][k].shape) for k in ("exp_avg_sq_row", "exp_avg_sq_col")] == [(3,), (4,)]
    assert sorted(got) == sorted(want)
    for index, state in want.items():
        assert_same_state(got[index], state)
    assert plain_steps(model2, opt2, 3) == plain_steps(model, opt, 3)


class _Student(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)


class _Holder(nn.Module):
    """A module whose own names are what a model's qualified ones become."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Student()


def _with_ema_and_holder(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    student, holder = _Student(), _Holder()
    opt = torch.optim.Adam([*student.parameters(), *holder.parameters()], lr=0.1)
    x = torch.randn(3, 2)
    (student.fc(x).sum() + 2 * holder.model.fc(x).sum()).backward()
    opt.step()
    return {"model": student, "ema": copy.deepcopy(student), "other": holder, "optimizer": opt}


def test_a_qualified_name_that_another_module_has_as_its_own_is_qualified_too(
    tmp_path: Path,
) -> None:
    """The model's fc.weight, qualified as model.fc.weight beside its EMA copy, met the
    holder's own model.fc.weight: the save was refused, saying an adapter "gives two
    different tensors the key 'optimizer/model.fc.weight/step' ... make keys with
    ctx.key(*path)"."""
    saved = _with_ema_and_holder(0)
    shardsafe.save(tmp_path / "c", saved)
    keys = set(shardsafe.read_manifest(tmp_path / "c").tensors)
    assert {"optimizer/model.fc.weight/exp_avg", "optimizer/other.model.fc.weight/exp_avg"} <= keys
    live = _with_ema_and_holder(1)
    shardsafe.load(tmp_path / "c", live)
    for module in ("model", "other"):
        for p, q in zip(saved[module].parameters(), live[module].parameters()):
            for name, value in saved["optimizer"].state[p].items():
                assert torch.equal(value, live["optimizer"].state[q][name]), (module, name)


def test_optimizer_state_loads_after_an_ema_copy_joins_the_state(tmp_path: Path) -> None:
    # A deep-copied EMA model beside the model gives every name two owners, so the live
    # names became "model.mid.weight": a checkpoint saved before the EMA was added (as
    # "mid.weight") was refused even with strict=False ("none of the 4 parameter names
    # in the checkpoint ... matches").
    model, opt = tied(0, emb_first=True, steps=2)
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    model2, opt2 = tied(1, emb_first=True, steps=0)
    ema = copy.deepcopy(model2)
    shardsafe.load(
        tmp_path / "ckpt", {"model": model2, "ema": ema, "optimizer": opt2}, strict=False
    )

    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert sorted(opt2.state[p2]) == sorted(opt.state[p]) == ["exp_avg", "exp_avg_sq", "step"]
        assert all(torch.equal(opt2.state[p2][k], v) for k, v in opt.state[p].items()), name
    assert not any(opt2.state[p] for p in ema.parameters())
    assert tied_steps(model2, opt2, 3) == tied_steps(model, opt, 3)


class _Wrapper(nn.Module):
    """A backbone child called ``model`` (as Hugging Face models have) beside a ``norm`` of
    its own: the model's ``norm.weight``, qualified by the state key ``model`` beside an
    EMA copy, is ``model.norm.weight``: the child's own name of its ``norm.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.norm = nn.LayerNorm(4)
        self.norm = nn.LayerNorm(4)


def _wrapper_stepped(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = _Wrapper()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return net, opt


@pytest.mark.parametrize("strict", [True, False])
def test_optimizer_state_saved_beside_an_ema_copy_loads_without_it_to_each_own_parameter(
    tmp_path: Path, strict: bool
) -> None:
    """Saved beside its EMA copy, the model's ``norm.weight`` was named ``model.norm.weight``
    and, loaded without the copy, matched the child's ``model.norm.weight``: under
    ``strict=False`` the child's parameters took the model's state without a word (and
    ``strict=True`` refused the load)."""
    net, opt = _wrapper_stepped(0)
    shardsafe.save(tmp_path / "c", {"model": net, "ema": copy.deepcopy(net), "opt": opt})
    net2, opt2 = _wrapper_stepped(1)
    shardsafe.load(tmp_path / "c", {"model": net2, "opt": opt2}, strict=strict)
    for (name, p), p2 in zip(net.named_parameters(), net2.parameters()):
        assert sorted(opt2.state[p2]) == sorted(opt.state[p]), name
        for k, v in opt.state[p].items():
            assert torch.equal(opt2.state[p2][k], v), (name, k)


def test_another_optimizer_class_is_refused_before_anything_is_restored(tmp_path: Path) -> None:
    """An SGD's state loaded into an Adam: torch's own load fails inside Adam's
    ``__setstate__`` (KeyError: 'step') after the model was restored; shardsafe names both
    classes up front and restores nothing."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    sgd.step()
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optim": sgd})
    fresh = nn.Linear(4, 4)
    before = copy.deepcopy(fresh.state_dict())
    adam = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    with pytest.raises(shardsafe.CheckpointMismatchError) as caught:
        shardsafe.load(tmp_path / "ckpt", {"model": fresh, "optim": adam})
    assert (
        "optim: the checkpoint holds the state of optimizer class SGD, the live optimizer's "
        "is Adam; build the same optimizer class as when saving, or leave 'optim' out of the "
        "state you load to start it afresh"
    ) in str(caught.value)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())
    assert adam.state_dict()["state"] == {}
    # The same class loads, and so does the model alone into the Adam's run.
    sgd2 = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    shardsafe.load(tmp_path / "ckpt", {"model": fresh, "optim": sgd2})
    assert torch.equal(
        sgd2.state_dict()["state"][0]["momentum_buffer"], sgd.state[model.weight]["momentum_buffer"]
    )


@pytest.mark.parametrize(
    ("name", "shown"),
    [(0, "the entry 0 (int)"), (("a", 1), "the entry ('a', 1) (tuple)"),
     ("__float__", "the entry '__float__' (str)")],
)  # fmt: skip
def test_a_state_entry_that_would_not_come_back_as_it_was_is_refused_and_nothing_written(
    tmp_path: Path, name: Any, shown: str
) -> None:
    """A per-parameter state entry named ``0`` came back as ``"0"`` (a silently different
    state); one named ``__float__`` alone came back as a float, and the load failed inside
    torch (TypeError). The save now refuses both, naming the parameter and the entry."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight][name] = 5
    with pytest.raises(shardsafe.CheckpointError) as caught:
        shardsafe.save(tmp_path / "ckpt", {"model": model, "optim": opt})
    assert (
        f"cannot save state['optim']: the state of parameter 'weight' has {shown}; "
        "per-parameter optimizer state is stored by name, so its names must be strings"
    ) in str(caught.value)
    assert not (tmp_path / "ckpt").exists()


def test_a_value_no_checkpoint_holds_in_a_parameters_state_is_refused_by_its_key(
    tmp_path: Path,
) -> None:
    """Found in review: it was refused as ``cannot save state['optim']: a value of type
    object ...``, naming neither the parameter nor its state entry."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model[1].bias]["junk"] = {"deep": [1, object()]}
    with pytest.raises(shardsafe.CheckpointError) as caught:
        shardsafe.save(tmp_path / "ckpt", {"model": model, "optim": opt})
    assert str(caught.value).startswith(
        "cannot save state['optim'].state['1.bias']['junk']['deep']['1']: a value of type "
        "object is neither a tensor nor JSON-able data"
    ), str(caught.value)
    assert not (tmp_path / "ckpt").exists()


def test_state_entry_names_that_are_only_unusual_strings_round_trip(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # (No string values: torch's own load_state_dict turns one into its generator's repr.)
    odd = {"a/b": torch.ones(2, 2), "": 7, "%40x": [1, 2], "__float__x": 1.5}
    opt.state[model.weight].update(odd)
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optim": opt})
    model2 = nn.Linear(2, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    shardsafe.load(tmp_path / "ckpt", {"model": model2, "optim": opt2})
    back = opt2.state[model2.weight]
    assert sorted(back) == sorted(odd)
    assert torch.equal(back["a/b"], odd["a/b"])
    assert (back[""], back["%40x"], back["__float__x"]) == (7, [1, 2], 1.5)


def _renaming_step_in_hooks(model: nn.Module) -> torch.optim.Optimizer:
    """An Adam whose state_dict() stores ``step`` as ``t`` and whose load pre-hook renames
    it back (torch's public hooks)."""

    def renamed(sd: dict[str, Any], old: str, new: str) -> dict[str, Any]:
        state = {
            i: {new if n == old else n: v for n, v in s.items()} for i, s in sd["state"].items()
        }
        return {**sd, "state": state}  # the live state's dicts stay as they are

    def post(opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
        return renamed(sd, "step", "t")

    def pre(opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
        return renamed(sd, "t", "step")

    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    opt.register_state_dict_post_hook(post)
    opt.register_load_state_dict_pre_hook(pre)
    return opt


class _NotedAdam(torch.optim.Adam):
    """A ``__setstate__`` of its own that reads what ``__init__`` set."""

    def __init__(self, model: nn.Module) -> None:
        self.note = "kept"
        super().__init__(model.parameters(), lr=0.1)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        assert self.note == "kept"


@pytest.mark.parametrize("make", [_renaming_step_in_hooks, _NotedAdam])
def test_optimizers_whose_load_is_their_own_still_load(tmp_path: Path, make: Any) -> None:
    """The check that a forged ``step`` would not load ran torch's ``__setstate__`` on a
    stand-in, and called these valid checkpoints corrupt (review of this stop's diff)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = make(model)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optim": opt})
    fresh = nn.Linear(3, 2)
    fresh_opt = make(fresh)
    shardsafe.load(tmp_path / "ckpt", {"model": fresh, "optim": fresh_opt})
    assert torch.equal(fresh_opt.state[fresh.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])
    assert torch.equal(fresh_opt.state[fresh.weight]["step"], opt.state[model.weight]["step"])


class Preconditioned(torch.optim.Optimizer):
    """Keeps Shampoo-style preconditioners, ``[rows, rows]`` and ``[cols, cols]``: state
    shaped unlike its parameter."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["L"], state["R"] = torch.eye(p.shape[0]), torch.eye(p.shape[1])
                state["L"] += p.grad @ p.grad.T
                state["R"] += p.grad.T @ p.grad
                p -= group["lr"] * torch.linalg.solve(state["L"], p.grad)


def preconditioned(seed: int, steps: int) -> tuple[nn.Module, Preconditioned, list[float]]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3, bias=False)
    opt = Preconditioned(model.parameters())
    losses = []
    for step in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def test_state_shaped_unlike_its_parameter_resumes_into_a_fresh_optimizer(tmp_path: Path) -> None:
    """An optimizer outside torch.optim keeps state of any shape: its save was accepted,
    and its resume into a fresh optimizer refused ("it must be a scalar or shaped like
    it") unless the optimizer had stepped first. Now it loads as saved."""
    model, opt, _ = preconditioned(0, 2)
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    model2, opt2, _ = preconditioned(1, 0)
    shardsafe.load(tmp_path / "ckpt", {"model": model2, "optimizer": opt2})
    saved, got = opt.state[model.weight], opt2.state[model2.weight]
    assert [t.shape for t in got.values()] == [torch.Size([3, 3]), torch.Size([4, 4])]
    assert all(torch.equal(got[k], v) for k, v in saved.items())
    _, _, want = preconditioned(0, 4)
    x = [torch.randn(5, 4, generator=torch.Generator().manual_seed(s)) for s in (2, 3)]
    losses = []
    for batch in x:
        loss = model2(batch).pow(2).mean()
        loss.backward()
        opt2.step()
        opt2.zero_grad()
        losses.append(loss.item())
    assert losses == want[2:]


class CountingSGD(torch.optim.SGD):
    """An SGD whose ``state_dict()`` carries a counter of its own, which its
    ``load_state_dict`` reads back."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.updates = 0

    def step(self, closure: Any = None) -> None:
        super().step(closure)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "updates": self.updates}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.updates = state_dict.pop("updates")
        super().load_state_dict(state_dict)


def test_an_optimizers_own_state_dict_entries_come_back_to_its_load_state_dict(
    tmp_path: Path,
) -> None:
    """Entries of ``state_dict()`` beside ``state`` and ``param_groups`` (a subclass's
    counter, a value a state_dict post-hook adds) were dropped: the subclass's load failed
    with KeyError after the model was restored, the hook's value came back as None."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = CountingSGD(model.parameters())
    head = nn.Linear(2, 2)
    adam = torch.optim.Adam(head.parameters())
    adam.register_state_dict_post_hook(lambda o, sd: {**sd, "ema_count": 42})
    seen: list[Any] = []
    for _ in range(5):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    state = {"model": model, "optimizer": opt, "head": head, "adam": adam}
    shardsafe.save(tmp_path / "ckpt", state)
    model2 = nn.Linear(3, 2)
    opt2 = CountingSGD(model2.parameters())
    head2 = nn.Linear(2, 2)
    adam2 = torch.optim.Adam(head2.parameters())
    adam2.register_load_state_dict_pre_hook(lambda o, sd: seen.append(sd.get("ema_count")))
    state2 = {"model": model2, "optimizer": opt2, "head": head2, "adam": adam2}
    shardsafe.load(tmp_path / "ckpt", state2)
    assert opt2.updates == 5 and seen == [42]
    assert all(
        torch.equal(opt2.state[p2]["momentum_buffer"], opt.state[p]["momentum_buffer"])
        for p, p2 in zip(model.parameters(), model2.parameters())
    )


def test_a_tensor_beside_an_optimizers_state_is_refused_at_save(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "scale": torch.ones(2)})
    with pytest.raises(shardsafe.CheckpointError) as info:
        shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    assert str(info.value) == (
        "state['optimizer'].state_dict() holds a tensor at scale beside its 'state' and "
        "'param_groups', which shardsafe cannot save there; keep tensors in the optimizer's "
        "per-parameter state, or register an adapter for this optimizer "
        "(shardsafe.register_adapter)"
    )
    assert not (tmp_path / "ckpt").exists()
