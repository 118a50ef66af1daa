"""``shardsafe.save``/``load`` in one process (no process group): what a user checks on resume.

* every tensor of model, AdamW and scheduler state comes back bitwise, param groups
  (tuple betas included) and scheduler state equal, the RNGs continue where they were;
* training resumed from the checkpoint produces the very same next losses (``==``) as a
  run that was never interrupted;
* partial loads, mismatch reports, values that cannot be saved without pickle, and
  refusing to overwrite a committed checkpoint.
"""

from __future__ import annotations

import copy
import datetime
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import shardsafe
from shardsafe import CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from shardsafe.checkpoint.storage.leftovers import marker_bytes

LAYOUTS = ["sharded", "consolidated"]


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(6, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Dropout(0.25),
        nn.Linear(16, 3),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, betas=(0.8, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train_step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> float:
    """One step whose loss depends on every RNG: torch (data, dropout), numpy and python."""
    model.train()
    x, y = torch.randn(12, 6), torch.randn(12, 3)
    weight = float(np.random.uniform(0.5, 1.5)) * random.uniform(0.5, 1.5)
    loss = ((model(x) - y) ** 2).mean() * weight
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def state_of(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    return copy.deepcopy(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "sched": sched.state_dict()}
    )


def assert_tensor_dicts_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def assert_same_training_state(expected: dict[str, Any], got: dict[str, Any]) -> None:
    assert_tensor_dicts_equal(expected["model"], got["model"])
    exp_opt, got_opt = expected["optimizer"], got["optimizer"]
    assert len(exp_opt["state"]) == 6  # every parameter has AdamW state
    assert sorted(exp_opt["state"]) == sorted(got_opt["state"])
    for index, per_param in exp_opt["state"].items():
        assert (
            sorted(per_param)
            == sorted(got_opt["state"][index])
            == ["exp_avg", "exp_avg_sq", "step"]
        )
        assert_tensor_dicts_equal(per_param, {k: got_opt["state"][index][k] for k in per_param})
    assert got_opt["param_groups"] == exp_opt["param_groups"]
    for group in got_opt["param_groups"]:
        assert type(group["betas"]) is tuple and group["betas"] == (0.8, 0.95)
        assert group["weight_decay"] == 0.1
    assert got["sched"] == expected["sched"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path: Path, layout: str) -> None:
    # The uninterrupted run: 3 + 5 steps, never saved.
    seed_all(0)
    model, opt, sched = build(0)
    reference = [train_step(model, opt, sched) for _ in range(8)][3:]

    # The same run, checkpointed after 3 steps.
    seed_all(0)
    model, opt, sched = build(0)
    for _ in range(3):
        train_step(model, opt, sched)
    path = tmp_path / "ckpt"
    state = {"model": model, "optimizer": opt, "sched": sched, "rng": shardsafe.RNGState()}
    shardsafe.save(path, state, layout=layout)
    at_save = state_of(model, opt, sched)
    # Saving has no side effect: continuing the saved run gives the reference losses too.
    continued = [train_step(model, opt, sched) for _ in range(5)]
    assert continued == reference

    # A new process would start from other weights and other RNG states.
    seed_all(123)
    model2, opt2, sched2 = build(99)
    train_step(model2, opt2, sched2)  # even with some state of its own
    assert not torch.equal(model2[0].weight, at_save["model"]["0.weight"])
    returned = shardsafe.load(
        path, {"model": model2, "optimizer": opt2, "sched": sched2, "rng": shardsafe.RNGState()}
    )
    assert returned == {}
    assert_same_training_state(at_save, state_of(model2, opt2, sched2))
    resumed = [train_step(model2, opt2, sched2) for _ in range(5)]
    assert resumed == reference  # floats compared with ==, bitwise


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rng_state_continues_the_same_random_streams(tmp_path: Path, layout: str) -> None:
    seed_all(5)
    np.random.randn(3)  # odd number of normals: numpy now holds a cached gaussian
    random.gauss(0, 1)  # python too
    torch.rand(7)
    shardsafe.save(tmp_path / "rng", {"rng": shardsafe.RNGState()}, layout=layout)

    def draws() -> tuple[Any, ...]:
        return (
            torch.rand(5),
            torch.randn(3, dtype=torch.float64),
            torch.randint(0, 1 << 30, (4,)),
            np.random.randn(3),
            np.random.rand(4),
            [random.random() for _ in range(3)],
            random.gauss(0, 1),
            random.getrandbits(64),
        )

    expected = draws()
    seed_all(77)
    assert not torch.equal(draws()[0], expected[0])
    shardsafe.load(tmp_path / "rng", {"rng": shardsafe.RNGState()})
    got = draws()
    for e, g in zip(expected, got):
        if isinstance(e, torch.Tensor):
            assert torch.equal(e, g)
        elif isinstance(e, np.ndarray):
            assert np.array_equal(e, g)
        else:
            assert e == g


def test_rng_state_repr() -> None:
    assert repr(shardsafe.RNGState()) == "RNGState()"


def test_plain_values_come_back_and_live_tensors_are_filled(tmp_path: Path) -> None:
    counter = torch.tensor([3, 1, 4], dtype=torch.int64)
    values = {
        "step": 1200,
        "config": {"lr": 1e-3, "betas": (0.9, 0.99), "clip": float("inf"), 3: "int key"},
        "ema_decay": torch.tensor(0.999, dtype=torch.float64),
        "counter": counter,
        "tags": ["a", ("b", None)],
    }
    shardsafe.save(tmp_path / "v", values)
    live = torch.zeros(3, dtype=torch.int64)
    out = shardsafe.load(tmp_path / "v", {"counter": live, "step": 0})
    assert torch.equal(live, counter)
    assert out["step"] == 1200
    assert out["config"] == values["config"] and type(out["config"]["betas"]) is tuple
    assert out["tags"] == ["a", ("b", None)]
    assert out["ema_decay"].dtype == torch.float64 and torch.equal(
        out["ema_decay"], values["ema_decay"]
    )
    assert set(out) == set(values)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tensors_of_every_kind_round_trip(tmp_path: Path, layout: str) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 2, generator=g).bfloat16(),
        "f16": torch.randn(4, generator=g).half(),
        "f64": torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float64),
        "bool": torch.tensor([[True, False], [False, True]]),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.arange(7, dtype=torch.uint8),
        "i64": torch.tensor([-(2**63), 2**63 - 1]),
        "c64": torch.tensor([1 + 2j], dtype=torch.complex64),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
    }
    shardsafe.save(tmp_path / "c", {"tensors": tensors}, layout=layout)
    out = shardsafe.load(tmp_path / "c", {})["tensors"]
    assert sorted(out) == sorted(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        # Bitwise, NaN included: compare the raw bytes.
        assert bytes(out[name].reshape(-1).view(torch.uint8)) == bytes(
            t.contiguous().reshape(-1).view(torch.uint8)
        ), name


# ------------------------------------------------------------------ strict / mismatch


class Net(nn.Module):
    def __init__(self, extra: dict[str, nn.Module]) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)
        for name, module in extra.items():
            self.add_module(name, module)


def trained(net: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.1)
    x = torch.randn(5, 4)
    loss = net.head(net.encoder(x)).sum() + sum(p.sum() for p in net.parameters())
    loss.backward()
    opt.step()
    return opt


def params_copy(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in net.state_dict().items()}


def test_strict_load_lists_missing_and_unexpected_keys_with_counts(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = Net({"old": nn.Linear(2, 2)})
    shardsafe.save(tmp_path / "c", {"model": saved})
    live = Net({"new": nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])})
    before = params_copy(live)
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"model": live})
    msg = str(info.value)
    assert "missing from the checkpoint (8): model/new.0.weight; model/new.0.bias;" in msg
    assert "... and 3 more" in msg
    assert "unexpected in the checkpoint (2): model/old.bias; model/old.weight" in msg
    assert "mismatch" not in msg.replace("CheckpointMismatchError", "")
    assert "Pass strict=False" in msg
    assert_tensor_dicts_equal(before, live.state_dict())  # nothing was restored


def test_strict_false_loads_what_both_sides_have(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = Net({"old": nn.Linear(2, 2)})
    saved_opt = trained(saved)
    shardsafe.save(tmp_path / "c", {"model": saved, "optimizer": saved_opt})
    torch.manual_seed(1)
    live = Net({"new": nn.Linear(2, 3)})
    live_opt = torch.optim.AdamW(live.parameters(), lr=0.5, weight_decay=0.0)
    new_before = params_copy(live.new)
    shardsafe.load(tmp_path / "c", {"model": live, "optimizer": live_opt}, strict=False)
    for name in ["encoder.weight", "encoder.bias", "head.weight", "head.bias"]:
        assert torch.equal(live.state_dict()[name], saved.state_dict()[name]), name
    assert_tensor_dicts_equal(new_before, live.new.state_dict())
    # Optimizer state for the shared parameters, by name; none for the new ones.
    by_param = {id(p): n for n, p in live.named_parameters()}
    saved_by_name = {n: saved_opt.state[p] for n, p in saved.named_parameters()}
    restored = {by_param[id(p)]: s for p, s in live_opt.state.items()}
    assert sorted(restored) == ["encoder.bias", "encoder.weight", "head.bias", "head.weight"]
    for name, s in restored.items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s[k], saved_by_name[name][k]), (name, k)
    assert live_opt.param_groups[0]["lr"] == 0.1 and live_opt.param_groups[0]["weight_decay"] == 0.1


def test_strict_false_keeps_the_optimizer_state_of_parameters_the_checkpoint_lacks(
    tmp_path: Path,
) -> None:
    # As the module keeps the weights of "new", its optimizer keeps their state: the load
    # dropped it, so the next step restarted Adam's moments and bias correction for
    # parameters that had trained, while their weights stayed.
    torch.manual_seed(0)
    saved = Net({"old": nn.Linear(2, 2)})
    shardsafe.save(tmp_path / "c", {"model": saved, "optimizer": trained(saved)})
    torch.manual_seed(1)
    live = Net({"new": nn.Linear(2, 3)})
    live_opt = trained(live)
    kept = {
        n: {k: v.clone() for k, v in live_opt.state[p].items()}
        for n, p in live.new.named_parameters()
    }
    shardsafe.load(tmp_path / "c", {"model": live, "optimizer": live_opt}, strict=False)
    for name, p in live.new.named_parameters():
        state = live_opt.state[p]
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"], name
        for k, v in kept[name].items():
            assert torch.equal(state[k], v), (name, k)
    restored = {n for n, p in live.named_parameters() if live_opt.state[p]}
    assert restored == {n for n, _ in live.named_parameters()}


def test_shape_and_dtype_mismatches_are_listed_even_when_not_strict(tmp_path: Path) -> None:
    torch.manual_seed(0)
    shardsafe.save(tmp_path / "c", {"model": Net({})})
    live = Net({})
    live.head = nn.Linear(8, 3)
    live.encoder.double()
    before = params_copy(live)
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"model": live}, strict=False)
    msg = str(info.value)
    assert "mismatched (4):" in msg
    assert "model/encoder.weight: checkpoint float32[8, 4], live float64[8, 4]" in msg
    assert "model/head.weight: checkpoint float32[2, 8], live float32[3, 8]" in msg
    assert "model/head.bias: checkpoint float32[2], live float32[3]" in msg
    assert "missing" not in msg and "unexpected" not in msg
    assert_tensor_dicts_equal(before, live.state_dict())


def test_a_value_loaded_into_a_different_kind_is_a_mismatch(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"model": nn.Linear(2, 2)})
    with pytest.raises(CheckpointMismatchError, match="state\\['model'\\] was saved as a 'module'"):
        shardsafe.load(tmp_path / "c", {"model": torch.optim.SGD([nn.Parameter(torch.ones(1))])})


def test_a_state_key_absent_from_the_checkpoint_is_missing_when_strict(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"model": nn.Linear(2, 2)})
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"model": nn.Linear(2, 2), "ema": nn.Linear(2, 2)})
    assert str(info.value) == 'the checkpoint has no entry "ema" (it has: "model")'
    # strict=False loads "model" and leaves "ema" as it is, saying so.
    live, ema = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.warns(UserWarning) as seen:
        shardsafe.load(tmp_path / "c", {"model": live, "ema": ema}, strict=False)
    assert [str(w.message) for w in seen] == [
        "shardsafe: strict=False leaves state['ema'] as it is: "
        'the checkpoint has no entry "ema" (it has: "model")'
    ]
    assert seen[0].filename == __file__  # points at the user's load


def test_a_misspelled_entry_names_the_closest_one_and_never_loads_nothing(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    state = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    shardsafe.save(tmp_path / "c", state)
    live = nn.Linear(2, 2)
    before = params_copy(live)
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"modle": live})
    assert str(info.value) == (
        'the checkpoint has no entry "modle" (it has: "model", "optimizer"); did you mean "model"?'
    )  # and no "Pass strict=False", which would load nothing
    # strict=False with nothing to load is no silent no-op: the same error, and why.
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"modle": live}, strict=False)
    assert str(info.value) == (
        "the checkpoint does not match the objects being loaded:\n"
        '  the checkpoint has no entry "modle" (it has: "model", "optimizer"); '
        'did you mean "model"?\n'
        "  strict=False loads what both sides have: here, nothing at all."
    )
    assert_tensor_dicts_equal(before, live.state_dict())
    # A misspelled entry beside keys missing inside a real one: fix the name first.
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"model": nn.Linear(2, 2, bias=False), "optimiser": 1})
    assert str(info.value) == (
        "the checkpoint does not match the objects being loaded:\n"
        '  the checkpoint has no entry "optimiser" (it has: "model", "optimizer"); '
        'did you mean "optimizer"?\n'
        "  unexpected in the checkpoint (1): model/bias"
    )


def test_strict_false_is_suggested_only_where_it_loads_something(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"model": nn.Linear(2, 2)})
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"model": nn.Linear(2, 2, bias=False)})
    assert str(info.value) == (
        "the checkpoint does not match the objects being loaded:\n"
        "  unexpected in the checkpoint (1): model/bias\n"
        "  Pass strict=False to load only the keys both sides have."
    )
    shardsafe.load(tmp_path / "c", {"model": nn.Linear(2, 2, bias=False)}, strict=False)


# ------------------------------------------------------------------ refusals at save


class Sampler:
    def __init__(self) -> None:
        self.epoch = 3

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "order": {"key_fn": lambda i: -i}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]


def test_a_value_json_cannot_hold_is_refused_naming_its_key(tmp_path: Path) -> None:
    path = tmp_path / "c"
    with pytest.raises(CheckpointError) as info:
        shardsafe.save(path, {"model": nn.Linear(2, 2), "sampler": Sampler()})
    msg = str(info.value)
    assert "state['sampler']['order']['key_fn']" in msg and "function" in msg
    assert "never pickles" in msg
    assert not (path / "manifest.json").exists()
    assert not path.exists() or list(path.iterdir()) == []  # nothing was written
    with pytest.raises(CheckpointNotFoundError):
        shardsafe.load(path, {"model": nn.Linear(2, 2)})


def test_an_arbitrary_object_inside_a_plain_value_is_refused_naming_its_key(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"state\['meta'\]\['created'\]: a value of type datetime"
    ):
        shardsafe.save(tmp_path / "c", {"meta": {"created": datetime.datetime.now()}})
    with pytest.raises(
        CheckpointError, match=r"state\['meta'\]\['perm'\]: a value of type ndarray"
    ):
        shardsafe.save(tmp_path / "d", {"meta": {"perm": np.arange(3)}})


def test_an_optimizer_over_parameters_the_model_no_longer_has_is_named_so(
    tmp_path: Path,
) -> None:
    # The optimizer was built before load_state_dict(assign=True) (or fully_shard)
    # replaced the model's parameters; the error told the user to pass the model, which
    # they had.
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.load_state_dict(nn.Linear(3, 2).state_dict(), assign=True)
    with pytest.raises(CheckpointError) as refused:
        shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt})
    assert str(refused.value) == (
        "state['optimizer'] holds a parameter of shape [2, 3] that is none of the parameters "
        "of the modules in the same state dict, so it has no name. Was the optimizer built "
        "for another instance of the model, or before its parameters were replaced "
        "(fully_shard, or loading with assign=True, after the optimizer was created)? Build "
        "the optimizer from the model's parameters as they are now, or pass the module that "
        "holds this parameter in the same state dict."
    )
    assert not (tmp_path / "c").exists()
    with pytest.raises(CheckpointError, match="Pass the model alongside it"):
        shardsafe.save(tmp_path / "c", {"optimizer": opt})


def test_an_unknown_top_level_object_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"state\['thing'\] is a object.*register_adapter"):
        shardsafe.save(tmp_path / "c", {"thing": object()})


def test_an_existing_checkpoint_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "c"
    first = nn.Linear(3, 3)
    shardsafe.save(path, {"model": first}, layout="consolidated")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(CheckpointError) as info:
        shardsafe.save(path, {"model": nn.Linear(3, 3)}, layout="consolidated")
    assert "already holds a committed checkpoint" in str(info.value)
    assert "never overwrites" in str(info.value)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    live = nn.Linear(3, 3)
    shardsafe.load(path, {"model": live})
    assert torch.equal(live.weight, first.weight)


def test_leftovers_of_an_uncommitted_save_are_replaced(tmp_path: Path) -> None:
    path = tmp_path / "c"
    path.mkdir()
    leftovers = ["model.safetensors", "shard-00003-of-00004.safetensors"]
    # What an interrupted save leaves behind: its marker, recording what it wrote.
    (path / ".shardsafe-incomplete").write_bytes(marker_bytes(leftovers))
    (path / "model.safetensors").write_bytes(b"half-written garbage")
    (path / "shard-00003-of-00004.safetensors").write_bytes(b"from an older, larger run")
    model = nn.Linear(3, 3)
    shardsafe.save(path, {"model": model}, layout="consolidated")
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "model.safetensors"]
    live = nn.Linear(3, 3)
    shardsafe.load(path, {"model": live})
    assert torch.equal(live.weight, model.weight)


@pytest.mark.parametrize(
    ("kwargs", "state", "fragment"),
    [
        ({"layout": "zip"}, {"x": 1}, "layout='zip' is not one of"),
        ({}, {}, "state must be a non-empty dict"),
        ({}, {"a/b": 1}, "state key 'a/b' must be a non-empty string without '/'"),
        ({}, {"@x": 1}, "state key '@x'"),
        ({"buffer_bytes": 1000}, {"x": 1}, "buffer_bytes=1000 is too small"),
    ],
)
def test_bad_save_arguments_are_value_errors(
    tmp_path: Path, kwargs: dict[str, Any], state: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValueError) as info:
        shardsafe.save(tmp_path / "c", state, **kwargs)
    assert fragment in str(info.value)
    assert not (tmp_path / "c").exists()


def test_a_load_state_that_is_not_a_dict_is_a_value_error(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"w": torch.ones(2)})
    w = torch.zeros(2)
    with pytest.raises(ValueError) as info:
        shardsafe.load(tmp_path / "c", w)  # type: ignore[arg-type]
    assert str(info.value) == "state must be a dict of name -> object to restore, not Tensor"
    assert w.tolist() == [0.0, 0.0]
    # The managers' load_latest too: a raw AttributeError from deep inside the load.
    manager = shardsafe.CheckpointManager(tmp_path / "m")
    manager.save(1, {"w": torch.ones(2)})
    with pytest.raises(ValueError) as info:
        manager.load_latest(None)
    assert str(info.value) == "state must be a dict of name -> object to restore, not NoneType"
    manager.close()


def test_a_path_given_as_bytes_or_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    """bytes failed deep inside ("cannot use a string pattern on a bytes-like object");
    a file in place of the checkpoint directory said "[Errno 17] File exists"."""
    where = os.fsencode(tmp_path / "c")
    said = f"path {where!r} is bytes; pass a str or a pathlib.Path (os.fsdecode(path) turns "
    for call in (
        lambda: shardsafe.save(where, {"w": torch.ones(2)}),
        lambda: shardsafe.load(where, {"w": torch.ones(2)}),
        lambda: shardsafe.verify(where),
        lambda: shardsafe.CheckpointManager(where),
    ):
        with pytest.raises(TypeError) as caught:
            call()  # type: ignore[arg-type]
        assert str(caught.value).startswith(said)
    (tmp_path / "file").write_bytes(b"mine")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name, what in (
        ("file", "a regular file"),
        ("file/c", "under a file"),
        ("dangling", "a symbolic link"),
    ):
        with pytest.raises(shardsafe.CheckpointError) as refused:
            shardsafe.save(tmp_path / name, {"w": torch.ones(2)})
        assert f"{tmp_path / name} is {what}, not a directory" in str(refused.value)
    assert (tmp_path / "file").read_bytes() == b"mine"
    assert not (tmp_path / "nowhere").exists()


def test_a_missing_checkpoint_is_also_a_file_not_found_error(tmp_path: Path) -> None:
    """Code written for files (``except FileNotFoundError``, as Lightning's tests expect of
    a missing checkpoint) catches it, with shardsafe's message."""
    with pytest.raises(FileNotFoundError) as missing:
        shardsafe.load(tmp_path / "absent", {"model": nn.Linear(2, 2)})
    assert isinstance(missing.value, CheckpointNotFoundError)
    assert str(missing.value) == f"{tmp_path / 'absent'} does not exist"


def _load_names_as_before(
    state: dict[str, Any],
) -> tuple[dict[int, str], dict[str, str], dict[str, str]]:
    """``protocol.load_names`` as a save before the fix used it: :func:`_names_as_before`."""
    return _names_as_before(state), {}, {}


def _names_as_before(state: dict[str, Any]) -> dict[int, str]:
    """Parameter names as saves made them before wrapper segments were dropped: each
    module's own ``named_parameters()``, ``_checkpoint_wrapped_module`` and ``_orig_mod``
    included."""
    return {
        id(p): n
        for value in state.values()
        if isinstance(value, nn.Module)
        for n, p in value.named_parameters()
    }


def _maybe_checkpointed(wrapped: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Two linear blocks, each under activation checkpointing's wrapper if ``wrapped``
    (as torchtitan applies it per block), with AdamW after one step."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    if wrapped:
        model[0], model[2] = checkpoint_wrapper(model[0]), checkpoint_wrapper(model[2])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).sum().backward()
    opt.step()
    return model, opt


def _assert_same_adam(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys() and len(sa) == 4
    for i in sa:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[i][name], sb[i][name]), (i, name)


@pytest.mark.parametrize("saved_wrapped", [True, False], ids=["saved-with-ac", "saved-without"])
def test_optimizer_state_loads_with_or_without_activation_checkpointing(
    tmp_path: Path, saved_wrapped: bool
) -> None:
    """Optimizer state is keyed as the model is (``checkpoint_wrapper``'s state_dict hook
    drops ``_checkpoint_wrapped_module`` from the model's keys): it used to keep the
    segment, so a checkpoint saved with activation checkpointing loaded its weights but
    refused its optimizer without it ("none of the 4 parameter names ... matches"), and
    the other way round."""
    model, opt = _maybe_checkpointed(saved_wrapped)
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    assert "optimizer/0.weight/exp_avg" in shardsafe.read_manifest(tmp_path / "ckpt").tensors
    _loads_into_both(tmp_path / "ckpt", model, opt, _maybe_checkpointed)


def test_a_checkpoint_keyed_with_activation_checkpointing_segments_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written as before the fix above (optimizer keys with ``_checkpoint_wrapped_module``):
    it loads into the model with activation checkpointing and without."""
    from shardsafe.checkpoint.plan import collecting

    model, opt = _maybe_checkpointed(True)
    with monkeypatch.context() as patched:
        patched.setattr(collecting, "load_names", _load_names_as_before)
        shardsafe.save(tmp_path / "old", {"model": model, "optimizer": opt})
    tensors = shardsafe.read_manifest(tmp_path / "old").tensors
    assert "optimizer/0._checkpoint_wrapped_module.weight/exp_avg" in tensors
    for wrapped in (True, False):
        other, other_opt = _maybe_checkpointed(wrapped)
        shardsafe.load(tmp_path / "old", {"model": other, "optimizer": other_opt})
        _assert_same_adam(opt, other_opt)


def _loads_into_both(
    path: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    make: Callable[[bool], tuple[nn.Module, torch.optim.Optimizer]],
) -> None:
    """``path`` loads, bit for bit, into zeroed models made both ways (wrapped or not)."""
    for wrapped in (True, False):
        other, other_opt = make(wrapped)
        for p in other.parameters():
            torch.nn.init.zeros_(p)
        shardsafe.load(path, {"model": other, "optimizer": other_opt})
        for p, q in zip(model.parameters(), other.parameters()):
            assert torch.equal(p, q)
        _assert_same_adam(opt, other_opt)


def _maybe_compiled(compiled: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Two linear blocks, each compiled on its own if ``compiled`` (torchtitan's way; lazy:
    nothing compiles, the step runs the blocks themselves), with AdamW after one step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    if compiled:
        model[0], model[2] = torch.compile(model[0]), torch.compile(model[2])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for block in model:
        x = getattr(block, "_orig_mod", block)(x)
    x.sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("saved_compiled", [True, False], ids=["saved-compiled", "saved-eager"])
def test_blocks_compiled_one_by_one_save_and_load_under_their_own_names(
    tmp_path: Path, saved_compiled: bool
) -> None:
    """A block compiled on its own puts ``_orig_mod`` in every name below it: the keys
    used to keep it ('model/0._orig_mod.weight'), so the checkpoint did not load into the
    model uncompiled (or compiled whole), nor the other way round."""
    model, opt = _maybe_compiled(saved_compiled)
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    tensors = shardsafe.read_manifest(tmp_path / "ckpt").tensors
    assert {"model/0.weight", "optimizer/2.bias/exp_avg"} <= set(tensors)
    _loads_into_both(tmp_path / "ckpt", model, opt, _maybe_compiled)


class _OwnOrigMod(nn.Module):
    """A module of a user's own with a child it happens to call ``_orig_mod``."""

    def __init__(self) -> None:
        super().__init__()
        self._orig_mod = nn.Linear(2, 2)
        self.head = nn.Linear(2, 3)


def test_a_module_with_a_child_named_orig_mod_saves_and_loads_all_of_itself(
    tmp_path: Path,
) -> None:
    """It was taken for torch.compile's wrapper and unwrapped to that child: 'head' was
    left out of the save and of the load, without a word, even with strict=True."""
    torch.manual_seed(0)
    model = _OwnOrigMod()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.head(model._orig_mod(torch.ones(1, 2))).sum().backward()
    opt.step()
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt})
    tensors = set(shardsafe.read_manifest(tmp_path / "c").tensors)
    assert {"model/head.weight", "model/weight", "optimizer/head.weight/momentum_buffer"} <= tensors
    torch.manual_seed(1)
    other = _OwnOrigMod()
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    shardsafe.load(tmp_path / "c", {"model": other, "optimizer": other_opt})
    for (name, p), q in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(p, q), name
    assert torch.equal(
        opt.state[model.head.weight]["momentum_buffer"],
        other_opt.state[other.head.weight]["momentum_buffer"],
    )


def test_a_checkpoint_keyed_with_orig_mod_still_loads_into_its_compiled_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written as before the fix above (keys with ``_orig_mod``): it still loads into the
    model compiled block by block."""
    from shardsafe.adapters import module as module_adapter
    from shardsafe.checkpoint.plan import collecting

    model, opt = _maybe_compiled(True)
    with monkeypatch.context() as patched:
        patched.setattr(collecting, "load_names", _load_names_as_before)
        patched.setattr(module_adapter, "_without_wrappers", lambda state: state)
        shardsafe.save(tmp_path / "old", {"model": model, "optimizer": opt})
    tensors = shardsafe.read_manifest(tmp_path / "old").tensors
    assert {"model/0._orig_mod.weight", "optimizer/0._orig_mod.weight/exp_avg"} <= set(tensors)
    other, other_opt = _maybe_compiled(True)
    for p in other.parameters():
        torch.nn.init.zeros_(p)
    shardsafe.load(tmp_path / "old", {"model": other, "optimizer": other_opt})
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)
    _assert_same_adam(opt, other_opt)
