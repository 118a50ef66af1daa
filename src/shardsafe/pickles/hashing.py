"""Keys crafted to share a hash: the one way to make a dict of n keys cost n**2.

A string's or bytes' hash is salted per process, but a number's is not (``hash(k)`` is
``k mod 2**61 - 1``), nor a tuple's of numbers, nor a frozen dataclass's of such fields
(DCP's ``MetadataIndex``, keyed by chunk offsets). :func:`worst_collision` rebuilds each key
a pickle hashes into a dict or set, where its hash is knowable, and counts how many
distinct keys of one container share a hash; strings inside a key are rebuilt from their
text, so the hash is exactly the one the unpickler will compute in this process.
"""

from __future__ import annotations

from typing import Any

from .machine import Machine
from .nodes import ATOM, BYTES, DICT, NONE, OBJECT, STR, TUPLE

_UNKNOWN = object()
"""A key whose hash cannot be known here (a long string's, an object's): it cannot be
forced to collide either."""


def worst_collision(machine: Machine, enough: int) -> int:
    """The most distinct keys of one container of ``machine`` that share a hash, counted
    up to ``enough + 1``: once one hash has more than ``enough`` keys, the count stops.
    Counting them all put every colliding key in one set, each added at the cost of
    comparing it with those already there: the check itself was quadratic (40,000 keys
    of 560 KB took a minute, found in review)."""
    rebuilt: dict[int, Any] = {}
    worst = 0
    for keys in machine.keys.values():
        by_hash: dict[int, set[Any]] = {}
        for node in keys:
            key = _rebuild(machine, node, rebuilt)
            if key is _UNKNOWN:
                continue
            try:
                same = by_hash.setdefault(hash(key), set())
                same.add(key)
            except TypeError:
                continue  # unhashable: the unpickler fails at once
            worst = max(worst, len(same))
            if worst > enough:
                return worst
    return worst


def _rebuild(machine: Machine, node: int, done: dict[int, Any]) -> Any:
    """The value ``node`` stands for, where its hash is knowable, else ``_UNKNOWN``;
    each node rebuilt once (``done``), never deeper than the scan allowed."""
    if node in done:
        return done[node]
    kind, value = machine.kinds[node], machine.values[node]
    result: Any = _UNKNOWN
    if kind == ATOM and value is not BYTES:
        result = None if value is NONE else value
    elif kind == STR and value is not None:
        result = value
    elif kind == TUPLE:
        result = _tuple(machine, machine.children[node] or [], done)
    elif kind == OBJECT and value in machine.policy.hashes_as:
        result = _object(machine, node, machine.policy.hashes_as[value], done)
    elif kind == OBJECT and value == _COMPLEX:
        result = _complex(machine, node, done)
    done[node] = result
    return result


_COMPLEX = ("builtins", "complex")


def _complex(machine: Machine, node: int, done: dict[int, Any]) -> Any:
    """``complex(real, imag)`` of rebuilt scalars: its hash, ``hash(real) + 1000003 *
    hash(imag)``, is as knowable (and as easily forced to collide) as a number's, where
    it was taken for unknowable and keys of one hash were never counted."""
    items = _tuple(machine, (machine.children[node] or [])[1:], done)  # its scalars
    if items is _UNKNOWN:
        return _UNKNOWN
    try:
        return complex(*items)
    except (TypeError, ValueError, OverflowError):
        return _UNKNOWN  # the unpickler's own call fails the same way


def _tuple(machine: Machine, nodes: list[int], done: dict[int, Any]) -> Any:
    items = [_rebuild(machine, n, done) for n in nodes]
    return _UNKNOWN if any(i is _UNKNOWN for i in items) else tuple(items)


def _object(machine: Machine, node: int, fields: tuple[str, ...], done: dict[int, Any]) -> Any:
    """An object that hashes as a tuple: of its one argument's items (``fields == ()``:
    ``torch.Size(list)``), or of the named fields of its ``BUILD`` state (``None`` where
    one is missing, as a dataclass's default)."""
    children = machine.children[node] or []
    if not fields:
        args = children[1:2]
        if not args:
            return _UNKNOWN
        return _tuple(machine, machine.children[args[0]] or [], done)
    state = machine.states.get(node)
    if state is None:
        return _UNKNOWN
    parts = machine.children[state] or [] if machine.kinds[state] == TUPLE else [state]
    given: dict[Any, int] = {}
    for part in parts:  # a dict state, or (dict state, slot state)
        if machine.kinds[part] == DICT:
            pairs = machine.children[part] or []
            given.update(zip((machine.values[k] for k in pairs[0::2]), pairs[1::2]))
    items = []
    for name in fields:
        field = given.get(name)
        items.append(None if field is None else _rebuild(machine, field, done))
    return _UNKNOWN if any(i is _UNKNOWN for i in items) else tuple(items)
