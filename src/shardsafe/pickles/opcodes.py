"""Which handler each opcode byte runs: the dispatch tables of the pickle machine.

:data:`GENERAL` holds every opcode of protocols 0-5 but these, which are refused: PERSID
(a text persistent id), EXT1/2/4 (globals from copyreg's extension registry),
NEXT_BUFFER/READONLY_BUFFER; STOP is :meth:`~.machine.Machine.run`'s own. :data:`HOT`
holds, for the opcodes that make up most of a real pickle, a one-step version of the
same handler (``hot.py``), which the machine tries first.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from . import hot
from .nodes import DICT, FROZENSET, LIST, NONE, SET, TUPLE, Refused
from .objects import build, call, global_, persistent
from .values import (
    add,
    atom,
    bytes_,
    container,
    dup,
    integer,
    mark,
    memo_get,
    memo_put,
    number,
    pop,
    pop_mark,
    small_tuple,
    string,
    text_index,
    text_number,
)

if TYPE_CHECKING:
    from .machine import Machine

Handler = Callable[["Machine"], None]
"""Runs one opcode, its arguments read from the stream after it (``Machine.pos``)."""
HotStep = Callable[["Machine", int], int]
"""Runs the opcode at a position; the position after it, or ``-1`` to refuse (``hot.py``)."""

# fmt: off
GENERAL: dict[int, Handler] = {
    0x80: lambda m: m.skip(1),  # PROTO
    0x95: lambda m: m.frame(),
    ord("("): mark,
    ord("0"): pop, ord("1"): pop_mark, ord("2"): dup,
    ord("N"): partial(atom, value=NONE), 0x88: partial(atom, value=True),
    0x89: partial(atom, value=False),
    ord("J"): partial(number, fmt="<i"), ord("K"): partial(number, fmt="<B"),
    ord("M"): partial(number, fmt="<H"), ord("G"): partial(number, fmt=">d"),
    0x8A: lambda m: integer(m, m.uint(1)), 0x8B: lambda m: integer(m, m.int32()),  # LONG1, LONG4
    ord("I"): partial(text_number, kind=int), ord("L"): partial(text_number, kind=int),
    ord("F"): partial(text_number, kind=float),
    ord("X"): lambda m: string(m, m.take(m.uint(4))),
    0x8C: lambda m: string(m, m.take(m.uint(1))),
    0x8D: lambda m: string(m, m.take(m.uint(8))), ord("U"): lambda m: string(m, m.take(m.uint(1))),
    ord("T"): lambda m: string(m, m.take(m.int32())),
    ord("S"): lambda m: string(m, m.line().encode()),
    ord("V"): lambda m: string(m, m.line().encode()),
    ord("B"): lambda m: bytes_(m, m.uint(4)), ord("C"): lambda m: bytes_(m, m.uint(1)),
    0x8E: lambda m: bytes_(m, m.uint(8)), 0x96: lambda m: bytes_(m, m.uint(8)),
    ord("}"): partial(container, kind=DICT, from_mark=False),
    ord("]"): partial(container, kind=LIST, from_mark=False),
    ord(")"): partial(container, kind=TUPLE, from_mark=False),
    0x8F: partial(container, kind=SET, from_mark=False),
    ord("d"): partial(container, kind=DICT, from_mark=True),
    ord("l"): partial(container, kind=LIST, from_mark=True),
    ord("t"): partial(container, kind=TUPLE, from_mark=True),
    0x91: partial(container, kind=FROZENSET, from_mark=True),
    0x85: partial(small_tuple, n=1), 0x86: partial(small_tuple, n=2),
    0x87: partial(small_tuple, n=3),
    ord("a"): partial(add, how=LIST, from_mark=False),
    ord("e"): partial(add, how=LIST, from_mark=True),
    ord("s"): partial(add, how=DICT, from_mark=False),
    ord("u"): partial(add, how=DICT, from_mark=True),
    0x90: partial(add, how=SET, from_mark=True),
    ord("c"): partial(global_, stacked=False), 0x93: partial(global_, stacked=True),
    ord("R"): partial(call, how="REDUCE"), 0x81: partial(call, how="NEWOBJ"),
    0x92: partial(call, how="NEWOBJ_EX"), ord("o"): partial(call, how="OBJ"),
    ord("i"): partial(call, how="INST"),
    ord("b"): build, ord("Q"): persistent,
    ord("h"): lambda m: memo_get(m, m.uint(1)), ord("j"): lambda m: memo_get(m, m.uint(4)),
    ord("g"): lambda m: memo_get(m, text_index(m)),
    ord("q"): lambda m: memo_put(m, m.uint(1)), ord("r"): lambda m: memo_put(m, m.uint(4)),
    ord("p"): lambda m: memo_put(m, text_index(m)), 0x94: memo_put,
}

_HOT: dict[int, HotStep] = {
    0x94: hot.memoize, 0x71: hot.binput,  # MEMOIZE, BINPUT ("q")
    0x68: hot.binget, 0x6A: hot.long_binget,  # BINGET ("h"), LONG_BINGET ("j")
    0x4B: hot.binint1,  # BININT1 ("K")
    0x85: hot.tuple1, 0x86: hot.tuple2,
    0x28: hot.mark,  # MARK ("(")
    0x29: hot.empty_tuple, 0x7D: hot.empty_dict, 0x5D: hot.empty_list,  # ")", "}", "]"
    0x89: hot.newfalse, 0x4E: hot.none,  # NEWFALSE, NONE ("N")
    0x8C: hot.short_binunicode,
}
# fmt: on
HOT: list[HotStep | None] = [_HOT.get(op) for op in range(256)]
"""Indexed by opcode byte: its one-step handler, or ``None`` (the general one runs)."""


def run(machine: Machine) -> int:
    """Run ``machine`` to ``STOP``; the node it returns. The opcodes that make up most of a real
    pickle (memo traffic, short strings, small ints) take one step each, without the
    general handlers' checks and calls (:data:`HOT`): the scan then costs about
    what torch's own ``weights_only`` unpickler does."""
    data, hot, general = machine.data, HOT, GENERAL
    end, pos = len(data), machine.pos
    while pos < end:
        op = data[pos]
        step = hot[op]
        if step is not None:
            after = step(machine, pos)
            if after > pos:
                pos = after
                continue
            machine.pos = pos + 1  # it found a problem: the general handler says which
            general[op](machine)
            raise AssertionError("unreachable: the handler refuses")
        machine.pos = pos + 1
        if op == 0x2E:  # STOP
            return machine.pop()
        handler = general.get(op)
        if handler is None:
            raise Refused(f"it uses opcode {op:#04x} (at byte {pos}), which is refused")
        handler(machine)
        pos = machine.pos
    machine.pos = pos
    raise Refused("it ends without a STOP")
