"""The stand-ins the pickle machine works on: kinds of node, sentinels, the refusal.

Every value a pickle would build is a node number. A node has a kind (below), the nodes it
holds or was built from, and a value: a number's own value (so that its hash is known), a
short string's text, a global's or an object's ``(module, name)``.
"""

from __future__ import annotations

ATOM, STR, GLOBAL, LIST, DICT, SET, TUPLE, FROZENSET, OBJECT, PERSISTENT = range(10)
NAMES = ("a number", "a string", "a global", "a list", "a dict", "a set", "a tuple",
         "a frozenset", "an object", "a storage reference")  # fmt: skip
NONE = object()
"""The value of the stand-in for ``None``."""
BYTES = object()
"""The value of a bytes atom (its hash is salted per process, as a string's: unknown)."""


class Refused(Exception):
    """A pickle the policy refuses; :func:`~.scan.scan` adds the file's name."""


def printable(text: str) -> str:
    """A name from the pickle, fit for a message."""
    return repr(text)[1:-1][:200]
