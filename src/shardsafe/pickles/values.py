"""What the opcodes that make values do to the stand-ins: numbers, strings, bytes,
containers and the items added to them, the memo and the stack.

Each is a function of the :class:`~.machine.Machine` (reading its arguments from the
stream); ``opcodes.py`` says which opcode runs which. A value's node keeps what its hash
needs (a number's value, a short string's text); a container's node holds its items, and
the nodes hashed into a dict or set are recorded as its keys (``hashing.py``).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from .nodes import ATOM, BYTES, DICT, FROZENSET, LIST, OBJECT, STR, TUPLE, Refused
from .policy import MAX_INT_BYTES

if TYPE_CHECKING:
    from .machine import Machine

_SHORT = 256
"""Strings up to this many bytes keep their value (a global's, a field's or a key's)."""


def atom(m: Machine, value: Any = None) -> None:
    m.push(ATOM, None, value)


def number(m: Machine, fmt: str) -> None:
    """BININT, BININT1, BININT2, BINFLOAT: a number whose hash is known."""
    atom(m, struct.unpack(fmt, m.take(struct.calcsize(fmt)))[0])


def integer(m: Machine, nbytes: int) -> None:
    """LONG1, LONG4: a little-endian two's complement integer, bounded."""
    if nbytes > MAX_INT_BYTES:
        raise Refused(f"it holds an integer of {nbytes} bytes (at most {MAX_INT_BYTES})")
    atom(m, int.from_bytes(m.take(nbytes), "little", signed=True))


def text_number(m: Machine, kind: type) -> None:
    """INT, LONG, FLOAT in protocol 0's text form (``I01`` is True)."""
    text = m.line().rstrip("L")
    if len(text) > 2 * MAX_INT_BYTES:
        raise Refused(f"it holds a number of {len(text)} characters")
    value: Any = {"01": True, "00": False}.get(text) if kind is int else None
    try:
        atom(m, value if value is not None else kind(text))
    except ValueError:
        raise Refused(f"{text[:40]!r} is not a number") from None


def bytes_(m: Machine, nbytes: int) -> None:
    m.take(nbytes)
    atom(m, BYTES)


def string(m: Machine, raw: memoryview | bytes) -> None:
    value = None
    if len(raw) <= _SHORT:
        try:
            value = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            value = None
    m.push(STR, None, value)


def container(m: Machine, kind: int, from_mark: bool) -> None:
    items = m.pop_mark() if from_mark else []
    if kind == DICT and len(items) % 2:
        raise Refused(f"a dict at byte {m.pos} has an odd number of items")
    m.push(kind, items)
    if kind in (DICT, FROZENSET):
        m.keys[m.stack[-1]] = items[0::2] if kind == DICT else list(items)


def small_tuple(m: Machine, n: int) -> None:
    items = [m.pop() for _ in range(n)]
    m.push(TUPLE, items[::-1])


def add(m: Machine, how: int, from_mark: bool) -> None:
    """APPEND(S) (``how`` LIST), SETITEM(S) (DICT), ADDITEMS (SET)."""
    popped = 2 if how == DICT else 1  # SETITEM pops a key and a value
    items = m.pop_mark() if from_mark else [m.pop() for _ in range(popped)][::-1]
    target = m.top()
    mapping = m.kinds[target] == OBJECT and m.values[target] in m.policy.mappings
    ok = m.kinds[target] == how or (how == DICT and mapping)
    if not ok:
        raise Refused(f"it adds items to {m.describe(target)}, not a container it made")
    if how == DICT and len(items) % 2:
        raise Refused(f"SETITEMS at byte {m.pos} has an odd number of items")
    if how != LIST:
        m.keys.setdefault(target, []).extend(items[0::2] if how == DICT else items)
    children = m.children[target]
    assert children is not None
    children.extend(items)


def memo_put(m: Machine, index: int | None = None) -> None:
    index = len(m.memo) if index is None else index
    if index > len(m.memo):
        raise Refused(f"memo index {index} skips ahead ({len(m.memo)} stored so far)")
    m.memo[index] = m.top()


def memo_get(m: Machine, index: int) -> None:
    if index not in m.memo:
        raise Refused(f"it refers to memo entry {index}, which was never stored")
    m.stack.append(m.memo[index])


def text_index(m: Machine) -> int:
    """GET, PUT: a memo index in protocol 0's text form."""
    text = m.line()
    if not (0 < len(text) <= 10 and text.isdigit()):
        raise Refused(f"memo index {text[:20]!r} is not a small number")
    return int(text)


def mark(m: Machine) -> None:
    m.marks.append(len(m.stack))


def dup(m: Machine) -> None:
    m.stack.append(m.top())


def pop_mark(m: Machine) -> None:
    m.pop_mark()


def pop(m: Machine) -> None:
    if m.marks and len(m.stack) == m.marks[-1]:
        m.marks.pop()  # POP on an empty marked stack drops the mark, as CPython does
    else:
        m.pop()
