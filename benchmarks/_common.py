"""Shared pieces of the benchmarks: launching ranks, timing, peak-RSS sampling, tables.

Every benchmark runs all tools on the same state, in the same processes, one after the
other, and reports medians over repetitions: the ratios are what matters, since the
absolute numbers depend on the disk.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], out: Any
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30)
        )
        out.put((rank, fn(rank, world, *args), None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the results by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world, port, args, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    for _ in procs:
        rank, value, error = out.get()
        if error:
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{error}")
        results[rank] = value
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


class PeakRSS:
    """Samples this process's RSS every few ms; ``extra`` is the peak above the start."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.proc = psutil.Process()
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        self.baseline = self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.baseline


@dataclass
class Measurement:
    seconds: list[float] = field(default_factory=list)
    rss_extra: list[list[int]] = field(default_factory=list)  # per repetition, per rank

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def median_rss(self, rank: int) -> int:
        return int(statistics.median(r[rank] for r in self.rss_extra))


def timed(fn: Callable[[], Any]) -> tuple[float, int]:
    """Seconds from a barrier before ``fn`` to a barrier after it, and this rank's extra RSS."""
    import gc

    gc.collect()
    dist.barrier()
    with PeakRSS() as rss:
        start = time.perf_counter()
        fn()
        dist.barrier()
        seconds = time.perf_counter() - start
    return seconds, rss.extra


def fsync_write(path: str, data: memoryview) -> None:
    """The floor: one buffered write of all the bytes, then fsync."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def clean(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.isfile(path):
        os.remove(path)


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = psutil.virtual_memory().total / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, torch {torch.__version__}"
