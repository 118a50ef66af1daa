"""Removing an old checkpoint when ``ModelCheckpoint`` asks (``save_top_k``, ``save_last``).

Lightning's own removal is ``fs.rm(path, recursive=True)``: whatever is at the path goes.
Here a checkpoint directory loses only what shardsafe wrote, by the same rules as
``CheckpointManager``'s retention (:mod:`shardsafe.checkpoint.storage.removal`); a symbolic link
(what ``save_last="link"`` makes) is removed itself, never what it points at; anything
else (a ``.ckpt`` file from before, a directory holding files of yours) is left in place
with a warning. A failure to delete is a warning too: the new checkpoint is committed by
then, and an old one left behind must not end the run.

Only inside the directory of one of the run's checkpoint callbacks (:func:`inside_run`):
``ModelCheckpoint`` removes the paths its state names (``best_k_models``,
``last_model_path``), and that state comes back from the checkpoint a fit resumes from,
which may come from anyone. Lightning's own check of those paths is by their text
(``ckpts/../other-run/best.ckpt`` passes it, and it skips URLs altogether), so a crafted
checkpoint made ``save_top_k`` delete another run's checkpoint, or any empty directory.

And, when a fit starts, clearing what a run interrupted mid-save left (its hidden
``.<name>.shardsafe-partial`` staging directory, never committed), which would otherwise
stay until that very name is saved again. Under an object-store ``dirpath`` (``s3://``)
nothing is cleared at the start: listing every staging prefix would cost requests at
every fit, and an interrupted save's objects there are cleared by the next save of the
same name (its staging prefix is reused, and the save clears what it left).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from ..checkpoint.format.manifest import MANIFEST_NAME
from ..checkpoint.storage import object_placement, placement
from ..checkpoint.storage.local import LocalStorage
from ..checkpoint.storage.locations import is_url, local_path, open_storage
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


def hold_name(path: str) -> None:
    """Make ``path`` an empty directory if nothing is there (a local path; rank 0), so that
    the name a background save takes at its commit shows as taken from the start.

    ``ModelCheckpoint`` picks each new name by looking at the names taken (a repeating
    ``filename`` gets ``-v1``), and ``save_last="link"`` points ``last.ckpt`` at the new
    name at once. With the name absent until the commit, the next save replaced the one
    in flight (``save_top_k`` kept one fewer), and a kill mid-write left ``last.ckpt``
    pointing at nothing, so ``fit(ckpt_path="last")`` trained from step 0 (found in
    review). An empty directory is what the save's commit may replace
    (``placement.py``); a kill leaves it empty, which a load refuses, saying so. An
    object store has no directories: there the name still appears at the commit."""
    if is_url(path) or os.path.lexists(path):
        return
    # Its folder as the save would make it; made meanwhile, the save looks at what it is.
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with contextlib.suppress(OSError):  # no place for it: the save itself says so, agreed
        os.mkdir(path)


def inside_run(path: str, trainer: Any) -> bool:
    """Whether ``path`` is inside the directory of one of ``trainer``'s checkpoint callbacks
    (its parent resolved, links and ``..`` included; a URL by its segments); if not, say
    that it is left in place (see the module docstring)."""
    dirpaths = [getattr(c, "dirpath", None) for c in trainer.checkpoint_callbacks]
    roots = [os.fspath(d) for d in dirpaths if d]
    if any(_inside(path, root) for root in roots):
        return True
    warn(
        f"left {path} in place: it is outside the checkpoint directories of this run "
        f"({', '.join(roots) or 'none'}), so the checkpoint callback's state that names it "
        "came from elsewhere (a checkpoint this fit resumed from); shardsafe deletes old "
        "checkpoints only inside them"
    )
    return False


def _inside(path: str, root: str) -> bool:
    if is_url(path) or is_url(root):
        prefix = root.rstrip("/") + "/"
        rest = path[len(prefix) :].rstrip("/").split("/")
        return path.startswith(prefix) and all(s not in ("", ".", "..") for s in rest)
    parent, name = os.path.split(os.path.abspath(local_path(path)))
    real_root = os.path.realpath(local_path(root))
    real_parent = os.path.realpath(parent)
    under = real_parent == real_root or real_parent.startswith(real_root.rstrip(os.sep) + os.sep)
    return bool(name) and under


def clear_interrupted(trainer: Any) -> None:
    """Delete the uncommitted staging directories in every ``ModelCheckpoint``'s directory
    (rank 0, when a fit starts, before any save of this run), and in the folders under it
    that its ``filename`` makes: a ``/`` there (``"{epoch}-{val/loss:.2f}"``, a metric
    logged as ``val/loss``) puts each checkpoint, and its staging directory, in a
    subdirectory (``epoch=3-val/loss=0.25.ckpt``), where a save interrupted was left,
    a whole checkpoint's size, until that very name was saved again."""
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath and not is_url(os.fspath(dirpath)):  # see module docstring
            depth = str(getattr(callback, "filename", None) or "").count("/")
            for directory in _folders(os.fspath(dirpath), depth):
                placement.clear_interrupted(directory)


def _folders(root: str, depth: int) -> list[str]:
    """``root`` and the directories under it down to ``depth`` levels: never through a
    symbolic link, never into a hidden one (a staging directory), nor past a checkpoint
    (a directory holding a manifest)."""
    found, level = [root], [root]
    for _ in range(depth):
        below = []
        for parent in level:
            try:
                entries = list(os.scandir(parent))
            except OSError:
                continue
            below += [
                e.path
                for e in entries
                if not e.name.startswith(".")
                and e.is_dir(follow_symlinks=False)
                and not os.path.lexists(os.path.join(e.path, MANIFEST_NAME))
            ]
        found += below
        level = below
    return found
