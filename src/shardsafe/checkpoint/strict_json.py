"""JSON as hostile input: no duplicate keys, no NaN or Infinity (nor ``1e999``), bounded
nesting (measured without recursion, in memory bounded by the depth)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from ..errors import CheckpointCorruptError
from .manifest_format import MAX_DEPTH


def load_manifest_json(raw: bytes, where: str) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointCorruptError(
            f"{where} is not valid UTF-8 ({e.reason} at byte {e.start}); the file is damaged"
        ) from None
    return load_json(text, where, deep_keys=("values", "info"))


def load_json(text: str, where: str, *, deep_keys: tuple[str, ...] | None = None) -> Any:
    """Strict JSON: no duplicate keys, no NaN/Infinity (nor ``1e999``), bounded nesting.

    ``deep_keys``: only these top-level entries can nest freely (the rest is checked
    field by field by its parser, never recursed into), so only they are measured.
    """
    too_deep = CheckpointCorruptError(f"{where} is nested too deeply to be a manifest")
    try:
        doc = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_float=_finite_float,
        )
    except RecursionError:
        raise too_deep from None
    except ValueError as e:
        raise CheckpointCorruptError(f"{where} is not valid JSON: {e}") from None
    if deep_keys is None or not isinstance(doc, dict):
        deepest = depth(doc)
    else:
        deepest = 1 + max((depth(doc.get(k)) for k in deep_keys), default=0)
    if deepest > MAX_DEPTH:
        raise too_deep
    return doc


def depth(doc: Any) -> int:
    """Nesting depth of parsed JSON, without recursion and in memory bounded by the depth."""
    deepest = 0
    stack: list[Iterator[Any]] = [iter((doc,))]
    while stack:
        node = next(stack[-1], _END)
        if node is _END:
            stack.pop()
            continue
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        stack.append(iter(node))
        deepest = max(deepest, len(stack) - 1)
    return deepest


_END = object()


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {duplicate!r}")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name}")
