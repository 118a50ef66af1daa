"""``shardsafe._tree``: the pickle-free JSON encoding of state trees.

Every value goes through real JSON text (``json.dumps(..., allow_nan=False)``) on its way
back, as it does in a manifest, so a value that only survives in memory would fail here.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardsafe
from shardsafe import _tree
from shardsafe.errors import CheckpointCorruptError, CheckpointError


def _no_tensors(path: tuple[str, ...], tensor: torch.Tensor) -> str:
    raise AssertionError(f"unexpected tensor at {path}")


def roundtrip(value: Any, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """encode -> JSON text -> decode, collecting tensors under their tree paths."""
    store: dict[str, torch.Tensor] = {}

    def sink(path: tuple[str, ...], tensor: torch.Tensor) -> str:
        key = "/".join(("v", *path))
        store[key] = tensor
        return key

    text = json.dumps(_tree.encode(value, "state['v']", sink), allow_nan=False)
    if tensors is not None:
        tensors.update(store)
    return _tree.decode(json.loads(text), store)


def same(a: Any, b: Any) -> bool:
    """Exact equality including types (tuple vs list, bool vs int) and NaN == NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def test_tuples_stay_tuples_at_any_depth() -> None:
    value = {"betas": (0.9, 0.999), "nested": [(1, (2, [3, (4,)])), ()]}
    out = roundtrip(value)
    assert same(out, value)
    assert type(out["betas"]) is tuple
    assert type(out["nested"][0][1][1]) is list
    assert type(out["nested"][0][1][1][1]) is tuple


@pytest.mark.parametrize("x", [math.inf, -math.inf, math.nan, -0.0, 5e-324, 1.7976931348623157e308])
def test_non_json_and_extreme_floats_are_exact(x: float) -> None:
    out = roundtrip({"x": x, "in_tuple": (x,)})
    assert same(out, {"x": x, "in_tuple": (x,)})


def test_float_bits_survive() -> None:
    values = [0.1, 1 / 3, 2.0**-1074, 123456789.123456789]
    out = roundtrip(values)
    assert [v.hex() for v in out] == [v.hex() for v in values]


def test_non_string_dict_keys_are_restored_with_their_types() -> None:
    value = {0: "int", 2.5: "float", None: "none", (1, "a"): "tuple", "s": "str", True: "b"}
    out = roundtrip(value)
    assert same(out, value)
    assert [type(k) for k in out] == [int, float, type(None), tuple, str, bool]


def test_string_keys_that_look_like_tags_are_not_misread() -> None:
    value = {
        "__tensor__": "not a tensor",
        "inner": {"__tuple__": [1, 2]},
        "f": {"__float__": "inf"},
        "d": {"__dtype__": "float32"},
        "c": {"__counter__": {"a": 1}},
    }
    out = roundtrip(value)
    assert same(out, value)


def test_bytes_and_dtypes() -> None:
    value = {"raw": b"\x00\xff\x10", "dtype": torch.bfloat16, "dtypes": (torch.float32, torch.int8)}
    assert same(roundtrip(value), value)


def test_numpy_scalars_become_python_numbers() -> None:
    out = roundtrip({"i": np.int64(7), "f": np.float32(1.5), "b": np.bool_(True)})
    assert same(out, {"i": 7, "f": 1.5, "b": True})


def test_a_state_entry_saves_every_value_it_could_hold_nested(tmp_path: Path) -> None:
    """What a list may hold, a state entry may be: a metric that is a numpy scalar, a
    dtype or bytes at the top of the state were refused ("does not know how to save")
    while the same value one level down saved."""
    values = {"loss": np.float32(0.25), "step": np.int64(7), "dtype": torch.bfloat16}
    state = {**values, "raw": b"\x00\xff", "nested": [*values.values(), b"\x00\xff"]}
    shardsafe.save(tmp_path / "ckpt", state)
    out = shardsafe.load(tmp_path / "ckpt", {})
    expected = {"loss": 0.25, "step": 7, "dtype": torch.bfloat16, "raw": b"\x00\xff"}
    assert same(out, {**expected, "nested": [0.25, 7, torch.bfloat16, b"\x00\xff"]})


def test_an_integer_longer_than_a_manifest_holds_is_refused_naming_its_path(
    tmp_path: Path,
) -> None:
    """Python's own limit failed the save deep in ``json`` ("ValueError: Exceeds the
    limit ... use sys.set_int_max_str_digits()"), naming no key and advising a setting
    that only made the checkpoint unloadable; the longest a manifest holds round-trips."""
    longest = -(10**4300 - 1)
    shardsafe.save(tmp_path / "ok", {"cfg": {"seed": [longest]}})
    assert shardsafe.load(tmp_path / "ok", {})["cfg"]["seed"] == [longest]
    with pytest.raises(CheckpointError) as caught:
        shardsafe.save(tmp_path / "long", {"cfg": {"seed": [10**4300]}})
    assert str(caught.value) == (
        "cannot save state['cfg']['seed']['0']: an integer of more than 4300 digits, more "
        "than a checkpoint holds (its manifest is read as hostile input, whatever the "
        "interpreter's own limit). Save it as a string or split it into smaller numbers "
        "(nothing was written)"
    )
    assert not (tmp_path / "long").exists()


def test_an_integer_dict_key_longer_than_a_manifest_holds_is_refused_in_shardsafes_words(
    tmp_path: Path,
) -> None:
    """Found in review: as a dict key, the path's text was made first, and Python's own
    "Exceeds the limit (4300 digits) ... use sys.set_int_max_str_digits()" came out; and
    one inside a tuple key was named by the dict's path and the tuple's index, as if it
    were a value (``state['cfg']['1']``), with no word of a key."""
    shown = "['cfg']: dict key (an integer too long to show)"
    for key, path in ((10**5000, shown), ((1, 10**5000), f"{shown}['1']")):
        with pytest.raises(CheckpointError) as caught:
            shardsafe.save(tmp_path / "long", {"cfg": {key: torch.ones(1)}})
        assert str(caught.value).startswith(
            f"cannot save state{path}: an integer of more than 4300 digits"
        ), str(caught.value)
        assert not (tmp_path / "long").exists()


def test_dict_keys_a_load_would_refuse_for_sharing_one_hash_are_refused_at_save(
    tmp_path: Path,
) -> None:
    """Found in review: the save committed 20 int keys of one hash (``k * (2**61 - 1)``),
    and every load of it then refused the checkpoint as damaged."""
    modulus = 2**61 - 1
    with pytest.raises(CheckpointError) as caught:
        shardsafe.save(tmp_path / "c", {"cfg": {k * modulus: k for k in range(17)}})
    assert str(caught.value) == (
        "cannot save state['cfg']: more than 16 of its dict keys share one hash value (such "
        f"as {16 * modulus}), which a load refuses (building that dict takes time quadratic "
        "in their number); key it by strings or by smaller ints"
    )
    assert not (tmp_path / "c").exists()
    sixteen = {k * modulus: k for k in range(16)}  # as many as a load takes
    shardsafe.save(tmp_path / "ok", {"cfg": sixteen})
    assert shardsafe.load(tmp_path / "ok", {})["cfg"] == sixteen


def test_a_tensor_inside_a_tuple_dict_key_is_refused_as_a_tensor_key_is(tmp_path: Path) -> None:
    """A tensor in a tuple key was stored under the dict's path and the tuple's index,
    the path of the string key "0" beside it: refused as "gives two different tensors
    the key 'v/0' ... make keys with ctx.key(*path)", and alone it came back as a new
    tensor, a key that finds nothing."""
    state = {"v": {(torch.ones(2),): "a", "0": torch.zeros(2)}}
    with pytest.raises(CheckpointError) as caught:
        shardsafe.save(tmp_path / "c", state)
    assert str(caught.value) == (
        "cannot save state['v']: dict key (tensor([1., 1.]),): it holds a tensor, and a "
        "dict key must be a string, number or tuple of them. Key the dict by name or index "
        "instead."
    )
    assert not (tmp_path / "c").exists()
    with pytest.raises(CheckpointError, match=r"dict key .* holds a tensor"):
        shardsafe.save(tmp_path / "c", {"v": {(1, torch.ones(2)): "a"}})


def test_tensors_are_cut_out_as_references() -> None:
    a, b = torch.arange(6).reshape(2, 3), torch.tensor(1.5, dtype=torch.bfloat16)
    seen: list[tuple[tuple[str, ...], torch.Tensor]] = []

    def sink(path: tuple[str, ...], tensor: torch.Tensor) -> str:
        seen.append((path, tensor))
        return "opt/" + "/".join(path)

    encoded = _tree.encode({"state": {3: {"exp_avg": a}}, "groups": [(b, 1)]}, "s", sink)
    assert [p for p, _ in seen] == [("state", "3", "exp_avg"), ("groups", "0", "0")]
    assert seen[0][1] is a and seen[1][1] is b
    assert sorted(_tree.tensor_refs(encoded)) == ["opt/groups/0/0", "opt/state/3/exp_avg"]
    text = json.dumps(encoded, allow_nan=False)
    assert "exp_avg" in text and "tensor(" not in text
    out = _tree.decode(json.loads(text), {"opt/state/3/exp_avg": a, "opt/groups/0/0": b})
    assert out["state"][3]["exp_avg"] is a
    assert out["groups"][0][0] is b and type(out["groups"][0]) is tuple


def test_tensor_refs_ignores_lookalike_data() -> None:
    encoded = _tree.encode({"__tensor__": "x"}, "s", _no_tensors)
    assert _tree.tensor_refs(encoded) == []


def test_a_reference_to_a_tensor_no_file_holds_is_corruption() -> None:
    with pytest.raises(CheckpointCorruptError, match=r"'model/w'.*no data file holds"):
        _tree.decode({"__tensor__": "model/w"}, {})


def test_a_lambda_is_refused_naming_its_path() -> None:
    value = {"lr_lambdas": [None, {"fn": lambda step: 0.5**step}]}
    with pytest.raises(CheckpointError) as info:
        _tree.encode(value, "state['scheduler']", _no_tensors)
    msg = str(info.value)
    assert "state['scheduler']['lr_lambdas']['1']['fn']" in msg
    assert "function" in msg and "never pickles" in msg


def test_a_function_and_an_object_are_refused_naming_their_paths() -> None:
    with pytest.raises(CheckpointError, match=r"state\['x'\]\['a'\]\['0'\].*builtin_function"):
        _tree.encode({"a": (len,)}, "state['x']", _no_tensors)

    class Thing:
        pass

    with pytest.raises(CheckpointError, match=r"state\['x'\]\['k'\].*Thing"):
        _tree.encode({"k": Thing()}, "state['x']", _no_tensors)


def test_an_unhashable_or_unknown_dict_key_is_refused_naming_its_path() -> None:
    with pytest.raises(CheckpointError, match=r"state\['x'\]\['a'\]: dict key .*object"):
        _tree.encode({"a": {object(): 1}}, "state['x']", _no_tensors)


def test_a_counter_stays_a_counter() -> None:
    """MultiStepLR's milestones came back a dict, which SequentialLR's hand-over to it
    then failed on (``'dict' object has no attribute 'elements'``)."""
    value = {"milestones": Counter({30: 1, 80: 2}), "words": Counter({"a": 3}), "empty": Counter()}
    assert same(roundtrip(value), value)


def test_a_dict_keyed_like_the_counter_mark_stays_a_dict() -> None:
    """What checkpoints before the Counter mark hold, and what a user's dict may be."""
    for value in ({"__counter__": 5}, {"__counter__": {"a": 1}}, {"__counter__": True, "x": 1}):
        assert same(roundtrip(value), value)
        assert same(_tree.decode(value, {}), value)  # as an earlier save wrote it


def test_a_sequential_warmup_into_multistep_resumes_as_it_ran(tmp_path: Path) -> None:
    def run(resume_at: int | None) -> list[float]:
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
        decay = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[4], gamma=0.1)
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[2])
        state = {"model": model, "optimizer": opt, "scheduler": sched}
        lrs = []
        for step in range(8):
            if step == resume_at:
                shardsafe.save(tmp_path / "c", state)
                return run_from(tmp_path / "c", lrs)
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        return lrs

    def run_from(path: Path, lrs: list[float]) -> list[float]:
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
        decay = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[4], gamma=0.1)
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[2])
        shardsafe.load(path, {"model": model, "optimizer": opt, "scheduler": sched})
        for _ in range(8 - len(lrs)):
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        return lrs

    assert run(resume_at=1) == run(resume_at=None)


def test_a_numpy_scalar_whose_item_is_no_python_number_is_refused() -> None:
    """``np.longdouble(0.1).item()`` is a longdouble: encode recursed until RecursionError."""
    with pytest.raises(
        CheckpointError, match=r"state\['v'\]\['decay'\]: a value of type longdouble"
    ):
        _tree.encode({"decay": np.longdouble(0.1)}, "state['v']", _no_tensors)


def test_a_numpy_array_is_refused_naming_its_path() -> None:
    # Only numpy scalars are plain numbers; an array would need pickle (or a tensor).
    with pytest.raises(CheckpointError, match=r"state\['sampler'\]\['order'\].*ndarray"):
        _tree.encode({"order": np.arange(4)}, "state['sampler']", _no_tensors)


@pytest.mark.parametrize(
    "bad",
    [
        {"__tuple__": 3},
        {"__float__": 1.0},
        {"__float__": "not a number"},
        {"__bytes__": ["x"]},
        {"__bytes__": "!!not base64!!"},
        {"__dtype__": "Tensor"},
        {"__dtype__": "__class__"},
        {"__dict__": "x"},
        {"__dict__": 3, "__counter__": True},
        {"__dict__": [[1]], "__counter__": True},
        {"__dict__": [1]},
        {"__dict__": [[1, 2, 3]]},
        {"__dict__": [[[1], 2]]},
        {"__dict__": [[{"__tuple__": [[1]]}, 2]]},
    ],
)
def test_decode_of_malformed_tags_is_corruption(bad: Any) -> None:
    with pytest.raises(CheckpointCorruptError, match="manifest"):
        _tree.decode(bad, {})


# ------------------------------------------------------------------ property: round trip

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
_keys = (
    st.text(max_size=8)
    | st.sampled_from(["__tensor__", "__tuple__", "__dict__", "__float__"])
    | st.integers(-5, 5)
    | st.none()
    | st.tuples(st.integers(0, 3), st.text(max_size=2))
)
_trees = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(_keys, children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_trees)
def test_any_plain_tree_round_trips_exactly(value: Any) -> None:
    assert same(roundtrip(value), value)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from([torch.float32, torch.bfloat16, torch.bool, torch.int64]), max_size=5)
)
def test_trees_with_tensors_round_trip(dtypes: list[torch.dtype]) -> None:
    value = {"t": [torch.ones(i, dtype=d) for i, d in enumerate(dtypes)], "n": tuple(dtypes)}
    tensors: dict[str, torch.Tensor] = {}
    out = roundtrip(value, tensors)
    assert len(tensors) == len(dtypes)
    assert same(out, value)
