"""What the in-place load tests share: the tensors of a model and its optimizer, by
their checkpoint keys, a byte flipped inside one tensor's data, and a state entry that
acts on the checkpoint's files in the middle of a load."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardsafe
from shardsafe.adapters import Adapter, LoadContext, LoadRequests, SaveContext, SavedValue, SaveItem


class BetweenPasses:
    """Runs ``act(path)`` between the passes of a load (nothing when saved)."""

    def __init__(self, path: Path, act: Callable[[Path], None] = lambda path: None) -> None:
        self.path, self.act = path, act


class BetweenPassesAdapter(Adapter):
    kind = "test-between-passes"

    def handles(self, obj: object) -> bool:
        return isinstance(obj, BetweenPasses)

    def save(self, obj: BetweenPasses, ctx: SaveContext) -> SaveItem:
        return SaveItem(self.kind, {})

    def plan_load(self, obj: BetweenPasses, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        return LoadRequests()

    def validate(
        self,
        obj: BetweenPasses,
        saved: SavedValue,
        tensors: Mapping[str, torch.Tensor],
        ctx: LoadContext,
    ) -> None:
        obj.act(obj.path)

    def restore(self, obj: Any, saved: SavedValue, tensors: Any, ctx: LoadContext) -> None:
        return None


def between_passes(path: Path, act: Callable[[Path], None] = lambda path: None) -> BetweenPasses:
    """A :class:`BetweenPasses` entry, its adapter registered."""
    shardsafe.register_adapter(BetweenPassesAdapter())
    return BetweenPasses(path, act)


def tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of the model's and the optimizer's tensors, keyed as the checkpoint keys them."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for p, state in opt.state.items():
        out.update({f"optimizer/{names[id(p)]}/{k}": v.clone() for k, v in state.items()})
    return out


def flip(path: Path, key: str) -> None:
    """Flip one byte in the middle of tensor ``key``'s bytes in its data file."""
    (chunk,) = shardsafe.read_manifest(path).tensors[key].chunks
    data = path / chunk.file
    raw = bytearray(data.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])[chunk.name]["data_offsets"]
    raw[8 + n + (begin + end) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
