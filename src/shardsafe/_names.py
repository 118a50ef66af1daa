"""Tensor keys: the one encoding of a path inside a state into the name it is stored under.

A key is the state entry's name and one segment per step of the path, joined by ``/``:
``optimizer/fc.weight/exp_avg``. Two different paths must never meet in one key (a save
would store one tensor under both, and a load hand it back in both places), so every
segment is encoded, and the encoding is injective:

* a name (a string dict key, a parameter's FQN, a state name): ``%`` becomes ``%25``,
  ``/`` becomes ``%2F``, and a leading ``@`` becomes ``%40``; a name has no ``/`` and
  never starts with ``@`` once encoded;
* a dict key that is not a string (:class:`DictKey`: int, float, bool, None, tuple):
  ``@`` and its literal, escaped the same way (``1`` -> ``@1``, ``(1, 'a')`` ->
  ``@(1, 'a')``), a form no string key takes (``"1"`` stays ``1``);
* a segment shardsafe reserves (:class:`Reserved`: the optimizer's ``@groups``, the RNG
  adapter's ``rank-00000``): as it is. Each stands only beside encoded names (which never
  start with ``@``) or beside its own kind;
* a list or tuple index: its digits. A list's indices and a dict's keys are never siblings.

A name without ``%``, ``/`` or a leading ``@`` is its own segment, so the keys of ordinary
state are what they were before this encoding: checkpoints written then still load
(module keys, recomputed from live names on load, fall back to the old form for the rare
name that changed: :func:`module_keys`).

What an encoding cannot prevent is caught by :class:`Claims` (two NaN dict keys: a key
made through ``ctx.key`` for two different paths is refused, naming both) and by the
collect phase (an adapter that builds keys by hand and gives one key to two tensors on a
rank: ``collecting._check_distinct``). Two ranks that give one hand-built key to two
different tensors of equal shape look like replicas to the planner: not caught.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Iterable
from typing import Any

from .errors import CheckpointError

SEPARATOR = "/"


class Reserved(str):
    """A key segment shardsafe itself reserves, stored as it is (never escaped)."""

    __slots__ = ()


class DictKey(str):
    """A dict key that is not a string, as a path segment.

    It is a string (``str(key)``) so that code which only displays or joins a path keeps
    working; :func:`segment` encodes it by its literal instead, and :func:`same_path`
    compares the key itself (two NaN keys are different paths).
    """

    key: Any

    def __new__(cls, key: Any) -> DictKey:
        self = super().__new__(cls, str(key))
        self.key = key
        return self

    def __repr__(self) -> str:
        return repr(self.key)


def join(entry: str, *parts: str) -> str:
    """The tensor key of ``parts`` under the state entry ``entry`` (see the module
    docstring). Entry names hold no ``/`` (``save`` refuses them), so they stand as they are."""
    return SEPARATOR.join((entry, *map(segment, parts)))


def segment(part: str) -> str:
    """One path segment as it is stored."""
    if isinstance(part, Reserved):
        return str.__str__(part)
    if isinstance(part, DictKey):
        return "@" + escape(literal(part.key))
    return escape(str.__str__(part))


def escape(text: str) -> str:
    """``text`` without ``/``, not starting with ``@``, and decodable: ``%`` escapes."""
    if "%" not in text and SEPARATOR not in text and not text.startswith("@"):
        return text
    out = text.replace("%", "%25").replace(SEPARATOR, "%2F")
    return "%40" + out[1:] if out.startswith("@") else out


def literal(value: Any) -> str:
    """A dict key's literal, one per distinct key (NaN aside): ``True``, ``1``, ``1.5``,
    ``None``, ``('a', 2)``; numbers of any subclass as the plain number they equal."""
    if isinstance(value, str):
        return repr(str.__str__(value))
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return repr(int(value))
    if isinstance(value, float):
        return repr(float(value))
    if isinstance(value, tuple):
        items = [literal(v) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    return repr(value)


_OWN_COPY = re.compile(r"(.+)/@rank-([0-9]{5,})", re.ASCII | re.DOTALL)


def own_copy_key(key: str, rank: int) -> str:
    """The key of ``rank``'s own copy of the tensor stored at ``key`` when the ranks' copies
    differ (``checkpoint/plan/per_rank.py``): ``key/@rank-00003``. ``key`` names a tensor
    (a leaf), so nothing else is ever stored below it; and no encoded segment starts with
    ``@rank-`` (names never start with ``@``, and no dict key's literal is ``rank-...``)."""
    return f"{key}{SEPARATOR}@rank-{rank:05d}"


def shared_key(key: str) -> str:
    """``key`` without an :func:`own_copy_key` suffix (itself if it has none)."""
    match = _OWN_COPY.fullmatch(key)
    return match.group(1) if match else key


def same_path(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """True if ``a`` and ``b`` are one path (a non-string key compared as itself)."""
    return len(a) == len(b) and all(_same_segment(x, y) for x, y in zip(a, b))


def _same_segment(a: str, b: str) -> bool:
    if type(a) is not type(b) or str.__ne__(a, b):
        return False
    if isinstance(a, DictKey) and isinstance(b, DictKey):
        return a.key is b.key or bool(type(a.key) is type(b.key) and a.key == b.key)
    return True


def show(path: Iterable[str]) -> str:
    """A path as a person reads it: ``['state'][3]['exp_avg']``."""
    return "".join(f"[{p!r}]" if isinstance(p, DictKey) else f"[{str.__str__(p)!r}]" for p in path)


class Claims:
    """Which path each key was made for, so that a second path to one key is refused.

    Keys made by :func:`join` differ for different paths, except where a key's literal
    does (two NaN keys): this is the net under the encoding, for keys ``ctx.key`` makes.
    """

    __slots__ = ("_paths",)

    def __init__(self) -> None:
        self._paths: dict[str, tuple[tuple[str, ...], str]] = {}

    def claim(self, key: str, path: tuple[str, ...], where: str) -> None:
        """Record that ``key`` stores ``path`` under ``where`` (how the entry it is in is
        shown); raise if it already stores another path. Each path is shown under its own
        entry: the first was shown under the second's (``['a']`` for ``['a/b']``)."""
        first, first_where = self._paths.setdefault(key, (path, where))
        if first is not path and not same_path(first, path):
            raise CheckpointError(
                collision(key, f"{first_where}{show(first)}", f"{where}{show(path)}")
            )

    def path_of(self, key: str) -> tuple[str, ...] | None:
        claimed = self._paths.get(key)
        return None if claimed is None else claimed[0]


def collision(key: str, first: str, second: str) -> str:
    """The message for two paths that would be stored under one name."""
    return (
        f"{first} and {second} would both be stored as {key!r}, so one would be lost; "
        "rename one of them (nothing was written)"
    )


def legacy(entry: str, name: str) -> str:
    """A module tensor's key as shardsafe wrote it before names were encoded."""
    return f"{entry}{SEPARATOR}{name}"


def module_keys(entry: str, names: Iterable[str], stored: Container[str]) -> Callable[[str], str]:
    """How the module entry ``entry``, saved with the tensor ``names``, keys its tensors.

    A checkpoint written before names were encoded stored ``<entry>/<name>`` as it was;
    it is recognised by every encoded key being absent while every old one is present.
    That decides exactly: an old checkpoint in which every encoded key is present as
    well would need, for each name that changed, another name equal to its encoding,
    which is longer: an endless chain in a finite module.
    """
    changed = [n for n in names if segment(n) != n]
    old = bool(changed) and not all(join(entry, n) in stored for n in changed)
    if old and all(legacy(entry, n) in stored for n in changed):
        return lambda name: legacy(entry, name)
    return lambda name: join(entry, name)
