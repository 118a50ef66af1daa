"""The checkpoint a user's path names: its manifest, or an error that says where to look.

Users often pass a run's checkpoint *root* (the directory holding ``step-*`` and
``latest``), or a Trainer's run directory, instead of one checkpoint. That stays an error,
because guessing which checkpoint they meant could verify or convert the wrong one, but
the message names the newest committed checkpoint so the fix is one copy-paste away.
Shared by ``verify``, ``inspect`` and the converters' source detection.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointNotFoundError
from .format.manifest import Manifest
from .loading import read_manifest_from
from .storage.files import describe_mode
from .storage.locations import is_url
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
    if not is_url(path):
        return _hint(path, None) if os.path.isdir(path) else ""
    try:
        return _hint(path.rstrip("/"), storage_options or None)
    except Exception:  # a hint: the store's error, if any, is not this error's
        return ""


def newest_checkpoint(root: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """The newest committed checkpoint under the checkpoint root ``root``, or ``None``
    (for error messages: it validates what it finds, as ``CheckpointManager.latest``)."""
    from .manager import CheckpointManager  # the error path only: it imports the save side

    manager = CheckpointManager(root, warn_if_not_empty=False, storage_options=storage_options)
    return manager._newest()


def _hint(path: str, storage_options: dict[str, Any] | None) -> str:
    def newest(root: str) -> str | None:
        return newest_checkpoint(root, storage_options)

    latest = newest(path)
    if latest is not None:
        return (
            f". It looks like a checkpoint root; the newest committed checkpoint in it is {latest}"
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
