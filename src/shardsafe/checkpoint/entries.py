"""The vocabulary shared by adapters and the engine: what a rank offers to save, what it
asks to load. Plain data, no I/O, no process group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

JSON = Any


@dataclass(frozen=True)
class Chunk:
    """A piece of a (possibly sharded) tensor that this rank holds and can write.

    ``offsets`` place the piece inside the global tensor of ``global_shape``. A
    ``replicated`` chunk is an identical full copy held by every rank (DDP weights): the
    planner picks one rank to write it, so it is stored once in total.
    """

    key: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    replicated: bool = False

    @staticmethod
    def whole(key: str, tensor: torch.Tensor, *, replicated: bool) -> Chunk:
        """A chunk that is the entire tensor."""
        shape = tuple(tensor.shape)
        return Chunk(key, tensor, shape, (0,) * len(shape), replicated)


@dataclass
class SaveItem:
    """What an adapter produces for one state value on one rank."""

    kind: str
    meta: JSON
    chunks: list[Chunk] = field(default_factory=list)


@dataclass(frozen=True)
class ReadRequest:
    """A region of a saved tensor that this rank wants.

    ``offsets``/``shape`` select a box of the global tensor; ``None`` means all of it.
    ``dtype``/``global_shape``, when given, are checked against the checkpoint and a
    difference is reported as a mismatch: give both for a tensor that goes into a live
    one. ``within`` (the shape of a live tensor, e.g. a parameter for its optimizer
    state) requires the saved tensor to be a scalar or broadcastable to it. An
    ``optional`` request that the checkpoint cannot satisfy is skipped instead of being
    reported as missing.
    """

    key: str
    offsets: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    global_shape: tuple[int, ...] | None = None
    optional: bool = False
    within: tuple[int, ...] | None = None

    @property
    def checked_against_live(self) -> bool:
        """Its size is bounded by a live tensor (dtype and shape both checked)."""
        return self.dtype is not None and self.global_shape is not None


@dataclass
class LoadPlan:
    """An adapter's answer to "what do you need?": requests plus the problems it found."""

    requests: list[ReadRequest] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SavedValue:
    """One state value as recorded in the manifest."""

    name: str
    kind: str
    meta: JSON
