"""A save checks its manifest once, before any data is written, and commits without
parsing it again: what ``load`` would refuse is refused with nothing written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.checkpoint import saving
from shardsafe.checkpoint.storage.local import LocalStorage
from shardsafe.protocol import LoadContext, LoadRequests, SaveContext, SavedValue, SaveItem


class _Recording(LocalStorage):
    """Records every file a save creates (class-wide: a factory makes one per directory)."""

    created: list[str] = []

    def create(self, name: str, size_hint: int = 0) -> Any:
        _Recording.created.append(name)
        return super().create(name, size_hint)


class _Deep:
    """A value whose adapter records metadata nested deeper than a manifest holds (plain
    values deeper than that are refused earlier, by ``_tree.encode``, naming their entry)."""


class _DeepAdapter(shardsafe.Adapter):
    kind = "too-deep"

    def handles(self, obj: object) -> bool:
        return isinstance(obj, _Deep)

    def save(self, obj: Any, ctx: SaveContext) -> SaveItem:
        meta: Any = 1
        for _ in range(120):
            meta = [meta]
        return SaveItem(self.kind, meta, [])

    def plan_load(self, obj: Any, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        return LoadRequests()

    def restore(self, obj: Any, saved: SavedValue, tensors: Any, ctx: LoadContext) -> None:
        pass


def _deep() -> _Deep:
    shardsafe.register_adapter(_DeepAdapter())
    return _Deep()


def test_what_load_would_refuse_is_refused_before_any_data_file_is_created(
    tmp_path: Path,
) -> None:
    _Recording.created = []
    state = {"model": nn.Linear(4, 4), "deep": _deep()}
    with pytest.raises(shardsafe.CheckpointError) as refused:
        shardsafe.save(tmp_path / "c", state, storage=_Recording)
    assert "refusing to save a checkpoint that shardsafe could not load back" in str(refused.value)
    assert str(refused.value).endswith("(nothing was written)")
    assert [n for n in _Recording.created if n.endswith(".safetensors")] == []


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_a_save_parses_its_manifest_once_and_writes_what_it_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    parsed: list[bytes] = []
    real = saving.parse

    def counting(raw: bytes, where: str = "manifest.json") -> Any:
        parsed.append(raw)
        return real(raw, where)

    monkeypatch.setattr(saving, "parse", counting)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    shardsafe.save(tmp_path / "c", {"model": model, "step": 3}, layout=layout)
    assert len(parsed) == 1
    checked = real(parsed[0])
    written = shardsafe.read_manifest(tmp_path / "c")
    # The same manifest but for what only the writers know: the checksums.
    assert written.files == checked.files
    assert written.values == checked.values
    assert {k: (r.dtype, r.shape) for k, r in written.tensors.items()} == {
        k: (r.dtype, r.shape) for k, r in checked.tensors.items()
    }
    assert all(c.crc32 == (0xFFFFFFFF,) for r in checked.tensors.values() for c in r.chunks)
    loaded = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    assert shardsafe.load(tmp_path / "c", {"model": loaded}) == {"step": 3}
    for a, b in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(a, b)


def test_a_background_save_refuses_it_too_and_commits_nothing(tmp_path: Path) -> None:
    handle = shardsafe.async_save(tmp_path / "c", {"model": nn.Linear(4, 4), "deep": _deep()})
    with pytest.raises(shardsafe.CheckpointError, match="could not load back"):
        handle.wait()
    assert not (tmp_path / "c" / "manifest.json").exists()
    assert not (tmp_path / "c").exists() or list((tmp_path / "c").iterdir()) == []


def _wrapped_buffer() -> nn.Module:
    from torch.testing._internal.two_tensor import TwoTensor

    module = nn.Module()
    module.register_buffer("b", TwoTensor(torch.ones(64, 64), torch.ones(64, 64)))
    return module


@pytest.mark.parametrize(
    ("state", "what"),
    [
        # A wrapper subclass has no memory of its own: reading it as if it had crashed
        # the interpreter (a segfault in the checksum) before this check.
        (lambda: {"model": _wrapped_buffer()}, "tensor 'model/b' of state['model'] is a TwoTensor"),
        (lambda: {"x": torch.ones(4, device="meta")}, "is on the meta device, with no data"),
        (lambda: {"x": torch.ones(4).to_sparse()}, "is a torch.sparse_coo tensor"),
    ],
)
def test_a_tensor_without_readable_bytes_is_refused_before_anything_is_written(
    tmp_path: Path, state: Any, what: str
) -> None:
    for save in (shardsafe.save, lambda *a, **k: shardsafe.async_save(*a, **k).wait()):
        _Recording.created = []
        with pytest.raises(shardsafe.CheckpointError, match="nothing was written") as refused:
            save(tmp_path / "c", state(), storage=_Recording)
        assert what in str(refused.value)
        assert _Recording.created == []
        assert not (tmp_path / "c").exists() or list((tmp_path / "c").iterdir()) == []


class _Unwrapping(torch.Tensor):
    """A wrapper subclass that hands its inner tensor to every op but a few, as torchao's
    float8 weight wrappers (``WeightWithDynamicFloat8CastTensor``) do: its bytes, as the
    writer views them, are a plain tensor's, so it saves."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Unwrapping:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.size(), strides=inner.stride(), dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self._inner = inner

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any, kwargs: Any = None) -> Any:
        if func == torch.ops.aten.detach.default:
            return _Unwrapping(args[0]._inner)
        unwrap = lambda x: x._inner if isinstance(x, _Unwrapping) else x  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})

    __torch_function__ = torch._C._disabled_torch_function_impl


def test_a_wrapper_whose_bytes_are_a_plain_tensors_saves_and_loads_bitwise(tmp_path: Path) -> None:
    linear = nn.Linear(4, 4)
    weight = torch.arange(16.0).reshape(4, 4)
    linear.weight = nn.Parameter(_Unwrapping(weight.clone()))
    shardsafe.save(tmp_path / "c", {"model": linear})
    fresh = nn.Linear(4, 4)
    shardsafe.load(tmp_path / "c", {"model": fresh})
    assert torch.equal(fresh.weight, weight) and torch.equal(fresh.bias, linear.bias)


def test_a_pending_conjugation_is_refused_with_the_fix(tmp_path: Path) -> None:
    negated = torch.ones(4)._neg_view()  # a lazily negated view (as conj() of a complex)
    with pytest.raises(shardsafe.CheckpointError, match=r"resolve_conj\(\).resolve_neg\(\)"):
        shardsafe.save(tmp_path / "c", {"x": negated})
    assert not (tmp_path / "c").exists() or list((tmp_path / "c").iterdir()) == []


def test_reading_the_bytes_of_a_tensor_without_memory_is_an_error_not_a_crash() -> None:
    from torch.testing._internal.two_tensor import TwoTensor

    from shardsafe.checkpoint.format.tensor_bytes import memory

    with pytest.raises(ValueError, match="needs a tensor with memory of its own, not a TwoTensor"):
        memory(TwoTensor(torch.ones(4), torch.ones(4)))


def _buffer_named_metadata() -> nn.Module:
    module = nn.Module()
    module.register_buffer("__metadata__", torch.ones(2))
    return module


@pytest.mark.parametrize(
    ("layout", "state", "key"),
    [
        ("sharded", {"__metadata__": torch.ones(2)}, "__metadata__"),
        ("consolidated", {"__metadata__": torch.ones(2)}, "__metadata__"),
        ("consolidated", {"x": {"__metadata__": torch.ones(2)}}, "x/__metadata__"),
        ("consolidated", {"model": _buffer_named_metadata()}, "model/__metadata__"),
    ],
)
@pytest.mark.parametrize("background", [False, True])
def test_a_tensor_stored_as_metadata_is_refused_with_nothing_written(
    tmp_path: Path, layout: str, state: dict[str, Any], key: str, background: bool
) -> None:
    """A tensor stored as ``__metadata__`` replaced the safetensors header's metadata: the
    save committed a checkpoint whose every load raised CheckpointCorruptError."""
    path = tmp_path / "c"
    with pytest.raises(shardsafe.CheckpointError) as refused:
        if background:
            shardsafe.async_save(path, state, layout=layout).wait()
        else:
            shardsafe.save(path, state, layout=layout)
    assert f"cannot save tensor {key!r}: it would be stored as '__metadata__'" in str(refused.value)
    assert not path.exists()
