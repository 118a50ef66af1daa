"""Conversions keep the structure they were given: empty dicts through DCP, a module's
extra state and dotless weights through torchtitan's flat layout, a plain file's
``state_dict`` key through ``--to torch`` (all found in review)."""

from __future__ import annotations

import collections
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.converters.flat_layout import unflatten

pytestmark = pytest.mark.timeout(120)

COUNTER_WARNING = (
    "shardsafe: DCP stores every dict as a plain dict, so the Counter at "
    "['sched']['milestones'] (and any other dict of another type) reads back as a dict "
    "unless loaded into a state dict of your own (dcp.load keeps its containers). Convert "
    "--to torch or --to shardsafe to keep its type"
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: Any, b: Any) -> None:
    """``a`` and ``b`` hold the same containers of the same types, keys in the same
    order, tensors bitwise."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _to_torch(src: Path, dst: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the pickle note
        shardsafe.convert(src, dst, to="torch", progress=False)
    return torch.load(dst, weights_only=True)


def _sched() -> dict[str, Any]:
    return {
        "milestones": collections.Counter({"3": 1}),
        "cfg": {},
        "hist": [{}, torch.ones(1)],
        "lists": [[], [torch.ones(1)]],
        "nested": [[{}], {"a": {}}],
    }


def _lightning_parts() -> dict[str, Any]:
    """What a real Lightning last.ckpt holds that is empty: each loop's ``state_dict``,
    ModelCheckpoint's ``best_k_models``."""
    return {
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_k_models": {}, "kth": 0.5}},
    }


def test_empty_dicts_survive_dcp_and_a_counter_is_warned_about(tmp_path: Path) -> None:
    """An empty dict stored no DCP item: ``cfg`` vanished, ``hist`` read back as
    ``{1: tensor}`` and a Lightning checkpoint lost every loop's ``state_dict``, all in
    silence; the Counter became a dict without a word."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    source = {"model": {"w": torch.arange(4.0)}, "sched": _sched(), **_lightning_parts()}
    torch.save(source, tmp_path / "src.pt")
    with pytest.warns(UserWarning) as said:
        shardsafe.convert(tmp_path / "src.pt", tmp_path / "dcp", to="dcp", progress=False)
    assert [str(w.message) for w in said] == [COUNTER_WARNING]

    expected = {**source, "sched": {**_sched(), "milestones": {"3": 1}}}
    _same(_to_torch(tmp_path / "dcp", tmp_path / "back.pt"), expected)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "theirs.pt")  # torch's own reader
    _same(torch.load(tmp_path / "theirs.pt", weights_only=True), expected)
    shardsafe.convert(tmp_path / "dcp", tmp_path / "ss", progress=False)
    restored = shardsafe.load(tmp_path / "ss", {})  # the plain values
    _same(restored["sched"], expected["sched"])
    _same(restored["loops"], expected["loops"])


def test_an_empty_dict_is_a_dcp_bytes_item(tmp_path: Path) -> None:
    """Stored as an empty list already was: one bytes item under its flattened key,
    ``planner_data`` naming its path (list indices as ints)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    s = {"cfg": {}, "hist": [{}, torch.ones(1)], "l": [], "e": [{}, [{"a": {}}]], "x": [{}, 1]}
    torch.save({"s": s}, tmp_path / "src.pt")
    shardsafe.convert(tmp_path / "src.pt", tmp_path / "dcp", to="dcp", progress=False)
    md = FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    kinds = {k: type(v).__name__ for k, v in md.state_dict_metadata.items()}
    assert kinds == {
        "s.cfg": "BytesStorageMetadata",
        "s.hist.0": "BytesStorageMetadata",
        "s.hist.1": "TensorStorageMetadata",
        "s.l": "BytesStorageMetadata",
        "s.e": "BytesStorageMetadata",  # only empty dicts: whole (dcp.load asks for none)
        "s.x": "BytesStorageMetadata",  # beside plain items only: whole, as dcp.load asks
    }
    assert isinstance(md.state_dict_metadata["s.cfg"], BytesStorageMetadata)
    assert md.planner_data == {
        "s.cfg": ("s", "cfg"),
        "s.hist.0": ("s", "hist", 0),
        "s.hist.1": ("s", "hist", 1),
        "s.l": ("s", "l"),
        "s.e": ("s", "e"),
        "s.x": ("s", "x"),
    }


def _zeroed(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _zeroed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_zeroed(v) for v in value]
    return value


LISTS = {
    "empty then tensor": [{}, torch.ones(2)],
    "empty then plain": [{}, 1],
    "empty list then empty dict": [[], {}],
    "empty then dict": [{}, {"b": 1}],
    "dict of empty then dict": [{"a": {}}, {"b": 1}],
    "inner empty then plain, dict": [[{}, 1], {"b": 1}],
    "inner empty then tensor, plain": [[{}, torch.ones(1)], 1],
    "only empties": [{}, [{"a": {}}]],
    "dict of empty": {"a": {}, "b": [{}]},
}


@pytest.mark.parametrize("name", LISTS)
def test_empty_dicts_in_lists_read_back_through_every_dcp_reader(tmp_path: Path, name: str) -> None:
    """Each shape reads back as written through ``dcp.load`` into a template of that
    shape, ``dcp_to_torch_save`` and shardsafe's reader (``dcp.load`` looks ``[{}, 1]``
    up whole and ``[{}, t]``'s ``{}`` as ``x.0``: torch's own save stores neither)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    source = {"w": torch.arange(3.0), "x": LISTS[name]}
    torch.save(source, tmp_path / "src.pt")
    shardsafe.convert(tmp_path / "src.pt", tmp_path / "dcp", to="dcp", progress=False)
    template = _zeroed(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
        dcp.load(template, checkpoint_id=str(tmp_path / "dcp"))
    _same(template, source)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "theirs.pt")
    _same(torch.load(tmp_path / "theirs.pt", weights_only=True), source)
    _same(_to_torch(tmp_path / "dcp", tmp_path / "back.pt"), source)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_dcp_load_of_get_state_dict_templates_still_works(tmp_path: Path, momentum: float) -> None:
    """An optimizer with no state (SGD without momentum) now has ``optimizer.state``
    stored as ``{}``: ``dcp.load`` of ``get_state_dict``'s dicts, which flattens its
    empty ``state`` to nothing, still finds every key it asks for, and shardsafe reads the
    optimizer back as one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    extra = {"cfg": {}, "hist": [{}, 1], "e": [{}], "n": {"a": {}}}
    shardsafe.save(tmp_path / "ss", {"model": model, "optimizer": opt, "step": 4, "extra": extra})
    shardsafe.convert(tmp_path / "ss", tmp_path / "dcp", to="dcp", progress=False)

    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=momentum)
    if momentum:  # a state to load into: make one
        fresh(torch.ones(1, 3)).sum().backward()
        fresh_opt.step()
    msd, osd = get_state_dict(fresh, fresh_opt)
    assert (osd["state"] == {}) is (not momentum)
    template = {"model": msd, "optimizer": osd, "step": 0, "extra": {"hist": [{}, 0]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
        dcp.load(template, checkpoint_id=str(tmp_path / "dcp"))
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    assert template["step"] == 4 and template["extra"] == {"hist": [{}, 1]}
    _same(fresh.state_dict(), model.state_dict())
    _same(fresh_opt.state_dict(), opt.state_dict())

    shardsafe.convert(tmp_path / "dcp", tmp_path / "back", progress=False)
    kinds = {k: v.kind for k, v in shardsafe.read_manifest(tmp_path / "back").values.items()}
    assert kinds == {"model": "module", "optimizer": "optimizer", "step": "value", "extra": "value"}
    _same(shardsafe.load(tmp_path / "back", {})["extra"], extra)


class _WithExtra(torch.nn.Linear):
    """A submodule whose ``get_extra_state`` is plain data, not a tensor."""

    got: Any = None

    def get_extra_state(self) -> Any:
        return {"scale": 2.0, "mode": "x"}

    def set_extra_state(self, state: Any) -> None:
        self.got = state


def test_flat_layout_keeps_extra_state_in_the_model(tmp_path: Path) -> None:
    """``0._extra_state`` written at the top level by ``--dcp-layout flat`` was read back as
    an entry of its own: strict load then failed, missing ``model/0._extra_state``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_WithExtra(3, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    shardsafe.save(tmp_path / "ss", {"model": model, "optimizer": opt})
    shardsafe.convert(tmp_path / "ss", tmp_path / "flat", to="dcp", dcp_layout="flat")
    shardsafe.convert(tmp_path / "flat", tmp_path / "back", progress=False)
    kinds = {k: v.kind for k, v in shardsafe.read_manifest(tmp_path / "back").values.items()}
    assert kinds == {"model": "module", "optimizer": "optimizer"}
    fresh = torch.nn.Sequential(_WithExtra(3, 3), torch.nn.Linear(3, 2))
    fresh_opt = torch.optim.Adam(fresh.parameters())
    shardsafe.load(tmp_path / "back", {"model": fresh, "optimizer": fresh_opt})
    assert fresh[0].got == {"scale": 2.0, "mode": "x"}
    _same(
        {k: v for k, v in fresh.state_dict().items() if not k.endswith("_extra_state")},
        {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")},
    )
    _same(fresh_opt.state_dict(), opt.state_dict())
    _same(
        _to_torch(tmp_path / "back", tmp_path / "b.pt"),
        _to_torch(tmp_path / "ss", tmp_path / "a.pt"),
    )


class _Dotless(torch.nn.Module):
    """A parameter at the top of the module (ViT's ``cls_token``) beside a submodule's."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.arange(3.0))
        self.lin = torch.nn.Linear(3, 3)


def test_flat_layout_reads_a_dotless_weight_into_the_model(tmp_path: Path) -> None:
    """``scale`` beside ``lin.weight`` (and a plain ``step``): every top-level tensor had
    to be dotted, so none became ``model`` and each weight was a value of its own."""
    torch.manual_seed(0)
    model = _Dotless()
    shardsafe.save(tmp_path / "ss", {"model": model, "step": 5})
    shardsafe.convert(tmp_path / "ss", tmp_path / "flat", to="dcp", dcp_layout="flat")
    shardsafe.convert(tmp_path / "flat", tmp_path / "back", progress=False)
    kinds = {k: v.kind for k, v in shardsafe.read_manifest(tmp_path / "back").values.items()}
    assert kinds == {"model": "module", "step": "value"}
    fresh = _Dotless()
    restored = shardsafe.load(tmp_path / "back", {"model": fresh, "step": 0})
    assert restored["step"] == 5
    _same(fresh.state_dict(), model.state_dict())


def test_unflatten_moves_tensors_only_beside_a_dotted_name() -> None:
    w, v = torch.ones(2), torch.zeros(3)
    assert unflatten({"w": w}) == {"w": w}  # a lone dotless tensor stays a value
    assert unflatten({"w": w, "b": v, "step": 1}) == {"w": w, "b": v, "step": 1}
    extra = {"mode": "x"}
    moved = unflatten({"w": w, "a.b": v, "a._extra_state": extra, "_extra_state": 1, "step": 2})
    assert list(moved) == ["model", "step"] and moved["step"] == 2
    assert list(moved["model"]) == ["w", "a.b", "a._extra_state", "_extra_state"]
    assert moved["model"]["w"] is w and moved["model"]["a.b"] is v
    assert moved["model"]["a._extra_state"] is extra and moved["model"]["_extra_state"] == 1
    # the tree's own "model": nothing moves, extra state included
    own = {"model": {"x": w}, "a.b": v, "a._extra_state": extra}
    assert unflatten(own) == own


def test_a_plain_files_state_dict_keeps_its_name(tmp_path: Path) -> None:
    """``{"state_dict": sd, "epoch": 3, "arch": "linear"}`` (timm's, torchvision's) came
    back from ``--to torch`` with ``model`` for ``state_dict``: its user's code failed on
    ``KeyError: 'state_dict'``. Only a Lightning checkpoint's is renamed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    source = {"state_dict": model.state_dict(), "epoch": 3, "arch": "linear"}
    torch.save(source, tmp_path / "src.pth")
    expected = {**source, "state_dict": dict(model.state_dict())}
    _same(_to_torch(tmp_path / "src.pth", tmp_path / "direct.pth"), expected)
    shardsafe.convert(tmp_path / "src.pth", tmp_path / "ss", progress=False)
    _same(_to_torch(tmp_path / "ss", tmp_path / "back.pth"), expected)
    fresh = torch.nn.Linear(3, 2)
    restored = shardsafe.load(tmp_path / "ss", {"state_dict": fresh})
    assert restored["epoch"] == 3 and restored["arch"] == "linear"
    _same(fresh.state_dict(), model.state_dict())


def test_a_lightning_ckpts_state_dict_is_still_the_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    source = {
        "epoch": 3,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"state_dict": {}}},
    }
    torch.save(source, tmp_path / "last.ckpt")
    shardsafe.convert(tmp_path / "last.ckpt", tmp_path / "ss", progress=False)
    fresh = torch.nn.Linear(3, 2)
    shardsafe.load(tmp_path / "ss", {"model": fresh})
    _same(fresh.state_dict(), model.state_dict())
    expected = {**source, "state_dict": dict(model.state_dict())}  # keys in their order
    _same(_to_torch(tmp_path / "ss", tmp_path / "back.ckpt"), expected)
    _same(_to_torch(tmp_path / "last.ckpt", tmp_path / "direct.ckpt"), expected)
