"""Removing an old checkpoint when ``ModelCheckpoint`` asks (``save_top_k``, ``save_last``).

Lightning's own removal is ``fs.rm(path, recursive=True)``: whatever is at the path goes.
Here a checkpoint directory loses only what shardsafe wrote, by the same rules as
``CheckpointManager``'s retention (:mod:`shardsafe.checkpoint.storage.removal`); a symbolic link
(what ``save_last="link"`` makes) is removed itself, never what it points at; anything
else (a ``.ckpt`` file from before, a directory holding files of yours) is left in place
with a warning. A failure to delete is a warning too: the new checkpoint is committed by
then, and an old one left behind must not end the run.

And, when a fit starts, clearing what a run interrupted mid-save left (its hidden
``.<name>.shardsafe-partial`` staging directory, never committed), which would otherwise
stay until that very name is saved again. Under an object-store ``dirpath`` (``s3://``)
nothing is cleared at the start: listing every staging prefix would cost requests at
every fit, and an interrupted save's objects there are cleared by the next save of the
same name (its staging prefix is reused, and the save clears what it left).
"""

from __future__ import annotations

import os
from typing import Any

from ..checkpoint.storage import object_placement, placement
from ..checkpoint.storage.local import LocalStorage
from ..checkpoint.storage.locations import is_url, open_storage
from ..checkpoint.storage.protocol import Storage
from ..checkpoint.storage.removal import delete_checkpoint, warn


def remove(path: str) -> None:
    """Remove the checkpoint ``path`` (rank 0 only, so it never raises), as described
    above."""
    try:
        if is_url(path):
            parent, name = object_placement.split(path)
            opened: Storage = open_storage(parent, follow=False)
        else:
            parent, name = os.path.split(os.path.abspath(path))
            opened = LocalStorage(parent)
        with opened as root:
            kind = root.kind(name)
            if kind == "directory":
                delete_checkpoint(root, name)
            elif kind == "symlink":
                root.remove(name)
            elif kind is not None:
                what = "a file" if kind == "file" else root.describe(name)
                warn(
                    f"left {path} in place: it is {what}, not a checkpoint directory "
                    "shardsafe wrote; delete it yourself if it is no longer needed"
                )
    except Exception as e:  # see the module docstring (a store's errors are not all OSError)
        warn(f"could not remove the old checkpoint {path}: {type(e).__name__}: {e}")


def clear_interrupted(trainer: Any) -> None:
    """Delete the uncommitted staging directories in every ``ModelCheckpoint``'s directory
    (rank 0, when a fit starts, before any save of this run)."""
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath and not is_url(os.fspath(dirpath)):  # see module docstring
            placement.clear_interrupted(os.fspath(dirpath))
