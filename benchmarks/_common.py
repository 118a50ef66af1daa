"""Shared pieces of the benchmarks: launching ranks, timing, peak-RSS sampling, tables.

Every save row runs in fresh processes (one launch per tool), on a state built from the
same seed, so one tool's freed heap cannot hide the next one's allocations; a tool's
loads run after its saves, in the same processes. Times are medians over repetitions,
peak RSS the maximum over them: the ratios are what matters, since the absolute numbers
depend on the disk.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
import torch.distributed as dist

# What every rank imports anyway: the forkserver imports it once (DDP alone pulls in
# torch._dynamo and sympy, ~2 s per process otherwise).
PRELOAD = (
    "__main__",
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.optim",
    "torch.nn.parallel",
    "shardsafe",
    "_common",
    "_tools",
    "pytorch_lightning",  # 3-5 s of CPU per rank otherwise, in each Lightning row's ranks
)
_context: Any = None


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
    threads = max(1, (os.cpu_count() or 2) // world)
    torch.set_num_threads(threads)
    # As torchrun and `accelerate launch` set it: without it, Accelerate's CPU setup
    # resets torch's threads from psutil's core count (2 a rank here, on 2 cores).
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
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


def _mp_context() -> Any:
    """A forkserver that has imported torch once: a fresh set of ranks starts in <1 s."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(
            [m for m in PRELOAD if m == "__main__" or importlib.util.find_spec(m)]
        )
    return _context


def launch(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh gloo ranks; return results by rank."""
    ctx = _mp_context()
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
    file_bytes: int = 0  # what one save left on disk (0: not measured)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def peak_rss(self, rank: int) -> int:
        """The largest extra RSS of ``rank`` over the repetitions (the first usually)."""
        return max(r[rank] for r in self.rss_extra)


def trim_heap() -> None:
    """Hand the heap that earlier calls freed back to the system (glibc ``malloc_trim``), so
    that a call reusing it still shows in its RSS (loads run after saves, in-process)."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not glibc: reused heap may hide
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def timed(fn: Callable[[], Any], trim: bool = False) -> tuple[float, int]:
    """Seconds from a barrier before ``fn`` to a barrier after it, and this rank's extra RSS
    (with ``trim``, measured from a trimmed heap: see :func:`trim_heap`)."""
    import gc

    gc.collect()
    if trim:
        trim_heap()
    dist.barrier()
    with PeakRSS() as rss:
        start = time.perf_counter()
        fn()
        dist.barrier()
        seconds = time.perf_counter() - start
    return seconds, rss.extra


def measure(
    fn: Callable[[], Any],
    repeat: int,
    cleanup: Callable[[], Any] | None = None,
    trim: bool = False,
) -> Measurement:
    """Time ``fn`` ``repeat`` times on every rank; ``cleanup`` runs on rank 0 after each."""
    m = Measurement()
    for _ in range(repeat):
        seconds, extra = timed(fn, trim)
        extras: list[int] = [0] * dist.get_world_size()
        dist.all_gather_object(extras, extra)
        m.seconds.append(seconds)
        m.rss_extra.append(extras)
        dist.barrier()
        if cleanup is not None and dist.get_rank() == 0:
            cleanup()
        dist.barrier()
    return m


def fsync_write(path: str, data: memoryview) -> None:
    """The floor: one buffered write of all the bytes, then fsync."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_bytes(path: str) -> int:
    """Size of a file, or of every file under a directory."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def clean(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.isfile(path):
        os.remove(path)


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and optimizer-state tensor, in a fixed order (not copied): what a
    benchmark compares, bitwise, after a restore."""
    found = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        found += [v for _, v in sorted(opt.state[p].items()) if torch.is_tensor(v)]
    return found


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def table(rows: Sequence[Sequence[str]]) -> str:
    """A markdown table, padded so that it also reads well in a terminal."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    lines = [line(r) for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    """A ratio with a limit: ``value >= limit`` when ``at_least``, else ``value <= limit``;
    ``limit=None`` shows the ratio with no target."""

    label: str
    value: float
    limit: float | None
    at_least: bool = False

    @property
    def met(self) -> bool:
        if self.limit is None:
            return True
        return self.value >= self.limit if self.at_least else self.value <= self.limit

    @property
    def rule(self) -> str:
        if self.limit is None:
            return "no target"
        return f"target {'>=' if self.at_least else '<='} {self.limit:g}"

    def line(self) -> str:
        verdict = "" if self.limit is None else (" MET" if self.met else " MISSED")
        return f"{self.label}: {self.value:.2f} ({self.rule}){verdict}"


def verdicts(targets: Sequence[Target]) -> str:
    return "\n".join(f"- {t.line()}" for t in targets)


def standalone_parser(
    doc: str | None, *, repeat: int, layers: int | None = 16
) -> argparse.ArgumentParser:
    """The options of a benchmark script run on its own: ``--layers`` (of
    ``Linear(1024, 1024)``), ``--ranks``, ``--repeat`` and ``--dir``; add the script's own."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=repeat)
    parser.add_argument("--dir", default="/tmp/shardsafe-bench")
    return parser


def print_standalone(directory: str, make: Callable[[], Any]) -> None:
    """Print the machine, then the section ``make()`` measures (in ``directory``): its
    table and its targets' verdicts, as ``run_all.py`` reports them."""
    os.makedirs(directory, exist_ok=True)
    print(f"machine: {machine()}\n")
    done = make()
    print(f"{done.text}\n\n{verdicts(done.targets)}")


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = psutil.virtual_memory().total / 2**30
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, {gpu}, torch {torch.__version__}, "
        f"gloo, all ranks on this host; {load}"
    )


def disk(path: str) -> str:
    """The filesystem ``path`` is on, as ``device (fstype)``."""
    path = os.path.realpath(path)
    best = max(
        (p for p in psutil.disk_partitions(all=True) if path.startswith(p.mountpoint)),
        key=lambda p: len(p.mountpoint),
        default=None,
    )
    free = psutil.disk_usage(path).free / 2**30
    name = f"{best.device} ({best.fstype})" if best else "unknown device"
    return f"{path} on {name}, {free:.0f} GiB free"


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``: a collective step takes its slowest rank's time."""
    every: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(every, seconds)
    return max(every)
