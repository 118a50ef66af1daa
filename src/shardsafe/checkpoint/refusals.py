"""Options refused on one rank alone, told to the others before the refusing rank raises.

A value wrong on one rank only (``buffer_bytes=1000``, ``verify="all"``, ``read_threads=0``,
a misspelled option name)
made that rank raise before it ever met the others, who waited ``entry_timeout`` and then
said it never called. Every entry point that builds its options before it meets the
others (``shardsafe.save``, ``async_save``, ``load``, and the same verbs of
``CheckpointManager``) builds them through :func:`told_if_refused`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ..distributed import Coordinator
from .options import SaveOptions

_DEFAULTS = SaveOptions()
_Made = TypeVar("_Made")


def told_if_refused(operation: str, name: str, make: Callable[[], _Made]) -> _Made:
    """``make()`` (this call's options); a ``ValueError`` or ``TypeError`` it raises (an
    option refused; an option name misspelled on one rank, ``bogus=1``) is raised once the
    other ranks are told (``Coordinator.refuse``, under ``name``, the name the operation
    agrees under, and with the default timeouts: this rank's are what may be wrong)."""
    try:
        return make()
    except (ValueError, TypeError) as e:
        tell_others(operation, name, e)
        raise


def tell_others(operation: str, name: str, error: Exception) -> None:
    """Meet the other ranks at the entry of ``operation`` under ``name`` and tell them this
    rank refuses it with ``error`` (which the caller then raises), with the default
    timeouts: they raise it at once instead of waiting for this rank."""
    coord = Coordinator(operation, name, timeout=_DEFAULTS.timeout)
    coord.refuse(error, _DEFAULTS.entry_timeout)
