"""What each callable of a policy may be given: an allowlisted function is safe to call
only with the arguments a real pickle passes it.

``bytearray(2**35)`` allocates 32 GiB, ``_codecs.encode(s, "punycode")`` takes time
quadratic in ``len(s)`` (and ``"bz2"`` imports a module), ``OrderedDict(pairs)`` hashes
what it is given. So each callable has a rule, checked on the stand-ins at the call:

* ``ANY``: torch's tensor rebuild functions, which torch itself checks (a storage reference,
  sizes and strides that must fit it);
* ``NO_ARGS``: what ``copyreg.__newobj__`` and ``OrderedDict.__reduce__`` pass: nothing;
* ``SCALARS``: numbers and strings only (``torch.device("cuda", 0)``, an enum's value, a
  path's parts, a layout's name);
* ``LATIN1``: ``(text, "latin1")``, how protocol 2 pickles ``bytes``;
* ``SIZE``: one list or tuple of numbers (``torch.Size``);
* ``ELEMENTS``: one list, whose members are hashed as a set's (``set``, ``frozenset``);
* ``MAPPING``: one dict, already filled (``Counter``, how protocol 2 pickles one).
"""

from __future__ import annotations

from typing import Any

from .nodes import ATOM, DICT, LIST, STR, TUPLE, Refused

ANY, NO_ARGS, SCALARS, LATIN1, SIZE, ELEMENTS, MAPPING = (
    "any", "no arguments", "numbers and strings", "text and 'latin1'",
    "one list of numbers", "one list", "one dict",
)  # fmt: skip


LATIN1_NAMES = ("latin1", "latin-1")


def check(machine: Any, rule: str, name: str, given: list[int]) -> list[int]:
    """Refuse a call of ``name`` with the argument nodes ``given`` if they break ``rule``;
    return the nodes whose hashes the call computes (a set's members)."""
    if rule == ANY:
        return []
    kinds, values = machine.kinds, machine.values
    if rule == NO_ARGS:
        ok = not given
    elif rule == SCALARS:
        ok = all(kinds[a] in (ATOM, STR) for a in given)
    elif rule == LATIN1:
        ok = len(given) == 2 and kinds[given[0]] == STR and values[given[1]] in LATIN1_NAMES
    elif rule == SIZE:
        ok = len(given) == 1 and kinds[given[0]] in (LIST, TUPLE)
        ok = ok and all(kinds[c] == ATOM for c in machine.children[given[0]] or ())
    elif rule == MAPPING:  # its keys were hashed (and bounded) as the dict was filled
        ok = len(given) == 1 and kinds[given[0]] == DICT
    else:
        ok = rule == ELEMENTS and len(given) <= 1 and all(kinds[a] == LIST for a in given)
    if not ok:
        raise Refused(f"it calls {name} with arguments no real pickle gives it ({rule} only)")
    if rule == ELEMENTS and given:
        return list(machine.children[given[0]] or ())
    return []
