"""A linear pre-scan of a pickle's opcodes: what the pickle would build, without building it.

A restricted unpickler stops code execution and nothing else. A few hundred bytes can
still nest a tuple 200,000 deep (hashing it as a dict key overflows CPython's C stack),
share one tuple through the memo until it has 2**60 leaves (hashing or walking it never
returns), make the C unpickler allocate a memo of 2**32 slots, or fill an allowlisted
*class or function* with ``BUILD`` (``pathlib.PosixPath.__truediv__`` replaced for the rest
of the process, ``torch.serialization._get_layout``'s cache poisoned).

:func:`scan` runs the pickle machine on stand-ins: every value is a node number, nothing is
built, imported or called. The machine has no branches, so the stand-ins say exactly which
global each opcode names, what each ``REDUCE`` calls, what each ``BUILD`` fills and what
each container holds. It refuses (with a :class:`CheckpointCorruptError` naming the file):

* a global outside the :class:`Policy`'s fixed table, a call of one that is not among its
  callables or with arguments its rule does not allow (``bytearray(2**35)``, a quadratic
  codec: ``calls.py``); extension codes, text persistent ids and out-of-band buffers;
* ``BUILD`` on anything but an instance this pickle created, of a class the policy lets be
  filled, with fields the policy names (never a class, a function, a module or a cache);
  items added to anything but a list, dict or set this pickle created;
* nesting deeper than ``MAX_DEPTH``; a structure that contains itself; a tree walk (every
  shared reference followed) or hashing (dict keys, set members, tuples anywhere) that
  would visit more than ``EXPANSION`` times the values the pickle creates, plus
  ``BASE_NODES``;
* more than ``MAX_COLLISIONS`` distinct keys of one dict or set sharing a hash (numbers
  hash alike everywhere: ``hashing.py``);
* integers longer than ``MAX_INT_BYTES``, memo indices that skip ahead, lengths that run
  past the end, bytes after ``STOP``.

Time and memory are linear in the pickle's size: each opcode creates at most one node and a
few edges, and the measure visits each node and edge once, iteratively. The limits are
in ``policy.py``.
"""

from __future__ import annotations

from ..errors import CheckpointCorruptError
from . import opcodes
from .hashing import worst_collision
from .machine import Machine
from .nodes import FROZENSET, OBJECT, TUPLE, Refused
from .policy import BASE_NODES, EXPANSION, MAX_COLLISIONS, MAX_DEPTH, MAX_PICKLE_BYTES, Policy


def _measure(m: Machine, root: int, cap: int) -> tuple[int, int]:
    """``(tree size of root, hashing work)`` (saturating just above ``cap``), visiting
    every node and edge once, without recursion; refuses cycles and excess depth."""
    children, kinds = m.children, m.kinds
    size, depth = [1] * len(kinds), [0] * len(kinds)
    # 0 unseen, 1 on the current path, 2 measured; a node that holds nothing is measured.
    state = bytearray(0 if kids else 2 for kids in children)
    for start in range(len(kinds)):
        if state[start]:
            continue
        state[start] = 1
        path = [(start, 0)]
        while path:
            node, i = path[-1]
            kids = children[node] or ()
            if i < len(kids):
                path[-1] = (node, i + 1)
                kid = kids[i]
                if state[kid] == 1:
                    raise Refused("it builds a structure that contains itself")
                if state[kid] == 0:
                    if len(path) > MAX_DEPTH:
                        raise Refused(f"it nests more than {MAX_DEPTH} levels deep")
                    state[kid] = 1
                    path.append((kid, 0))
                continue
            path.pop()
            state[node] = 2
            size[node] = min(1 + sum(size[k] for k in kids), cap + 1)
            depth[node] = 1 + max((depth[k] for k in kids), default=-1)
            if depth[node] > MAX_DEPTH:
                raise Refused(f"it nests more than {MAX_DEPTH} levels deep")
    hashing = sum(
        size[k] for kids in children for k in kids or () if kinds[k] in (TUPLE, FROZENSET)
    )
    hashing += sum(size[k] for keys in m.keys.values() for k in keys if kinds[k] == OBJECT)
    return size[root], hashing


def scan(data: bytes, where: str, policy: Policy) -> Machine:
    """Refuse ``data`` unless it is one pickle that ``policy`` allows and that unpickles in
    time and memory linear in its size (see the module docstring); the machine that ran it
    on stand-ins, for what a caller checks further (a torch archive's storage sizes)."""
    try:
        if len(data) > MAX_PICKLE_BYTES:
            raise Refused(f"it is {len(data)} bytes long (at most {MAX_PICKLE_BYTES})")
        machine = Machine(data, policy)
        root = opcodes.run(machine)
        if machine.pos != len(machine.data):
            raise Refused(f"{len(machine.data) - machine.pos} bytes follow its STOP")
        cap = EXPANSION * len(machine.kinds) + BASE_NODES
        tree, hashing = _measure(machine, root, cap)
        if max(tree, hashing) > cap:
            raise Refused(
                f"it shares references so that walking or hashing it would visit more than "
                f"{cap} values ({EXPANSION} times the {len(machine.kinds)} it creates)"
            )
        shared = worst_collision(machine, MAX_COLLISIONS)
        if shared > MAX_COLLISIONS:
            raise Refused(
                f"more than {MAX_COLLISIONS} distinct keys of one dict or set share a hash "
                "(counted no further): keys crafted so that inserting them takes time quadratic "
                "in their number"
            )
    except Refused as e:
        raise CheckpointCorruptError(
            f"{where} is not a {policy.kind} shardsafe can read safely: {e}"
        ) from None
    return machine
