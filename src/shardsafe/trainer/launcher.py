"""Starting a run's processes the way torchrun does, or joining the ones torchrun started.

``Trainer(devices=N).fit(...)`` in a plain ``python train.py`` turns that process into a
pure launcher: it runs the same command N times with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (and torchrun's other variables) set,
waits, and exits with the workers' status. The workers then find exactly what torchrun
workers find, so ``python train.py`` and ``torchrun --nproc-per-node N train.py`` run the
same code and produce the same numbers.

A launcher that only waits could leave a run hanging: a worker that crashed leaves its
peers blocked in a collective until the process-group timeout (30 minutes). So the
launcher watches every worker and, as soon as one exits with an error, stops the others
(SIGTERM, then SIGKILL) and exits with that worker's status. Workers also die with the
launcher (``PR_SET_PDEATHSIG`` on Linux), so killing the launcher never leaves orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch.distributed as dist

from ..strategies.base import Environment

LAUNCHER_VARIABLE = "SHARDSAFE_LAUNCHER"
"""Set in every worker this launcher starts (torchrun's workers have ``TORCHELASTIC_RUN_ID``)."""

_GRACE_S = 5.0
INTERRUPTED = 130
"""What :func:`launch` returns after Ctrl-C (SIGINT), as a shell reports it."""


def current_environment(devices: int) -> Environment | None:
    """This process's place in the run; ``None`` if it must launch ``devices`` workers."""
    variables = os.environ
    if "RANK" in variables and "WORLD_SIZE" in variables:
        world_size = _whole("WORLD_SIZE", 1)
        if world_size != devices:
            raise ValueError(
                f"devices={devices}, but this process was started as one of {world_size} "
                f"(WORLD_SIZE={world_size}, e.g. by torchrun --nproc-per-node {world_size}); "
                "make devices match the launcher"
            )
        rank = _whole("RANK", 0)
        if rank >= world_size:  # RANK=1 WORLD_SIZE=1 trained in silence, as if not rank 0
            raise ValueError(
                f"RANK={rank} is not below WORLD_SIZE={world_size}: a rank is 0 to "
                "WORLD_SIZE - 1 (set by the launcher: torchrun, or this Trainer's own)"
            )
        launched = LAUNCHER_VARIABLE in variables or "TORCHELASTIC_RUN_ID" in variables
        local_rank = _whole("LOCAL_RANK", 0) if "LOCAL_RANK" in variables else rank
        return Environment(rank, world_size, local_rank, launched)
    if dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
        if world_size != devices:
            # Not checked, strategy="single" in a group of 2 trained two replicas whose
            # gradients were never averaged, and saved one checkpoint stitched from both.
            raise ValueError(
                f"devices={devices}, but this process is one of {world_size} ranks of the "
                "process group already initialized (init_process_group); make devices match "
                "it, with a strategy that runs on several processes (ddp, zero, fsdp)"
            )
        return Environment(dist.get_rank(), world_size, dist.get_rank())
    if devices == 1:
        return Environment()
    return None


def _whole(variable: str, least: int) -> int:
    """The environment's ``variable`` as a whole number of at least ``least``: ``RANK=-1``
    failed deep in the seeding ("Seed must be between 0 and 2**32 - 1"), ``RANK=x`` in
    ``int()`` (found in review)."""
    text = os.environ[variable]
    value = int(text) if re.fullmatch(r"-?[0-9]{1,9}", text.strip()) else None
    if value is None or value < least:
        raise ValueError(
            f"{variable}={text!r} in the environment must be a whole number, at least "
            f"{least} (set by the launcher: torchrun, or this Trainer's own)"
        )
    return value


def script_command() -> list[str]:
    """The command that started this process, to run again as each worker. A program
    read from standard input (``python - < train.py``) cannot be: the launcher has read
    it, and each worker ran an empty program, so the run trained nothing and exited 0."""
    from_stdin = sys.argv[:1] in (["-"], [""]) or not _runnable_again(sys.argv[0])
    if len(sys.orig_argv) < 2 or from_stdin or sys.flags.interactive or "ipykernel" in sys.modules:
        raise RuntimeError(
            "devices > 1 starts one process per device by running this program again, which "
            "needs a script: put the code in train.py and run `python train.py`, or start it "
            "with `torchrun --nproc-per-node N train.py`"
        )
    return [sys.executable, *sys.orig_argv[1:]]


def _runnable_again(program: str) -> bool:
    """Whether ``program`` (``sys.argv[0]``) can be run again: ``-c`` (its code is in the
    command), or a regular file (a pipe named as a file, ``python /dev/stdin``, was read
    up by the launcher, as ``python -`` was)."""
    if program == "-c":
        return True
    try:
        return stat.S_ISREG(os.stat(program).st_mode)
    except (OSError, ValueError):
        return False


def launch(command: Sequence[str], nprocs: int) -> int:
    """Run ``command`` as ``nprocs`` workers of one process group; return the exit status."""
    if threading.current_thread() is not threading.main_thread():
        # signal.signal below raised a bare "signal only works in main thread".
        raise RuntimeError(
            f"devices={nprocs} runs its workers from the main thread, which alone can stop "
            "them on SIGTERM or Ctrl-C; call Trainer.fit from the main thread, or start the "
            f"script with `torchrun --nproc-per-node {nprocs}`"
        )
    port = _free_port()
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(nprocs):
            workers.append(
                subprocess.Popen(
                    list(command),
                    env=worker_environment(rank, nprocs, port),
                    preexec_fn=_die_with_parent,
                )
            )
        return _supervise(workers)
    except KeyboardInterrupt:
        return INTERRUPTED
    except _Stop:
        return 128 + signal.SIGTERM
    finally:
        _stop_undisturbed(workers, previous)


def _stop_undisturbed(workers: list[subprocess.Popen[bytes]], sigterm: Any) -> None:
    """:func:`_stop`, deaf to a second SIGTERM or Ctrl-C; then SIGTERM's ``sigterm`` handler
    is back. coreutils' ``timeout`` sends SIGTERM twice (to the launcher, then to its
    process group) and an impatient user presses Ctrl-C again: raised inside the grace
    period, either ended the launcher with the traceback of ``_Stop`` (or of a
    ``KeyboardInterrupt``) and status 1, the workers' stop cut short."""
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        _stop(workers)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        signal.signal(signal.SIGINT, interrupt)


def worker_environment(rank: int, nprocs: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for a worker on one machine (``--nproc-per-node``)."""
    variables = dict(os.environ)
    variables.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        ROLE_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    variables[LAUNCHER_VARIABLE] = "1"
    if nprocs > 1:
        variables.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: no CPU oversubscription
    return variables


def _supervise(workers: list[subprocess.Popen[bytes]]) -> int:
    """Wait for the workers; on the first that fails, return its status.

    ``os.wait`` reports children in the order they exit, so the rank named is the one
    that failed first, not a peer that died of it a moment later.
    """
    ranks = {w.pid: rank for rank, w in enumerate(workers)}
    while any(w.returncode is None for w in workers):
        pid, status = os.wait()
        if pid not in ranks:
            continue  # a child the program started itself
        code = os.waitstatus_to_exitcode(status)
        workers[ranks[pid]].returncode = code
        if code != 0:
            others = sum(w.returncode is None for w in workers)
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            stopping = f"; stopping the other {others} worker(s)" if others else ""
            print(f"shardsafe: rank {ranks[pid]} {how}{stopping}", file=sys.stderr, flush=True)
            return 128 - code if code < 0 else code
    return 0


def _stop(workers: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every running worker, then SIGKILL those still there after a grace period."""
    for w in workers:
        if w.poll() is None:
            with contextlib.suppress(OSError):
                w.terminate()
    deadline = time.monotonic() + _GRACE_S
    for w in workers:
        try:
            w.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


class _Stop(Exception):
    """The launcher received SIGTERM."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def _die_with_parent() -> None:
    """In the worker, before exec: get SIGKILL when the launcher dies (Linux only)."""
    pr_set_pdeathsig = 1
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
