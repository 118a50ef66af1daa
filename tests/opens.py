"""Which files a piece of code opens, as real paths, through Python's "open" audit event.

The event fires for ``open()``, ``io.open_code`` and ``os.open`` alike, but carries only
the path argument. shardsafe opens names relative to a directory descriptor
(``os.open(name, dir_fd=...)``) and reopens checked descriptors through
``/proc/self/fd/N``; both are resolved here to the file they really name (the caller's
``dir_fd`` is read from its frame, and ``/proc/self/fd/N`` is read as a link while the
descriptor is open), so a test can assert that nothing outside a directory was opened.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

_RECORDING: list[list[str]] = []


def _dir_fd_of_caller() -> int | None:
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return None
        fd = frame.f_locals.get("dir_fd")
        if isinstance(fd, int):
            return fd
        frame = frame.f_back
    return None


def _resolve(path: str) -> str:
    if path.startswith("/proc/self/fd/"):
        with contextlib.suppress(OSError):
            return os.readlink(path)
        return path
    if not os.path.isabs(path):
        fd = _dir_fd_of_caller()
        if fd is not None:
            with contextlib.suppress(OSError):
                return os.path.join(os.readlink(f"/proc/self/fd/{fd}"), path)
    return os.path.abspath(path)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _RECORDING and isinstance(args[0], (str, bytes, os.PathLike)):
        resolved = _resolve(os.fsdecode(args[0]))
        for record in _RECORDING:
            record.append(resolved)


sys.addaudithook(_audit)


@contextlib.contextmanager
def recorded_opens() -> Iterator[list[str]]:
    """Every path opened inside the block (callers may ``clear()`` it midway)."""
    record: list[str] = []
    _RECORDING.append(record)
    try:
        yield record
    finally:
        _RECORDING.remove(record)


def outside(opened: list[str], directory: Any) -> list[str]:
    """The opened paths that are neither ``directory`` nor inside it, ignoring Python's own
    imports (a lazily imported module of torch is not a checkpoint file)."""
    root = os.path.realpath(os.fspath(directory))
    prefix = sys.prefix + os.sep

    def real(path: str) -> str:  # the last component is what was opened: never resolved
        return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))

    return [
        p
        for p in opened
        if real(p) != root
        and not real(p).startswith(root + os.sep)
        and not (p.startswith(prefix) and p.endswith((".py", ".pyc", ".so")))
    ]
