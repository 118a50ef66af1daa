"""Shape checks against live objects cannot be bypassed by pointing at another key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe import CheckpointMismatchError
from tests import forge
from tests.unit.attacks.common import (
    assert_bitwise,
    bits,
    manifest_doc,
    optimizer_tensors,
    trained,
    weights,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tensor_ckpt(tmp_path: Path) -> Path:
    ckpt = tmp_path / "tensors"
    shardsafe.save(
        ckpt,
        {
            "t": torch.arange(16, dtype=torch.float32),
            "s": torch.tensor(3.0),
            "sq": torch.arange(16, dtype=torch.float32).reshape(4, 4),
            "d": torch.arange(16, dtype=torch.float64),
            "one": torch.ones(1),
        },
    )
    return ckpt


def test_a_live_tensor_is_filled_in_place_from_its_own_key(tensor_ckpt: Path) -> None:
    live = torch.zeros(16)
    out = shardsafe.load(tensor_ckpt, {"t": live})
    assert out["t"] is not None and bits(live) == bits(torch.arange(16, dtype=torch.float32))


@pytest.mark.parametrize(
    ("meta", "fragment"),
    [
        ({"__tensor__": "s"}, "s: checkpoint float32[], live float32[16]"),
        ({"__tensor__": "one"}, "one: checkpoint float32[1], live float32[16]"),
        ({"__tensor__": "sq"}, "sq: checkpoint float32[4, 4], live float32[16]"),
        ({"__tensor__": "d"}, "d: checkpoint float64[16], live float32[16]"),
        ([{"__tensor__": "t"}], "is a live tensor float32[16], but the checkpoint holds a list"),
        ({"__tuple__": [{"__tensor__": "t"}]}, "but the checkpoint holds a tuple for it"),
        (16, "but the checkpoint holds a int for it"),
    ],
    ids=["scalar", "one element", "same numel", "other dtype", "list", "tuple", "int"],
)
def test_a_live_tensor_pointed_at_another_key_is_a_mismatch(
    tensor_ckpt: Path, meta: Any, fragment: str
) -> None:
    doc = manifest_doc(tensor_ckpt)
    doc["values"]["t"]["meta"] = meta
    forge.write_manifest(tensor_ckpt, doc)
    live = torch.zeros(16)
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(tensor_ckpt, {"t": live})
    assert fragment in str(info.value), str(info.value)
    assert bits(live) == bits(torch.zeros(16))


@pytest.fixture
def adam_ckpt(tmp_path: Path) -> Path:
    model, opt = trained(0)
    ckpt = tmp_path / "adam"
    shardsafe.save(ckpt, {"model": model, "optimizer": opt})
    return ckpt


def _optimizer_pointed_at(ckpt: Path, target: str) -> tuple[nn.Module, Any, Any, Any]:
    doc = manifest_doc(ckpt)
    doc["values"]["optimizer"]["meta"]["state"]["0.weight"]["exp_avg"] = {"__tensor__": target}
    forge.write_manifest(ckpt, doc)
    model, opt = trained(1)
    return model, opt, weights(model), optimizer_tensors(opt)


@pytest.mark.parametrize(
    "target", ["optimizer/0.bias/exp_avg", "model/0.bias", "optimizer/0.weight/exp_avg_sq"]
)
def test_optimizer_state_pointed_at_a_wrongly_shaped_tensor_is_refused_at_load(
    adam_ckpt: Path, target: str
) -> None:
    model, opt, model_before, opt_before = _optimizer_pointed_at(adam_ckpt, target)
    if target.endswith("exp_avg_sq"):  # same shape: legitimate, loads
        shardsafe.load(adam_ckpt, {"model": model, "optimizer": opt})
        state = opt.state[model[0].weight]
        assert bits(state["exp_avg"]) == bits(state["exp_avg_sq"])
        return
    with pytest.raises(CheckpointMismatchError) as info:
        shardsafe.load(adam_ckpt, {"model": model, "optimizer": opt})
    # The optimizer has stepped, so its live state is what the saved one must match.
    assert f"{target}: checkpoint float32[8], live float32[8, 4]" in str(info.value)
    assert_bitwise(weights(model), model_before)
    assert_bitwise(optimizer_tensors(opt), opt_before)
