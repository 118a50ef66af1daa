"""Spreading a load's reads over a few threads, each with a reader of its own.

A load's work is copying bytes out of the page cache and computing their CRC32s, and
both release the GIL (``os.preadv``, isal's or zlib's CRC of a buffer, torch's
``copy_``): one thread leaves the process's other cores idle. Measured on a 2-core Xeon,
one process loading 768 MiB (16 x ``Linear(2048, 2048)`` + AdamW) from ``/dev/shm`` into
live tensors, medians of 5 (``benchmarks/gpu_checkpoint.py --device cpu``, beside DCP's
0.22-0.23 s): ``verify="first"`` 0.27 s on one thread, 0.19 s on two; ``"inline"``
0.16-0.17 s and 0.10-0.12 s.

The rules, each for a reason:

* Each thread reads through a fork of the caller's reader
  (:meth:`CheckpointReader.fork`), made before any thread starts: buffers of its own
  (they are reused from piece to piece), and the caller's open files, each opened and
  validated once, so that every thread reads the very descriptor that was checked; no
  file is closed while a fork may read it.
* Only local files are read this way (``Storage.cheap_rereads``), never through a spool:
  an object store's bytes arrive over the network, and its spool records one stream.
* Items marked ``home`` are read by the calling thread: CUDA targets, whose copies are
  queued on the caller's current CUDA stream (torch keeps it per thread), and tensors
  whose rows are wider than a read piece (each holds a buffer of a row: one at a time).
  The helpers run in the caller's inference mode, which torch also keeps per thread.
* Threads take contiguous runs of the items, about equal in bytes: the items come in
  file order, so each thread reads forward through its files.
* A failure stops the threads at their next item after it; items before it are still
  done. So every item before the earliest bad one is tried, and
  :meth:`Outcome.raise_first` raises the earliest bad item's error: the same bytes name
  the same cause whatever the timing. The caller also gets exactly which items finished
  and which failed (:class:`Outcome`), for ``in_place.fill``'s account of what the live
  objects hold; how far the other threads got before they stopped depends on timing,
  so that account does. ``KeyboardInterrupt`` and other non-``Exception`` errors are not
  collected: they stop every thread and propagate at once.

How many threads: the CPUs this process may run on (its affinity; a container's CPU
quota is not read, since a load opens nothing outside the checkpoint: pass
``read_threads`` there), shared equally by the processes of its node (``LOCAL_WORLD_SIZE``, which
torchrun sets; else the world size), at most :data:`MAX_THREADS`. Ranks that share
their cores (as 4 ranks on this 2-core machine do) read on one thread, exactly as
before.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

if TYPE_CHECKING:  # the reader runs its own checks on threads too
    from .reader import CheckpointReader

MAX_THREADS = 4
"""A copy out of the page cache is bounded by memory bandwidth, which a few cores
saturate; only 1 and 2 threads were measured (the machine has 2 cores)."""

Item = TypeVar("Item")
Result = TypeVar("Result")


def default_threads(world_size: int) -> int:
    """The threads one rank reads with: its share of the CPUs, 1 to :data:`MAX_THREADS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        processes = 0
    if processes < 1:
        processes = max(world_size, 1)
    return max(1, min(MAX_THREADS, cpus // processes))


@dataclass
class Outcome(Generic[Result]):
    """What became of each item (by index): finished, failed part-way, or never started."""

    results: dict[int, Result] = field(default_factory=dict)
    failures: dict[int, Exception] = field(default_factory=dict)

    def raise_first(self) -> None:
        """Raise the error of the earliest failed item, if any did."""
        if self.failures:
            raise self.failures[min(self.failures)]


def run(
    reader: CheckpointReader,
    items: Sequence[Item],
    work: Callable[[CheckpointReader, Item], Result],
    *,
    threads: int,
    sizes: Sequence[int],
    home: Callable[[Item], bool] = lambda item: False,
) -> Outcome[Result]:
    """``work(reader, item)`` for every item, on up to ``threads`` threads; ``sizes``
    (bytes per item) balance them. Stops at the first failure (see the module docstring)."""
    home_items = [i for i, item in enumerate(items) if home(item)]
    others = [i for i, item in enumerate(items) if not home(item)]
    runs: list[list[int]] = []
    if threads <= 1 or len(items) <= 1:
        mine = list(range(len(items)))
    elif home_items:  # the calling thread has its own items: the other threads split the rest
        mine, runs = home_items, _runs(others, sizes, threads - 1)
    else:  # the calling thread takes the first run itself
        mine, *runs = _runs(others, sizes, threads)
    outcome: Outcome[Result] = Outcome()
    stop = _Cutoff()
    runs = [indices for indices in runs if indices]
    if not runs:
        _work(reader, mine, items, work, stop, outcome)
        return outcome

    mode = torch.is_inference_mode_enabled()

    def forked(own: CheckpointReader, indices: list[int]) -> None:
        # The caller's inference mode holds on its helpers too (torch keeps it per
        # thread): copying into an inference tensor is refused outside it.
        with own, torch.inference_mode(mode):
            try:
                _work(own, indices, items, work, stop, outcome)
            except BaseException:  # SystemExit, say: every thread stops too
                stop.before(-1)
                raise

    with ThreadPoolExecutor(len(runs), thread_name_prefix="shardsafe-read") as pool:
        try:
            # The first fork stops files being closed to make room, before its thread reads.
            futures = [pool.submit(forked, reader.fork(), indices) for indices in runs]
            _work(reader, mine, items, work, stop, outcome)
            for future in futures:  # an item's error is in outcome; one here is a bug's
                future.result()
        except BaseException:
            stop.before(-1)  # the other threads stop at their next item; the pool waits for them
            raise
    return outcome


class _Cutoff:
    """The earliest item that failed: no thread starts an item after it."""

    def __init__(self) -> None:
        self.index = math.inf
        self._lock = threading.Lock()

    def before(self, index: int) -> None:
        with self._lock:
            self.index = min(self.index, index)


def _work(
    reader: CheckpointReader,
    indices: list[int],
    items: Sequence[Item],
    work: Callable[[CheckpointReader, Item], Result],
    stop: _Cutoff,
    outcome: Outcome[Result],
) -> None:
    """Do ``indices`` in order until one fails, or the next is after one that did."""
    for i in indices:
        if i > stop.index:
            return
        try:
            outcome.results[i] = work(reader, items[i])
        except Exception as e:  # handed to the caller, which raises the earliest
            outcome.failures[i] = e
            stop.before(i)
            return


def _runs(indices: list[int], sizes: Sequence[int], n: int) -> list[list[int]]:
    """``indices`` cut into at most ``n`` contiguous runs of about equal bytes."""
    total = sum(sizes[i] for i in indices)
    runs: list[list[int]] = [[]]
    done = 0
    for i in indices:
        if runs[-1] and len(runs) < n and done >= total * len(runs) / n:
            runs.append([])
        runs[-1].append(i)
        done += sizes[i]
    return runs
