"""The opcodes that make up most of a real pickle, each in one step.

Memo traffic, short strings, small ints, small tuples and empty containers are nearly
every opcode of a ``torch.save`` pickle. Each function here does what its general handler
(``values.py``) does, reading the stream and pushing the node itself, and returns the
position after the opcode; it returns ``-1`` where that handler would refuse the opcode
(a length past the end, an empty stack, an unknown memo index), and
:meth:`~.machine.Machine.run` then calls the handler to say why. ``opcodes.HOT`` maps each
opcode to its function here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .nodes import ATOM, DICT, LIST, NONE, STR, TUPLE

if TYPE_CHECKING:
    from .machine import Machine


def memoize(m: Machine, pos: int) -> int:
    """MEMOIZE: store the top in the next memo slot."""
    stack, marks = m.stack, m.marks
    if len(stack) <= (marks[-1] if marks else 0):
        return -1
    m.memo[len(m.memo)] = stack[-1]
    return pos + 1


def binput(m: Machine, pos: int) -> int:
    """BINPUT: store the top in a memo slot numbered by one byte (none may be skipped)."""
    data, stack, marks, memo = m.data, m.stack, m.marks, m.memo
    if pos + 2 > len(data):
        return -1
    index = data[pos + 1]
    if len(stack) <= (marks[-1] if marks else 0) or index > len(memo):
        return -1
    memo[index] = stack[-1]
    return pos + 2


def binget(m: Machine, pos: int) -> int:
    """BINGET: push a memo entry numbered by one byte."""
    return _get(m, pos, 2)


def long_binget(m: Machine, pos: int) -> int:
    """LONG_BINGET: push a memo entry numbered by four bytes."""
    return _get(m, pos, 5)


def _get(m: Machine, pos: int, size: int) -> int:
    data = m.data
    if pos + size > len(data):
        return -1
    node = m.memo.get(int.from_bytes(data[pos + 1 : pos + size], "little"))
    if node is None:
        return -1
    m.stack.append(node)
    return pos + size


def binint1(m: Machine, pos: int) -> int:
    """BININT1: a number from one byte."""
    data = m.data
    if pos + 2 > len(data):
        return -1
    _push(m, ATOM, None, data[pos + 1])
    return pos + 2


def short_binunicode(m: Machine, pos: int) -> int:
    """SHORT_BINUNICODE: a string of at most 255 bytes, which keeps its text."""
    data = m.data
    if pos + 2 > len(data) or pos + 2 + data[pos + 1] > len(data):
        return -1
    n = data[pos + 1]
    try:
        text: str | None = m.raw[pos + 2 : pos + 2 + n].decode("utf-8")
    except UnicodeDecodeError:
        text = None
    _push(m, STR, None, text)
    return pos + 2 + n


def tuple1(m: Machine, pos: int) -> int:
    """TUPLE1: the top, as a tuple."""
    return _tuple(m, pos, 1)


def tuple2(m: Machine, pos: int) -> int:
    """TUPLE2: the top two, as a tuple."""
    return _tuple(m, pos, 2)


def _tuple(m: Machine, pos: int, n: int) -> int:
    stack, marks = m.stack, m.marks
    if len(stack) - n < (marks[-1] if marks else 0):
        return -1
    items = stack[-n:]
    del stack[-n:]
    _push(m, TUPLE, items, None)
    return pos + 1


def mark(m: Machine, pos: int) -> int:
    """MARK: where the items of the next container begin."""
    m.marks.append(len(m.stack))
    return pos + 1


def empty_tuple(m: Machine, pos: int) -> int:
    _push(m, TUPLE, [], None)
    return pos + 1


def empty_dict(m: Machine, pos: int) -> int:
    _push(m, DICT, [], None)
    return pos + 1


def empty_list(m: Machine, pos: int) -> int:
    _push(m, LIST, [], None)
    return pos + 1


def newfalse(m: Machine, pos: int) -> int:
    _push(m, ATOM, None, False)
    return pos + 1


def none(m: Machine, pos: int) -> int:
    _push(m, ATOM, None, NONE)
    return pos + 1


def _push(m: Machine, kind: int, children: list[int] | None, value: Any) -> None:
    kinds = m.kinds
    kinds.append(kind)
    m.children.append(children)
    m.values.append(value)
    m.stack.append(len(kinds) - 1)
