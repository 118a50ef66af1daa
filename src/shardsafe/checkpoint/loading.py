"""``load``: the phases of restoring a checkpoint and the agreement between them.

enter (timed barrier) -> plan (read and validate the manifest; each adapter says which
tensor regions it needs; all mismatches collected into one error; what would be
allocated is bounded) -> read (only those regions, checksums verified; then every
adapter checks, without changing anything, that its data will restore) -> restore
(adapters put state back).

Nothing is restored until every rank has read, verified and checked everything it
needs, so a corrupt file, hostile metadata or a mismatch on one rank leaves every rank's
objects untouched.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..adapters import find_adapter
from ..adapters.base import Adapter, Context
from ..adapters.module import param_names
from ..adapters.values import ValueAdapter
from ..distributed import Coordinator
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from . import dtypes
from .entries import ReadRequest, SavedValue
from .manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, TensorRecord, parse
from .reader import CheckpointReader
from .storage import LocalStorage

_SHOWN = 5
DEFAULT_UNTRUSTED_BYTES = 1 << 30
LIVE_MULTIPLE = 8
"""Tensors only the checkpoint sizes may take this many times the live tensors' bytes."""


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Parse and validate ``path/manifest.json``; no data file is opened."""
    with LocalStorage(os.fspath(path)) as storage:
        return read_manifest_from(storage)


def read_manifest_from(storage: LocalStorage) -> Manifest:
    """The validated manifest of an open checkpoint directory."""
    storage.require_directory()
    if not storage.exists(MANIFEST_NAME):
        raise CheckpointNotFoundError(
            f"{storage.directory} has no {MANIFEST_NAME}, so it is not a committed checkpoint "
            "(a save into it may have been interrupted)"
        )
    raw = storage.read_small(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    return parse(raw, storage.where(MANIFEST_NAME))


@dataclass
class _Planned:
    """One state value to restore: who restores it and what it needs."""

    obj: Any
    adapter: Adapter
    saved: SavedValue
    ctx: Context
    requests: list[ReadRequest]


@dataclass
class _Problems:
    missing: list[str]
    unexpected: list[str]
    mismatched: list[str]

    def message(self, strict: bool) -> str:
        lines = ["the checkpoint does not match the objects being loaded:"]
        for title, keys in (
            ("missing from the checkpoint", self.missing),
            ("unexpected in the checkpoint", self.unexpected),
            ("shape/dtype mismatch", self.mismatched),
        ):
            if keys:
                shown = "; ".join(keys[:_SHOWN])
                more = f" ... and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
                lines.append(f"  {title} ({len(keys)}): {shown}{more}")
        if strict and not self.mismatched:
            lines.append("  Pass strict=False to load only the keys both sides have.")
        return "\n".join(lines)


def load(
    storage: LocalStorage,
    state: Mapping[str, Any],
    *,
    strict: bool,
    entry_timeout: float,
    timeout: float,
    untrusted_bytes_limit: int = DEFAULT_UNTRUSTED_BYTES,
) -> dict[str, Any]:
    if not isinstance(state, Mapping):
        raise ValueError("state must be a dict of name -> object to restore")
    coord = Coordinator("load", storage.directory, timeout=timeout)
    coord.enter(entry_timeout)
    try:
        return _phases(coord, storage, state, strict, untrusted_bytes_limit)
    finally:
        coord.close()


def _phases(
    coord: Coordinator,
    storage: LocalStorage,
    state: Mapping[str, Any],
    strict: bool,
    untrusted_bytes_limit: int,
) -> dict[str, Any]:
    planned: list[_Planned] = []
    error: BaseException | None = None
    try:
        manifest = read_manifest_from(storage)
        planned = _plan(manifest, state, strict, coord)
        _check_allocation(manifest, planned, coord.rank, untrusted_bytes_limit)
    except Exception as e:
        error = e
    coord.exchange("plan", None, error)
    tensors: dict[str, torch.Tensor] = {}
    try:
        with CheckpointReader(storage, manifest) as reader:
            # Each request once: metadata may refer to one tensor any number of times.
            for req in dict.fromkeys(req for item in planned for req in item.requests):
                tensors[req.key] = reader.read(req.key, req.offsets, req.shape)
        for item in planned:
            _guarded(item, "validate", item.adapter.validate, item.obj, item.saved, tensors)
    except Exception as e:
        error = e
    coord.exchange("read", None, error)
    returned: dict[str, Any] = {}
    try:
        for item in planned:
            value = item.adapter.restore(item.obj, item.saved, tensors, item.ctx)
            if item.adapter.returns_value:
                returned[item.saved.name] = value
    except Exception as e:
        error = e
    coord.exchange("restore", None, error)
    return returned


def _guarded(item: _Planned, step: str, call: Any, *args: Any) -> Any:
    """Run an adapter's ``plan_load``/``validate``: an unexpected exception there comes from
    metadata the adapter could not make sense of, so it is corruption, named as such."""
    try:
        return call(*args, item.ctx)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointCorruptError(
            f"the manifest entry for {item.saved.name!r} (a {item.saved.kind!r} value) is "
            f"malformed: {type(item.adapter).__name__}.{step} failed with "
            f"{type(e).__name__}: {e}"
        ) from e


def _plan(
    manifest: Manifest, state: Mapping[str, Any], strict: bool, coord: Coordinator
) -> list[_Planned]:
    names = param_names(state)
    saved_tensors = {k: (r.dtype, r.shape) for k, r in manifest.tensors.items()}
    problems = _Problems([], [], [])
    planned = []

    def context(name: str) -> Context:
        return Context(
            name, coord.rank, coord.world_size, names, manifest.world_size, strict, saved_tensors
        )

    for name, saved in manifest.values.items():
        if name not in state and saved.kind == ValueAdapter.kind:
            # Plain values come back to the caller even when not asked for.
            item = _Planned(None, ValueAdapter(), saved, context(name), [])
            plan = _guarded(item, "plan_load", item.adapter.plan_load, None, saved)
            for req in plan.requests:
                if req.key not in manifest.tensors:
                    raise CheckpointCorruptError(
                        f"the manifest's value {name!r} refers to tensor {req.key!r}, "
                        "which the manifest does not list"
                    )
            item.requests = plan.requests
            planned.append(item)
    for name, obj in state.items():
        found = manifest.values.get(name)
        if found is None:
            if strict:
                problems.missing.append(f"state[{name!r}]")
            continue
        adapter = find_adapter(obj, name)
        if found.kind != adapter.kind:
            problems.mismatched.append(
                f"state[{name!r}] was saved as a {found.kind!r} value but is loaded into a "
                f"{type(obj).__qualname__} ({adapter.kind!r})"
            )
            continue
        item = _Planned(obj, adapter, found, context(name), [])
        plan = _guarded(item, "plan_load", adapter.plan_load, obj, found)
        problems.missing += plan.missing
        problems.mismatched += plan.mismatched
        if strict:
            problems.unexpected += plan.unexpected
        for req in plan.requests:
            issue = _check_request(req, manifest)
            if issue == "missing":
                if not req.optional:
                    problems.missing.append(req.key)
            elif issue:
                problems.mismatched.append(issue)
            else:
                item.requests.append(req)
        planned.append(item)
    if problems.missing or problems.unexpected or problems.mismatched:
        raise CheckpointMismatchError(problems.message(strict))
    return planned


def _check_request(req: ReadRequest, manifest: Manifest) -> str | None:
    rec = manifest.tensors.get(req.key)
    if rec is None:
        return "missing"
    saved = f"{dtypes.dtype_name(rec.dtype)}{list(rec.shape)}"
    dtype = req.dtype or rec.dtype
    shape = req.global_shape if req.global_shape is not None else rec.shape
    if dtype != rec.dtype or shape != rec.shape:
        return f"{req.key}: checkpoint {saved}, live {dtypes.dtype_name(dtype)}{list(shape)}"
    if req.within is not None and not _scalar_or_broadcastable(rec.shape, req.within):
        return (
            f"{req.key}: checkpoint {saved}, but it belongs to a live tensor of shape "
            f"{list(req.within)}: it must be a scalar or shaped like it"
        )
    if (
        req.offsets is not None
        and req.shape is not None
        and not (
            len(req.offsets) == len(req.shape) == len(rec.shape)
            and all(o + n <= s for o, n, s in zip(req.offsets, req.shape, rec.shape))
        )
    ):
        return f"{req.key}: requested region lies outside the saved shape {list(rec.shape)}"
    return None


def _scalar_or_broadcastable(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """True for a 0-d shape, or one whose dims (aligned at the end) are 1 or ``target``'s."""
    if not shape:
        return True
    return len(shape) <= len(target) and all(
        n in (1, m) for n, m in zip(reversed(shape), reversed(target))
    )


def _check_allocation(manifest: Manifest, planned: list[_Planned], rank: int, limit: int) -> None:
    """Refuse, before allocating anything, a load whose sizes only the checkpoint vouches for
    beyond ``limit`` plus :data:`LIVE_MULTIPLE` times the live tensors being filled.

    Tensors checked against a live tensor (module weights, tensors passed in) cannot be
    larger than it. Everything else (a fresh optimizer's state, returned plain tensors,
    RNG and scheduler state) takes the size the manifest says: a hostile checkpoint of a
    few KiB (sparse files) could otherwise make a load allocate terabytes.
    """
    live = untrusted = 0
    largest: list[tuple[int, str]] = []
    for req in dict.fromkeys(req for item in planned for req in item.requests):
        nbytes = _request_bytes(manifest.tensors[req.key], req)
        if req.checked_against_live:
            live += nbytes
        else:
            untrusted += nbytes
            largest.append((nbytes, req.key))
    allowed = limit + LIVE_MULTIPLE * live
    if untrusted > allowed:
        top = ", ".join(f"{key!r} ({_gib(n)})" for n, key in sorted(largest, reverse=True)[:3])
        raise CheckpointCorruptError(
            f"loading this checkpoint would make rank {rank} allocate {_gib(untrusted)} for "
            f"tensors whose size only the checkpoint gives (largest: {top}), more than the "
            f"{_gib(allowed)} allowed ({LIVE_MULTIPLE}x the {_gib(live)} of live tensors being "
            f"loaded, plus untrusted_bytes_limit={limit}). If the checkpoint is trusted, pass "
            "a larger untrusted_bytes_limit to load()."
        )


def _request_bytes(rec: TensorRecord, req: ReadRequest) -> int:
    shape = req.shape if req.shape is not None else rec.shape
    return math.prod(shape) * dtypes.itemsize(rec.dtype)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
