"""What a load does with the live objects it restores into, beyond their tensors: param
groups (split, merged, named, tensor hyperparameters), a module's extra state, plain tensor
entries torch cannot write, live objects that raise, and tensors without strides. Each case
came from a hostile review (the fourth of the load path) and failed before its fix."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from tests.forge import read_manifest, write_manifest

from .load_helpers import flip

pytestmark = pytest.mark.timeout(120)


def two_layers() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.a = nn.Linear(3, 2)
    m.b = nn.Linear(2, 5)
    return m


def stepped(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.b(model.a(torch.randn(4, 3))).sum().backward()
    opt.step()


def test_live_groups_taking_one_saved_group_get_their_own_hyperparameters(
    tmp_path: Path,
) -> None:
    """One saved group with a tensor lr, loaded into two live groups: each gets its own
    tensor, so a per-group schedule sets one group's rate only (they shared one)."""
    src = two_layers()
    opt = torch.optim.AdamW(src.parameters(), lr=torch.tensor(0.1))
    stepped(src, opt)
    shardsafe.save(tmp_path / "c", {"model": src, "optimizer": opt})
    m = two_layers()
    o = torch.optim.AdamW(
        [
            {"params": m.a.parameters(), "lr": torch.tensor(0.5)},
            {"params": m.b.parameters(), "lr": torch.tensor(0.5)},
        ]
    )
    shardsafe.load(tmp_path / "c", {"model": m, "optimizer": o})
    g0, g1 = o.param_groups
    assert g0["lr"] is not g1["lr"]
    assert g0["betas"] is not g1["betas"] or isinstance(g0["betas"], tuple)
    torch.optim.lr_scheduler.LambdaLR(o, [lambda e: 1.0, lambda e: 0.0])
    assert float(g0["lr"]) == pytest.approx(0.1)
    assert float(g1["lr"]) == 0.0


def test_a_groups_param_names_stay_the_live_ones(tmp_path: Path) -> None:
    """Parameters ordered otherwise at load: the state is matched by name, and
    ``param_names`` keeps naming the live group's parameters in its order."""
    src = two_layers()
    opt = torch.optim.AdamW(src.named_parameters(), lr=1e-2)
    stepped(src, opt)
    shardsafe.save(tmp_path / "c", {"model": src, "optimizer": opt})
    m = two_layers()
    o = torch.optim.AdamW(list(m.named_parameters())[::-1], lr=1e-2)
    shardsafe.load(tmp_path / "c", {"model": m, "optimizer": o})
    group = o.param_groups[0]
    actual = {id(p): n for n, p in m.named_parameters()}
    assert group["param_names"] == [actual[id(p)] for p in group["params"]]
    assert group["param_names"] == ["b.bias", "b.weight", "a.bias", "a.weight"]
    saved = dict(src.named_parameters())
    for name, p in m.named_parameters():
        assert torch.equal(o.state[p]["exp_avg"], opt.state[saved[name]]["exp_avg"])


def test_saved_groups_differing_only_in_param_names_load_into_one(tmp_path: Path) -> None:
    src = two_layers()
    opt = torch.optim.AdamW(
        [
            {"params": list(src.a.named_parameters(prefix="a"))},
            {"params": list(src.b.named_parameters(prefix="b"))},
        ],
        lr=1e-2,
    )
    stepped(src, opt)
    shardsafe.save(tmp_path / "c", {"model": src, "optimizer": opt})
    m = two_layers()
    o = torch.optim.AdamW(m.named_parameters(), lr=0.5)
    shardsafe.load(tmp_path / "c", {"model": m, "optimizer": o})
    assert o.param_groups[0]["lr"] == 1e-2
    assert o.param_groups[0]["param_names"] == ["a.weight", "a.bias", "b.weight", "b.bias"]


def grouped(lrs: tuple[Any, Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
    m = two_layers()
    opt = torch.optim.AdamW(
        [{"params": m.a.parameters(), "lr": lrs[0]}, {"params": m.b.parameters(), "lr": lrs[1]}]
    )
    stepped(m, opt)
    return m, opt


def test_saved_groups_with_equal_tensor_hyperparameters_load_into_one(tmp_path: Path) -> None:
    src, opt = grouped((torch.tensor(0.1), torch.tensor(0.1)))
    shardsafe.save(tmp_path / "c", {"model": src, "optimizer": opt})
    m = two_layers()
    o = torch.optim.AdamW(m.parameters(), lr=torch.tensor(0.3))
    shardsafe.load(tmp_path / "c", {"model": m, "optimizer": o})
    assert float(o.param_groups[0]["lr"]) == pytest.approx(0.1)


def test_saved_groups_with_differing_tensor_hyperparameters_are_refused_before_restoring(
    tmp_path: Path,
) -> None:
    src, opt = grouped((torch.tensor(0.1), torch.tensor(0.2)))
    shardsafe.save(tmp_path / "c", {"model": src, "optimizer": opt})
    m = two_layers()
    before = [p.detach().clone() for p in m.parameters()]
    o = torch.optim.AdamW(m.parameters(), lr=torch.tensor(0.3))
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"model": m, "optimizer": o})
    assert str(info.value) == (
        "the checkpoint does not match the objects being loaded:\n  mismatched "
        "(1): optimizer: live param group 0 holds parameters that were saved in param "
        "groups 0 and 1, which have different hyperparameters; group the parameters as "
        "they were grouped when saving"
    )
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
    assert float(o.param_groups[0]["lr"]) == pytest.approx(0.3)


class Plain(nn.Module):
    def __init__(self, value: Any = 1.0) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.value = value


class WithExtra(Plain):
    """Extra state is the module's when its class defines get_extra_state (torch asks the
    class, not the instance)."""

    def get_extra_state(self) -> Any:
        return self.value

    def set_extra_state(self, state: Any) -> None:
        self.value = state


def test_strict_refuses_extra_state_missing_from_the_checkpoint(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"model": Plain()})
    live = WithExtra(value=99.0)
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"model": live})
    assert "missing from the checkpoint (1): model/_extra_state" in str(info.value)
    shardsafe.load(tmp_path / "c", {"model": live}, strict=False)
    assert live.value == 99.0


def test_strict_refuses_extra_state_the_live_module_has_no_place_for(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"model": WithExtra(value=3.0)})
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"model": Plain()})
    assert "unexpected in the checkpoint (1): model/_extra_state" in str(info.value)
    shardsafe.load(tmp_path / "c", {"model": Plain()}, strict=False)


def test_extra_state_given_as_a_tensor_of_any_size_reaches_set_extra_state(
    tmp_path: Path,
) -> None:
    """Serialized bytes as a uint8 tensor (as TransformerEngine's modules give), longer in
    the checkpoint than the live module's now: handed over as saved, as torch does."""
    saved = WithExtra()
    saved.value = torch.arange(34, dtype=torch.uint8)
    shardsafe.save(tmp_path / "c", {"model": saved})
    live = WithExtra(value=torch.zeros(20, dtype=torch.uint8))
    shardsafe.load(tmp_path / "c", {"model": live})
    assert torch.equal(live.value, torch.arange(34, dtype=torch.uint8))


@pytest.mark.parametrize("kind", ["inference", "expanded"])
def test_a_plain_tensor_entry_torch_cannot_write_is_refused_before_anything_is_restored(
    tmp_path: Path, kind: str
) -> None:
    shardsafe.save(tmp_path / "c", {"model": nn.Linear(4, 3), "stats": torch.ones(3, 4)})
    m = nn.Linear(4, 3)
    before = m.weight.detach().clone()
    if kind == "inference":
        with torch.inference_mode():
            stats = torch.zeros(3, 4)
        expected = "state['stats'] is an inference tensor (made under torch.inference_mode())"
    else:
        stats = torch.zeros(1, 4).expand(3, 4)
        expected = "state['stats'] is an expanded view (shape [3, 4], strides [0, 1])"
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"model": m, "stats": stats})
    assert str(info.value).startswith(expected)
    assert torch.equal(m.weight, before)


def raising_hook(module: nn.Module, state: Any, prefix: str, metadata: Any) -> None:
    raise RuntimeError("bug in the caller's state_dict hook")


def test_a_live_object_that_raises_is_not_called_a_damaged_checkpoint(tmp_path: Path) -> None:
    """A state_dict hook of the caller's raising while the load is planned: the error names
    the object, and the manager does not pass over good checkpoints as damaged."""
    manager = shardsafe.CheckpointManager(tmp_path / "run")
    for step in (1, 2):
        manager.save(step, {"model": nn.Linear(4, 3)})
    manager.close()
    live = nn.Linear(4, 3)
    live._register_state_dict_hook(raising_hook)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "could not load ..., looking for ..." would be one
        with pytest.raises(CheckpointError) as info:
            shardsafe.CheckpointManager(tmp_path / "run").load_latest({"model": live})
    assert not isinstance(info.value, CheckpointCorruptError)
    assert str(info.value).startswith(
        "state['model'] could not be loaded: ModuleAdapter.plan_load failed with "
        "RuntimeError: bug in the caller's state_dict hook. The live object fails when "
        "saved as well (RuntimeError: bug in the caller's state_dict hook), so the cause is "
        "the object (a hook of its own, or what it holds), not the checkpoint"
    )


def test_a_param_group_holding_what_is_not_a_parameter_is_named_as_the_cause(
    tmp_path: Path,
) -> None:
    src = nn.Linear(4, 3)
    opt = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    shardsafe.save(tmp_path / "c", {"model": src, "optimizer": opt})
    m = nn.Linear(4, 3)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    o.param_groups[0]["params"].append(None)
    with pytest.raises(CheckpointError) as info:
        shardsafe.load(tmp_path / "c", {"model": m, "optimizer": o})
    assert not isinstance(info.value, CheckpointCorruptError)
    assert "so the cause is the object" in str(info.value)


def test_a_damaged_entry_is_still_called_corrupt(tmp_path: Path) -> None:
    """The other side of the two tests above: metadata an adapter cannot make sense of,
    with live objects that save fine, stays a CheckpointCorruptError."""
    src = nn.Linear(4, 3)
    opt = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    shardsafe.save(tmp_path / "c", {"model": src, "optimizer": opt})
    doc = read_manifest(tmp_path / "c")
    doc["values"]["optimizer"]["meta"]["param_groups"][0]["hyper"] = {"params": 1}
    write_manifest(tmp_path / "c", doc)
    m = nn.Linear(4, 3)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointCorruptError, match="param group 0 holds no valid"):
        shardsafe.load(tmp_path / "c", {"model": m, "optimizer": o})


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "_mkldnn"])
def test_a_tensor_without_strides_is_refused_naming_its_layout(tmp_path: Path, layout: str) -> None:
    if layout == "_mkldnn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no mkldnn in this torch")

    class Holder(nn.Module):
        def __init__(self, b: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("b", b)

    shardsafe.save(tmp_path / "c", {"model": Holder(torch.arange(6.0).reshape(2, 3))})
    dense = torch.zeros(2, 3)
    made = {
        "sparse_coo": dense.to_sparse,
        "sparse_csr": dense.to_sparse_csr,
        "_mkldnn": dense.to_mkldnn,
    }[layout]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's beta warning for sparse CSR
        with pytest.raises(CheckpointMismatchError) as info:
            shardsafe.load(tmp_path / "c", {"model": Holder(made)})
    assert str(info.value) == (
        f"'b' is a {layout} tensor, which cannot hold a checkpoint's dense values in place "
        "(torch refuses to copy into it as well): make it dense (.to_dense()) before "
        "loading. Nothing was restored."
    )


class Columns(nn.Module):
    def __init__(self, views: list[torch.Tensor]) -> None:
        super().__init__()
        for i, v in enumerate(views):
            self.register_buffer(f"b{i:02d}", v)


def test_a_failed_fill_of_64_interleaved_views_gives_the_exact_account(tmp_path: Path) -> None:
    """64 column views of one matrix, the last one's bytes damaged: the account (63
    restored, the last partly overwritten) comes from one sweep of the group's bytes, not
    from a mask per pair of views (minutes at 256 MiB before)."""
    rows, k = 4096, 64
    shardsafe.save(
        tmp_path / "c", {"model": Columns([torch.full((rows,), i + 1.0) for i in range(k)])}
    )
    flip(tmp_path / "c", f"model/b{k - 1:02d}")
    base = torch.zeros(rows, k)
    with pytest.raises(CheckpointCorruptError) as info:
        shardsafe.load(
            tmp_path / "c",
            {"model": Columns([base[:, i] for i in range(k)])},
            verify="inline",
            read_threads=1,
        )
    assert "63 of the 64 tensors loaded in place hold the checkpoint's values" in str(info.value)
    assert "'model/b63' is partly overwritten, and the other 0 keep" in str(info.value)
    assert torch.equal(base[:, :63], torch.arange(1.0, 64.0).expand(rows, 63))


class BufferNamedLikeExtraState(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("_extra_state", torch.zeros(n))


def test_a_buffer_called_extra_state_is_still_a_buffer(tmp_path: Path) -> None:
    """Extra state is told by the class's get_extra_state, not by the name: a plain buffer
    called ``_extra_state`` keeps its shape check, and a mismatch restores nothing."""
    src = nn.Module()
    src.sub = BufferNamedLikeExtraState(3)
    shardsafe.save(tmp_path / "c", {"n": torch.ones(2), "model": src})
    live = nn.Module()
    live.sub = BufferNamedLikeExtraState(4)
    n = torch.zeros(2)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"sub\._extra_state: checkpoint float32\[3\], live float32\[4\]",
    ):
        shardsafe.load(tmp_path / "c", {"n": n, "model": live})
    assert torch.equal(n, torch.zeros(2))


def test_a_tensor_extra_state_reaches_a_module_whose_extra_state_is_none_now(
    tmp_path: Path,
) -> None:
    """Calibrated state saved as a tensor, loaded into a module not calibrated yet (its
    get_extra_state gives None): set_extra_state gets the tensor, as torch gives it."""
    saved = WithExtra(value=torch.tensor([1, 2, 3], dtype=torch.uint8))
    shardsafe.save(tmp_path / "c", {"model": saved})
    live = WithExtra(value=None)
    shardsafe.load(tmp_path / "c", {"model": live})
    assert torch.equal(live.value, torch.tensor([1, 2, 3], dtype=torch.uint8))


def test_saved_groups_with_nan_hyperparameters_still_merge(tmp_path: Path) -> None:
    """A NaN is equal to itself in a hyperparameter, float or tensor, as in the JSON."""
    src, opt = grouped((torch.tensor(float("nan")), torch.tensor(float("nan"))))
    for group in opt.param_groups:
        group["clip"] = float("nan")
    shardsafe.save(tmp_path / "c", {"model": src, "optimizer": opt})
    m = two_layers()
    o = torch.optim.AdamW(m.parameters(), lr=torch.tensor(0.3))
    shardsafe.load(tmp_path / "c", {"model": m, "optimizer": o})
    assert torch.isnan(o.param_groups[0]["lr"])
    assert o.param_groups[0]["clip"] != o.param_groups[0]["clip"]  # NaN


class Presenting(nn.Module):
    """Presents its inner module's keys without the ``inner.`` prefix (a checkpoint
    compatibility shim): its state-dict names are not its modules' names."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.inner = WithExtra(value=value)
        self._register_state_dict_hook(Presenting._strip)
        self._register_load_state_dict_pre_hook(Presenting._add)

    @staticmethod
    def _strip(module: nn.Module, state: dict[str, Any], prefix: str, local: Any) -> None:
        for k in [k for k in state if k.startswith(prefix + "inner.")]:
            state[prefix + k[len(prefix + "inner.") :]] = state.pop(k)

    @staticmethod
    def _add(state: dict[str, Any], prefix: str, *args: Any) -> None:
        for k in [k for k in state if k.startswith(prefix) and not k.startswith(prefix + "inner.")]:
            state[prefix + "inner." + k[len(prefix) :]] = state.pop(k)


@pytest.mark.parametrize("live", [None, torch.zeros(2, dtype=torch.int64)])
def test_extra_state_renamed_by_a_hook_is_still_extra_state(tmp_path: Path, live: Any) -> None:
    shardsafe.save(tmp_path / "c", {"model": Presenting(torch.arange(5))})
    model = Presenting(live)
    shardsafe.load(tmp_path / "c", {"model": model})
    assert torch.equal(model.inner.value, torch.arange(5))


class ExtraBesideANonPersistentBuffer(WithExtra):
    def __init__(self, value: Any = None) -> None:
        super().__init__(value)
        self.register_buffer("_extra_state", torch.zeros(1), persistent=False)


def test_a_non_persistent_buffer_does_not_hide_the_extra_state_of_its_name(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"model": ExtraBesideANonPersistentBuffer(torch.arange(4))})
    live = ExtraBesideANonPersistentBuffer()
    shardsafe.load(tmp_path / "c", {"model": live})
    assert torch.equal(live.value, torch.arange(4))


def test_tensor_hyperparameters_compare_as_floats_do(tmp_path: Path) -> None:
    """-0.0 and 0.0 merge, as two float hyperparameters do in the manifest's JSON."""
    src, opt = grouped((torch.tensor(0.0), torch.tensor(-0.0)))
    shardsafe.save(tmp_path / "c", {"model": src, "optimizer": opt})
    m = two_layers()
    o = torch.optim.AdamW(m.parameters(), lr=torch.tensor(0.3))
    shardsafe.load(tmp_path / "c", {"model": m, "optimizer": o})
    assert float(o.param_groups[0]["lr"]) == 0.0


def test_a_module_on_the_meta_device_is_refused_not_loaded_into_nothing(tmp_path: Path) -> None:
    """Built on meta (to be materialized later), it "loaded": torch only warned that a copy
    into a meta tensor is a no-op, and the run went on with no weights."""
    shardsafe.save(tmp_path / "c", {"model": torch.nn.Linear(2, 2), "x": torch.ones(2)})
    with torch.device("meta"):
        live = torch.nn.Linear(2, 2)
    for state, name in (({"model": live}, "'weight'"), ({"x": live.bias}, "state['x']")):
        with pytest.raises(shardsafe.CheckpointMismatchError) as caught:
            shardsafe.load(tmp_path / "c", state, strict=False)
        assert str(caught.value).startswith(f"{name} is on the meta device, which holds no data")
