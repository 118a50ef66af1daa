"""The load plan: for this rank, every state entry to restore and the tensor regions it
needs, with every mismatch found and the allocation it implies bounded.

Pure: no process group, no I/O; the mirror of ``save_plan.py``. Adapters answer "what
do you need?" (their :class:`LoadRequests`); the plan checks each request against the
manifest and each request's size against what live objects bound.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import dtypes
from ...adapters.registry import adapter_for, returning_adapter
from ...errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from ...protocol import (
    Adapter,
    LoadContext,
    ReadRequest,
    SavedValue,
    load_names,
)
from ..format.manifest import Manifest, TensorRecord

_SHOWN = 5
CASTS = ("bfloat16", "float16", "float32")
"""The dtypes ``convert(dtype=...)`` casts weights to (``converters/options.py``)."""
_LISTED = 10
"""Entry names an error lists when the asked one is not in the checkpoint."""
_COMPARED_CHARS = 256
"""Longer entry names are not compared for "did you mean" (a hostile manifest's names
would make the comparison quadratic in their length)."""
LIVE_MULTIPLE = 8
"""Tensors only the checkpoint sizes may take this many times the live tensors' bytes."""


@dataclass
class PlannedEntry:
    """One state entry to restore: who restores it and what it needs."""

    obj: Any
    adapter: Adapter
    saved: SavedValue
    ctx: LoadContext
    requests: list[ReadRequest] = field(default_factory=list)


@dataclass
class LoadPlan:
    """Every entry this rank restores, in order, with the regions each needs."""

    entries: list[PlannedEntry]
    unexpected: dict[str, list[str]] = field(default_factory=dict)
    """By entry of ``state`` this rank passed (every one the checkpoint has), the keys of
    it in the checkpoint this rank holds no object for (strict loads, more than one rank).
    Another rank passing that entry may hold them (pipeline stages, per-rank experts): the
    load refuses only those no such rank holds (:func:`unexpected_everywhere`)."""
    absent: list[str] = field(default_factory=list)
    """Entries of ``state`` the checkpoint does not have, left as they are (``strict=False``
    only, and only when some other entry loads): the load warns about each."""
    left_out: list[str] = field(default_factory=list)
    """Entries of the checkpoint (not plain values, which load returns anyway) that
    ``state`` does not pass (strict loads): :func:`unexpected_anywhere` checks them."""

    @property
    def requests(self) -> list[ReadRequest]:
        """Each request once: metadata may refer to one tensor any number of times."""
        return list(dict.fromkeys(req for item in self.entries for req in item.requests))


def plan_load(
    manifest: Manifest,
    state: Mapping[str, Any],
    *,
    strict: bool,
    rank: int,
    world_size: int,
    untrusted_bytes_limit: int,
) -> LoadPlan:
    """Plan restoring ``state`` from ``manifest`` on ``rank`` of ``world_size``.

    Raises :class:`CheckpointMismatchError` listing every mismatch, and
    :class:`CheckpointCorruptError` for metadata an adapter cannot make sense of or a
    load that would allocate more than live objects bound (see ``_check_allocation``).

    An entry of ``state`` the checkpoint lacks altogether (a misspelled ``"modle"``) is
    named with the entries the checkpoint has and the closest one. ``strict=False`` does
    not excuse it when no entry asked for is in the checkpoint: that load would restore
    nothing, silently; when others are, it is left as it is (``LoadPlan.absent``).
    """
    names, aliases, unqualified = load_names(state)
    saved_tensors = {k: (r.dtype, r.shape) for k, r in manifest.tensors.items()}

    def context(name: str) -> LoadContext:
        return LoadContext(
            name=name,
            rank=rank,
            world_size=world_size,
            param_names=names,
            saved_world_size=manifest.world_size,
            strict=strict,
            saved_tensors=saved_tensors,
            param_aliases=aliases,
            param_unqualified=unqualified,
        )

    entries = _unasked(manifest, state, context)
    problems = _Problems([], [], [], known=list(manifest.values))
    unexpected: dict[str, list[str]] = {}
    for name, obj in state.items():
        before = len(problems.unexpected)
        entry = _asked(name, obj, manifest, context, problems)
        if entry is not None:
            entries.append(entry)
            unexpected[name] = problems.unexpected[before:]
    if world_size > 1:  # refused only if no rank holds them (see LoadPlan.unexpected)
        problems.unexpected = []
    absent: list[str] = []
    if not strict and len(problems.absent) < len(state):  # something else loads
        absent, problems.absent = problems.absent, []
    if problems.missing or problems.unexpected or problems.mismatched or problems.absent:
        raise CheckpointMismatchError(problems.message(strict))
    left_out = [
        name
        for name, saved in manifest.values.items()
        if strict and name not in state and returning_adapter(saved.kind) is None
    ]
    plan = LoadPlan(entries, unexpected, absent, left_out)
    _check_allocation(manifest, plan, rank, untrusted_bytes_limit)
    return plan


def _unasked(
    manifest: Manifest, state: Mapping[str, Any], context: Callable[[str], LoadContext]
) -> list[PlannedEntry]:
    """Entries of a kind that load returns (plain values), restored even when not asked."""
    entries = []
    for name, saved in manifest.values.items():
        adapter = returning_adapter(saved.kind)
        if name in state or adapter is None:
            continue
        item = PlannedEntry(None, adapter, saved, context(name))
        wanted = guarded(item, "plan_load", adapter.plan_load, None, saved)
        for req in wanted.requests:
            if req.key not in manifest.tensors:
                raise CheckpointCorruptError(
                    f"the manifest's value {name!r} refers to tensor {req.key!r}, "
                    "which the manifest does not list"
                )
        item.requests = wanted.requests
        entries.append(item)
    return entries


def _asked(
    name: str,
    obj: Any,
    manifest: Manifest,
    context: Callable[[str], LoadContext],
    problems: _Problems,
) -> PlannedEntry | None:
    """The plan for ``state[name]``, its problems added to ``problems``."""
    found = manifest.values.get(name)
    if found is None:
        problems.absent.append(name)
        return None
    adapter, obj = adapter_for(obj, name)
    if found.kind != adapter.kind:
        problems.mismatched.append(
            f"state[{name!r}] was saved as a {found.kind!r} value but is loaded into a "
            f"{type(obj).__qualname__} ({adapter.kind!r})"
        )
        return None
    item = PlannedEntry(obj, adapter, found, context(name))
    wanted = guarded(item, "plan_load", adapter.plan_load, obj, found)
    problems.missing += wanted.missing
    problems.mismatched += wanted.mismatched
    if item.ctx.strict:
        problems.unexpected += wanted.unexpected
    for req in wanted.requests:
        issue = _check_request(req, manifest)
        if issue == "missing":
            if not req.optional:
                problems.missing.append(req.key)
        elif issue:
            problems.mismatched.append(issue)
            saved_dtype = manifest.tensors[req.key].dtype
            if req.dtype is not None and req.dtype != saved_dtype and saved_dtype.is_floating_point:
                live = dtypes.dtype_name(req.dtype)
                problems.castable = live if live in CASTS else problems.castable
        else:
            item.requests.append(req)
    return item


def guarded(item: PlannedEntry, step: str, call: Callable[..., Any], *args: Any) -> Any:
    """Run an adapter's ``plan_load``/``targets``/``validate``: an unexpected exception
    there comes from metadata the adapter could not make sense of, so it is corruption,
    named as such; unless the live object fails to be saved too (a state_dict hook that
    raises, a param group holding what is not a parameter): then the object is the cause,
    and the error says so without calling a good checkpoint damaged (which would send
    ``CheckpointManager.load_latest`` to older ones)."""
    try:
        return call(*args, item.ctx)
    except CheckpointError:
        raise
    except Exception as e:
        failed = f"{type(item.adapter).__name__}.{step} failed with {type(e).__name__}: {e}"
        live = _live_failure(item)
        if live is not None:
            raise CheckpointError(
                f"state[{item.saved.name!r}] could not be loaded: {failed}. The live object "
                f"fails when saved as well ({live}), so the cause is the object (a hook of "
                "its own, or what it holds), not the checkpoint"
            ) from e
        raise CheckpointCorruptError(
            f"the manifest entry for {item.saved.name!r} (a {item.saved.kind!r} value) is "
            f"malformed: {failed}"
        ) from e


def _live_failure(item: PlannedEntry) -> str | None:
    """How saving the live object fails (``None`` if it saves, or there is none). Only on
    the failing rank, on the error path: an adapter's ``save`` must not communicate
    (``Adapter.save``), but a ``state_dict`` of the object's own that does (FSDP1's full
    state dict, which shardsafe does not support) would wait here for its peers."""
    if item.obj is None:
        return None
    try:
        item.adapter.save(item.obj, item.ctx)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def unexpected_anywhere(
    per_rank: list[dict[str, list[str]]], left_out: list[list[str]], strict: bool
) -> None:
    """Refuse a load of each rank's own copy (a tiered manager's rank checkpoints) that
    holds keys its rank holds no object for: no other rank loads that copy, so none holds
    them (intersected, as for one checkpoint, they were skipped in silence: another rank's
    copy never lists them). ``per_rank`` as for :func:`unexpected_everywhere`;
    ``left_out[r]``: the entries rank ``r``'s copy holds that it did not pass, refused
    where another rank passes that entry (where none does, it is not loaded anywhere)."""
    passed = {name for entries in per_rank for name in entries}
    keys = [
        f"{key} (rank {rank})"
        for rank, entries in enumerate(per_rank)
        for name in entries
        for key in entries[name]
    ]
    lines = [
        f"rank {rank} passed no {name!r}"
        for rank, names in enumerate(left_out)
        for name in names
        if name in passed
    ]
    note = (
        f"{'; '.join(lines[:8])}: each rank restores its own copy, which holds that entry; "
        "pass it on every rank, or on none"
    )
    _refuse_held_by_no_rank(keys, strict, note if lines else "")


def unexpected_everywhere(per_rank: list[dict[str, list[str]]], strict: bool) -> None:
    """Refuse a load whose checkpoint holds keys that no rank holds an object for:
    ``per_rank[r]`` maps each entry rank ``r`` passed to its unexpected keys there, so those
    are the keys every rank passing that entry lists. A rank that left the entry out holds
    none of it: counting its empty list made a stage that left out its optimizer (or
    passed ``{}``) skip that stage's saved state in silence under ``strict=True`` (found
    in review). An entry no rank passes is not loaded, as on one rank."""
    keys: list[str] = []
    left_out: list[str] = []  # what ranks that left an entry out would have held of it
    for name in dict.fromkeys(name for entries in per_rank for name in entries):
        lists = [entries[name] for entries in per_rank if name in entries]
        common = set(lists[0]).intersection(*lists[1:])
        keys += [key for key in lists[0] if key in common]
        without = [str(r) for r, entries in enumerate(per_rank) if name not in entries]
        if common and without:
            left_out.append(f"rank(s) {', '.join(without[:8])} passed no {name!r}")
    note = (
        f"{'; '.join(left_out)} to this load: pass each entry on every rank whose objects "
        "hold part of it"
    )
    _refuse_held_by_no_rank(keys, strict, note if left_out else "")


def _refuse_held_by_no_rank(keys: list[str], strict: bool, note: str) -> None:
    """Raise the mismatch of ``keys`` no rank holds an object for, with ``note`` (which
    ranks left an entry out) after it; nothing if there is neither."""
    if keys or note:
        text = _Problems([], keys, [], unexpected_title=_HELD_BY_NO_RANK).message(strict)
        raise CheckpointMismatchError(text + (f"\n  ({note})" if note else ""))


_HELD_BY_NO_RANK = "unexpected in the checkpoint (held by no rank)"


@dataclass
class _Problems:
    missing: list[str]
    unexpected: list[str]
    mismatched: list[str]
    unexpected_title: str = "unexpected in the checkpoint"
    absent: list[str] = field(default_factory=list)
    """Entries of the state the checkpoint does not have at all."""
    known: list[str] = field(default_factory=list)
    """The checkpoint's entries, to name in place of an absent one."""
    castable: str | None = None
    """A live floating-point dtype some saved weights differ in: the way out is a cast."""

    def message(self, strict: bool) -> str:
        lines = [no_entry(name, self.known) for name in self.absent]
        for title, keys in (
            ("missing from the checkpoint", self.missing),
            (self.unexpected_title, self.unexpected),
            ("mismatched", self.mismatched),  # shapes, dtypes, classes, names
        ):
            if keys:
                shown = "; ".join(keys[:_SHOWN])
                more = f" ... and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
                lines.append(f"{title} ({len(keys)}): {shown}{more}")
        if self.castable is not None:
            lines.append(
                "shardsafe never casts as it loads; to load weights saved in another dtype, "
                f"cast them once as you convert: shardsafe.convert(path, new_path, "
                f'dtype="{self.castable}")'
            )
        if self.absent and not strict:
            lines.append("strict=False loads what both sides have: here, nothing at all.")
        elif strict and not self.absent and not self.mismatched:
            # Only where strict=False would load something: an entry that is not there at
            # all is a wrong name (or a wrong checkpoint), which strict=False would hide.
            lines.append(STRICT_HINT)
        if len(lines) == 1 and self.absent:  # a misspelled entry alone: one line
            return lines[0]
        return "\n  ".join(["the checkpoint does not match the objects being loaded:", *lines])


STRICT_HINT = "Pass strict=False to load only the keys both sides have."
"""The way out a strict load's mismatch names; a caller whose users cannot pass
``strict`` (``ShardsafeTrainer``'s resume) says its own instead."""


def no_entry(name: str, known: list[str]) -> str:
    """``the checkpoint has no entry "modle" (it has: "model", "optimizer"); did you
    mean "model"?``"""
    shown = ", ".join(_quoted(k) for k in known[:_LISTED])
    more = f", ... and {len(known) - _LISTED} more" if len(known) > _LISTED else ""
    has = f"it has: {shown}{more}" if known else "it has no entries"
    candidates = [k for k in known if len(k) <= _COMPARED_CHARS]
    close = difflib.get_close_matches(name, candidates, n=1)
    guess = f"; did you mean {_quoted(close[0])}?" if close else ""
    return f"the checkpoint has no entry {_quoted(name)} ({has}){guess}"


def _quoted(name: str) -> str:
    """``"name"``, escaped where it holds characters a terminal would not show as they are."""
    return json.dumps(name, ensure_ascii=not name.isprintable())


def _check_request(req: ReadRequest, manifest: Manifest) -> str | None:
    rec = manifest.tensors.get(req.key)
    if rec is None:
        return "missing"
    return request_problem(req, rec.dtype, tuple(rec.shape))


def request_problem(
    req: ReadRequest, dtype_saved: torch.dtype, shape_saved: tuple[int, ...]
) -> str | None:
    """What is wrong with a saved tensor of ``dtype_saved`` and ``shape_saved`` for
    ``req`` (``None``: nothing); also for tensors given in memory (``interop``)."""
    saved = f"{dtypes.dtype_name(dtype_saved)}{list(shape_saved)}"
    dtype = req.dtype or dtype_saved
    shape = req.global_shape if req.global_shape is not None else shape_saved
    if dtype != dtype_saved or tuple(shape) != shape_saved:
        return f"{req.key}: checkpoint {saved}, live {dtypes.dtype_name(dtype)}{list(shape)}"
    if req.within is not None and not _fits(shape_saved, req.within, req.factored):
        return (
            f"{req.key}: checkpoint {saved}, but it belongs to a live tensor of shape "
            f"{list(req.within)}: it must be a scalar or shaped like it"
        )
    if (
        req.offsets is not None
        and req.shape is not None
        and not (
            len(req.offsets) == len(req.shape) == len(shape_saved)
            and all(o + n <= s for o, n, s in zip(req.offsets, req.shape, shape_saved))
        )
    ):
        return f"{req.key}: requested region lies outside the saved shape {list(shape_saved)}"
    return None


def _fits(shape: tuple[int, ...], target: tuple[int, ...], factored: bool) -> bool:
    """True for a 0-d shape or ``target`` itself; with ``factored`` also ``target`` with
    some dimensions 1 (``[rows, 1]``, ``[1, cols]``: torch's Adafactor) or with one
    dimension left out (``[rows]``, ``[cols]``: transformers' and timm's Adafactor)."""
    if not shape or shape == target:
        return True
    if not factored:
        return False
    if len(shape) == len(target):
        return all(n in (1, m) for n, m in zip(shape, target))
    return len(shape) + 1 == len(target) and any(
        shape == target[:i] + target[i + 1 :] for i in range(len(target))
    )


def _check_allocation(manifest: Manifest, plan: LoadPlan, rank: int, limit: int) -> None:
    """Refuse, before allocating anything, a load whose sizes only the checkpoint vouches for
    beyond ``limit`` plus :data:`LIVE_MULTIPLE` times the live tensors being filled.

    Tensors checked against a live tensor (module weights, tensors passed in) cannot be
    larger than it. Everything else (a fresh optimizer's state, returned plain tensors,
    RNG and scheduler state) takes the size the manifest says: a hostile checkpoint of a
    few KiB (sparse files) could otherwise make a load allocate terabytes.
    """
    live = untrusted = 0
    largest: list[tuple[int, str]] = []
    for req in plan.requests:
        nbytes = request_bytes(manifest.tensors[req.key], req)
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


def request_bytes(rec: TensorRecord, req: ReadRequest) -> int:
    """The bytes of tensor ``rec`` that ``req`` reads."""
    shape = req.shape if req.shape is not None else rec.shape
    return math.prod(shape) * dtypes.itemsize(rec.dtype)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
