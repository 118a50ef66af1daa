"""The checkpoint a user's path names: its manifest, or an error that says where to look.

Users often pass a run's checkpoint *root* (the directory holding ``step-*`` and
``latest``), or a Trainer's run directory, instead of one checkpoint. That stays an error,
because guessing which checkpoint they meant could verify or convert the wrong one, but
the message names the newest committed checkpoint so the fix is one copy-paste away.
Shared by ``verify``, ``inspect`` and the converters' source detection.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import CheckpointNotFoundError
from .format.manifest import MANIFEST_NAME, Manifest
from .loading import read_manifest_from
from .storage.files import describe_mode
from .storage.locations import is_url, open_storage
from .storage.protocol import Storage


def manifest_at(path: str, storage: Storage) -> Manifest:
    """The validated manifest of the checkpoint at ``path``, already opened as ``storage``;
    a missing one's error says where a real checkpoint is (see the module docstring)."""
    if not is_url(path) and os.path.exists(path) and not os.path.isdir(path):
        # Named by its kind: a FIFO or a device was called "a file".
        raise CheckpointNotFoundError(
            f"{path} is {describe_mode(os.stat(path).st_mode)}, not a directory; pass the "
            "checkpoint directory (the one holding manifest.json)"
        )
    try:
        return read_manifest_from(storage)
    except CheckpointNotFoundError as e:
        options = getattr(storage, "storage_options", None)
        raise CheckpointNotFoundError(f"{e}{where_checkpoints_are(path, options)}") from None


def where_checkpoints_are(path: str, storage_options: dict[str, Any] | None = None) -> str:
    """A hint for a path or URL that is a checkpoint root or a Trainer's run directory
    (``". It looks like ..."``), else ``""``. On an object store a few listings, only on
    this error path; a store that fails them gives no hint (the error stands as it is)."""
    try:
        if not is_url(path):
            return _hint(path, None) if os.path.isdir(path) else ""
        return _hint(path.rstrip("/"), storage_options or None)
    except Exception:  # a hint: its own error (a store's, a link's) is not this error's
        return ""


def newest_checkpoint(root: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """The newest committed checkpoint under the checkpoint root ``root``, or ``None``
    (for error messages: it validates what it finds, as ``CheckpointManager.latest``)."""
    from .manager import CheckpointManager  # the error path only: it imports the save side

    manager = CheckpointManager(root, warn_if_not_empty=False, storage_options=storage_options)
    return manager._newest()


def hint_for(storage: Storage) -> str:
    """:func:`where_checkpoints_are` for the opened directory ``storage`` of a load that
    found no manifest (``loading.Hint``: given by ``shardsafe.load`` and the Lightning
    strategy's loads)."""
    return where_checkpoints_are(storage.directory, getattr(storage, "storage_options", None))


def _hint(path: str, storage_options: dict[str, Any] | None) -> str:
    def newest(root: str) -> str | None:
        return newest_checkpoint(root, storage_options)

    latest = newest(path)
    if latest is not None:
        return (
            f". It looks like a checkpoint root; the newest committed checkpoint in it is {latest}"
        )
    held = _lightning_checkpoints(path, storage_options)
    if held:
        return (
            f". It looks like a folder of Lightning checkpoints (it holds {', '.join(held)}"
            f"{' ...' if len(held) == _SHOWN else ''}): pass one of them"
        )
    run_root = f"{path}/checkpoints" if is_url(path) else os.path.join(path, "checkpoints")
    if is_url(path) or os.path.isdir(run_root):
        latest = newest(run_root)
        if latest is None and is_url(path):
            return ""  # a prefix has no directory to find: no checkpoints, no hint
        found = f"; the newest is {latest}" if latest else ", but none is committed yet"
        return (
            f". It looks like a Trainer run directory: its checkpoints are under {run_root}{found}"
        )
    return ""


_SHOWN = 3
"""The ``.ckpt`` checkpoints a hint shows (the last, by name, numbers by value)."""
_LOOKED_AT = 10
"""The ``.ckpt`` names it looks at, from the last: a few requests, however many there are."""


def _lightning_checkpoints(path: str, storage_options: dict[str, Any] | None) -> list[str]:
    """The last few ``.ckpt`` checkpoints directly in ``path`` (a shardsafe checkpoint
    directory, or a file or object: Lightning's own), by name: a ``ModelCheckpoint``
    ``dirpath`` passed where one of them was meant (on an object store, said to be "not
    a committed checkpoint (a save into it may have been interrupted)", which sent users
    looking for a crash; found in review). At most a listing and a few requests more."""
    # Following a link to the folder, as the load that failed did: only names are read.
    with open_storage(path, storage_options=storage_options) as folder:
        names = sorted((n for n in folder.names() if n.endswith(".ckpt")), key=_in_step_order)
        found = []
        for name in names[: -_LOOKED_AT - 1 : -1]:
            kind = folder.kind(name)
            if kind == "directory":
                with folder.child(name) as inside:
                    kind = "file" if inside.kind(MANIFEST_NAME) == "file" else None
            if kind == "file":
                found.append(name)
            if len(found) == _SHOWN:
                break
    return found[::-1]


def _in_step_order(name: str) -> list[tuple[int, str]]:
    """A sort key that orders the numbers in names by value: ``step=10`` after ``step=5``
    (ASCII digits, compared by length then digits: no ``int()`` of a hostile name's
    thousand digits)."""
    parts = re.split(r"([0-9]+)", name)
    return [(len(p.lstrip("0")), p.lstrip("0")) if i % 2 else (-1, p) for i, p in enumerate(parts)]
