"""The pickle machine run on stand-ins: what a pickle would build, without building it.

Every value is a node number (``nodes.py``); a node records its kind, the nodes it holds
or was built from, and a value: a number's own value, a short string's text, a global's
or an object's ``(module, name)``. Nothing is built, imported or called. The pickle
machine has no branches, so the stand-ins tell exactly which global each opcode names,
what each ``REDUCE`` calls and with what, what each ``BUILD`` fills and what each
container holds, and each opcode is refused the moment it breaks the
:class:`~.policy.Policy` (see ``pickles/scan.py`` for what the finished graph is measured
against). Each opcode creates at most one node and a few edges.

This module holds the machine's state, its reading of the stream and its stack; what each
opcode does is in ``values.py`` (numbers, strings, containers, the memo) and
``objects.py`` (globals, calls, ``BUILD``: where the policy is enforced), and which
handler each opcode byte runs is in ``opcodes.py``.
"""

from __future__ import annotations

import struct
from typing import Any

from .nodes import GLOBAL, NAMES, OBJECT, STR, Refused
from .policy import Policy


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
