"""Live tensors that are not plain dense memory, as load targets: wrapper subclasses,
views with a pending conjugation, expanded views, inference tensors, tied views that
interleave; and a caller whose default device is not the CPU.

Each load either restores the checkpoint's exact values or refuses before anything is
restored, and an error met part-way says exactly what each target now holds
(``io/in_place.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import shardsafe
from shardsafe import CheckpointCorruptError, CheckpointMismatchError

from .load_helpers import flip

MODES = ["first", "inline"]


class Buffers(nn.Module):
    """Buffers ``b0``, ``b1``, ... as given (``b000``, ``b001``, ... with ``digits=3``)."""

    def __init__(self, *buffers: torch.Tensor, digits: int = 1) -> None:
        super().__init__()
        for i, b in enumerate(buffers):
            self.register_buffer(f"b{i:0{digits}d}", b)


def values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_contiguous_wrapper_subclass_targets_are_written_through_their_own_copy(
    tmp_path: Path, mode: str, threads: int
) -> None:
    """A contiguous TwoTensor has no memory of its own to read into: before, its load
    failed part-way with "memory() needs a tensor with memory of its own"."""
    saved = Buffers(*[torch.full((64, 64), float(i + 1)) for i in range(4)])
    shardsafe.save(tmp_path / "c", {"model": saved})
    target = Buffers(*[TwoTensor(torch.zeros(64, 64), torch.zeros(64, 64)) for _ in range(4)])
    shardsafe.load(tmp_path / "c", {"model": target}, verify=mode, read_threads=threads)
    for i in range(4):
        buf = getattr(target, f"b{i}")
        assert torch.equal(buf.a, saved.b0 * 0 + i + 1) and torch.equal(buf.b, buf.a)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_a_conjugate_view_target_gets_the_checkpoints_values_not_their_conjugates(
    tmp_path: Path, mode: str, threads: int
) -> None:
    """Its memory holds the conjugates of its values: raw bytes written into it came back
    conjugated, silently, before."""
    z = torch.tensor([1 + 2j, 3 - 4j, -5 + 6j], dtype=torch.complex64)
    shardsafe.save(tmp_path / "c", {"model": Buffers(z, torch.randn(8))})
    base = torch.zeros(3, dtype=torch.complex64)
    target = Buffers(base.conj(), torch.zeros(8))
    assert target.b0.is_conj() and target.b0.is_contiguous()
    shardsafe.load(tmp_path / "c", {"model": target}, verify=mode, read_threads=threads)
    assert torch.equal(target.b0.resolve_conj(), z)


@pytest.mark.parametrize("mode", MODES)
def test_an_expanded_target_is_refused_before_anything_is_restored(
    tmp_path: Path, mode: str
) -> None:
    shardsafe.save(tmp_path / "c", {"model": Buffers(*[torch.randn(3, 2) for _ in range(3)])})
    target = Buffers(torch.zeros(3, 2), torch.zeros(1, 2).expand(3, 2), torch.zeros(3, 2))
    before = values(target)
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "c", {"model": target}, verify=mode, read_threads=2)
    assert "'b1' is an expanded view (shape [3, 2], strides [0, 1])" in str(info.value)
    assert "Nothing was restored" in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


@pytest.mark.parametrize("mode", MODES)
def test_inference_tensors_load_inside_inference_mode_and_are_refused_outside(
    tmp_path: Path, mode: str
) -> None:
    """torch lets nothing write an inference tensor outside inference mode; raw writes
    into a contiguous one slipped past that check before, and a strided one failed
    part-way."""
    saved = Buffers(torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))
    shardsafe.save(tmp_path / "c", {"model": saved})
    with torch.inference_mode():
        target = Buffers(torch.zeros(4, 4), torch.zeros(4, 4).t(), torch.zeros(4, 4))
    with pytest.raises(CheckpointMismatchError, match="'b0' is an inference tensor") as info:
        shardsafe.load(tmp_path / "c", {"model": target}, verify=mode, read_threads=2)
    assert "load inside `with torch.inference_mode():`" in str(info.value)
    assert all(bool((v == 0).all()) for v in target.state_dict().values())
    with torch.inference_mode():
        shardsafe.load(tmp_path / "c", {"model": target}, verify=mode, read_threads=2)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in saved.state_dict().items())


TIED_REFUSAL = (
    "the checkpoint holds different values for 'model/0.weight' and 'model/1.weight', which "
    "the objects being loaded tie (one tensor under both names, as a tied embedding and "
    "output layer): the load would keep the values of one and drop the other's. The "
    "checkpoint was saved untied: load it into the model untied as it was saved, or pass "
    "strict=False to load it anyway, the tied tensor holding one of the two"
)


def tied_pair(tied: bool) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False), nn.Linear(4, 2))
    if tied:
        model[1].weight = model[0].weight
    return model


def test_an_untied_checkpoint_is_refused_by_a_tied_model_and_a_tied_one_loads_either_way(
    tmp_path: Path,
) -> None:
    """Two keys a load writes into one tied tensor: saved untied (different values), the
    load kept one and dropped the other in silence, as load_state_dict does. Now refused
    before anything is restored, found from the chunks' checksums; saved tied, it loads
    into a tied model and into an untied one."""
    torch.manual_seed(0)
    untied = tied_pair(tied=False)
    shardsafe.save(tmp_path / "untied", {"model": untied})
    target = tied_pair(tied=True)
    before = values(target)
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tmp_path / "untied", {"model": target})
    assert str(info.value) == TIED_REFUSAL
    assert all(torch.equal(values(target)[k], v) for k, v in before.items())

    with pytest.warns(UserWarning) as said:
        shardsafe.load(tmp_path / "untied", {"model": target}, strict=False)
    assert [str(w.message) for w in said] == [
        "shardsafe: strict=False loads 'model/0.weight' and 'model/1.weight' into one tied "
        "tensor although the checkpoint holds different values for them (it was saved "
        "untied): that tensor holds the values of one of them, and the other's are dropped"
    ]
    assert any(torch.equal(target[0].weight, untied[i].weight) for i in (0, 1))
    assert torch.equal(target[2].weight, untied[2].weight)

    shardsafe.save(tmp_path / "tied", {"model": target})
    for tie in (True, False):
        again = tied_pair(tied=tie)
        shardsafe.load(tmp_path / "tied", {"model": again})
        assert all(torch.equal(values(again)[k], v) for k, v in values(target).items())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_tied_target_overwritten_by_its_later_twin_is_said_to_hold_the_twins_values(
    tmp_path: Path, threads: int
) -> None:
    """Tied weights from a checkpoint that holds them untied: the later key's values win
    (as in load_state_dict); when a later tensor fails, the earlier twin is not called
    restored."""
    untied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    untied.append(nn.Linear(256, 256, bias=False))
    with torch.no_grad():
        untied[0].weight.fill_(1.0)
        untied[1].weight.fill_(2.0)
    shardsafe.save(tmp_path / "c", {"model": untied}, layout="consolidated")
    flip(tmp_path / "c", "model/2.weight")
    tied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    tied.append(nn.Linear(256, 256, bias=False))
    tied[1].weight = tied[0].weight
    with (
        pytest.raises(CheckpointCorruptError) as info,
        pytest.warns(UserWarning, match="saved untied"),
    ):
        shardsafe.load(
            tmp_path / "c", {"model": tied}, verify="inline", read_threads=threads, strict=False
        )
    assert bool((tied[0].weight == 2.0).all())
    assert (
        "1 of the 3 tensors loaded in place hold the checkpoint's values ('model/1.weight'), "
        "'model/0.weight' shares its memory with 'model/1.weight' and holds that key's "
        "values, 'model/2.weight' is partly overwritten, and the other 0 keep their "
        "previous values"
    ) in str(info.value)


@pytest.mark.parametrize("threads", [1, 2])
def test_interleaved_views_that_share_no_element_are_accounted_exactly(
    tmp_path: Path, threads: int
) -> None:
    """The even and odd columns of one tensor: their byte ranges meet, their elements do
    not, so the one restored before the other failed holds the checkpoint's values."""
    shardsafe.save(
        tmp_path / "c",
        {"model": Buffers(torch.full((256, 64), 1.0), torch.full((256, 64), 2.0))},
        layout="consolidated",
    )
    flip(tmp_path / "c", "model/b1")
    w = torch.zeros(256, 128)
    target = Buffers(w[:, 0::2], w[:, 1::2])
    with pytest.raises(CheckpointCorruptError) as info:
        shardsafe.load(tmp_path / "c", {"model": target}, verify="inline", read_threads=threads)
    assert bool((target.b0 == 1.0).all())
    assert (
        "1 of the 2 tensors loaded in place hold the checkpoint's values ('model/b0'), "
        "'model/b1' is partly overwritten, and the other 0 keep their previous values"
    ) in str(info.value)


def test_wrapper_subclass_targets_are_accounted_by_the_tensors_they_wrap(
    tmp_path: Path,
) -> None:
    """Four TwoTensors, each wrapping memory of its own: one failing leaves the others as
    they are (restored, or untouched after it), not all "partly overwritten"."""
    shardsafe.save(
        tmp_path / "c",
        {"model": Buffers(*[torch.full((64, 64), float(i + 1)) for i in range(4)])},
        layout="consolidated",
    )
    flip(tmp_path / "c", "model/b1")
    target = Buffers(*[TwoTensor(torch.zeros(64, 64), torch.zeros(64, 64)) for _ in range(4)])
    with pytest.raises(CheckpointCorruptError) as info:
        shardsafe.load(tmp_path / "c", {"model": target}, verify="inline", read_threads=1)
    assert bool((target.b0.a == 1.0).all()) and bool((target.b0.b == 1.0).all())
    assert all(bool((getattr(target, f"b{i}").a == 0.0).all()) for i in (2, 3))
    assert (
        "1 of the 4 tensors loaded in place hold the checkpoint's values ('model/b0'), "
        "'model/b1' is partly overwritten, and the other 2 keep their previous values"
    ) in str(info.value)


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_a_caller_whose_default_device_is_not_the_cpu_saves_and_loads(
    tmp_path: Path, layout: str
) -> None:
    """``torch.set_default_device("cuda")`` is common in GPU code; shardsafe's own
    buffers and tables are on the CPU whatever it is (meta here: nothing on it can be
    read, so any allocation that followed it would fail)."""
    torch.manual_seed(0)
    model, opt = trained()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = trained()
    torch.set_default_device("meta")
    try:
        shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt}, layout=layout)
        shardsafe.async_save(tmp_path / "a", {"model": model, "optimizer": opt}).wait()
        for threads in (1, 2):
            for mode in MODES:
                shardsafe.load(
                    tmp_path / "a",
                    {"model": fresh, "optimizer": fresh_opt},
                    verify=mode,
                    read_threads=threads,
                )
        assert shardsafe.verify(tmp_path / "c").problems == ()
        shardsafe.inspect(tmp_path / "c")
    finally:
        torch.set_default_device(None)
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("mode", MODES)
def test_any_failure_part_way_says_what_each_target_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Not only a bad byte: whatever stops the fill (here a copy that raises once it has
    begun writing, as a tensor subclass's copy_ may) is reported with the account of
    what was restored, and not blamed on a modified file."""
    from shardsafe.checkpoint.io.reader import CheckpointReader

    saved = Buffers(*[torch.full((8, 8), float(i + 1)) for i in range(3)])
    shardsafe.save(tmp_path / "c", {"model": saved}, layout="consolidated")
    real = CheckpointReader.read_into

    def read_into(self: CheckpointReader, key: str, *args: object) -> None:
        real(self, key, *args)  # type: ignore[arg-type]
        if key == "model/b1":
            raise RuntimeError("the copy was refused")

    monkeypatch.setattr(CheckpointReader, "read_into", read_into)
    target = Buffers(*[torch.zeros(8, 8) for _ in range(3)])
    with pytest.raises(shardsafe.CheckpointError) as info:
        shardsafe.load(tmp_path / "c", {"model": target}, verify=mode, read_threads=1)
    assert str(info.value).startswith(
        "RuntimeError: the copy was refused. This was found while restoring: each tensor "
        "is copied into its live object as it is read. On rank 0, 1 of the 3 tensors "
        "loaded in place hold the checkpoint's values ('model/b0'), 'model/b1' is partly "
        "overwritten, and the other 1 keep their previous values"
    )
    assert bool((target.b0 == 1.0).all()) and bool((target.b2 == 0.0).all())


def test_conversions_and_tiers_run_under_a_non_cpu_default_device(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, opt = trained()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt})
    fresh, _ = trained()
    torch.set_default_device("meta")
    try:
        for to in ("dcp", "hf", "shardsafe"):
            shardsafe.convert(tmp_path / "c", tmp_path / f"out-{to}", to=to, only=["model"])
        with pytest.warns(UserWarning, match="the job runs on 1 node"):
            tiers = shardsafe.TieredCheckpointManager(
                tmp_path / "persistent", tmp_path / "local", local_every=1, persist_every=2
            )
        tiers.save(1, {"model": model, "optimizer": opt})
        tiers.wait()
        tiers.load_latest({"model": fresh})
        tiers.close()
    finally:
        torch.set_default_device(None)
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())
    assert shardsafe.verify(tmp_path / "out-shardsafe").problems == ()


class OwnLoading(nn.Module):
    """An expanded buffer the module's own loading gives memory before torch copies."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1).expand(4))

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        self.scale = self.scale.clone()
        super()._load_from_state_dict(state_dict, prefix, *args)


class PreHooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1).expand(4))
        self._register_load_state_dict_pre_hook(self._own_memory)

    def _own_memory(self, *args: Any) -> None:
        self.scale = self.scale.clone()


@pytest.mark.parametrize("cls", [OwnLoading, PreHooked])
def test_an_expanded_buffer_a_modules_own_loading_handles_is_not_refused(
    tmp_path: Path, cls: type[nn.Module]
) -> None:
    """torch's load_state_dict loads these modules; so does shardsafe."""
    saved = cls()
    saved.scale = torch.arange(4.0)
    shardsafe.save(tmp_path / "c", {"model": saved})
    target = cls()
    torch.testing.assert_close(target.state_dict()["scale"], torch.ones(4))
    shardsafe.load(tmp_path / "c", {"model": target})
    assert torch.equal(target.scale, torch.arange(4.0))


class HiddenExpanded(nn.Module):
    """Hands a copy of its expanded buffer to state_dict(): the real one is checked."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(1).expand(4))

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        state = super().state_dict(*args, **kwargs)
        state["scale"] = state["scale"].clone()
        return state


def test_the_modules_own_tensors_are_checked_not_what_state_dict_hands_over(
    tmp_path: Path,
) -> None:
    shardsafe.save(tmp_path / "c", {"model": HiddenExpanded()})
    target = HiddenExpanded()
    weight = target.lin.weight.clone()
    with pytest.raises(CheckpointMismatchError, match="'scale' is an expanded view"):
        shardsafe.load(tmp_path / "c", {"model": target})
    assert torch.equal(target.lin.weight, weight)


class Refusing:
    def state_dict(self) -> dict[str, int]:
        return {"v": 1}

    def load_state_dict(self, state: Any) -> None:
        raise RuntimeError("refused by the object")


def test_a_restore_step_that_fails_says_what_every_entry_holds(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"model": nn.Linear(4, 4), "obj": Refusing(), "step": 3})
    with pytest.raises(shardsafe.CheckpointError) as info:
        shardsafe.load(tmp_path / "c", {"model": nn.Linear(4, 4), "obj": Refusing(), "step": 0})
    message = str(info.value)
    assert message.startswith("RuntimeError: refused by the object (at ")
    assert (
        "This was found while restoring state['obj']: on rank 0, all 2 tensors loaded in "
        "place (in every entry) had already been filled from the checkpoint; "
        "state['model'] was restored before it; "
        "state['step'] was not restored, apart from tensors loaded in place; state['obj'] "
        "may be partly restored."
    ) in message


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 4)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight


def test_a_restore_step_that_fails_after_tied_weights_were_filled_says_so(
    tmp_path: Path,
) -> None:
    shardsafe.save(tmp_path / "c", {"model": Tied(), "obj": Refusing()})
    with pytest.raises(shardsafe.CheckpointError) as info:
        shardsafe.load(tmp_path / "c", {"model": Tied(), "obj": Refusing()})
    assert (
        "on rank 0, all 2 tensors loaded in place (in every entry) had already been filled "
        "from the checkpoint (a tied weight with the later key's values); state['model'] "
        "was restored before it; state['obj'] may be partly restored."
    ) in str(info.value)


class KeyedError(shardsafe.CheckpointError):
    """A subclass whose constructor wants more than a message."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"{key}: {detail}")


class RefusingWithItsOwnError:
    def state_dict(self) -> dict[str, int]:
        return {"v": 1}

    def load_state_dict(self, state: Any) -> None:
        raise KeyedError("obj/v", "the object refused its state")


def test_a_restore_error_of_a_class_with_its_own_constructor_keeps_its_text(
    tmp_path: Path,
) -> None:
    state = {"model": nn.Linear(4, 4), "obj": RefusingWithItsOwnError()}
    shardsafe.save(tmp_path / "c", state)
    with pytest.raises(shardsafe.CheckpointError) as info:
        shardsafe.load(tmp_path / "c", state)
    assert str(info.value).startswith(
        "obj/v: the object refused its state. This was found while restoring state['obj']"
    )
    assert "state['model'] was restored before it; state['obj'] may be partly" in str(info.value)


@pytest.mark.parametrize("kind", ["conj", "overlapping"])
def test_a_tensor_sharing_memory_with_one_its_object_writes_later_is_not_read_in_place(
    tmp_path: Path, kind: str
) -> None:
    """b1 is not read in place (a conj view, or a view over itself) and shares b0's
    memory: b0 then goes through the object's restore too, so a failed fill cannot have
    changed b1 behind the account's back."""
    dtype = torch.complex64 if kind == "conj" else torch.float32
    base = torch.zeros(8, dtype=dtype)
    b1 = base.conj() if kind == "conj" else base.as_strided((3, 2), (1, 1))
    shardsafe.save(
        tmp_path / "c",
        {"model": Buffers(torch.arange(8).to(dtype), b1.resolve_conj().clone(), torch.ones(64))},
        layout="consolidated",
    )
    flip(tmp_path / "c", "model/b2")
    target = Buffers(base, b1, torch.zeros(64))
    with pytest.raises(CheckpointCorruptError) as info:
        shardsafe.load(tmp_path / "c", {"model": target}, verify="inline")
    assert "0 of the 1 tensors loaded in place" in str(info.value)
    assert bool((base == 0).all())  # neither b0 nor, through it, b1 was written


def test_hundreds_of_interleaved_views_are_accounted_exactly(tmp_path: Path) -> None:
    """The columns of one matrix as 200 buffers: their ranges all meet (one group, larger
    than is compared pair by pair), their elements never do; a bad byte in column 150
    leaves 150 restored, 1 partly overwritten, 49 untouched, and says so."""
    columns = 200
    shardsafe.save(
        tmp_path / "c",
        {"model": Buffers(*[torch.full((16,), float(i + 1)) for i in range(columns)], digits=3)},
        layout="consolidated",
    )
    flip(tmp_path / "c", "model/b150")
    w = torch.zeros(16, columns)
    target = Buffers(*[w[:, i] for i in range(columns)], digits=3)
    with pytest.raises(CheckpointCorruptError) as info:
        shardsafe.load(tmp_path / "c", {"model": target}, verify="inline", read_threads=1)
    assert torch.equal(w[:, :150], torch.arange(1.0, 151.0).expand(16, 150))
    assert bool((w[:, 151:] == 0).all())
    assert "150 of the 200 tensors loaded in place hold the checkpoint's values" in str(info.value)
    assert "'model/b150' is partly overwritten, and the other 49 keep" in str(info.value)


@pytest.mark.parametrize("mode", MODES)
def test_a_lazy_module_takes_the_checkpoints_shapes_as_load_state_dict_gives_them(
    tmp_path: Path, mode: str
) -> None:
    """Its uninitialized parameters and buffers have no shape to check or read into:
    they are read as saved and handed to load_state_dict, which materializes them (the
    plan used to fail on them, blaming the checkpoint)."""
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    saved(torch.randn(6, 4)).sum().backward()
    shardsafe.save(tmp_path / "c", {"model": saved})
    lazy = nn.Sequential(nn.LazyLinear(8), nn.LazyBatchNorm1d())
    shardsafe.load(tmp_path / "c", {"model": lazy}, verify=mode)
    want, got = saved.state_dict(), lazy.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    x = torch.randn(3, 4)
    assert torch.equal(lazy.eval()(x), saved.eval()(x))


def test_a_chain_of_overlapping_views_is_accounted_through_the_middle_one(
    tmp_path: Path,
) -> None:
    """a overlaps b, b overlaps c, a does not overlap c; c fails after being written:
    c wrote into b, b had written into a, so none holds the checkpoint's values (a was
    called restored before)."""
    n = 1 << 16
    shardsafe.save(
        tmp_path / "c",
        {"model": Buffers(*[torch.full((n,), float(i + 1)) for i in range(3)])},
        layout="consolidated",
    )
    flip(tmp_path / "c", "model/b2")
    w = torch.zeros(3 * n)
    target = Buffers(w[:n], w[n // 2 : n // 2 + n], w[n + n // 2 - 1 : n + n // 2 - 1 + n])
    with pytest.raises(CheckpointCorruptError) as info:
        shardsafe.load(tmp_path / "c", {"model": target}, verify="inline", read_threads=1)
    assert bool((w[n // 2 : n] == 2.0).all())  # a's second half holds b's values
    assert (
        "0 of the 3 tensors loaded in place hold the checkpoint's values, 'model/b0', "
        "'model/b1', 'model/b2' are partly overwritten"
    ) in str(info.value)


def test_a_lazy_module_and_its_fresh_optimizer_load_as_torch_loads_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt})
    lazy = nn.Sequential(nn.LazyLinear(8))
    lazy_opt = torch.optim.Adam(lazy.parameters())
    shardsafe.load(tmp_path / "c", {"model": lazy, "optimizer": lazy_opt})
    assert all(torch.equal(lazy.state_dict()[k], v) for k, v in model.state_dict().items())
    want = opt.state_dict()["state"]
    got = lazy_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    assert all(torch.equal(got[i][k], v) for i in want for k, v in want[i].items())


class Parent(nn.Module):
    """Its load pre-hook gives its child's expanded buffer memory before the child loads."""

    def __init__(self) -> None:
        super().__init__()
        self.child = Buffers(torch.zeros(1, 1).expand(2, 2))
        self._register_load_state_dict_pre_hook(self._own_memory)

    def _own_memory(self, *args: Any) -> None:
        self.child.b0 = self.child.b0.clone()


def test_an_expanded_buffer_its_parents_loading_handles_is_not_refused(tmp_path: Path) -> None:
    saved = Parent()
    saved.child.b0 = torch.arange(4.0).reshape(2, 2)
    shardsafe.save(tmp_path / "c", {"model": saved})
    target = Parent()
    shardsafe.load(tmp_path / "c", {"model": target})
    assert torch.equal(target.child.b0, torch.arange(4.0).reshape(2, 2))


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.parametrize("where", ["value", "buffer"])
def test_a_nested_tensor_is_refused_with_a_way_out_that_works(
    tmp_path: Path, layout: torch.layout, where: str
) -> None:
    """As a module buffer, a strided nested tensor raised torch's "Internal error ...
    Please file an issue"; a jagged one was told to use to_dense(), which torch refuses
    for it. Both are refused alike, naming unbind() and to_padded_tensor(0), which work."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: the nested tensor API is a prototype
        nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=layout)
    state: dict[str, Any] = {"v": nested}
    if where == "buffer":
        module = nn.Module()
        module.register_buffer("b", nested)
        state = {"m": module}
    with pytest.raises(shardsafe.CheckpointError) as refused:
        shardsafe.save(tmp_path / "ck", state)
    said = str(refused.value)
    assert "save its components (tensor.unbind()) or its padded form" in said, said
    assert "Internal error" not in said and "to_dense" not in said, said
    assert nested.to_padded_tensor(0).shape == (2, 3) and len(nested.unbind()) == 2
    assert not (tmp_path / "ck").exists()
