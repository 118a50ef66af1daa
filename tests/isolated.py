"""Run one attack in a process of its own, under a memory and a time bound, and report how
it ended and whether it changed the interpreter.

A hostile input may crash the process (SIGSEGV), hang it, exhaust its memory or change the
running interpreter (a class attribute replaced, a module imported, a cache poisoned).
None of that may be tried in the test process itself. Each case runs in a child forked
from a forkserver that has already imported torch and shardsafe (a fresh, single-threaded
parent, so a case costs tens of milliseconds, not an interpreter start). The child

* limits its address space (``RLIMIT_AS``) to what it has mapped plus ``memory_bytes``,
* records a fingerprint of the interpreter (see :func:`fingerprint`),
* calls the case, and records the exception it raised (class and message) or its result,
* records the fingerprint again and reports every difference,

and the parent kills it if it has not answered within ``seconds``. So a test asserts a
clean exit, the exact error class, and an unchanged interpreter.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import resource
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

_PRELOAD = [
    "faulthandler",
    "multiprocessing.synchronize",
    "torch",
    "torch.distributed.checkpoint",
    "torch.utils.serialization.config",  # what torch.load imports on first use
    "shardsafe",
    "shardsafe.converters",
    "tests.isolated",
    # What hypothesis imports as it runs, for cases that generate their inputs.
    "hypothesis",
    "hypothesis.internal.conjecture.optimiser",
    "numpy.random",
    "secrets",
    "hmac",
]
_OPTIONAL_PRELOAD = ["s3fs"]
"""Imported too where installed: the object-store cases (a hostile lock on S3) each spent
about 2 s importing the S3 client otherwise."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    exitcode: int | None
    """0: the case returned or raised; negative: killed by that signal; None: timed out."""
    error: str | None
    """The qualified class name of the exception the case raised, ``None`` if it returned."""
    message: str
    result: Any
    changed: list[str]
    """What in the interpreter differs after the case (attributes, imported modules)."""
    seconds: float

    @property
    def clean(self) -> bool:
        """The case ended by itself, within its bounds, and changed nothing."""
        return self.exitcode == 0 and not self.changed

    def describe(self) -> str:
        return (
            f"exit {self.exitcode}, {self.error}: {self.message[:2000]}; changed "
            f"{self.changed[:10]}; {self.seconds:.1f}s"
        )


def _prime() -> None:
    """Fill what torch fills lazily on first use (``_get_layout``'s cache, on the first
    layout unpickled), so that only a change a case makes shows in its fingerprint."""
    import torch.serialization

    torch.serialization._get_layout("torch.strided")


_prime()
_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(_PRELOAD + _OPTIONAL_PRELOAD)
    return _CONTEXT


def run_isolated(
    case: Callable[..., Any],
    *args: Any,
    memory_bytes: int = 1 << 30,
    seconds: float = 60.0,
) -> Outcome:
    """Call ``case(*args)`` (a module-level function) in a child process (module docstring)."""
    ctx = _context()
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(writer, case, args, memory_bytes))
    start = time.monotonic()
    child.start()
    writer.close()
    report: dict[str, Any] | None = None
    try:
        if reader.poll(seconds):
            with contextlib.suppress(EOFError):
                report = reader.recv()
    finally:
        reader.close()
    child.join(None if report is not None else 1.0)
    if child.is_alive():
        child.kill()
        child.join()
        return Outcome(None, None, "timed out", None, [], time.monotonic() - start)
    elapsed = time.monotonic() - start
    if report is None:
        return Outcome(child.exitcode, None, "died without a report", None, [], elapsed)
    return Outcome(
        child.exitcode,
        report["error"],
        report["message"],
        report["result"],
        report["changed"],
        elapsed,
    )


def _child(
    writer: multiprocessing.connection.Connection,
    case: Callable[..., Any],
    args: tuple[Any, ...],
    memory_bytes: int,
) -> None:
    for name in _PRELOAD:  # imported here too: another test may have started the server
        importlib.import_module(name)
    for name in _OPTIONAL_PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    _prime()
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + memory_bytes, hard))
    before = fingerprint()
    error, message, result = None, "", None
    try:
        result = case(*args)
    except BaseException as e:  # the point: report whatever it was
        error = f"{type(e).__module__}.{type(e).__qualname__}"
        message = str(e)
        if not isinstance(e, Exception) or type(e).__module__ != "shardsafe.errors":
            message += "\n" + "".join(traceback.format_exception(e))[-4000:]
    after = fingerprint()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    try:
        writer.send({"error": error, "message": message, "result": result, "changed": changed})
    except Exception as e:  # an unpicklable result
        writer.send({"error": "unsendable", "message": repr(e), "result": None, "changed": changed})
    writer.close()


def _watched() -> Iterator[tuple[str, Any]]:
    """The objects a hostile pickle has been seen to change, and their neighbours: the
    classes and functions an unpickler may be handed, and the modules they live in."""
    import torch
    import torch.serialization
    from torch.distributed.checkpoint import filesystem, metadata

    for cls in (
        pathlib.PurePath,
        pathlib.Path,
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        pathlib.WindowsPath,
        pathlib.PureWindowsPath,
        collections.OrderedDict,
        collections.Counter,
        torch.Size,
        torch.Tensor,
        torch.nn.Parameter,
        torch.device,
        filesystem._StorageInfo,
    ):
        yield f"{cls.__module__}.{cls.__qualname__}", cls
    for name in dir(metadata):
        value = getattr(metadata, name)
        if isinstance(value, type):
            yield f"{metadata.__name__}.{name}", value
    yield "torch.serialization", torch.serialization
    yield "torch._utils", torch._utils
    yield "torch.serialization._get_layout", torch.serialization._get_layout
    for name in dir(torch._utils):
        if name.startswith("_rebuild"):
            yield f"torch._utils.{name}", getattr(torch._utils, name)


def fingerprint() -> dict[str, Any]:
    """``{where: identity or value}`` of every attribute of the watched objects (and of
    ``_get_layout``'s cache), plus the set of imported modules."""
    seen: dict[str, Any] = {}
    for where, obj in _watched():
        for name, value in list(vars(obj).items()):
            seen[f"{where}.{name}"] = id(value)
    import torch.serialization

    cache = getattr(torch.serialization._get_layout, "cache", None)
    if isinstance(cache, dict):
        for name, value in cache.items():
            seen[f"_get_layout.cache[{name!r}]"] = id(value)
    seen.update((f"imported {name}", True) for name in list(sys.modules))
    return seen
