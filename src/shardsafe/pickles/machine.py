"""The pickle machine run on stand-ins: what a pickle would build, without building it.

Every value is a node number; a node records its kind, the nodes it holds or was built
from, and, for a short string, a global or an object, its text or ``(module, name)``.
Nothing is built, imported or called. The pickle machine has no branches, so the
stand-ins tell exactly which global each opcode names, what each ``REDUCE`` calls, what
each ``BUILD`` fills and what each container holds, and each opcode is refused the moment
it breaks the :class:`~.policy.Policy` (see ``pickles/scan.py`` for what the finished
graph is measured against). Each opcode creates at most one node and a few edges.
"""

from __future__ import annotations

import _compat_pickle
import struct
from collections.abc import Callable
from functools import partial
from typing import Any

from .policy import MAX_INT_BYTES, Policy


class Refused(Exception):
    """Raised inside the scan; :func:`scan` adds the file's name."""


ATOM, STR, GLOBAL, LIST, DICT, SET, TUPLE, FROZENSET, OBJECT, PERSISTENT = range(10)
_NAMES = ("a number", "a string", "a global", "a list", "a dict", "a set", "a tuple",
          "a frozenset", "an object", "a storage reference")  # fmt: skip
_SHORT = 256
"""Strings up to this many bytes keep their value (a global's or a field's name)."""
_NONE = object()
"""The value of the stand-in for ``None`` (a ``BUILD`` state may be ``(None, slots)``)."""


class Machine:
    """The pickle machine on stand-ins. Node ``n`` has ``kinds[n]``, ``children[n]`` (the
    values it holds or was built from) and ``values[n]`` (a short string's text, a
    global's or an object's ``(module, name)``)."""

    def __init__(self, data: bytes | memoryview, policy: Policy) -> None:
        self.data = memoryview(data).cast("B")
        self.policy = policy
        self.pos = 0
        self.kinds: list[int] = []
        self.children: list[list[int] | None] = []
        self.values: list[Any] = []
        self.keys: list[int] = []
        """Nodes hashed as a dict key or set member, each time (an object's hash, a
        dataclass's, walks its fields)."""
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
        end = bytes(self.data[self.pos : self.pos + 4096]).find(b"\n")
        if end < 0:
            raise Refused(f"a text argument at byte {self.pos} is unterminated or too long")
        self.pos += end + 1
        return bytes(self.data[self.pos - end - 1 : self.pos - 1]).decode("utf-8", "replace")

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
        return _NAMES[self.kinds[node]]

    # -- opcodes

    def atom(self, skip: int = 0, value: Any = None) -> None:
        self.take(skip)
        self.push(ATOM, None, value)

    def text_float(self) -> None:
        self.line()
        self.atom()

    def integer(self, nbytes: int) -> None:
        if nbytes > MAX_INT_BYTES:
            raise Refused(f"it holds an integer of {nbytes} bytes (at most {MAX_INT_BYTES})")
        self.atom(nbytes)

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
        if kind in (DICT, FROZENSET):
            self.keys.extend(items[0::2] if kind == DICT else items)
        self.push(kind, items)

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
            self.keys.extend(items[0::2] if how == DICT else items)
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
                f"it names the global {_printable(module)}.{_printable(name)}, which is not part "
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
        """REDUCE, NEWOBJ, NEWOBJ_EX, OBJ, INST: an object made by calling a global."""
        if how == "INST":
            module, name = self.line(), self.line()
            self.push(GLOBAL, None, self.name_global(module, name))
            callee, args = self.pop(), self.pop_mark()
        elif how == "OBJ":
            args = self.pop_mark()
            if not args:
                raise Refused(f"OBJ at byte {self.pos} has no class")
            callee, args = args[0], args[1:]
        else:
            args = [self.pop() for _ in range({"REDUCE": 1, "NEWOBJ": 1}.get(how, 2))][::-1]
            callee = self.pop()
        key = self.values[callee] if self.kinds[callee] == GLOBAL else None
        if key not in self.policy.callables:
            raise Refused(
                f"it calls {self.describe(callee)} ({how}); a {self.policy.kind} never does"
            )
        self.push(OBJECT, [callee, *args], key)

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

    def check_fields(self, state: int, fields: frozenset[str], what: str) -> None:
        parts = [state]
        if self.kinds[state] == TUPLE and len(self.children[state] or ()) == 2:
            parts = list(self.children[state] or ())  # (dict state, slot state)
        for part in parts:
            if self.values[part] is _NONE:
                continue
            if self.kinds[part] != DICT:
                raise Refused(f"the state it gives a {what} is {self.describe(part)}, not a dict")
            for key in (self.children[part] or [])[0::2]:
                if self.text(key) not in fields:
                    shown = _printable(str(self.text(key) or self.describe(key)))
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
        """Run to ``STOP``; the node it returns."""
        data, ops = self.data, _OPS
        while self.pos < len(data):
            op = data[self.pos]
            self.pos += 1
            if op == 0x2E:  # STOP
                return self.pop()
            handler = ops.get(op)
            if handler is None:
                raise Refused(
                    f"it uses opcode {op:#04x} (at byte {self.pos - 1}), which is refused"
                )
            handler(self)
        raise Refused("it ends without a STOP")


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
    ord("N"): partial(_M.atom, value=_NONE), 0x88: _M.atom, 0x89: _M.atom,  # None True False
    ord("J"): partial(_M.atom, skip=4), ord("K"): partial(_M.atom, skip=1),
    ord("M"): partial(_M.atom, skip=2), ord("G"): partial(_M.atom, skip=8),
    0x8A: lambda m: m.integer(m.uint(1)), 0x8B: lambda m: m.integer(m.int32()),  # LONG1, LONG4
    ord("I"): lambda m: m.integer(len(m.line()) // 2),
    ord("L"): lambda m: m.integer(len(m.line()) // 2),
    ord("F"): _M.text_float,
    ord("X"): lambda m: m.string(m.take(m.uint(4))), 0x8C: lambda m: m.string(m.take(m.uint(1))),
    0x8D: lambda m: m.string(m.take(m.uint(8))), ord("U"): lambda m: m.string(m.take(m.uint(1))),
    ord("T"): lambda m: m.string(m.take(m.int32())),
    ord("S"): lambda m: m.string(m.line().encode()),
    ord("V"): lambda m: m.string(m.line().encode()),
    ord("B"): lambda m: m.atom(m.uint(4)), ord("C"): lambda m: m.atom(m.uint(1)),
    0x8E: lambda m: m.atom(m.uint(8)), 0x96: lambda m: m.atom(m.uint(8)),
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


def _printable(text: str) -> str:
    return repr(text)[1:-1][:200]
