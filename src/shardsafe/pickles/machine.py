"""The pickle machine run on stand-ins: what a pickle would build, without building it.

Every value is a node number (``nodes.py``); a node records its kind, the nodes it holds
or was built from, and a value: a number's own value, a short string's text, a global's
or an object's ``(module, name)``. Nothing is built, imported or called. The pickle
machine has no branches, so the stand-ins tell exactly which global each opcode names,
what each ``REDUCE`` calls and with what, what each ``BUILD`` fills and what each
container holds, and each opcode is refused the moment it breaks the
:class:`~.policy.Policy` (see ``pickles/scan.py`` for what the finished graph is measured
against). Each opcode creates at most one node and a few edges.
"""

from __future__ import annotations

import _compat_pickle
import struct
from collections.abc import Callable
from functools import partial
from typing import Any

from . import calls
from .nodes import (
    ATOM,
    BYTES,
    DICT,
    FROZENSET,
    GLOBAL,
    LIST,
    NAMES,
    NONE,
    OBJECT,
    PERSISTENT,
    SET,
    STR,
    TUPLE,
    Refused,
    printable,
)  # fmt: skip
from .policy import MAX_INT_BYTES, Policy

_SHORT = 256
"""Strings up to this many bytes keep their value (a global's, a field's or a key's)."""


class Machine:
    """The pickle machine on stand-ins. Node ``n`` has ``kinds[n]``, ``children[n]`` (the
    values it holds or was built from) and ``values[n]`` (a short string's text, a
    global's or an object's ``(module, name)``)."""

    def __init__(self, data: bytes, policy: Policy) -> None:
        self.raw = data
        self.data = memoryview(data).cast("B")
        self.policy = policy
        self.pos = 0
        self.kinds: list[int] = []
        self.children: list[list[int] | None] = []
        self.values: list[Any] = []
        self.keys: dict[int, list[int]] = {}
        """Per dict or set (or ``set(...)`` call), the nodes hashed into it: its keys."""
        self.states: dict[int, int] = {}
        """The state ``BUILD`` gave each object (what a dataclass hashes)."""
        self.stack: list[int] = []
        self.marks: list[int] = []
        self.memo: dict[int, int] = {}

    # -- the stream

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise Refused(f"a length of {n} bytes at byte {self.pos} runs past the end")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def skip(self, n: int) -> None:
        self.take(n)

    def frame(self) -> None:
        """FRAME: a length prefix for what follows; only its bound matters here."""
        size = self.uint(8)
        if size > len(self.data) - self.pos:
            raise Refused(f"a frame of {size} bytes runs past the end")

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "little")

    def int32(self) -> int:
        value: int = struct.unpack("<i", self.take(4))[0]
        return value

    def line(self) -> str:
        end = self.raw.find(b"\n", self.pos, self.pos + 4096)
        if end < 0:
            raise Refused(f"a text argument at byte {self.pos} is unterminated or too long")
        text = self.raw[self.pos : end].decode("utf-8", "replace")
        self.pos = end + 1
        return text

    # -- nodes and the stack

    def push(self, kind: int, children: list[int] | None = None, value: Any = None) -> None:
        self.kinds.append(kind)
        self.children.append(children)
        self.values.append(value)
        self.stack.append(len(self.kinds) - 1)

    def pop(self) -> int:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise Refused(f"an opcode at byte {self.pos} pops an empty stack")
        return self.stack.pop()

    def top(self) -> int:
        node = self.pop()
        self.stack.append(node)
        return node

    def pop_mark(self) -> list[int]:
        if not self.marks:
            raise Refused(f"an opcode at byte {self.pos} needs a MARK that was never set")
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def text(self, node: int) -> str | None:
        value = self.values[node]
        return value if self.kinds[node] == STR else None

    def describe(self, node: int) -> str:
        if self.kinds[node] in (GLOBAL, OBJECT):
            what = ".".join(self.values[node])
            return f"the global {what}" if self.kinds[node] == GLOBAL else f"a {what} it made"
        return NAMES[self.kinds[node]]

    # -- opcodes

    def atom(self, value: Any = None) -> None:
        self.push(ATOM, None, value)

    def number(self, fmt: str) -> None:
        """BININT, BININT1, BININT2, BINFLOAT: a number whose hash is known."""
        self.atom(struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0])

    def integer(self, nbytes: int) -> None:
        """LONG1, LONG4: a little-endian two's complement integer, bounded."""
        if nbytes > MAX_INT_BYTES:
            raise Refused(f"it holds an integer of {nbytes} bytes (at most {MAX_INT_BYTES})")
        self.atom(int.from_bytes(self.take(nbytes), "little", signed=True))

    def text_number(self, kind: type) -> None:
        """INT, LONG, FLOAT in protocol 0's text form (``I01`` is True)."""
        text = self.line().rstrip("L")
        if len(text) > 2 * MAX_INT_BYTES:
            raise Refused(f"it holds a number of {len(text)} characters")
        value: Any = {"01": True, "00": False}.get(text) if kind is int else None
        try:
            self.atom(value if value is not None else kind(text))
        except ValueError:
            raise Refused(f"{text[:40]!r} is not a number") from None

    def bytes_(self, nbytes: int) -> None:
        self.take(nbytes)
        self.atom(BYTES)

    def string(self, raw: memoryview | bytes) -> None:
        value = None
        if len(raw) <= _SHORT:
            try:
                value = bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                value = None
        self.push(STR, None, value)

    def container(self, kind: int, from_mark: bool) -> None:
        items = self.pop_mark() if from_mark else []
        if kind == DICT and len(items) % 2:
            raise Refused(f"a dict at byte {self.pos} has an odd number of items")
        self.push(kind, items)
        if kind in (DICT, FROZENSET):
            self.keys[self.stack[-1]] = items[0::2] if kind == DICT else list(items)

    def small_tuple(self, n: int) -> None:
        items = [self.pop() for _ in range(n)]
        self.push(TUPLE, items[::-1])

    def add(self, how: int, from_mark: bool) -> None:
        """APPEND(S) (``how`` LIST), SETITEM(S) (DICT), ADDITEMS (SET)."""
        if from_mark:
            items = self.pop_mark()
        else:
            items = [self.pop() for _ in range(2 if how == DICT else 1)][::-1]
        target = self.top()
        mapping = self.kinds[target] == OBJECT and self.values[target] in self.policy.mappings
        ok = self.kinds[target] == how or (how == DICT and mapping)
        if not ok:
            raise Refused(f"it adds items to {self.describe(target)}, not a container it made")
        if how == DICT and len(items) % 2:
            raise Refused(f"SETITEMS at byte {self.pos} has an odd number of items")
        if how != LIST:
            self.keys.setdefault(target, []).extend(items[0::2] if how == DICT else items)
        children = self.children[target]
        assert children is not None
        children.extend(items)

    def name_global(self, module: str, name: str) -> tuple[str, str]:
        if self.policy.fix_names:
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        if (module, name) not in self.policy.globals:
            raise Refused(
                f"it names the global {printable(module)}.{printable(name)}, which is not part "
                f"of {self.policy.holds}; refusing it (a pickle naming other globals can run "
                "code)"
            )
        return module, name

    def global_(self, stacked: bool) -> None:
        if stacked:
            name, module = self.text(self.pop()), self.text(self.pop())
            if name is None or module is None:
                raise Refused("STACK_GLOBAL names its global with something other than strings")
        else:
            module, name = self.line(), self.line()
        self.push(GLOBAL, None, self.name_global(module, name))

    def call(self, how: str) -> None:
        """REDUCE, NEWOBJ, NEWOBJ_EX, OBJ, INST: an object made by calling a global, with
        arguments its rule allows (``calls.py``)."""
        if how == "INST":
            module, name = self.line(), self.line()
            self.push(GLOBAL, None, self.name_global(module, name))
            callee, given = self.pop(), self.pop_mark()
        elif how == "OBJ":
            given = self.pop_mark()
            if not given:
                raise Refused(f"OBJ at byte {self.pos} has no class")
            callee, given = given[0], given[1:]
        else:
            if how == "NEWOBJ_EX" and self.children[self.pop()]:
                raise Refused("NEWOBJ_EX is given keyword arguments")
            args = self.pop()
            callee = self.pop()
            if self.kinds[args] != TUPLE:
                raise Refused(f"{how} at byte {self.pos} is given {self.describe(args)}")
            given = list(self.children[args] or ())
        key = self.values[callee] if self.kinds[callee] == GLOBAL else None
        rule = self.policy.calls.get(key) if key is not None else None
        if key is None or rule is None:
            raise Refused(
                f"it calls {self.describe(callee)} ({how}); a {self.policy.kind} never does"
            )
        hashed = calls.check(self, rule, ".".join(key), given)
        self.push(OBJECT, [callee, *given], key)
        if hashed:
            self.keys[self.stack[-1]] = hashed

    def build(self) -> None:
        state = self.pop()
        inst = self.top()
        key = self.values[inst] if self.kinds[inst] == OBJECT else None
        if key is None or key not in self.policy.buildable:
            raise Refused(
                f"it sets the state (BUILD) of {self.describe(inst)}; only objects this pickle "
                f"made, of the classes a {self.policy.kind} holds, may be filled"
            )
        fields = self.policy.buildable[key]
        if fields is not None:
            self.check_fields(state, fields, key[1])
        children = self.children[inst]
        assert children is not None
        children.append(state)
        self.states[inst] = state

    def check_fields(self, state: int, fields: frozenset[str], what: str) -> None:
        parts = [state]
        if self.kinds[state] == TUPLE and len(self.children[state] or ()) == 2:
            parts = list(self.children[state] or ())  # (dict state, slot state)
        for part in parts:
            if self.values[part] is NONE:
                continue
            if self.kinds[part] != DICT:
                raise Refused(f"the state it gives a {what} is {self.describe(part)}, not a dict")
            for key in (self.children[part] or [])[0::2]:
                if self.text(key) not in fields:
                    shown = printable(str(self.text(key) or self.describe(key)))
                    raise Refused(f"it sets {shown!r} on a {what}, which has no such field")

    def persistent(self) -> None:
        if not self.policy.persistent_ids:
            raise Refused(f"it holds a persistent reference, which a {self.policy.kind} never does")
        self.push(PERSISTENT, [self.pop()])

    def memo_put(self, index: int | None = None) -> None:
        index = len(self.memo) if index is None else index
        if index > len(self.memo):
            raise Refused(f"memo index {index} skips ahead ({len(self.memo)} stored so far)")
        self.memo[index] = self.top()

    def memo_get(self, index: int) -> None:
        if index not in self.memo:
            raise Refused(f"it refers to memo entry {index}, which was never stored")
        self.stack.append(self.memo[index])

    def pop_mark_op(self) -> None:
        self.pop_mark()

    def pop_op(self) -> None:
        if self.marks and len(self.stack) == self.marks[-1]:
            self.marks.pop()  # POP on an empty marked stack drops the mark, as CPython does
        else:
            self.pop()

    def run(self) -> int:
        """Run to ``STOP``; the node it returns. The opcodes that make up most of a real
        pickle (memo traffic, short strings, small ints) are handled inline: the scan then
        costs about what torch's own ``weights_only`` unpickler does."""
        data, ops, stack, memo, marks = self.data, _OPS, self.stack, self.memo, self.marks
        kinds, children, values, raw = self.kinds, self.children, self.values, self.raw
        end, pos = len(data), self.pos
        while pos < end:
            op = data[pos]
            if op == 0x94 or op == 0x71:  # MEMOIZE, BINPUT: store the top
                if op == 0x94:
                    index, size = len(memo), 1
                elif pos + 2 <= end:
                    index, size = data[pos + 1], 2
                else:
                    break
                if len(stack) <= (marks[-1] if marks else 0) or index > len(memo):
                    break  # the general handler says why
                memo[index] = stack[-1]
                pos += size
            elif op == 0x6A or op == 0x68:  # LONG_BINGET, BINGET
                size = 5 if op == 0x6A else 2
                if pos + size > end:
                    break
                index = int.from_bytes(data[pos + 1 : pos + size], "little")
                node = memo.get(index)
                if node is None:
                    break
                stack.append(node)
                pos += size
            elif op == 0x4B and pos + 2 <= end:  # BININT1
                kinds.append(ATOM)
                children.append(None)
                values.append(data[pos + 1])
                stack.append(len(kinds) - 1)
                pos += 2
            elif op == 0x85 or op == 0x86:  # TUPLE1, TUPLE2
                n = op - 0x84
                if len(stack) - n < (marks[-1] if marks else 0):
                    break
                items = stack[-n:]
                del stack[-n:]
                kinds.append(TUPLE)
                children.append(items)
                values.append(None)
                stack.append(len(kinds) - 1)
                pos += 1
            elif op == 0x28:  # MARK
                marks.append(len(stack))
                pos += 1
            elif op in _EMPTY:  # EMPTY_TUPLE, EMPTY_DICT, EMPTY_LIST, NEWFALSE, NONE
                kind, value = _EMPTY[op]
                kinds.append(kind)
                children.append(None if kind == ATOM else [])
                values.append(value)
                stack.append(len(kinds) - 1)
                pos += 1
            elif op == 0x8C and pos + 2 + data[pos + 1] <= end:  # SHORT_BINUNICODE
                n = data[pos + 1]
                try:
                    text: str | None = raw[pos + 2 : pos + 2 + n].decode("utf-8")
                except UnicodeDecodeError:
                    text = None
                kinds.append(STR)
                children.append(None)
                values.append(text)
                stack.append(len(kinds) - 1)
                pos += 2 + n
            else:
                self.pos = pos + 1
                if op == 0x2E:  # STOP
                    return self.pop()
                handler = ops.get(op)
                if handler is None:
                    raise Refused(f"it uses opcode {op:#04x} (at byte {pos}), which is refused")
                handler(self)
                pos = self.pos
        else:
            self.pos = pos
            raise Refused("it ends without a STOP")
        self.pos = pos + 1  # an inline opcode found a problem: its general handler reports it
        ops[op](self)
        raise AssertionError("unreachable: the handler refuses")


_EMPTY: dict[int, tuple[int, Any]] = {
    0x29: (TUPLE, None), 0x7D: (DICT, None), 0x5D: (LIST, None), 0x89: (ATOM, False),
    0x4E: (ATOM, NONE),
}  # fmt: skip
"""Opcodes that push an empty container or a constant, which :meth:`Machine.run` handles
itself (with the memo's, small ints', short strings' and small tuples')."""


def _text_index(m: Machine) -> int:
    text = m.line()
    if not (0 < len(text) <= 10 and text.isdigit()):
        raise Refused(f"memo index {text[:20]!r} is not a small number")
    return int(text)


_M = Machine
# fmt: off
_OPS: dict[int, Callable[[Machine], None]] = {
    0x80: lambda m: m.skip(1),  # PROTO
    0x95: _M.frame,
    ord("("): lambda m: m.marks.append(len(m.stack)),
    ord("0"): _M.pop_op, ord("1"): _M.pop_mark_op, ord("2"): lambda m: m.stack.append(m.top()),
    ord("N"): partial(_M.atom, value=NONE), 0x88: partial(_M.atom, value=True),
    0x89: partial(_M.atom, value=False),
    ord("J"): partial(_M.number, fmt="<i"), ord("K"): partial(_M.number, fmt="<B"),
    ord("M"): partial(_M.number, fmt="<H"), ord("G"): partial(_M.number, fmt=">d"),
    0x8A: lambda m: m.integer(m.uint(1)), 0x8B: lambda m: m.integer(m.int32()),  # LONG1, LONG4
    ord("I"): partial(_M.text_number, kind=int), ord("L"): partial(_M.text_number, kind=int),
    ord("F"): partial(_M.text_number, kind=float),
    ord("X"): lambda m: m.string(m.take(m.uint(4))), 0x8C: lambda m: m.string(m.take(m.uint(1))),
    0x8D: lambda m: m.string(m.take(m.uint(8))), ord("U"): lambda m: m.string(m.take(m.uint(1))),
    ord("T"): lambda m: m.string(m.take(m.int32())),
    ord("S"): lambda m: m.string(m.line().encode()),
    ord("V"): lambda m: m.string(m.line().encode()),
    ord("B"): lambda m: m.bytes_(m.uint(4)), ord("C"): lambda m: m.bytes_(m.uint(1)),
    0x8E: lambda m: m.bytes_(m.uint(8)), 0x96: lambda m: m.bytes_(m.uint(8)),
    ord("}"): partial(_M.container, kind=DICT, from_mark=False),
    ord("]"): partial(_M.container, kind=LIST, from_mark=False),
    ord(")"): partial(_M.container, kind=TUPLE, from_mark=False),
    0x8F: partial(_M.container, kind=SET, from_mark=False),
    ord("d"): partial(_M.container, kind=DICT, from_mark=True),
    ord("l"): partial(_M.container, kind=LIST, from_mark=True),
    ord("t"): partial(_M.container, kind=TUPLE, from_mark=True),
    0x91: partial(_M.container, kind=FROZENSET, from_mark=True),
    0x85: partial(_M.small_tuple, n=1), 0x86: partial(_M.small_tuple, n=2),
    0x87: partial(_M.small_tuple, n=3),
    ord("a"): partial(_M.add, how=LIST, from_mark=False),
    ord("e"): partial(_M.add, how=LIST, from_mark=True),
    ord("s"): partial(_M.add, how=DICT, from_mark=False),
    ord("u"): partial(_M.add, how=DICT, from_mark=True),
    0x90: partial(_M.add, how=SET, from_mark=True),
    ord("c"): partial(_M.global_, stacked=False), 0x93: partial(_M.global_, stacked=True),
    ord("R"): partial(_M.call, how="REDUCE"), 0x81: partial(_M.call, how="NEWOBJ"),
    0x92: partial(_M.call, how="NEWOBJ_EX"), ord("o"): partial(_M.call, how="OBJ"),
    ord("i"): partial(_M.call, how="INST"),
    ord("b"): _M.build, ord("Q"): _M.persistent,
    ord("h"): lambda m: m.memo_get(m.uint(1)), ord("j"): lambda m: m.memo_get(m.uint(4)),
    ord("g"): lambda m: m.memo_get(_text_index(m)),
    ord("q"): lambda m: m.memo_put(m.uint(1)), ord("r"): lambda m: m.memo_put(m.uint(4)),
    ord("p"): lambda m: m.memo_put(_text_index(m)), 0x94: _M.memo_put,
}
# fmt: on
"""Every opcode of protocols 0-5 but these, which are refused: PERSID (a text persistent
id), EXT1/2/4 (globals from copyreg's extension registry), NEXT_BUFFER/READONLY_BUFFER."""
