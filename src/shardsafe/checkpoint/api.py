"""The public entry points of the engine: ``save`` and ``load``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from . import loading, saving
from .loading import read_manifest
from .saving import DEFAULT_BUFFER_BYTES, DEFAULT_TIMEOUT_S, StorageFactory
from .storage import LocalStorage


def save(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    layout: str = "sharded",
    entry_timeout: float = 60.0,
    timeout: float = DEFAULT_TIMEOUT_S,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    storage: StorageFactory | None = None,
) -> None:
    """Save ``state`` to the directory ``path``. Call it on every rank.

    ``state`` maps names to modules (plain or DDP), optimizers (plain, ZeRO, OSS), LR
    schedulers, any object with ``state_dict``/``load_state_dict``, tensors, JSON-able
    values and :class:`shardsafe.RNGState`.

    ``layout="sharded"``: each rank writes its own file, replicated tensors once in
    total. ``"consolidated"``: rank 0 writes one file per state entry
    (``model.safetensors``, ``optimizer.safetensors``, ...), receiving other ranks'
    shards as raw tensors through a buffer of ``buffer_bytes``.

    A rank that does not call ``save`` within ``entry_timeout`` seconds is reported by
    name; a later phase waits at most ``timeout`` seconds for the slowest rank. The
    checkpoint exists once ``path/manifest.json`` does; on any error nothing is committed.

    ``storage`` (advanced) makes the storage layer for a directory: a subclass of
    ``shardsafe.checkpoint.storage.LocalStorage``, e.g. to inject faults in tests.
    """
    saving.save(
        os.fspath(path),
        state,
        layout=layout,
        entry_timeout=entry_timeout,
        timeout=timeout,
        buffer_bytes=buffer_bytes,
        storage=storage,
    )


def load(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    strict: bool = True,
    entry_timeout: float = 60.0,
    timeout: float = DEFAULT_TIMEOUT_S,
    untrusted_bytes_limit: int = loading.DEFAULT_UNTRUSTED_BYTES,
) -> dict[str, Any]:
    """Restore the stateful values of ``state`` in place from ``path``. Call it on every rank.

    Works at any world size, whatever layout and world size the checkpoint was saved
    with. Returns the plain values (JSON data, tensors) the checkpoint holds, as saved.
    ``strict=True``: keys the live objects have and the checkpoint lacks, or the reverse,
    are an error; ``strict=False`` loads what both have. Shapes and dtypes must match.
    Nothing is restored on any rank unless every rank has read and verified its data.

    ``untrusted_bytes_limit`` bounds what a checkpoint can make this rank allocate for
    tensors no live object sizes (returned plain tensors, a fresh optimizer's state):
    at most this plus 8 times the live tensors being loaded.
    """
    with LocalStorage(os.fspath(path)) as storage:
        return loading.load(
            storage,
            state,
            strict=strict,
            entry_timeout=entry_timeout,
            timeout=timeout,
            untrusted_bytes_limit=untrusted_bytes_limit,
        )


__all__ = ["load", "read_manifest", "save"]
