"""Start a test's Python script as a process forked from a server that has imported torch
and Lightning already, instead of as a fresh interpreter.

A Lightning script's process spends about 5 s of CPU importing before it does anything
(``pytorch_lightning`` pulls in ``torch._dynamo`` and torchmetrics); the Lightning tests
start about a hundred of them, two at a time on this project's two cores. Forked from a
server that imported those modules once, a process starts in well under a second, and
is otherwise what ``python script.py`` with that environment would be: a process of its
own (its own session, so that a kill reaches everything it starts), its arguments in
``sys.argv``, the script run as ``__main__``, its environment, output to the given file,
its exit status or the signal that killed it (:class:`ScriptProcess` answers as
``subprocess.Popen`` does, for what the tests use). The one difference: what a module
read from the environment when it was imported, it read in the server. Lightning's
``rank_zero_only.rank`` is such a value; it is read again here (Lightning sets it again
anyway once the strategy knows the rank).

The server is this module's own (``tests/forkservers.py``), as ``tests/harness.py``'s
is, and is started on first use (importing in it takes as long as in one script, once
per test session).
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping
from typing import Any

from tests.forkservers import ServedProcess, server

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "pytorch_lightning",
    "shardsafe",
    "shardsafe.lightning",
]
"""Imported by the server before it forks (a module that is not installed is skipped)."""


class _Process(ServedProcess):
    served = server(_PRELOAD)


def _run_script(
    argv: list[str], env: dict[str, str], cwd: str | None, output: str, errors: str | None
) -> None:
    """In the forked process: become ``python argv...`` as it would start, then exit with
    the script's status."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.close(nothing)
    for fd, path in ((1, output), (2, errors or output)):
        written = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(written, fd)
        os.close(written)
    module = argv[1] if argv[0] == "-m" else None
    first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [first, *paths]
    sys.argv = [module or argv[0], *argv[2 if module else 1 :]]
    sys.orig_argv = [sys.executable, *argv]  # what a launcher restarts (shardsafe.Trainer)
    _reread_environment()
    status = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _reread_environment() -> None:
    """What preloaded modules read from the environment on import, read again from this
    process's: Lightning's rank for its rank-zero-only messages."""
    rank_zero = sys.modules.get("lightning_fabric.utilities.rank_zero")
    if rank_zero is not None:
        rank_zero.rank_zero_only.rank = rank_zero._get_rank()  # type: ignore[attr-defined]


class ScriptProcess:
    """A started script, answering as ``subprocess.Popen`` does: ``pid``, ``poll``,
    ``wait`` (raising ``subprocess.TimeoutExpired``) and ``returncode`` (the negative
    signal number if a signal killed it)."""

    def __init__(self, process: Any, argv: list[str]) -> None:
        self._process = process
        self.args = argv
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        code = self._process.exitcode
        return None if code is None else int(code)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code


def start_script(
    argv: list[str],
    env: Mapping[str, str],
    output: str,
    cwd: str | None = None,
    errors: str | None = None,
) -> ScriptProcess:
    """Start ``python *argv`` (a script and its arguments, or ``-m module ...``) with
    ``env``, its output appended to the file ``output`` (and its error stream too, or to
    ``errors``), in a session of its own."""
    args = (list(argv), dict(env), cwd, output, errors)
    process = _Process(target=_run_script, args=args, daemon=True)
    process.start()
    return ScriptProcess(process, list(argv))


def run_script(
    argv: list[str], env: Mapping[str, str], timeout: float, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    """:func:`start_script`, waited for, as ``subprocess.run(["python", *argv], ...,
    capture_output=True, text=True)`` would: its exit status and both streams (killed,
    with everything it started, and ``subprocess.TimeoutExpired`` raised after
    ``timeout`` seconds)."""
    with tempfile.TemporaryDirectory() as captured:
        out, err = os.path.join(captured, "out"), os.path.join(captured, "err")
        for path in (out, err):
            open(path, "w").close()
        started = start_script(argv, env, out, cwd=cwd, errors=err)
        try:
            code = started.wait(timeout)
        finally:
            if started.poll() is None:
                os.killpg(started.pid, signal.SIGKILL)
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(argv, code, o.read(), e.read())
