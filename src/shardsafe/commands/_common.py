"""What the checkpoint commands share: reading a manifest with a helpful not-found message."""

from __future__ import annotations

import os

from ..checkpoint.loading import read_manifest_from
from ..checkpoint.locations import is_url, open_storage
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.manifest import Manifest
from ..checkpoint.storage import Storage
from ..errors import CheckpointNotFoundError


def load_manifest(path: str, storage: Storage | None = None) -> Manifest:
    """The parsed manifest of ``path``; a missing one says where a real checkpoint is.

    Users often pass the run's checkpoint *root* (the directory holding ``step-*`` and
    ``latest``) instead of one checkpoint. That is still an error, because guessing which
    checkpoint they meant could verify the wrong one, but the message names the newest
    committed checkpoint so the fix is one copy-paste away.
    """
    if not is_url(path) and os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointNotFoundError(
            f"{path} is a file; pass the checkpoint directory (the one holding manifest.json)"
        )
    try:
        if storage is None:
            with open_storage(path) as opened:
                return read_manifest_from(opened)
        return read_manifest_from(storage)
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(f"{e}{_where_checkpoints_are(path)}") from None


def _where_checkpoints_are(path: str) -> str:
    """A hint for a path that is a checkpoint root or a Trainer's run directory."""
    if is_url(path) or not os.path.isdir(path):
        return ""
    latest = CheckpointManager(path, warn_if_not_empty=False).latest()
    if latest is not None:
        return (
            f". It looks like a checkpoint root; the newest committed checkpoint in it is {latest}"
        )
    run_root = os.path.join(path, "checkpoints")
    if os.path.isdir(run_root):
        latest = CheckpointManager(run_root, warn_if_not_empty=False).latest()
        newest = f"; the newest is {latest}" if latest else ", but none is committed yet"
        return (
            f". It looks like a Trainer run directory: its checkpoints are under {run_root}{newest}"
        )
    return ""
