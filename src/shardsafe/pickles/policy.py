"""What one kind of pickle may contain, and the limits every pickle is held to.

A :class:`Policy` is a fixed table written in code (DCP's in ``converters/dcp_metadata.py``,
``torch.save``'s in ``pickles/gate.py``): which globals a pickle may name, which of them it
may call and with what (``calls.py``), which classes' instances it may fill and with which
fields, and how an object it makes hashes. Nothing in it is derived from the input, so
reading a pickle can make shardsafe import nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

MAX_DEPTH = 100
"""Deepest nesting a pickle may build (a state dict with optimizer state is under 15)."""
EXPANSION = 16
"""How many times the values a pickle creates its walk and its hashing may visit: sharing
small pieces (strings, globals, a tied weight) is normal, a sharing bomb is not."""
BASE_NODES = 1 << 20
MAX_INT_BYTES = 1024
"""Longest integer, in bytes (about 2,466 decimal digits; Python converts at most 4,300)."""
MAX_PICKLE_BYTES = 256 << 20
"""Largest pickle scanned (the scan holds up to ~30 bytes per byte of pickle, as the
unpickler's objects do): a Lightning checkpoint's ``data.pkl`` is about a kilobyte per
tensor, a DCP ``.metadata`` a few hundred bytes per stored chunk (a million chunks fit)."""
MAX_COLLISIONS = 32
"""Most distinct keys of one dict or set that may share a hash. Numbers hash alike on every
machine (``k * (2**61 - 1) + 5`` all hash to 5), so a pickle could make inserting its keys
take time quadratic in their number; honest keys almost never share a full hash."""
ANY_FIELDS: frozenset[str] | None = None
"""In :attr:`Policy.buildable`: the class's own ``__setstate__`` takes whatever state."""


@dataclass(frozen=True)
class Policy:
    """What one kind of pickle may contain. Every table is fixed in code, never derived from
    the input, so a checkpoint cannot make shardsafe import anything."""

    kind: str
    """What the pickle is, for messages: ``"DCP metadata file"``."""
    holds: str
    """What such a pickle is made of, for messages: ``"DCP's checkpoint metadata"``."""
    globals: frozenset[tuple[str, str]]
    """``(module, name)`` pairs the pickle may name, as its unpickler resolves them."""
    calls: Mapping[tuple[str, str], str]
    """Those of :attr:`globals` that ``REDUCE``/``NEWOBJ``/``OBJ``/``INST`` may call, each
    with the rule its arguments must follow (``calls.ANY``, ``calls.SCALARS``, ...)."""
    buildable: Mapping[tuple[str, str], frozenset[str] | None] = field(default_factory=dict)
    """Classes whose instances ``BUILD`` may fill, with the fields it may set."""
    mappings: frozenset[tuple[str, str]] = frozenset()
    """Classes (besides ``dict``) whose instances ``SETITEM(S)`` may fill."""
    hashes_as: Mapping[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    """Classes whose instances hash as a tuple: of these fields of their ``BUILD`` state (a
    frozen dataclass), or, for ``()``, of their one argument (``torch.Size``)."""
    persistent_ids: bool = False
    """Whether ``BINPERSID`` (torch's storage references) may appear."""
    fix_names: bool = False
    """Map Python 2 names as torch's unpickler does (``__builtin__.set``)."""
