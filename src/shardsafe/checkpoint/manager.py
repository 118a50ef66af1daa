"""A directory of step checkpoints with a ``latest`` pointer and retention.

Order of operations on save, chosen so that no crash loses the last good checkpoint:

1. write ``root/step-<step>`` (data files, then ``manifest.json`` atomically);
2. replace ``root/latest`` atomically (temp file, fsync, rename);
3. only then delete older checkpoints beyond ``keep_last``, and leftovers of saves that
   never committed. A checkpoint is deleted manifest first, so a crash half-way through
   a deletion leaves a directory that is plainly not a checkpoint, never a broken one.

``latest()`` trusts manifests, not the pointer: it returns the newest step directory
that holds a ``manifest.json``. The pointer file is for humans and other tools.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from typing import Any

from ..distributed import world
from ..errors import CheckpointError
from .api import load
from .lock import LOCK_NAME, RootLock
from .manifest import MANIFEST_NAME
from .saving import DEFAULT_BUFFER_BYTES, DEFAULT_TIMEOUT_S, StorageFactory
from .saving import save as _save
from .storage import LocalStorage

_STEP_DIR = re.compile(r"step-(\d{9,})")
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


class CheckpointManager:
    """Saves ``root/step-<step>`` checkpoints, keeps the newest ``keep_last`` of them."""

    def __init__(self, root: str | os.PathLike[str], keep_last: int | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be at least 1 (or None to keep all)")
        self.root = os.fspath(root)
        self.keep_last = keep_last
        self._lock = RootLock(self.root)

    def close(self) -> None:
        """Give up this process's claim on the root (also done at exit)."""
        self._lock.release()

    def path_for(self, step: int) -> str:
        return os.path.join(self.root, step_dir_name(step))

    def save(
        self,
        step: int,
        state: Any,
        *,
        layout: str = "sharded",
        entry_timeout: float = 60.0,
        timeout: float = DEFAULT_TIMEOUT_S,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        storage: StorageFactory | None = None,
    ) -> str:
        """Save ``state`` as step ``step`` on every rank; return the checkpoint's path.

        The first save takes ``root/.shardsafe.lock`` for this process (see ``lock.py``):
        a second run saving into the same root gets a :class:`CheckpointError`.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        path = self.path_for(step)
        if world()[0] == 0:
            os.makedirs(self.root, exist_ok=True)
        _save(
            path,
            state,
            layout=layout,
            entry_timeout=entry_timeout,
            timeout=timeout,
            buffer_bytes=buffer_bytes,
            storage=storage,
            before_write=lambda: self._before_write(step),
            on_commit=lambda: self._publish(step),
        )
        return path

    def _before_write(self, step: int) -> None:
        """Runs on rank 0 before any data is written: own the root, and never go back in time.

        A save older than the newest committed step means this run resumed from an older
        checkpoint. Going on would let retention delete this run's own checkpoints while
        keeping the newer ones of the abandoned run, and ``latest()`` would name those.
        Deleting the newer ones silently could destroy the run the user wanted, so refuse.
        """
        self._lock.acquire()
        newer = [s for s in self.complete_steps() if s > step]
        if newer:
            raise CheckpointError(
                f"{self.root} already holds step {newer[-1]}, newer than step {step} being "
                "saved: this run resumed from an older checkpoint. shardsafe will not delete "
                "the newer checkpoints for you; move or delete "
                f"{', '.join(step_dir_name(s) for s in newer)}, or save into another root."
            )

    def _publish(self, step: int) -> None:
        """Runs on rank 0 right after the commit: move ``latest``, then apply retention."""
        LocalStorage(self.root).commit(LATEST, (step_dir_name(step) + "\n").encode())
        keep = self.complete_steps()
        if self.keep_last is not None:
            keep = keep[-self.keep_last :]
        for name in os.listdir(self.root):
            if name.startswith(f".{LATEST}.tmp-"):  # a pointer update killed half-way
                LocalStorage(self.root).remove(name)
            if name.startswith(f"{LOCK_NAME}.") and _older_than(self.root, name, 60.0):
                LocalStorage(self.root).remove(name)  # a lock claim killed before its link
            match = _STEP_DIR.fullmatch(name)
            if match and int(match.group(1)) not in keep and int(match.group(1)) != step:
                _delete_checkpoint(os.path.join(self.root, name))

    def complete_steps(self) -> list[int]:
        """Steps of every committed checkpoint under ``root``, oldest first."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        steps = []
        for name in names:
            match = _STEP_DIR.fullmatch(name)
            if match and os.path.isfile(os.path.join(self.root, name, MANIFEST_NAME)):
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest(self) -> str | None:
        """Path of the newest committed checkpoint, or ``None`` if there is none."""
        steps = self.complete_steps()
        return self.path_for(steps[-1]) if steps else None

    def load_latest(self, state: Any, **load_kwargs: Any) -> dict[str, Any] | None:
        """Load the newest checkpoint into ``state``; ``None`` if there is none yet."""
        path = self.latest()
        if path is None:
            return None
        return load(path, state, **load_kwargs)


def _older_than(root: str, name: str, seconds: float) -> bool:
    try:
        return time.time() - os.stat(os.path.join(root, name)).st_mtime > seconds
    except OSError:
        return False


def _delete_checkpoint(path: str) -> None:
    try:
        manifest = os.path.join(path, MANIFEST_NAME)
        if os.path.exists(manifest):
            os.remove(manifest)
            LocalStorage(path).sync_directory()
        shutil.rmtree(path)
    except OSError as e:
        raise CheckpointError(
            f"the new checkpoint is committed, but deleting the old checkpoint {path} failed: {e}"
        ) from e
