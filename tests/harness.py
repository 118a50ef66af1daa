"""Run a function on N real ranks (separate processes, gloo process group) and collect results.

Children are forked from a forkserver that has already imported torch and shardsafe, so
a 2-rank test starts in well under a second instead of re-importing torch per rank. A
rank that raises makes the whole call fail with that rank's traceback; a run that
exceeds ``timeout`` is killed (every rank, SIGKILL) and fails, so a hang costs seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "shardsafe"])


class RankFailed(AssertionError):
    def __init__(self, rank: int, text: str) -> None:
        super().__init__(f"rank {rank} failed:\n{text}")
        self.rank = rank
        self.text = text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90,
    init_process_group: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results by rank.

    A rendezvous that loses the race for its port (picked free, then taken by another
    process before rank 0 binds it) is retried once on a new port: a harness race, not a
    finding about the code under test.
    """
    try:
        return _run_ranks(fn, world_size, args, timeout, init_process_group)
    except RankFailed as e:
        if "EADDRINUSE" not in e.text:
            raise
        return _run_ranks(fn, world_size, args, timeout, init_process_group)


def _run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout: float,
    init_process_group: bool,
) -> list[Any]:
    port = free_port()
    results = _CTX.Queue()
    procs = [
        _CTX.Process(
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
                        raise AssertionError(
                            f"rank(s) {dead} died without a result "
                            f"(exit codes {[procs[r].exitcode for r in dead]})"
                        ) from None
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
