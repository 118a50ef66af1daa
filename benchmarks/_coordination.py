"""Coordination cost against rank count: a tiny state, so the time is the agreement.

Setup: N ranks on this host (oversubscribed; one intra-op thread per rank), a DDP model
of 4 Linear(256, 256) layers with Adam after one step (about 3 MiB in all). In the same
processes, alternating, ``repeat`` times each: shardsafe sharded save and load, and
torch.distributed.checkpoint (DCP) save and load (get_state_dict -> dcp.save;
get_state_dict -> dcp.load -> set_state_dict). A time is rank 0's, from a barrier
before the call to a barrier after it; the median is printed.

Store requests: every rank counts what it asked of the process group's store during one
shardsafe save and one load (``shardsafe.distributed.store_requests``), summed over
ranks: what the single store, hosted by rank 0, served. Targets: at most 30 x ranks per
save; at 32 ranks and more, shardsafe save and load at most 0.8x DCP's time.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import shardsafe
from _common import Target, launch, table
from _report import Section

try:
    from shardsafe.distributed import reset_store_requests, store_requests
except ImportError:  # a shardsafe from before issue 17 (to time it): no count, shown as -1

    def reset_store_requests() -> None:
        pass

    def store_requests() -> dict[str, int]:
        return {"total": -1}


REQUESTS_PER_RANK = 30
TIME_RATIO = 0.8
TIME_TARGET_FROM = 32
"""World sizes from which shardsafe must take at most ``TIME_RATIO`` x DCP's time."""


@dataclass
class Point:
    world: int
    seconds: dict[str, list[float]]
    requests: dict[str, int]
    """Store requests of one shardsafe save and one load, summed over ranks."""

    def median(self, what: str) -> float:
        return statistics.median(self.seconds[what])


def _state() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    return model, opt


def _timed(call: Callable[[], Any]) -> tuple[float, int]:
    """Barrier-to-barrier seconds of ``call`` on every rank, and the store requests every
    rank made during it, summed."""
    dist.barrier()
    reset_store_requests()
    start = time.perf_counter()
    call()
    dist.barrier()
    seconds = time.perf_counter() - start
    total = torch.tensor([store_requests()["total"]], dtype=torch.int64)
    dist.all_reduce(total)
    return seconds, int(total.item())


def _worker(rank: int, world: int, root: str, repeat: int) -> Point:
    torch.set_num_threads(1)
    model, opt = _state()
    state = {"model": model, "optimizer": opt, "step": 1}

    def dcp_save(path: str) -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    def dcp_load(path: str) -> None:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    shardsafe.save(f"{root}/warm", state)  # first calls: imports, this process's connection
    dcp_save(f"{root}/warm-dcp")
    kinds = ("ss save", "ss load", "dcp save", "dcp load")
    seconds: dict[str, list[float]] = {k: [] for k in kinds}
    requests: dict[str, int] = {}
    for i in range(repeat):
        ss, dc = f"{root}/ss-{i}", f"{root}/dcp-{i}"
        t, requests["save"] = _timed(functools.partial(shardsafe.save, ss, state))
        seconds["ss save"].append(t)
        seconds["dcp save"].append(_timed(functools.partial(dcp_save, dc))[0])
        t, requests["load"] = _timed(functools.partial(shardsafe.load, ss, state))
        seconds["ss load"].append(t)
        seconds["dcp load"].append(_timed(functools.partial(dcp_load, dc))[0])
    return Point(world, seconds, requests)


def run(worlds: Sequence[int], repeat: int, root: str) -> list[Point]:
    points = []
    for world in worlds:
        path = os.path.join(root, f"coordination-{world}")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        points.append(launch(_worker, world, path, repeat)[0])
        shutil.rmtree(path, ignore_errors=True)
    return points


def targets(points: Sequence[Point]) -> list[Target]:
    out = []
    for p in points:
        if p.requests["save"] >= 0:  # counted (not a shardsafe from before issue 17)
            per_rank = p.requests["save"] / p.world
            label = f"store requests per save per rank, {p.world} ranks"
            out.append(Target(label, per_rank, REQUESTS_PER_RANK))
        for op in ("save", "load"):
            ratio = p.median(f"ss {op}") / p.median(f"dcp {op}")
            limit = TIME_RATIO if p.world >= TIME_TARGET_FROM else None
            out.append(Target(f"shardsafe / DCP {op} time, {p.world} ranks", ratio, limit))
    return out


def points_table(points: Sequence[Point]) -> str:
    rows = [
        [
            "ranks",
            "shardsafe save s",
            "DCP save s",
            "shardsafe load s",
            "DCP load s",
            "store requests / save",
            "per rank",
            "store requests / load",
            "per rank",
        ]
    ]
    for p in points:
        rows.append(
            [
                str(p.world),
                f"{p.median('ss save'):.3f}",
                f"{p.median('dcp save'):.3f}",
                f"{p.median('ss load'):.3f}",
                f"{p.median('dcp load'):.3f}",
                *_request_cells(p, "save"),
                *_request_cells(p, "load"),
            ]
        )
    return table(rows)


def section(worlds: Sequence[int], repeat: int, root: str) -> Section:
    """The table and its targets (MET or MISSED), for ``run_all.py`` and ``scaling.py``."""
    points = run(worlds, repeat, root)
    text = (
        "Tiny DDP + Adam state (4 layers of 256x256), shardsafe sharded and DCP in the same "
        f"processes, median of {repeat}; store requests summed over every rank's requests "
        "during one shardsafe save and one load.\n\n" + points_table(points)
    )
    return Section(text, targets(points), {})


def _request_cells(p: Point, op: str) -> list[str]:
    n = p.requests[op]
    return [str(n), f"{n / p.world:.1f}"] if n >= 0 else ["not counted", "-"]
