"""Loading into live tensors, in one process: the two verify modes, what each leaves behind
on a bad byte (including a file modified between verify='first''s two reads), targets
that cannot be read into directly (non-contiguous, absent), and the options' checks."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe import CheckpointCorruptError
from shardsafe.adapters import Adapter, LoadContext, LoadRequests, SaveContext, SavedValue, SaveItem
from shardsafe.checkpoint import LoadOptions

from .load_helpers import between_passes, tensors

MODES = ["first", "inline"]


def trained(seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(steps):
        model(torch.full((4, 16), 0.1 * (i + 1))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def flip_in_largest_tensor(path: Path) -> None:
    data = sorted(path.glob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = {k: v for k, v in json.loads(raw[8 : 8 + n]).items() if k != "__metadata__"}
    begin, end = max((v["data_offsets"] for v in header.values()), key=lambda o: o[1] - o[0])
    raw[8 + n + (begin + end) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
@pytest.mark.parametrize("mode", MODES)
def test_round_trip_into_stepped_and_fresh_optimizers(
    tmp_path: Path, mode: str, layout: str
) -> None:
    model, opt = trained(0, 2)
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt}, layout=layout)
    want = tensors(model, opt)
    for steps in (1, 0):  # live state read into in place; no state yet: new tensors
        fresh, fresh_opt = trained(1, steps)
        kept = [p.data_ptr() for p in fresh.parameters()]
        shardsafe.load(tmp_path / "c", {"model": fresh, "optimizer": fresh_opt}, verify=mode)
        got = tensors(fresh, fresh_opt)
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], v) for k, v in want.items())
        assert kept == [p.data_ptr() for p in fresh.parameters()], "parameters were replaced"


@pytest.mark.parametrize("mode", MODES)
def test_a_non_contiguous_parameter_is_filled_through_the_buffer(tmp_path: Path, mode: str) -> None:
    model = nn.Linear(24, 40)
    shardsafe.save(tmp_path / "c", {"model": model})
    fresh = nn.Linear(24, 40)
    fresh.weight = nn.Parameter(torch.zeros(24, 40).t())  # a transposed view
    assert not fresh.weight.is_contiguous()
    shardsafe.load(tmp_path / "c", {"model": fresh}, verify=mode, buffer_bytes=1 << 20)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_inline_names_what_a_corrupt_byte_left_restored(tmp_path: Path) -> None:
    model, opt = trained(0, 2)
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt})
    flip_in_largest_tensor(tmp_path / "c")
    fresh, fresh_opt = trained(1, 1)
    before = tensors(fresh, fresh_opt)
    lr = fresh_opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(CheckpointCorruptError, match="verify='inline'") as info:
        shardsafe.load(tmp_path / "c", {"model": fresh, "optimizer": fresh_opt}, verify="inline")
    assert "partly overwritten" in str(info.value) and "On rank 0" in str(info.value)
    assert fresh_opt.param_groups[0]["lr"] == lr, "param groups must not have been restored"
    assert tensors(fresh, fresh_opt).keys() == before.keys()


def test_first_restores_nothing_from_a_corrupt_byte(tmp_path: Path) -> None:
    model, opt = trained(0, 2)
    shardsafe.save(tmp_path / "c", {"model": model, "optimizer": opt})
    flip_in_largest_tensor(tmp_path / "c")
    fresh, fresh_opt = trained(1, 1)
    before = tensors(fresh, fresh_opt)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as info:
        shardsafe.load(tmp_path / "c", {"model": fresh, "optimizer": fresh_opt})
    assert "while restoring" not in str(info.value)
    after = tensors(fresh, fresh_opt)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def rewrite_in_place(path: Path) -> None:
    """Rewrite a data file in place, one byte flipped inside its last tensor: a file
    modified after verify='first''s checking pass and before its restoring pass."""
    data = sorted(path.glob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF  # same file, same size
    with open(data, "r+b") as f:
        f.write(bytes(raw))


def test_first_catches_a_file_modified_between_its_two_reads(tmp_path: Path) -> None:
    path = tmp_path / "c"
    model, _ = trained(0, 0)
    shardsafe.save(path, {"model": model, "tamper": between_passes(path)})
    fresh, _ = trained(1, 0)
    with pytest.raises(CheckpointCorruptError, match="modified during the load") as info:
        shardsafe.load(path, {"model": fresh, "tamper": between_passes(path, rewrite_in_place)})
    assert "checksum mismatch" in str(info.value) and "partly overwritten" in str(info.value)


def test_options_name_what_they_accept() -> None:
    with pytest.raises(ValueError, match="verify='both' is not one of"):
        LoadOptions(verify="both")
    with pytest.raises(ValueError, match="buffer_bytes=1024 is too small"):
        LoadOptions(buffer_bytes=1024)
    assert LoadOptions().verify == "first" and LoadOptions().buffer_bytes == 64 << 20


class Holder:
    """One tensor, and the target its adapter offers for it (which may not fit)."""

    def __init__(self, value: torch.Tensor, offered: torch.Tensor) -> None:
        self.value, self.offered = value, offered


class HolderAdapter(Adapter):
    kind = "test-holder"

    def handles(self, obj: object) -> bool:
        return isinstance(obj, Holder)

    def save(self, obj: Holder, ctx: SaveContext) -> SaveItem:
        from shardsafe.adapters import Chunk

        return SaveItem(self.kind, {}, [Chunk.whole(ctx.key("t"), obj.value, replicated=True)])

    def plan_load(self, obj: Holder, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        from shardsafe.adapters import ReadRequest

        value = obj.value
        return LoadRequests(
            [ReadRequest(ctx.key("t"), dtype=value.dtype, global_shape=value.shape)]
        )

    def targets(self, obj: Holder, saved: SavedValue, ctx: LoadContext) -> dict[str, torch.Tensor]:
        return {ctx.key("t"): obj.offered}

    def restore(self, obj: Holder, saved: SavedValue, tensors: Any, ctx: LoadContext) -> None:
        obj.value = tensors[ctx.key("t")]


@pytest.mark.parametrize(
    "offered",
    [
        torch.zeros(4, 6),  # wrong shape
        torch.zeros(6, 4, dtype=torch.float64),  # wrong dtype
        torch.zeros(1, 4).expand(6, 4),  # elements share memory
    ],
    ids=["shape", "dtype", "overlapping"],
)
@pytest.mark.parametrize("mode", MODES)
def test_a_target_that_does_not_fit_is_ignored(
    tmp_path: Path, offered: torch.Tensor, mode: str
) -> None:
    shardsafe.register_adapter(HolderAdapter())
    saved = torch.randn(6, 4)
    shardsafe.save(tmp_path / "c", {"h": Holder(saved, saved)})
    holder = Holder(torch.ones(6, 4), offered)
    untouched = offered.clone()
    shardsafe.load(tmp_path / "c", {"h": holder}, verify=mode)
    assert torch.equal(holder.value, saved) and holder.value is not offered
    assert torch.equal(offered, untouched)


def test_a_fitting_target_is_read_into_and_handed_to_restore(tmp_path: Path) -> None:
    shardsafe.register_adapter(HolderAdapter())
    saved = torch.randn(6, 4)
    shardsafe.save(tmp_path / "c", {"h": Holder(saved, saved)})
    offered = torch.zeros(6, 4)
    holder = Holder(torch.ones(6, 4), offered)
    shardsafe.load(tmp_path / "c", {"h": holder})
    assert holder.value is offered and torch.equal(offered, saved)
