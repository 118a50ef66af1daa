"""``load``: the phases of restoring a checkpoint and the agreement between them.

enter (timed barrier) -> plan (read and validate the manifest; each adapter says which
tensor regions it needs; all mismatches collected into one error) -> read (only those
regions, checksums verified) -> restore (adapters put state back).

Nothing is restored until every rank has read and verified everything it needs, so a
corrupt file or a mismatch on one rank leaves every rank's objects untouched.
"""

from __future__ import annotations

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
from ..errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from . import dtypes
from .entries import ReadRequest, SavedValue
from .manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse
from .reader import CheckpointReader
from .storage import LocalStorage

_SHOWN = 5


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Parse and validate ``path/manifest.json``; no data file is opened."""
    storage = LocalStorage(os.fspath(path))
    if not os.path.isdir(storage.directory):
        raise CheckpointNotFoundError(f"{storage.directory} does not exist")
    if not storage.exists(MANIFEST_NAME):
        raise CheckpointNotFoundError(
            f"{storage.directory} has no {MANIFEST_NAME}, so it is not a committed checkpoint "
            "(a save into it may have been interrupted)"
        )
    raw = storage.read_small(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    return parse(raw, f"{storage.directory}/{MANIFEST_NAME}")


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
    path: str, state: Mapping[str, Any], *, strict: bool, entry_timeout: float, timeout: float
) -> dict[str, Any]:
    if not isinstance(state, Mapping):
        raise ValueError("state must be a dict of name -> object to restore")
    coord = Coordinator("load", path, timeout=timeout)
    coord.enter(entry_timeout)
    try:
        return _phases(coord, path, state, strict)
    finally:
        coord.close()


def _phases(
    coord: Coordinator, path: str, state: Mapping[str, Any], strict: bool
) -> dict[str, Any]:
    planned: list[_Planned] = []
    error: BaseException | None = None
    try:
        manifest = read_manifest(path)
        planned = _plan(manifest, state, strict, coord)
    except Exception as e:
        error = e
    coord.exchange("plan", None, error)
    tensors: dict[str, torch.Tensor] = {}
    try:
        with CheckpointReader(LocalStorage(path), manifest) as reader:
            # Each request once: metadata may refer to one tensor any number of times.
            for req in dict.fromkeys(req for item in planned for req in item.requests):
                tensors[req.key] = reader.read(req.key, req.offsets, req.shape)
    except Exception as e:
        error = e
    coord.exchange("read", None, error)
    returned: dict[str, Any] = {}
    try:
        for item in planned:
            value = item.adapter.restore(item.obj, item.saved, tensors, item.ctx)
            if item.saved.kind == ValueAdapter.kind:
                returned[item.saved.name] = value
    except Exception as e:
        error = e
    coord.exchange("restore", None, error)
    return returned


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
            value_adapter = ValueAdapter()
            plan = value_adapter.plan_load(None, saved, context(name))
            for req in plan.requests:
                if req.key not in manifest.tensors:
                    raise CheckpointCorruptError(
                        f"the manifest's value {name!r} refers to tensor {req.key!r}, "
                        "which the manifest does not list"
                    )
            planned.append(_Planned(None, value_adapter, saved, context(name), plan.requests))
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
        plan = adapter.plan_load(obj, found, context(name))
        problems.missing += plan.missing
        problems.mismatched += plan.mismatched
        if strict:
            problems.unexpected += plan.unexpected
        requests = []
        for req in plan.requests:
            issue = _check_request(req, manifest)
            if issue == "missing":
                if not req.optional:
                    problems.missing.append(req.key)
            elif issue:
                problems.mismatched.append(issue)
            else:
                requests.append(req)
        planned.append(_Planned(obj, adapter, found, context(name), requests))
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
