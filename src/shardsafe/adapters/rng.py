"""Random number generator state, per rank: torch (CPU and CUDA), numpy and Python.

Each rank draws different random numbers (dropout masks, data augmentation), so each
rank's generators are saved separately and restored on the same rank. A rank that did
not exist at save time (a larger world size on load) keeps its generators and a
warning says so.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import torch

from .. import _names, _tree, _warnings
from ..errors import CheckpointCorruptError
from ..protocol import (
    JSON,
    Adapter,
    Chunk,
    LoadContext,
    LoadRequests,
    ReadRequest,
    SaveContext,
    SavedValue,
    SaveItem,
)

np: Any
try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is optional
    np = None


class RNGState:
    """Put one in the state dict to save and restore every RNG of every rank::

    shardsafe.save(path, {"model": model, "rng": shardsafe.RNGState()})
    """

    def __repr__(self) -> str:
        return "RNGState()"


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    if np is not None:
        algorithm, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "algorithm": algorithm,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    return state


def check_state(state: Any) -> None:
    """Raise (any exception) unless ``state`` is what :func:`capture` returns.

    Each generator's state is set on a fresh private generator, so the real ones are
    untouched: a bad state fails here, before anything is restored.
    """
    if not isinstance(state, dict) or not {"torch", "python"} <= state.keys():
        raise ValueError("it lacks the 'torch' or 'python' generator")
    torch_state = state["torch"]
    if not (isinstance(torch_state, torch.Tensor) and torch_state.dtype == torch.uint8):
        raise ValueError("the torch generator state is not a uint8 tensor")
    torch.Generator().set_state(torch_state)
    version, internal, gauss = state["python"]
    _check_mt19937(internal[:-1], internal[-1], "Python's")
    # setstate takes any gauss_next: a string or 10**400 broke the next random.gauss()
    # in the user's own code, long after the load.
    if version != random.Random.VERSION or not (
        gauss is None or (type(gauss) is float and math.isfinite(gauss))
    ):
        raise ValueError(
            f"Python's generator state is not one of this Python's (version {version!r}, "
            f"cached gauss {_short(gauss)})"
        )
    random.Random().setstate((version, tuple(internal), gauss))
    cuda = state.get("cuda", [])
    if not (
        isinstance(cuda, list)
        and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda)
    ):
        raise ValueError("the CUDA generator states are not uint8 tensors")
    if cuda and torch.cuda.is_available():
        # Checked before CUDA is initialized too (a load before model.cuda()), without
        # initializing it: restore_state queues the states, and a bad one failed later,
        # inside torch, at CUDA's lazy initialization.
        size = (
            torch.cuda.get_rng_state().numel()  # every device's is this size
            if torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
            else _CUDA_STATE_BYTES
        )
        if any(t.dim() != 1 or t.numel() != size for t in cuda):
            raise ValueError(f"the CUDA generator states are not {size} bytes each")
    if "numpy" in state and np is not None:
        s = state["numpy"]
        keys = s.get("keys")
        if not (isinstance(keys, torch.Tensor) and keys.dtype == torch.int64 and keys.dim() == 1):
            raise ValueError("numpy's generator keys are not a 1-d int64 tensor")
        _check_mt19937(keys.tolist(), s.get("pos"), "numpy's")
        if s.get("algorithm") != "MT19937" or s.get("has_gauss") not in (0, 1):
            raise ValueError("numpy's generator is not an MT19937 state")
        np.random.RandomState().set_state(
            (
                s["algorithm"],
                s["keys"].numpy().astype(np.uint32),
                s["pos"],
                s["has_gauss"],
                s["cached"],
            )
        )


def _check_mt19937(words: Any, position: Any, whose: str) -> None:
    """A Mersenne Twister state: 624 words of 32 bits and a position in 0..624.

    The generators' own setters do not all check (numpy's accepts any position and then
    reads past its key array; Python's truncates words to 32 bits), so this does.
    """
    if not (
        isinstance(words, (list, tuple))
        and len(words) == _MT_WORDS
        and all(type(w) is int and 0 <= w < 1 << 32 for w in words)
    ):
        raise ValueError(f"{whose} generator state is not {_MT_WORDS} words of 32 bits")
    if not (type(position) is int and 0 <= position <= _MT_WORDS):
        raise ValueError(f"{whose} generator position {position!r} is not in 0..{_MT_WORDS}")


_MT_WORDS = 624
_CUDA_STATE_BYTES = 16
"""A CUDA generator's state: its Philox seed and offset, 8 bytes each (torch's
``CUDAGeneratorImpl::get_state``)."""


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else f"{shown[:37]}..."


def restore_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        _restore_cuda(state["cuda"])
    if "numpy" in state and np is not None:
        s = state["numpy"]
        np.random.set_state(
            (
                s["algorithm"],
                s["keys"].numpy().astype(np.uint32),
                s["pos"],
                s["has_gauss"],
                s["cached"],
            )
        )


def _restore_cuda(saved: list[torch.Tensor]) -> None:
    """Each device's generator from its saved state, for the devices this process sees.
    Saved by a process that saw more (8 GPUs then, 4 now), the rest are left, with a
    warning: ``set_rng_state_all`` raised an ``IndexError`` for the first device missing,
    after the other state was restored, or, before CUDA is initialized, at its first use."""
    count = torch.cuda.device_count()
    if len(saved) > count:
        _warnings.warn(
            f"shardsafe: the checkpoint holds the CUDA generator states of {len(saved)} "
            f"devices, but this process sees {count}: restored those of the first {count}",
        )
    for device, state in enumerate(saved[:count]):
        torch.cuda.set_rng_state(state, device)


class RNGAdapter(Adapter):
    kind = "rng"

    def handles(self, obj: object) -> bool:
        return isinstance(obj, RNGState)

    def save(self, obj: RNGState, ctx: SaveContext) -> SaveItem:
        chunks: list[Chunk] = []
        prefix = _names.Reserved(f"rank-{ctx.rank:05d}")

        def sink(path: tuple[str, ...], tensor: torch.Tensor) -> str:
            key = ctx.key(prefix, *path)
            chunks.append(Chunk.whole(key, tensor.detach(), replicated=False))
            return key

        return SaveItem(self.kind, _tree.encode(capture(), f"state[{ctx.name!r}]", sink), chunks)

    def merge(self, metas: list[JSON]) -> JSON:
        return {"per_rank": metas}

    def _mine(self, saved: SavedValue, ctx: LoadContext) -> JSON | None:
        per_rank = _per_rank(saved)
        return per_rank[ctx.rank] if ctx.rank < len(per_rank) else None

    def plan_load(self, obj: RNGState, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        mine = self._mine(saved, ctx)
        if mine is None:
            return LoadRequests()
        _check_record(mine, ctx.rank, saved)
        return LoadRequests(requests=[ReadRequest(ref) for ref in _tree.tensor_refs(mine)])

    def validate(
        self,
        obj: RNGState,
        saved: SavedValue,
        tensors: Mapping[str, torch.Tensor],
        ctx: LoadContext,
    ) -> None:
        mine = self._mine(saved, ctx)
        if mine is None:
            return
        try:
            check_state(_tree.decode(mine, tensors))
        except CheckpointCorruptError:
            raise
        except Exception as e:
            raise CheckpointCorruptError(
                f"the RNG state of rank {ctx.rank} in {saved.entry} is "
                f"not valid: {type(e).__name__}: {e}"
            ) from None

    def restore(
        self,
        obj: RNGState,
        saved: SavedValue,
        tensors: Mapping[str, torch.Tensor],
        ctx: LoadContext,
    ) -> None:
        mine = self._mine(saved, ctx)
        if mine is None:
            _warnings.warn(
                f"state[{ctx.name!r}]: the checkpoint holds RNG state for "
                f"{ctx.saved_world_size} rank(s); rank {ctx.rank} keeps its current RNG state",
            )
            return
        restore_state(_tree.decode(mine, tensors))


def check_rng_meta(saved: SavedValue) -> None:
    """Raise what a load of this RNG entry raises for malformed metadata on any rank (the
    check ``plan_load`` runs on its own rank's record, needing no live state), so that
    ``verify`` never passes a checkpoint that no load accepts."""
    for rank, record in enumerate(_per_rank(saved)):
        _check_record(record, rank, saved)


def _per_rank(saved: SavedValue) -> list[JSON]:
    """Every saving rank's record of an RNG entry."""
    per_rank = saved.meta.get("per_rank") if isinstance(saved.meta, dict) else None
    if not isinstance(per_rank, list):
        raise CheckpointCorruptError(f"{saved.entry} is not RNG state")
    return per_rank


def _check_record(record: JSON, rank: int, saved: SavedValue) -> None:
    """The checks of a rank's record that need no tensor: its structure, and the two
    generators every record holds (a record without them failed only once its tensors
    were read, which ``verify``, checking metadata, did not foresee)."""
    _tree.check_structure(record, f"the RNG state of rank {rank} in {saved.name!r}")
    if not isinstance(record, dict) or not {"torch", "python"} <= record.keys():
        raise CheckpointCorruptError(
            f"the RNG state of rank {rank} in {saved.entry} is not valid: it lacks the "
            "'torch' or 'python' generator"
        )
