"""What the tests of hostile files beside a checkpoint share: a small state to save, the
exact contents of a directory to compare before and after, and the marker record an
interrupted save leaves."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from shardsafe.checkpoint.storage import leftovers


def state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"w": torch.randn(4, 3), "b": torch.randn(3), "step": seed}


def snapshot(directory: Path) -> dict[str, tuple[str, Any]]:
    """Every entry of ``directory``: what it is and its bytes (a link: its target)."""
    out: dict[str, tuple[str, Any]] = {}
    for name in sorted(os.listdir(directory)):
        path = directory / name
        if path.is_symlink():
            out[name] = ("symlink", os.readlink(path))
        elif path.is_dir():
            out[name] = ("directory", sorted(os.listdir(path)))
        elif path.is_fifo():
            out[name] = ("fifo", None)
        else:
            out[name] = ("file", path.read_bytes())
    return out


def record(*names: str) -> bytes:
    """A marker record, as an interrupted save of this version leaves it."""
    return leftovers.marker_bytes(list(names))
