"""The fixed cost of a small save: ZeRO sharded save against the write floor, and where
the time goes.

Issue #17: at 48 MiB (``--layers 4``) the sharded ZeRO save should take at most 1.2x the
write floor (one buffered write of the same bytes by rank 0, then fsync). On a shared
host the floor itself drifts by tens of percent between launches, so here the floor and
the save alternate in the same processes, ``--repeat`` times, and the medians are
compared. Then the save's parts on each rank, as medians in ms: the phases (from the
moment the rank posts its outcome until every rank has: ``wait:<phase>``), writing the
data (``write``: the write calls, the CRC32s, the file's fsync), building and checking
the manifest (``manifest``) and committing it (``commit``: temp file, fsync, rename,
directory fsync), and the rest (``other``: entering, collecting the state, planning,
preparing the directory, closing).

Run:  python benchmarks/small_save.py [--layers 4] [--ranks 2 4] [--repeat 15]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Target, clean, fsync_write, launch, mib, verdicts
from zero_checkpoint import Case

TARGET = 1.2


def instrument(spans: dict[str, float]) -> None:
    """Wrap the parts of a save (in this process) so that each call adds its duration to
    ``spans``."""
    from shardsafe.checkpoint import saving
    from shardsafe.checkpoint.storage import protocol as storage
    from shardsafe.distributed import coordinator

    def timed(owner: Any, attr: str, label: Callable[..., str]) -> None:
        inner = getattr(owner, attr)

        @functools.wraps(inner)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                key = label(*args)
                spans[key] = spans.get(key, 0.0) + time.perf_counter() - start

        setattr(owner, attr, wrapper)

    timed(coordinator.Coordinator, "_exchange", lambda self, phase, *a: f"wait:{phase}")
    timed(saving, "write_plan", lambda *a: "write")
    timed(saving, "loadable", lambda *a: "manifest")
    timed(storage.LocalStorage, "commit", lambda *a: "commit")


def bench(rank: int, world: int, layers: int, repeat: int, root: str) -> dict[str, Any]:
    import shardsafe

    case = Case(layers, rank, world, root)
    _, ddp, opt = case.state
    total = case.info["model_bytes"] + case.info["opt_bytes"]
    payload = torch.ones(total, dtype=torch.uint8) if rank == 0 else None
    spans: dict[str, float] = {}
    instrument(spans)
    times: dict[str, list[float]] = {"floor": [], "save": []}
    parts: list[dict[str, float]] = []
    for i in range(repeat):
        for tool in ("floor", "save") if i % 2 else ("save", "floor"):
            path = f"{root}/small-{tool}"
            if rank == 0:
                clean(path)
            dist.barrier()
            spans.clear()
            start = time.perf_counter()
            if tool == "save":
                shardsafe.save(path, {"model": ddp, "optimizer": opt}, layout="sharded")
                parts.append(dict(spans))  # "other" is added below
            elif payload is not None:
                fsync_write(path, memoryview(payload.numpy()))
            elapsed = time.perf_counter() - start
            times[tool].append(elapsed)
            if tool == "save":
                parts[-1]["other"] = elapsed - sum(parts[-1].values())
            dist.barrier()
    if rank == 0:
        clean(f"{root}/small-floor")
        clean(f"{root}/small-save")
    medians = {k: statistics.median(p.get(k, 0.0) for p in parts) for k in parts[0]}
    return {"times": times, "parts": medians, "bytes": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="1024x1024 layers (4: 48 MiB)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--dir", default="/tmp/shardsafe-bench")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    targets = []
    for world in args.ranks:
        out = launch(bench, world, args.layers, args.repeat, args.dir)
        floor = statistics.median(out[0]["times"]["floor"])
        save = statistics.median(out[0]["times"]["save"])
        print(
            f"{world} ranks, {mib(out[0]['bytes'])}: floor {floor * 1e3:.1f} ms, sharded save "
            f"{save * 1e3:.1f} ms (medians of {args.repeat}, alternating)"
        )
        for rank, result in enumerate(out):
            cells = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in result["parts"].items())
            print(f"  rank {rank}: {cells}")
        targets.append(Target(f"{world} ranks: sharded save / write floor", save / floor, TARGET))
    print(verdicts(targets))


if __name__ == "__main__":
    main()
