"""A directory of step checkpoints with a ``latest`` pointer and retention.

Order of operations on save, chosen so that no crash loses the last good checkpoint:

1. write ``root/step-<step>`` (data files, then ``manifest.json`` atomically);
2. replace ``root/latest`` atomically (temp file, fsync, rename);
3. only then delete older checkpoints beyond ``keep_last``, and leftovers of saves that
   never committed. A checkpoint is first marked as being deleted, then loses its
   manifest, so a crash half-way through a deletion leaves a directory that is plainly
   not a checkpoint (and that the next save finishes deleting), never a broken one.

``latest()`` trusts manifests, not the pointer: it returns the newest step directory
whose checkpoint would load (manifest and data files checked, see :func:`problem_with`),
and warns about each newer one it passes over. The pointer file is for humans and other
tools.

What the manager touches: only entries of ``root`` named exactly as it names step
directories (``step-`` and at least nine ASCII digits), only if they are real
directories (a symlink is never followed, written through or deleted), and inside them
only regular files with names shardsafe writes. Anything else is left in place, with a
warning when it stops a deletion.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
import warnings
from collections.abc import Iterator
from typing import Any

from ..distributed import world
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from . import loading
from .lock import LOCK_NAME, RootLock
from .manifest import MANIFEST_NAME
from .reader import CheckpointReader
from .saving import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_TIMEOUT_S,
    INCOMPLETE_MARKER,
    StorageFactory,
)
from .saving import save as _save
from .storage import LocalStorage

_STEP_DIR = re.compile(r"step-([0-9]{9,})", re.ASCII)
_OURS = re.compile(
    r"manifest\.json|\.shardsafe-incomplete|\.manifest\.json\.tmp-[0-9]+"
    r"|[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}\.safetensors",
    re.ASCII,
)
"""The names shardsafe writes inside a checkpoint directory."""
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def step_of(name: str) -> int | None:
    """The step of a directory name the manager writes, else ``None`` (``step-1``,
    ``step-0000000001`` and non-ASCII digits are not its names)."""
    match = _STEP_DIR.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dir_name(step) == name else None


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
            storage=functools.partial(storage or LocalStorage, follow=False),
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
        with LocalStorage(self.root) as root:
            root.commit(LATEST, (step_dir_name(step) + "\n").encode())
            keep = self.complete_steps()
            if self.keep_last is not None:
                keep = keep[-self.keep_last :]
            for name in root.names():
                if name.startswith(f".{LATEST}.tmp-"):  # a pointer update killed half-way
                    root.remove(name)
                if name.startswith(f"{LOCK_NAME}.") and _older_than(root, name, 60.0):
                    root.remove(name)  # a lock claim killed before its link
            for found, name in self._step_dirs():
                if found not in keep and found != step:
                    _delete_checkpoint(root, name)

    def _step_dirs(self) -> Iterator[tuple[int, str]]:
        """``(step, name)`` of every real step directory under ``root``, newest first."""
        try:
            root = LocalStorage(self.root)
            names = root.names()
        except (FileNotFoundError, NotADirectoryError, CheckpointError):
            return
        with root:
            found = sorted(((s, n) for n in names if (s := step_of(n)) is not None), reverse=True)
            for step, name in found:
                kind = root.kind(name)
                if kind == "directory":
                    yield step, name
                elif kind is not None:
                    _warn(f"{root.where(name)} is {root.describe(name)}, not a directory")

    def complete_steps(self) -> list[int]:
        """Steps of every committed checkpoint under ``root`` (a step directory holding a
        regular ``manifest.json``), oldest first."""
        steps = []
        for step, name in self._step_dirs():
            with contextlib.suppress(CheckpointError, OSError), self._open(name) as storage:
                if storage.kind(MANIFEST_NAME) == "file":
                    steps.append(step)
        return sorted(steps)

    def latest(self) -> str | None:
        """Path of the newest checkpoint that would load, or ``None`` if there is none.

        Newer step directories that would not (a damaged or symlinked manifest, a missing
        or resized data file) are passed over with a warning saying why.
        """
        for path in self._loadable():
            return path
        return None

    def _loadable(self) -> Iterator[str]:
        """Paths of the checkpoints that pass :func:`problem_with`, newest first."""
        for _, name in self._step_dirs():
            with self._open(name) as storage:
                if storage.kind(MANIFEST_NAME) is None:
                    continue  # an interrupted save, not a checkpoint
                problem = problem_with(storage)
            if problem is None:
                yield storage.directory
            else:
                _warn(f"passing over {storage.directory}: {problem}")

    def load_latest(self, state: Any, **load_kwargs: Any) -> dict[str, Any] | None:
        """Load the newest checkpoint into ``state``; ``None`` if there is none yet.

        Returns what :func:`shardsafe.load` returns: the plain values the checkpoint holds
        (for the Trainer's checkpoints, ``{"trainer": {"step": ..., ...}}``). If the newest
        checkpoint turns out to be damaged while loading (nothing is restored then), the
        next older one is loaded instead, with a warning; if every one is damaged, the
        newest one's error is raised.
        """
        first: CheckpointCorruptError | None = None
        for path in self._loadable():
            name = os.path.basename(path)
            try:
                with self._open(name) as storage:
                    return loading.load(storage, state, **_load_options(load_kwargs))
            except CheckpointCorruptError as e:
                _warn(f"could not load {path}, trying the previous checkpoint: {e}")
                first = first or e
        if first is not None:
            raise first
        return None

    def _open(self, name: str) -> LocalStorage:
        return LocalStorage(os.path.join(self.root, name), follow=False)


def _load_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    options = {
        "strict": True,
        "entry_timeout": 60.0,
        "timeout": DEFAULT_TIMEOUT_S,
        "untrusted_bytes_limit": loading.DEFAULT_UNTRUSTED_BYTES,
    }
    unknown = set(kwargs) - set(options)
    if unknown:
        raise TypeError(f"load_latest() got unexpected keyword argument(s) {sorted(unknown)}")
    return {**options, **kwargs}


def problem_with(storage: LocalStorage) -> str | None:
    """Why the checkpoint in ``storage`` would not load, from cheap checks, or ``None``.

    The manifest is read, checksummed and validated; every data file must be a regular
    file of the recorded size whose header matches its checksum. Tensor bytes are not
    read (``load`` checks those, and ``shardsafe verify`` checks all of them).
    """
    try:
        manifest = loading.read_manifest_from(storage)
        with CheckpointReader(storage, manifest) as reader:
            problems = reader.check_files()
    except (CheckpointError, OSError) as e:
        return str(e)
    if problems:
        name = min(problems)
        return problems[name]
    return None


def _warn(message: str) -> None:
    warnings.warn(f"shardsafe: {message}", stacklevel=3)


def _older_than(root: LocalStorage, name: str, seconds: float) -> bool:
    try:
        mtime = os.stat(name, dir_fd=root.fd, follow_symlinks=False).st_mtime
    except OSError:
        return False
    return time.time() - mtime > seconds


def _delete_checkpoint(root: LocalStorage, name: str) -> None:
    """Delete what shardsafe wrote in ``root/name``, never following or deleting a link.

    A directory holding anything else is left untouched, with a warning. Otherwise it is
    marked first (so that a crash mid-way leaves a directory the next save recognises as
    its own leftover), then loses the manifest, then the data files, then itself.
    """
    try:
        with LocalStorage(os.path.join(root.directory, name), follow=False) as step:
            names = step.names()
            foreign = [n for n in names if not (_OURS.fullmatch(n) and step.kind(n) == "file")]
            if foreign:
                _warn(
                    f"left {step.directory} in place: it holds {foreign[:3]}, which shardsafe "
                    "did not write; delete it yourself if it is no longer needed"
                )
                return
            step.touch(INCOMPLETE_MARKER)
            if MANIFEST_NAME in names:
                step.remove(MANIFEST_NAME)
                step.sync_directory()
            for entry in names:
                if entry not in (MANIFEST_NAME, INCOMPLETE_MARKER):
                    step.remove(entry)
            step.remove(INCOMPLETE_MARKER)
        os.rmdir(name, dir_fd=root.fd)
    except CheckpointNotFoundError:
        return
    except (OSError, CheckpointError) as e:
        raise CheckpointError(
            f"the new checkpoint is committed, but deleting the old checkpoint "
            f"{root.where(name)} failed: {e}"
        ) from e
