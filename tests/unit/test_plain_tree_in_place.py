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


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


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
    assert torch.equal(fresh.emb.weight.detach(), saved.emb.weight.detach())
    assert fresh.head.weight is fresh.emb.weight


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
        "  missing from the checkpoint (2): sd/extra; sd/n\n"
        "  Pass strict=False to load only the keys both sides have."
    )
    assert torch.equal(w, torch.zeros(3))
    values = shardsafe.load(tmp_path / "c", {"sd": {"w": w, "extra": extra}}, strict=False)
    assert torch.equal(w, saved["w"]) and torch.equal(extra, torch.full((2,), 5.0))
    assert values["sd"].keys() == {"w", "n"}
    assert values["sd"]["w"] is w and values["sd"]["n"] == 1
