"""Stored names are unambiguous (issue #25, item 5): two different paths in a state never
share a stored name. A state whose names only differ by "/", "%", a leading "@", or an
int key beside its string comes back exactly; what no encoding can keep apart (two NaN
keys, keys an adapter builds by hand, DCP's "."-joined names) is refused before anything
is written, naming both paths.
"""

from __future__ import annotations

import math
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import shardsafe
from shardsafe import _names
from shardsafe.adapters import registry
from shardsafe.checkpoint.storage.locations import open_storage
from shardsafe.converters import dcp_write, entries, flat_layout
from shardsafe.converters.api import read_source
from shardsafe.converters.source import Source
from shardsafe.errors import CheckpointCorruptError, CheckpointError
from shardsafe.protocol import (
    Adapter,
    Chunk,
    LoadContext,
    LoadRequests,
    SaveContext,
    SavedValue,
    SaveItem,
)

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::UserWarning"),  # DCP: no process group; torch: pickle
]


# -- what a user checks


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Exactly equal: types (int key vs str key, list vs tuple), tensors bit for bit."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert tensor_bytes(got) == tensor_bytes(want), where
    elif isinstance(want, dict):
        assert sorted(map(repr, got)) == sorted(map(repr, want)), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def nothing_at(path: Path) -> bool:
    """No checkpoint and no file of one: the refusal came before anything was written."""
    return not path.exists() or not any(path.iterdir())


def dcp_form(value: Any) -> Any:
    """What DCP keeps of a tree: it names dict keys by ``str(key)``."""
    if isinstance(value, dict):
        return {str(k): dcp_form(v) for k, v in value.items()}
    if isinstance(value, list):
        return [dcp_form(v) for v in value]
    return value


def dcp_refuses(state: dict[str, Any]) -> bool:
    """DCP's own flattening (``dcp.save``'s) meets two paths in one name, or naming dict
    keys by ``str(key)`` merges two of them (``1`` and ``"1"``): fewer leaves are left."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._traverse import traverse_state_dict

    try:
        flatten_state_dict(state)
    except ValueError as e:
        assert "duplicated flatten key" in str(e)
        return True

    def leaves(tree: dict[str, Any]) -> int:
        found: list[object] = []
        traverse_state_dict(tree, lambda path, value: found.append(path))
        return len(found)

    return leaves(dcp_form(state)) < leaves(state)


def read_dcp(path: Path, out: Path) -> Any:
    """A DCP checkpoint as DCP itself reads it without a template."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=True)


def convert(src: Path, dst: Path, to: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the torch format's pickle warning
        shardsafe.convert(src, dst, to=to, progress=False)


@contextmanager
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


# -- states drawn to collide under a naive join

_KEY_TEXT = st.text(alphabet="ab/.%@1", max_size=4)
_KEYS = st.one_of(
    st.sampled_from(["1", 1, "0", 0, "a/b", "a", "b", "a.b", "%", "%2F", "@1", "@", "", 12]),
    _KEY_TEXT,
    st.integers(min_value=-2, max_value=12),
)


def _tensor(start: int, n: int, floating: bool) -> torch.Tensor:
    dtype = torch.float32 if floating else torch.int64
    return torch.arange(start, start + n, dtype=dtype) if n else torch.tensor(start, dtype=dtype)


_TENSORS = st.builds(_tensor, st.integers(-5, 5), st.integers(0, 3), st.booleans())
_PLAIN = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.text(alphabet="ab/", max_size=2)
)
_TREES = st.recursive(
    st.one_of(_TENSORS, _PLAIN),
    lambda inner: st.one_of(
        st.dictionaries(_KEYS, inner, min_size=1, max_size=4),
        st.lists(inner, min_size=1, max_size=3),
    ),
    max_leaves=10,
)
_STATES = st.dictionaries(_KEYS, _TREES, min_size=1, max_size=4)

_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@_SETTINGS
@given(_STATES)
def test_any_state_loads_back_exactly(tree: dict[Any, Any]) -> None:
    state = {"extra": tree}
    with scratch() as d:
        shardsafe.save(d / "c", state)
        assert_same(shardsafe.load(d / "c", {}), state)


@_SETTINGS
@given(_STATES)
def test_any_state_converts_to_shardsafe_and_torch_and_back_exactly(tree: dict[Any, Any]) -> None:
    state = {"extra": tree}
    with scratch() as d:
        shardsafe.save(d / "c", state)
        convert(d / "c", d / "copy", "shardsafe")
        assert_same(shardsafe.load(d / "copy", {}), state)
        convert(d / "copy", d / "t.pt", "torch")
        assert_same(torch.load(d / "t.pt", weights_only=True), state)
        convert(d / "t.pt", d / "back", "shardsafe")
        convert(d / "back", d / "again.pt", "torch")
        assert_same(torch.load(d / "again.pt", weights_only=True), state)


@_SETTINGS
@given(_STATES)
def test_any_state_converts_to_dcp_exactly_or_is_refused_as_dcp_would(
    tree: dict[Any, Any],
) -> None:
    state = {"extra": tree}
    with scratch() as d:
        shardsafe.save(d / "c", state)
        if dcp_refuses(state):
            with pytest.raises(CheckpointError, match="would both be stored") as e:
                convert(d / "c", d / "dcp", "dcp")
            assert str(e.value).count("['extra']") == 2  # both paths named
            assert nothing_at(d / "dcp")
            return
        convert(d / "c", d / "dcp", "dcp")
        assert_same(read_dcp(d / "dcp", d / "dcp.pt"), dcp_form(state))
        convert(d / "dcp", d / "back", "shardsafe")
        convert(d / "back", d / "back.pt", "torch")
        assert_same(torch.load(d / "back.pt", weights_only=True), dcp_form(state))


# -- the cases of the issue


T1, T2 = torch.tensor([1.0, 1.5]), torch.tensor([2.0, 2.5, 3.0])


@pytest.mark.parametrize(
    "tree",
    [
        {"a/b": T1, "a": {"b": T2}},
        {1: T1, "1": T2},
        {"@x": T1, "%40x": T2, "x/y": T1 * 3, "x%2Fy": T2 * 3},
        {(1, "a/b"): T1, "(1, 'a/b')": T2, None: T1 * 2, "None": T2 * 2},
    ],
    ids=["slash", "int-and-str", "escapes-themselves", "tuple-and-none"],
)
def test_paths_that_a_plain_join_would_merge_load_back_apart(tmp_path: Path, tree: Any) -> None:
    shardsafe.save(tmp_path / "c", {"extra": tree})
    assert_same(shardsafe.load(tmp_path / "c", {}), {"extra": tree})


class Odd(nn.Module):
    """A module whose names a "/"-join would confuse: register_buffer forbids only "."."""

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("@groups", nn.Parameter(torch.randn(3)))
        self.register_parameter("w/1", nn.Parameter(torch.randn(2, 3)))
        self.register_buffer("a/b", torch.randn(2))
        self.register_buffer("100%", torch.randn(4))


def trained_odd(seed: int) -> tuple[Odd, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Odd()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def assert_same_module_and_optimizer(
    a: tuple[nn.Module, torch.optim.Optimizer], b: tuple[nn.Module, torch.optim.Optimizer]
) -> None:
    assert_same(b[0].state_dict(), a[0].state_dict())
    assert_same(b[1].state_dict(), a[1].state_dict())


def test_a_module_with_slash_names_and_an_at_groups_param_beside_its_optimizer(
    tmp_path: Path,
) -> None:
    saved = trained_odd(0)
    shardsafe.save(tmp_path / "c", {"model": saved[0], "optimizer": saved[1]})
    live = trained_odd(1)
    shardsafe.load(tmp_path / "c", {"model": live[0], "optimizer": live[1]})
    assert_same_module_and_optimizer(saved, live)
    # The tensor-valued lr lives under the reserved "@groups"; the param "@groups" apart.
    assert torch.equal(live[1].param_groups[0]["lr"], torch.tensor(0.01))


def test_it_converts_to_torch_with_its_own_names(tmp_path: Path) -> None:
    model, opt = trained_odd(0)
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt})
    convert(tmp_path / "c", tmp_path / "t.pt", "torch")
    loaded = torch.load(tmp_path / "t.pt", weights_only=True)
    assert_same(loaded["model"], dict(model.state_dict()))
    assert set(loaded["optimizer"]["state"]) == {"@groups", "w/1"}
    assert_same(loaded["optimizer"]["state"]["@groups"], opt.state_dict()["state"][0])
    assert_same(loaded["optimizer"]["param_groups"][0]["lr"], torch.tensor(0.01))


def test_a_checkpoint_written_before_names_were_encoded_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = trained_odd(0)
    with monkeypatch.context() as m:  # the writer as it was: segments joined as they are
        m.setattr(_names, "segment", lambda part: str.__str__(part))
        shardsafe.save(tmp_path / "old", {"model": saved[0], "optimizer": saved[1]})
    live = trained_odd(1)
    shardsafe.load(tmp_path / "old", {"model": live[0], "optimizer": live[1]})
    assert_same_module_and_optimizer(saved, live)
    convert(tmp_path / "old", tmp_path / "t.pt", "torch")
    back = torch.load(tmp_path / "t.pt", weights_only=True)["model"]
    assert_same(back, dict(saved[0].state_dict()))


def test_two_nan_keys_are_refused_naming_both_and_nothing_is_written(tmp_path: Path) -> None:
    tree = {"x": {float("nan"): T1, float("nan"): T2}}
    with pytest.raises(CheckpointError) as e:
        shardsafe.save(tmp_path / "c", {"extra": tree})
    assert (
        "state['extra']['x'][nan] and state['extra']['x'][nan] would both be stored as "
        "'extra/x/@nan'" in str(e.value)
    )
    assert nothing_at(tmp_path / "c")


def test_one_nan_key_is_fine(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"extra": {float("nan"): T1, 1.5: T2}})
    (key, value), (other, value2) = shardsafe.load(tmp_path / "c", {})["extra"].items()
    assert math.isnan(key) and torch.equal(value, T1)
    assert other == 1.5 and torch.equal(value2, T2)


def test_a_nan_key_converts_to_torch_and_reads_back(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"extra": {float("nan"): T1, 1.5: T2}})
    shardsafe.convert(tmp_path / "c", tmp_path / "out.pt", to="torch", progress=False)
    (key, value), (other, value2) = torch.load(tmp_path / "out.pt", weights_only=True)[
        "extra"
    ].items()
    assert math.isnan(key) and torch.equal(value, T1)
    assert other == 1.5 and torch.equal(value2, T2)


class Pair:
    """Two tensors that a careless adapter stores under one hand-made key."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b


class CarelessAdapter(Adapter):
    kind = "test-careless"

    def handles(self, obj: object) -> bool:
        return isinstance(obj, Pair)

    def save(self, obj: Pair, ctx: SaveContext) -> SaveItem:
        keys = [f"{ctx.name}/w", f"{ctx.name}/w"]  # by hand, not ctx.key()
        chunks = [Chunk.whole(k, t, replicated=True) for k, t in zip(keys, (obj.a, obj.b))]
        return SaveItem(self.kind, {}, chunks)

    def plan_load(self, obj: Pair, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        return LoadRequests()

    def restore(self, obj: Pair, saved: SavedValue, tensors: Any, ctx: LoadContext) -> None:
        return None


@pytest.mark.parametrize("b", [T1.clone(), T2], ids=["same-shape", "other-shape"])
def test_an_adapter_that_gives_two_tensors_one_key_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, b: torch.Tensor
) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", [CarelessAdapter(), *registry._REGISTRY])
    with pytest.raises(CheckpointError, match="gives two different tensors the key 'p/w'"):
        shardsafe.save(tmp_path / "c", {"p": Pair(T1, b)})
    assert nothing_at(tmp_path / "c")


def test_a_key_made_twice_through_ctx_key_names_both_paths() -> None:
    ctx = SaveContext(name="e", rank=0, world_size=1)
    nan_a, nan_b = _names.DictKey(float("nan")), _names.DictKey(float("nan"))
    assert ctx.key("x", nan_a) == "e/x/@nan"
    assert ctx.key("x", nan_a) == "e/x/@nan"  # the same path again is the same key
    with pytest.raises(CheckpointError, match=r"state\['e'\]\['x'\]\[nan\] and"):
        ctx.key("x", nan_b)


def test_an_empty_key_below_an_entry_saves_sharded_and_is_refused_consolidated_by_name(
    tmp_path: Path,
) -> None:
    """Found in review: consolidated, the check of the written manifest refused it ("'chunks.
    names' is not a list of valid stored tensor names"), naming neither entry nor key."""
    state = {"x": {"": torch.arange(3.0)}}
    shardsafe.save(tmp_path / "sharded", state)
    assert torch.equal(shardsafe.load(tmp_path / "sharded", {})["x"][""], torch.arange(3.0))
    with pytest.raises(CheckpointError) as e:
        shardsafe.save(tmp_path / "consolidated", state, layout="consolidated")
    assert str(e.value) == (
        "cannot save state['x'] with layout='consolidated': it holds a tensor under the empty "
        "key '', which a consolidated file cannot name (each tensor in x's file is named by "
        "its key); rename that key, or save with layout='sharded' (nothing was written)"
    )
    assert not (tmp_path / "consolidated").exists()


# -- converters


def test_dcp_refuses_a_dotted_key_beside_its_nested_twin_and_writes_nothing(
    tmp_path: Path,
) -> None:
    shardsafe.save(tmp_path / "c", {"extra": {"a.b": T1, "a": {"b": T2}}})
    with pytest.raises(CheckpointError) as e:
        convert(tmp_path / "c", tmp_path / "dcp", "dcp")
    assert "['extra']['a.b'] and ['extra']['a']['b'] would both be stored as 'extra.a.b'" in str(
        e.value
    )
    assert nothing_at(tmp_path / "dcp")


def test_a_torch_file_with_a_slashed_entry_beside_its_nested_twin_names_both_paths(
    tmp_path: Path,
) -> None:
    """Found in review: the first path was shown under the second's entry (``['a']``)."""
    torch.save({"a/b": T1, "a": {"b": T2}}, tmp_path / "m.pt")
    with pytest.raises(CheckpointError) as e:
        convert(tmp_path / "m.pt", tmp_path / "out", "shardsafe")
    assert str(e.value).startswith(
        "['a/b'] and ['a']['b'] would both be stored as 'a/b', so one would be lost"
    ), str(e.value)
    assert nothing_at(tmp_path / "out")


def test_dcp_refuses_an_int_key_beside_its_string(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"extra": {1: T1, "1": T2}})
    with pytest.raises(CheckpointError, match=r"\['extra'\]\[1\] and \['extra'\]\['1'\]"):
        convert(tmp_path / "c", tmp_path / "dcp", "dcp")
    assert nothing_at(tmp_path / "dcp")


def test_dcp_verification_notices_an_item_that_is_not_there(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"extra": {"a": T1, "b": T2}})
    convert(tmp_path / "c", tmp_path / "dcp", "dcp")
    with open_storage(str(tmp_path / "dcp")) as storage:
        dcp_write.verify(storage, {}, ["extra.a", "extra.b"])  # as written: fine
        with pytest.raises(CheckpointCorruptError, match="lists 2 items, but 3 were written"):
            dcp_write.verify(storage, {}, ["extra.a", "extra.b", "extra.b"])


def test_the_flat_dcp_layout_refuses_optimizer_names_that_meet() -> None:
    tree = {
        "model": {"a.b": T1},
        "optim": {"state": {"a.b": {"c": T1}, "a": {"b.c": T2}}, "param_groups": []},
    }
    with pytest.raises(CheckpointError, match=r"would both be stored as 'state\.a\.b\.c'"):
        flat_layout.flatten(tree, {"model": "module", "optim": "optimizer"})


def test_a_module_whose_extra_state_reuses_a_tensor_name_is_refused() -> None:
    meta = {"tensors": ["w"], "extra": {"w": 3}}
    source = Source("test", "here", {"m": SavedValue("m", "module", meta)}, {})
    with pytest.raises(CheckpointCorruptError, match="names 'w' both as a tensor and as extra"):
        entries.nested(source)


def test_a_torch_file_converts_to_the_keys_save_makes(tmp_path: Path) -> None:
    state = {"model": {"a/b": T1, "@c": T2}, "extra": {1: T1, "1": T2, "%": [T2]}}
    torch.save(state, tmp_path / "t.pt")
    convert(tmp_path / "t.pt", tmp_path / "c", "shardsafe")
    with read_source(tmp_path / "c") as source:
        assert sorted(source.tensors) == [
            "extra/%25/0", "extra/1", "extra/@1", "model/%40c", "model/a%2Fb",
        ]  # fmt: skip
    shardsafe.save(tmp_path / "direct", {"extra": state["extra"]})
    with read_source(tmp_path / "direct") as source:
        assert sorted(source.tensors) == ["extra/%25/0", "extra/1", "extra/@1"]
    assert_same(shardsafe.load(tmp_path / "c", {}), {"extra": state["extra"]})
    convert(tmp_path / "c", tmp_path / "back.pt", "torch")
    assert_same(torch.load(tmp_path / "back.pt", weights_only=True), state)


def test_odd_module_names_go_to_hugging_face_and_back(tmp_path: Path) -> None:
    model, _ = trained_odd(0)
    shardsafe.save(tmp_path / "c", {"model": model})
    convert(tmp_path / "c", tmp_path / "hf", "hf")
    convert(tmp_path / "hf", tmp_path / "back", "shardsafe")
    live, _ = trained_odd(1)
    shardsafe.load(tmp_path / "back", {"model": live})
    assert_same(live.state_dict(), model.state_dict())


# -- the encoding itself


@pytest.mark.parametrize(
    ("parts", "key"),
    [
        (("fc.weight", "exp_avg"), "e/fc.weight/exp_avg"),  # ordinary names: as they were
        (("a/b",), "e/a%2Fb"),
        (("100%",), "e/100%25"),
        (("@groups",), "e/%40groups"),
        (("a@b",), "e/a@b"),
        ((_names.Reserved("@groups"), "0", "lr"), "e/@groups/0/lr"),
        ((_names.DictKey(1),), "e/@1"),
        (("1",), "e/1"),
        ((_names.DictKey(True),), "e/@True"),
        ((_names.DictKey(None),), "e/@None"),
        ((_names.DictKey(1.5),), "e/@1.5"),
        ((_names.DictKey((1, "a/b")),), "e/@(1, 'a%2Fb')"),
        ((_names.DictKey(("x",)),), "e/@('x',)"),
    ],
)
def test_keys(parts: tuple[str, ...], key: str) -> None:
    assert _names.join("e", *parts) == key


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.lists(
            st.one_of(_KEY_TEXT, st.integers(-3, 3).map(_names.DictKey)), min_size=1, max_size=3
        ),
        min_size=2,
        max_size=2,
    )
)
def test_different_paths_never_share_a_key(paths: list[list[str]]) -> None:
    a, b = (tuple(p) for p in paths)
    if not _names.same_path(a, b):
        assert _names.join("e", *a) != _names.join("e", *b)
