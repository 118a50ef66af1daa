"""JSON as hostile input: no duplicate keys, no NaN or Infinity (nor ``1e999``), bounded
nesting (measured without recursion, in memory bounded by the depth), and integers of at
most ``MAX_INT_DIGITS`` digits.

Every JSON document shardsafe reads from disk goes through here (the manifest, a Hugging
Face index, the root lock, the incomplete-save marker), so that a hostile one always ends
in :class:`CheckpointCorruptError` naming the file, never in a ``RecursionError`` or in the
interpreter's own integer-conversion error.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import CheckpointCorruptError
from .manifest_format import MAX_DEPTH

MAX_INT_DIGITS = 4300
"""The longest integer literal accepted: Python's own default limit on converting digits
to an int (``sys.set_int_max_str_digits``), enforced here whatever the interpreter's
setting, so that a number's parse stays fast and its refusal is this module's error."""


def load_manifest_json(raw: bytes, where: str) -> Any:
    return load_json_bytes(raw, where, deep_keys=("values", "info"))


def load_json_bytes(raw: bytes, where: str, *, deep_keys: tuple[str, ...] | None = None) -> Any:
    """:func:`load_json` of UTF-8 bytes; bytes that are not UTF-8 are a damaged file."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointCorruptError(
            f"{where} is not valid UTF-8 ({e.reason} at byte {e.start}); the file is damaged"
        ) from None
    return load_json(text, where, deep_keys=deep_keys)


def load_json(text: str, where: str, *, deep_keys: tuple[str, ...] | None = None) -> Any:
    """Strict JSON: no duplicate keys, no NaN/Infinity (nor ``1e999``), bounded nesting.

    ``deep_keys``: only these top-level entries can nest freely (the rest is checked
    field by field by its parser, never recursed into), so only they are measured.
    """
    too_deep = CheckpointCorruptError(
        f"{where} is nested too deeply (over {MAX_DEPTH} levels); the file is damaged"
    )
    try:
        doc = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_float=_finite_float,
            parse_int=int_parser(),
        )
    except RecursionError:
        raise too_deep from None
    except ValueError as e:
        raise CheckpointCorruptError(f"{where} is not valid JSON: {why_not_json(e)}") from None
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


def int_parser() -> Callable[[str], int] | None:
    """What ``json.loads`` should convert integers with: its own C conversion where the
    interpreter already refuses more than ``MAX_INT_DIGITS`` digits (the default: no
    Python call per number, which would make an int-heavy manifest parse 3x slower), else
    :func:`bounded_int`."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    return None if 0 < limit <= MAX_INT_DIGITS else bounded_int


_LIMIT = re.compile(
    r"Exceeds the limit \(\d+ digits\) for integer string conversion: value has (\d+)"
)


def why_not_json(error: ValueError) -> str:
    """What a parse error says, in one wording whichever converter refused a long number
    (:func:`bounded_int`, or the interpreter's own limit, whose message names a setting)."""
    found = _LIMIT.search(str(error))
    if found is None:
        return str(error)[:200]
    return f"a number of {found.group(1)} digits, over the {MAX_INT_DIGITS} accepted"


def bounded_int(text: str) -> int:
    """A JSON integer literal of at most ``MAX_INT_DIGITS`` digits (``parse_int``)."""
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"a number of {digits} digits, over the {MAX_INT_DIGITS} accepted")
    return int(text)


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
