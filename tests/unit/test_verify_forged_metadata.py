"""``verify`` runs the metadata checks ``load`` runs before it restores anything.

Found in review: a checkpoint whose per-kind metadata was forged, its checksums
recomputed (``tests/forge.py``), verified OK, and ``load`` then refused it. Every byte is
intact there, so only the metadata checks can catch it; ``verify`` calls the adapters'
own checks, so each forged entry is one problem line carrying the very message the
load raises.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointCorruptError
from tests import forge
from tests.unit.attacks.common import run_cli

Edit = Callable[[dict[str, Any]], None]


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    rng = shardsafe.RNGState()
    return {"model": model, "optimizer": opt, "sched": sched, "cfg": {"a": 1}, "rng": rng}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ck") / "ck"
    shardsafe.save(path, _state())
    return path


def _forged(saved: Path, tmp_path: Path, edit: Any) -> Path:
    return forge.forged_copy(saved, tmp_path / "forged", edit)


def _meta(doc: dict[str, Any], name: str) -> Any:
    return doc["values"][name]["meta"]


def _set(name: str, meta: Any) -> Edit:
    return lambda doc: doc["values"][name].update(meta=meta)


def _first_state(doc: dict[str, Any]) -> None:
    state = _meta(doc, "optimizer")["state"]
    state[next(iter(state))]["step"] = {"__tensor__": 5}


CASES: dict[str, tuple[str, Edit, str]] = {
    "module tensors not a list": (
        "model",
        lambda doc: _meta(doc, "model").update(tensors="0.weight"),
        "the manifest entry for 'model' is not valid module metadata: 'tensors' is not a list "
        "of names",
    ),
    "module extra state malformed": (
        "model",
        lambda doc: _meta(doc, "model").update(extra={"x": {"__tuple__": 3}}),
        "the extra state 'x' of 'model' is malformed: malformed __tuple__ value in the manifest: 3",
    ),
    "module extra state holds a tensor reference": (
        "model",
        lambda doc: _meta(doc, "model").update(
            extra={"x": {"a": [{"__tensor__": "model/0.bias"}]}}
        ),
        "the extra state 'x' of 'model' is malformed: it refers to tensor 'model/0.bias', but "
        "extra state is plain data (save refuses a tensor inside it)",
    ),
    "optimizer metadata a string": (
        "optimizer",
        _set("optimizer", "hello"),
        "the manifest entry for 'optimizer' is not valid optimizer metadata: 'param_groups', "
        "'state' or 'param_shapes' is missing",
    ),
    "optimizer state tensor marker malformed": (
        "optimizer",
        _first_state,
        "the state of parameter '0.weight' is malformed: malformed __tensor__ value in the "
        "manifest: 5",
    ),
    "optimizer hyperparameters not a dict": (
        "optimizer",
        lambda doc: _meta(doc, "optimizer")["param_groups"][0].update(hyper=[1]),
        "the manifest entry for 'optimizer': param group 0 holds no valid hyperparameters",
    ),
    "value tensor marker malformed": (
        "cfg",
        _set("cfg", {"a": {"__tensor__": 5}}),
        "the manifest entry for 'cfg' is malformed: malformed __tensor__ value in the manifest: 5",
    ),
    "stateful per-rank records not one per rank": (
        "sched",
        _set("sched", {"__per_rank__": [{}, {}]}),
        "the manifest entry for 'sched' holds per-rank values that are not one per saving rank (1)",
    ),
    "rng record malformed": (
        "rng",
        lambda doc: _meta(doc, "rng")["per_rank"].__setitem__(0, {"__dtype__": 3}),
        "the RNG state of rank 0 in 'rng' is malformed: malformed __dtype__ value in the "
        "manifest: 3",
    ),
}


def test_an_unforged_checkpoint_of_every_kind_verifies(saved: Path) -> None:
    kinds = {v.kind for v in shardsafe.read_manifest(saved).values.values()}
    assert kinds == {"module", "optimizer", "stateful", "value", "rng"}
    report = shardsafe.verify(saved)
    assert report.ok, report.problems


@pytest.mark.parametrize("case", list(CASES))
def test_verify_reports_the_forged_metadata_that_load_refuses(
    saved: Path, tmp_path: Path, case: str
) -> None:
    name, edit, message = CASES[case]
    path = _forged(saved, tmp_path, edit)
    assert shardsafe.verify(path).problems == (f"state entry {name!r}: {message}",)
    with pytest.raises(CheckpointCorruptError) as refused:
        shardsafe.load(path, _state())
    assert str(refused.value) == message


def test_the_command_fails_with_one_line_per_forged_entry(saved: Path, tmp_path: Path) -> None:
    def forge_two(doc: dict[str, Any]) -> None:
        doc["values"]["optimizer"]["meta"] = "hello"
        doc["values"]["cfg"]["meta"] = {"a": {"__tensor__": 5}}

    path = _forged(saved, tmp_path, forge_two)
    rc, out, err = run_cli("verify", str(path))
    assert (rc, err) == (1, "")
    lines = out.splitlines()
    assert lines[:2] == [
        "  state entry 'cfg': the manifest entry for 'cfg' is malformed: malformed __tensor__ "
        "value in the manifest: 5",
        "  state entry 'optimizer': the manifest entry for 'optimizer' is not valid optimizer "
        "metadata: 'param_groups', 'state' or 'param_shapes' is missing",
    ]
    assert lines[2].startswith(f"FAILED: 2 problems in {path} ")
    assert len(lines) == 3


class _Calibrated(torch.nn.Module):
    """A block with extra state (``get_extra_state``): plain data, as save keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.calibration = {"scale": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.calibration["scale"]

    def get_extra_state(self) -> dict[str, int]:
        return dict(self.calibration)

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.calibration = state


def _calibrated_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), _Calibrated())
    model[1].calibration = {"scale": seed}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "step_value": torch.full((2,), float(seed))}


def _bits(state: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every tensor of ``state`` as its raw bytes, and the module's extra state."""
    tensors = {
        **{f"model/{k}": v for k, v in state["model"].state_dict().items()},
        **{f"optimizer/{k}": v for k, v in _flat(state["optimizer"].state_dict()["state"])},
        "step_value": state["step_value"],
    }
    out: list[tuple[str, Any]] = [
        (k, v.detach().reshape(-1).view(torch.uint8).tolist())
        for k, v in tensors.items()
        if isinstance(v, torch.Tensor)
    ]
    return [*out, ("calibration", dict(state["model"][1].calibration))]


def _flat(state: dict[Any, Any]) -> list[tuple[str, Any]]:
    return [(f"{i}/{name}", v) for i, per in state.items() for name, v in per.items()]


def test_a_tensor_reference_in_extra_state_is_refused_before_anything_is_restored(
    tmp_path: Path,
) -> None:
    """Found in review: save never puts a tensor in extra state, so ``restore`` decodes it
    with none; a forged ``__tensor__`` marker there passed the structure check (and
    ``verify``), and the load raised in ``restore``, after every tensor loaded in place
    had been filled from the checkpoint."""
    path = tmp_path / "ck"
    shardsafe.save(path, _calibrated_state(1))

    def forge_ref(doc: dict[str, Any]) -> None:
        _meta(doc, "model")["extra"]["1._extra_state"] = {"__tensor__": "model/0.weight"}

    forged = _forged(path, tmp_path, forge_ref)
    message = (
        "the extra state '1._extra_state' of 'model' is malformed: it refers to tensor "
        "'model/0.weight', but extra state is plain data (save refuses a tensor inside it)"
    )
    assert shardsafe.verify(forged).problems == (f"state entry 'model': {message}",)
    live = _calibrated_state(2)
    before = _bits(live)
    with pytest.raises(CheckpointCorruptError) as refused:
        shardsafe.load(forged, live)
    assert str(refused.value) == message
    assert _bits(live) == before
    for to in ("torch", "dcp"):  # nor is it written out as a tensor of the extra state
        with pytest.raises(CheckpointCorruptError) as converted:
            shardsafe.convert(forged, tmp_path / f"out-{to}", to=to, progress=False)
        assert message in str(converted.value), str(converted.value)
        assert not (tmp_path / f"out-{to}").exists()


def _missing_reference(doc: dict[str, Any]) -> None:
    state = _meta(doc, "optimizer")["state"]
    state[next(iter(state))]["exp_avg"] = {"__tensor__": "nope"}


CONVERT_CASES: dict[str, tuple[Edit, str]] = {
    **{case: (edit, message) for case, (_, edit, message) in CASES.items()},
    "optimizer refers to a tensor not held": (
        _missing_reference,
        "state entry 'optimizer' refers to 1 tensor: 'nope' that the checkpoint does not hold",
    ),
    "module meta a number": (_set("model", 1.5), "is not valid module metadata"),
    "optimizer meta a number": (_set("optimizer", 1.5), "is not valid optimizer metadata"),
}


@pytest.mark.parametrize("case", list(CONVERT_CASES))
def test_convert_refuses_what_load_refuses_before_writing_anything(
    saved: Path, tmp_path: Path, case: str
) -> None:
    """Found in review: ``convert`` read the entries' metadata as written, and a forged one
    failed in the writers of DCP and HF with ``KeyError``/``TypeError`` (the CLI said "a
    bug in shardsafe"). It is refused first, whatever the target, with the load's words."""
    edit, message = CONVERT_CASES[case]
    forged = _forged(saved, tmp_path, edit)
    for to in ("torch", "dcp", "hf", "shardsafe"):
        out = tmp_path / f"out-{to}"
        with pytest.raises(CheckpointCorruptError) as refused:
            shardsafe.convert(forged, out, to=to, progress=False)
        assert str(refused.value).startswith(
            f"refusing to convert {forged}: a load would refuse it: "
        ), str(refused.value)
        assert message in str(refused.value)
        assert str(refused.value).endswith(f"(shardsafe verify {forged} lists every problem)")
        assert not out.exists()


def test_convert_only_leaves_out_an_entry_a_load_refuses(saved: Path, tmp_path: Path) -> None:
    """Found in review of the refusal above: ``only=["model"]`` was refused for the forged
    optimizer it leaves out, which a load of the model alone takes."""
    forged = _forged(saved, tmp_path, _set("optimizer", 1.5))
    converted = shardsafe.convert(
        forged, tmp_path / "model.pt", to="torch", only=["model"], progress=False
    )
    assert converted.tensors == len(_state()["model"].state_dict())
    with pytest.raises(CheckpointCorruptError, match="is not valid optimizer metadata"):
        shardsafe.convert(
            forged, tmp_path / "both.pt", to="torch", only=["model", "optimizer"], progress=False
        )
    assert not (tmp_path / "both.pt").exists()
