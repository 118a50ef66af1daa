"""Run a function on N real ranks (separate processes, gloo process group) and collect results.

Children are forked from a forkserver that has already imported torch and shardsafe, and
what ranks import lazily on first use (``torch._dynamo``, which building any optimizer or
DDP imports: seconds of CPU per rank; ZeRO, OSS, DCP, s3fs), so a 2-rank test starts in
well under a second instead of re-importing all that per rank. A rank that raises makes
the whole call fail with that rank's traceback; a run that exceeds ``timeout`` is killed
(every rank, SIGKILL) and fails, so a hang costs seconds.

That forkserver is this harness's own (``tests/forkservers.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import pickle
import queue
import signal
import socket
import subprocess
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from tests.forkservers import CONTEXT, ServedProcess, server

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",  # what torch.optim and DDP import on first use
    "torch.distributed.optim",
    "torch.distributed.checkpoint",
    "fairscale.optim",
    "s3fs",
    "shardsafe",
]
"""Imported by the server before it forks (a module that is not installed is skipped).
Not gcsfs: it reads its environment on import, which the gs:// tests hand to each rank
(``tests/gcsserver.py``)."""


class _Process(ServedProcess):
    served = server(_PRELOAD)


class RankFailed(AssertionError):
    def __init__(self, rank: int, text: str) -> None:
        super().__init__(f"rank {rank} failed:\n{text}")
        self.rank = rank
        self.text = text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Launch an example through this script, not directly: see its docstring.
RUN_EXAMPLE_THEN_EXIT = os.path.join(os.path.dirname(__file__), "run_example_then_exit.py")


def launched(argv: list[str], cwd: str | os.PathLike[str], timeout: float = 200) -> str:
    """Run a launcher's command line (``torchrun``, ``accelerate launch``) in ``cwd``, with
    a Hugging Face cache of its own there (nothing downloaded, nothing shared); its
    output, once it has succeeded (else the tails of both streams)."""
    env = {**os.environ, "HF_HOME": os.path.join(cwd, "hf-home")}
    done = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    results: Any,
    init: bool,
) -> None:
    import torch
    import torch.distributed as dist

    # A rank that dies of a signal (SIGABRT from glibc's heap checks, SIGSEGV) prints
    # every thread's Python stack to the test's captured stderr: the one clue such a
    # crash leaves on a CI machine.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        if init and world_size > 0:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=120),
            )
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", pickle.dumps(out)))  # plain pickle: copies tensors
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if init and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


class RanksCrashed(AssertionError):
    """Ranks died of a signal before reporting (exit codes ``-signal``)."""

    def __init__(self, dead: list[int], codes: list[int | None]) -> None:
        super().__init__(f"rank(s) {dead} died without a result (exit codes {codes})")
        self.codes = codes


NATIVE_CRASHES = {-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGABRT, -signal.SIGFPE}
"""Exit codes of a crash in native code: shardsafe is pure Python, so such a crash is
torch's or gloo's (a rare one, of 4-rank gloo collectives on sub-meshes in CI)."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90,
    init_process_group: bool = True,
    rerun_after_native_crash: Callable[[], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results by rank.

    A rendezvous that loses the race for its port (picked free, then taken by another
    process before rank 0 binds it) is retried once on a new port: a harness race, not a
    finding about the code under test. With ``rerun_after_native_crash``, a rank killed
    by a crash in native code (:data:`NATIVE_CRASHES`) makes the run start over once,
    after that callable undid what the first run left (its checkpoint), with a warning
    in the test report: the crash is printed, never hidden, and a second one fails.
    """
    try:
        return _run_ranks(fn, world_size, args, timeout, init_process_group)
    except RankFailed as e:
        if "EADDRINUSE" not in e.text:
            raise
        return _run_ranks(fn, world_size, args, timeout, init_process_group)
    except RanksCrashed as e:
        if rerun_after_native_crash is None or not NATIVE_CRASHES.intersection(e.codes):
            raise
        warnings.warn(f"{fn.__name__}: {e}; run once more", RuntimeWarning, stacklevel=2)
        rerun_after_native_crash()
        return _run_ranks(fn, world_size, args, timeout, init_process_group)


def _run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout: float,
    init_process_group: bool,
) -> list[Any]:
    port = free_port()
    results = CONTEXT.Queue()
    procs = [
        _Process(
            target=_child,
            args=(fn, r, world_size, port, args, results, init_process_group),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(outcomes) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise AssertionError(
                    f"ranks {sorted(set(range(world_size)) - set(outcomes))} "
                    f"did not finish within {timeout}s (hang?)"
                )
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcomes]
                if dead and results.empty():
                    # give a just-finished rank's result a moment to arrive
                    try:
                        rank, status, value = results.get(timeout=2.0)
                    except queue.Empty:
                        raise RanksCrashed(dead, [procs[r].exitcode for r in dead]) from None
                else:
                    continue
            outcomes[rank] = (status, value)
            if status == "error" and "EADDRINUSE" in value:
                break  # the others would only wait for a store that never came up
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    for rank in sorted(outcomes):
        status, value = outcomes[rank]
        if status == "error":
            raise RankFailed(rank, value)
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
