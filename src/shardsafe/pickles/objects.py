"""What the opcodes that name, call and fill objects do: where the policy is enforced.

``GLOBAL``/``STACK_GLOBAL`` may name only the globals of the :class:`~.policy.Policy`;
``REDUCE``, ``NEWOBJ``, ``NEWOBJ_EX``, ``OBJ`` and ``INST`` may call only its callables,
with the arguments each one's rule allows (``calls.py``); ``BUILD`` may fill only an
object this pickle made, of a class the policy lets be filled, with the fields it names;
a persistent id only where the policy has storages. Each refusal names what the pickle
tried, before anything is imported or called.
"""

from __future__ import annotations

import _compat_pickle
from typing import TYPE_CHECKING

from . import calls
from .nodes import DICT, GLOBAL, NONE, OBJECT, PERSISTENT, TUPLE, Refused, printable

if TYPE_CHECKING:
    from .machine import Machine


def name_global(m: Machine, module: str, name: str) -> tuple[str, str]:
    if m.policy.fix_names:
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
    if (module, name) not in m.policy.globals:
        raise Refused(
            f"it names the global {printable(module)}.{printable(name)}, which is not part "
            f"of {m.policy.holds}; refusing it (a pickle naming other globals can run "
            "code)"
        )
    return module, name


def global_(m: Machine, stacked: bool) -> None:
    if stacked:
        name, module = m.text(m.pop()), m.text(m.pop())
        if name is None or module is None:
            raise Refused("STACK_GLOBAL names its global with something other than strings")
    else:
        module, name = m.line(), m.line()
    m.push(GLOBAL, None, name_global(m, module, name))


def call(m: Machine, how: str) -> None:
    """REDUCE, NEWOBJ, NEWOBJ_EX, OBJ, INST: an object made by calling a global, with
    arguments its rule allows (``calls.py``)."""
    callee, given = _callee_and_arguments(m, how)
    key = m.values[callee] if m.kinds[callee] == GLOBAL else None
    rule = m.policy.calls.get(key) if key is not None else None
    if key is None or rule is None:
        raise Refused(f"it calls {m.describe(callee)} ({how}); a {m.policy.kind} never does")
    hashed = calls.check(m, rule, ".".join(key), given)
    m.push(OBJECT, [callee, *given], key)
    if hashed:
        m.keys[m.stack[-1]] = hashed


def _callee_and_arguments(m: Machine, how: str) -> tuple[int, list[int]]:
    """The node called and its argument nodes, as each of the call opcodes gives them."""
    if how == "INST":
        module, name = m.line(), m.line()
        m.push(GLOBAL, None, name_global(m, module, name))
        return m.pop(), m.pop_mark()
    if how == "OBJ":
        given = m.pop_mark()
        if not given:
            raise Refused(f"OBJ at byte {m.pos} has no class")
        return given[0], given[1:]
    if how == "NEWOBJ_EX" and m.children[m.pop()]:
        raise Refused("NEWOBJ_EX is given keyword arguments")
    args = m.pop()
    callee = m.pop()
    if m.kinds[args] != TUPLE:
        raise Refused(f"{how} at byte {m.pos} is given {m.describe(args)}")
    return callee, list(m.children[args] or ())


def build(m: Machine) -> None:
    state = m.pop()
    inst = m.top()
    key = m.values[inst] if m.kinds[inst] == OBJECT else None
    if key is None or key not in m.policy.buildable:
        raise Refused(
            f"it sets the state (BUILD) of {m.describe(inst)}; only objects this pickle "
            f"made, of the classes a {m.policy.kind} holds, may be filled"
        )
    fields = m.policy.buildable[key]
    if fields is not None:
        _check_fields(m, state, fields, key[1])
    children = m.children[inst]
    assert children is not None
    children.append(state)
    m.states[inst] = state


def _check_fields(m: Machine, state: int, fields: frozenset[str], what: str) -> None:
    parts = [state]
    if m.kinds[state] == TUPLE and len(m.children[state] or ()) == 2:
        parts = list(m.children[state] or ())  # (dict state, slot state)
    for part in parts:
        if m.values[part] is NONE:
            continue
        if m.kinds[part] != DICT:
            raise Refused(f"the state it gives a {what} is {m.describe(part)}, not a dict")
        for key in (m.children[part] or [])[0::2]:
            if m.text(key) not in fields:
                shown = printable(str(m.text(key) or m.describe(key)))
                raise Refused(f"it sets {shown!r} on a {what}, which has no such field")


def persistent(m: Machine) -> None:
    if not m.policy.persistent_ids:
        raise Refused(f"it holds a persistent reference, which a {m.policy.kind} never does")
    m.push(PERSISTENT, [m.pop()])
