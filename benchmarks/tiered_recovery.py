"""Tiered checkpoints (``TieredCheckpointManager``): how fast a job restarts from each
tier, and what frequent local saves cost the training loop.

Setup: 4 ranks as 2 simulated nodes of 2 (``SHARDSAFE_NODE=rank // 2``), each node with
its own local directory (under ``/dev/shm`` when it has room, else the scratch
directory; the output says which); the persistent tier on a local S3 API server (moto on
127.0.0.1, started here, as in ``object_storage.py``; a local directory, labelled so,
when moto or s3fs is not installed). The state is data parallel: every rank holds an
MLP of 16 ``Linear(d, d)`` layers wrapped in DDP and its AdamW, one training step
taken, about ``--mib`` MiB per rank (``d`` = 1024 at 192 MiB: the 16x1024x1024 MLP of
``async_checkpoint.py``). The manager runs with ``local_every=1``, ``replicas=1``
(each rank's checkpoint is also kept by the rank in the same position on the other
node) and ``keep_local=2``; loads use the manager's defaults: one read from a local
copy (``verify="inline"``: a damaged one is followed by a whole load from the next
source), ``verify="first"`` from the persistent tier.

Timed, in one launch of 4 ranks (each row's slowest rank counts):

* **recovery**: a restart's restore, from the moment the process group is up and the
  model and optimizer are built (fresh ones, their tensors zeroed so that a restore
  that did nothing would show) until every rank's state is restored: constructing
  ``TieredCheckpointManager`` (its node survey and its gloo group) plus
  ``load_latest(state)``, barrier to barrier. Step 1 was saved once to every tier
  before. ``local``: every node's directory intact; ``peer``: node 1's directory
  deleted (its ranks get their checkpoints from node 0's replicas, sent over, verified,
  then loaded); ``persistent``: both deleted (the S3 tier). Against DCP: ``dcp.save``
  of the same state to the same filesystem as the local tier, then ``get_state_dict``
  on the fresh objects, ``dcp.load``, ``set_state_dict``. The order rotates each
  repetition; after each restore every parameter and optimizer tensor is compared with
  the saved ones. ``load_latest s`` is the manager's own figure (``restored.seconds``).
  Shown with them, untargeted: the **floor** of a restore from the local tier on this
  machine: each rank reads its rank checkpoint's data files from its node's directory
  into memory made and touched beforehand (no checksum, nothing restored, no manager).
* **stall**: the ``async_save`` call with only the local tier due (it returns once the
  state is staged), against ``shardsafe.async_save`` of the same state to a path on
  the same filesystem; background work finished before each call (so the stall is the
  staging alone), alternating, one warm-up each. Shown with it, untargeted: the copy
  floor (one ``copy_`` of every tensor the rank holds into preallocated buffers), and
  the call's median inside the save-every-step loop below (where it also waits for the
  previous step's write).
* **training while replicating**: right after an ``async_save`` returns, the training
  loop steps until every rank's local write and replication of that step are done (at
  least 3 steps; every step ends with one all-reduce agreeing whether they are), then
  steps as many times again with no save in flight (the same all-reduce each step).
  Ratio: steps per second during over steps per second after; the median of the pairs.
  The stall of the call itself is not in this window (it is in the next two rows).
* **a local save every step**: seconds per step of ``--steps`` steps of the loop with
  ``async_save`` after every step (the last saves drained by ``wait()``, inside the
  timing), against the same loop with no save; the median of the pairs' ratios.

The training loop is ``async_checkpoint.py``'s: a batch of 32 through the DDP MLP,
``pow(2).mean().backward()``, ``opt.step()``, ``zero_grad``; one thread per rank.
On this machine 4 ranks share 2 cores and their gloo traffic is all loopback: the
replication and the local write compete with training for the same cores.

Run:  python benchmarks/tiered_recovery.py [--mib 192] [--repeat 3] [--steps 8] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from torch import nn

from _common import (
    Measurement,
    Target,
    clean,
    disk,
    launch,
    machine,
    measure,
    mib,
    slowest,
    table,
    verdicts,
)
from _common import state_tensors as tensors
from _report import Section, rss_cells, rss_headers

WORLD, PER_NODE, LAYERS, BATCH = 4, 2, 16, 32
KEEP_LOCAL = 2
RECOVERY_VS_PERSISTENT = 0.25
RECOVERY_VS_DCP = 0.5
STALL_VS_ASYNC_SAVE = 1.0
TRAINING_SPEED = 0.9
SAVE_EVERY_STEP = 0.15
RECOVERIES = ("local", "peer", "persistent", "dcp", "floor")
EXPECTED_TIERS = {
    "local": ["local"] * WORLD,
    "peer": ["local"] * PER_NODE + ["peer"] * (WORLD - PER_NODE),
    "persistent": ["persistent"] * WORLD,
}
LABELS = {
    "local": "local tier (every node's directory intact)",
    "peer": "peer replica (node 1's directory deleted)",
    "persistent": "persistent tier (both directories deleted)",
    "dcp": "DCP: dcp.load, same filesystem as the local tier",
    "floor": "floor: each rank's local files read into touched memory (no check, no restore)",
}
BUCKET = "shardsafe-bench-tiers"


def width(per_rank_mib: float) -> int:
    """``d`` such that 16 d^2 weights with AdamW's two moments take ``per_rank_mib``."""
    return max(8, round(math.sqrt(per_rank_mib * 2**20 / 4 / 3 / LAYERS)))


def build(d: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The DDP MLP and its AdamW, one training step taken (the optimizer state exists)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(*[nn.Linear(d, d) for _ in range(LAYERS)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, opt)
    return model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One step of the training loop (``async_checkpoint.step``, any width)."""
    d = next(model.parameters()).shape[1]
    model(torch.randn(BATCH, d)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _local_root(per_rank_bytes: int, scratch: str) -> str:
    """``/dev/shm`` if it has room for what the local tier and the comparisons keep at
    once (with a margin), else the scratch directory."""
    # Per node, keep_local + 1 steps of 2 own checkpoints and 2 replicas; both nodes,
    # two deleted-and-refetched directories, DCP's and async_save's copies.
    needed = (2 * (KEEP_LOCAL + 1) * WORLD + WORLD + 3) * per_rank_bytes * 5 // 4
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > needed:
        return shm
    return scratch


@dataclass
class Paths:
    base: str
    node: int

    def local(self, node: int) -> str:
        return os.path.join(self.base, f"local-node{node}")

    def lost(self, node: int) -> str:
        """Where a node whose directory was deleted finds (and fetches into) nothing."""
        return os.path.join(self.base, f"lost-node{node}")


def _manager(persistent: str, local: str, **options: Any) -> Any:
    from shardsafe import TieredCheckpointManager

    kwargs: dict[str, Any] = {
        "local_every": 1,
        "persist_every": 100,
        "replicas": 1,
        "keep_local": KEEP_LOCAL,
    }
    return TieredCheckpointManager(persistent, local, **(kwargs | options))


class Recovery:
    """The four restores into one set of fresh objects (see the module docstring)."""

    def __init__(self, rank: int, d: int, paths: Paths, persistent: str, saved: Any) -> None:
        self.rank, self.paths, self.persistent = rank, paths, persistent
        self.saved = tensors(*saved)
        self.model, self.opt = build(d)
        self.state = {"model": self.model, "optimizer": self.opt}
        self.manager: Any = None
        self.seconds: dict[str, list[float]] = {}
        self.dcp_path = os.path.join(paths.base, "dcp")
        self.floor: list[tuple[str, torch.Tensor]] = []

    def save_dcp(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import save

        msd, osd = get_state_dict(model, opt)
        save({"model": msd, "optim": osd}, checkpoint_id=self.dcp_path)

    def prepare(self, tool: str) -> None:
        """Untimed: zero the fresh objects; delete the directories this restore lacks."""
        with torch.no_grad():
            for t in tensors(self.model, self.opt):
                t.zero_()
        if self.rank % PER_NODE == 0:  # one rank per node deletes its node's directory
            clean(self.paths.lost(self.paths.node))
        if tool == "floor" and not self.floor:  # the buffers made and touched once
            rank_dir = os.path.join(
                self.paths.local(self.paths.node), "step-000000001", f"rank-{self.rank:05d}"
            )
            for name in sorted(os.listdir(rank_dir)):
                if name.endswith(".safetensors"):
                    path = os.path.join(rank_dir, name)
                    self.floor.append((path, torch.zeros(os.path.getsize(path), dtype=torch.uint8)))
        dist.barrier()

    def run(self, tool: str) -> None:
        if tool == "dcp":
            self._dcp_load()
            return
        if tool == "floor":  # the least any restore from the local files does
            for path, buffer in self.floor:
                with open(path, "rb", buffering=0) as f:
                    view, done = memoryview(buffer.numpy()), 0
                    while done < len(view):
                        done += f.readinto(view[done:]) or len(view)
            return
        node = self.paths.node
        lost = tool == "persistent" or (tool == "peer" and node == 1)
        local = self.paths.lost(node) if lost else self.paths.local(node)
        self.manager = _manager(self.persistent, local)
        self.manager.load_latest(self.state)

    def _dcp_load(self) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        msd, osd = get_state_dict(self.model, self.opt)
        sd: dict[str, Any] = {"model": msd, "optim": osd}
        load(sd, checkpoint_id=self.dcp_path)
        model_sd, optim_sd = sd["model"], sd["optim"]
        set_state_dict(self.model, self.opt, model_state_dict=model_sd, optim_state_dict=optim_sd)

    def finish(self, tool: str) -> None:
        """Untimed: check what was restored, and from which tier; close the manager."""
        if tool == "floor":
            return
        restored = tensors(self.model, self.opt)
        if len(restored) != len(self.saved) or not all(
            torch.equal(a, b) for a, b in zip(restored, self.saved)
        ):
            raise AssertionError(f"rank {self.rank}: the {tool} restore differs from the save")
        if self.manager is not None:
            got = self.manager.restored
            if got is None or got.tiers != EXPECTED_TIERS[tool]:
                raise AssertionError(f"{tool}: restored {got}, expected {EXPECTED_TIERS[tool]}")
            self.seconds.setdefault(tool, []).append(got.seconds)
            self.manager.close()
            self.manager = None


def recoveries(recovery: Recovery, repeat: int) -> dict[str, Measurement]:
    """``repeat`` rounds of every restore, the order rotating each round."""
    out = {tool: Measurement() for tool in RECOVERIES}
    names = list(RECOVERIES)
    for i in range(repeat):
        for tool in names[i % len(names) :] + names[: i % len(names)]:
            recovery.prepare(tool)
            m = measure(lambda: recovery.run(tool), 1, trim=True)  # noqa: B023 (called now)
            recovery.finish(tool)
            out[tool].seconds += m.seconds
            out[tool].rss_extra += m.rss_extra
    return out


def _in_flight(manager: Any) -> bool:
    """Whether this rank's local write or a replication is still running (without
    waiting): the replicator's futures, which the public API only lets one wait for."""
    replicator = manager._replicator
    write = replicator._write
    busy = write is not None and not write.done()
    return busy or any(not f.done() for f in replicator._replications)


def _all_done(manager: Any | None) -> bool:
    """One agreed answer: every rank's write and replication done (``None``: no save)."""
    flag = torch.tensor([1 if manager is not None and _in_flight(manager) else 0])
    dist.all_reduce(flag)
    return int(flag.item()) == 0


class Loop:
    """The training loop, with and without the manager's local saves."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, manager: Any) -> None:
        self.model, self.opt, self.manager = model, opt, manager
        self.state = {"model": model, "optimizer": opt}
        self.next_step = 100
        self.stalls: list[float] = []

    def save(self) -> float:
        """``async_save`` of the next step; this rank's seconds in the call."""
        self.next_step += 1
        start = time.perf_counter()
        tiers = self.manager.async_save(self.next_step, self.state)
        seconds = time.perf_counter() - start
        assert tiers == ["local"], tiers
        return seconds

    def while_replicating(self) -> tuple[float, float, int]:
        """Seconds per step (slowest rank) while a save is written and replicated, then
        the same with none; and the steps taken each time."""
        dist.barrier()
        self.save()
        begun, taken = time.perf_counter(), 0
        while taken < 3 or not _all_done(self.manager):
            step(self.model, self.opt)
            taken += 1
        during = slowest(time.perf_counter() - begun) / taken
        self.manager.wait()
        dist.barrier()
        begun = time.perf_counter()
        for _ in range(taken):
            step(self.model, self.opt)
            _all_done(None)
        alone = slowest(time.perf_counter() - begun) / taken
        return during, alone, taken

    def per_step(self, steps: int, saving: bool) -> float:
        """Seconds per step of ``steps`` steps (slowest rank), saving after each step or
        not; the saves' tail (``wait``) is inside the timing."""
        dist.barrier()
        begun = time.perf_counter()
        for _ in range(steps):
            step(self.model, self.opt)
            if saving:
                self.stalls.append(slowest(self.save()))
        if saving:
            self.manager.wait()
        return slowest(time.perf_counter() - begun) / steps


def stalls(loop: Loop, root: str, repeat: int) -> dict[str, list[float]]:
    """The ``async_save`` call of the manager (local tier only) and of the engine, each
    with nothing in flight, alternating; one warm-up each."""
    import shardsafe

    path = os.path.join(root, "async_save")
    out: dict[str, list[float]] = {"tiers": [], "engine": [], "copy": []}
    sources = tensors(loop.model, loop.opt)
    buffers = [t.clone() for t in sources]

    def tiers() -> float:
        seconds = loop.save()
        loop.manager.wait()
        return seconds

    def engine() -> float:
        if dist.get_rank() == 0:
            clean(path)
        dist.barrier()
        start = time.perf_counter()
        handle = shardsafe.async_save(path, loop.state)
        seconds = time.perf_counter() - start
        handle.wait()
        return seconds

    def copy() -> float:
        start = time.perf_counter()
        for buffer, source in zip(buffers, sources):
            buffer.copy_(source)
        return time.perf_counter() - start

    calls: list[tuple[str, Callable[[], float]]] = [
        ("tiers", tiers),
        ("engine", engine),
        ("copy", copy),
    ]
    tiers(), engine()  # staging buffers, the budget check, the writer's group
    for i in range(repeat):
        for name, fn in calls[i % 3 :] + calls[: i % 3]:
            dist.barrier()
            out[name].append(slowest(fn()))
    dist.barrier()
    if dist.get_rank() == 0:
        clean(path)
    return out


def bench(
    rank: int,
    world: int,
    env: dict[str, str],
    persistent: str,
    root: str,
    per_rank_mib: float,
    repeat: int,
    steps: int,
) -> dict[str, Any]:
    os.environ.update(env)  # ranks come from a forkserver started before the server
    os.environ["SHARDSAFE_NODE"] = str(rank // PER_NODE)
    torch.set_num_threads(1)
    d = width(per_rank_mib)
    model, opt = build(d)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors(model, opt))
    base = ""
    if rank == 0:
        base = os.path.join(_local_root(state_bytes, root), f"shardsafe-bench-tiers-{os.getpid()}")
        clean(base)
    holder = [base]
    dist.broadcast_object_list(holder, src=0)
    paths = Paths(holder[0], rank // PER_NODE)
    state = {"model": model, "optimizer": opt}
    try:
        # The checkpoint every restore restores: step 1 in every tier, and DCP's copy.
        first = _manager(persistent, paths.local(paths.node), persist_every=1)
        first.save(1, state)
        first.wait()
        first.close()
        recovery = Recovery(rank, d, paths, persistent, (model, opt))
        recovery.save_dcp(model, opt)
        dist.barrier()
        loads = recoveries(recovery, repeat)
        load_latest = {tool: statistics.median(s) for tool, s in recovery.seconds.items()}
        del recovery
        dist.barrier()
        if rank == 0:
            for node in range(WORLD // PER_NODE):
                clean(paths.lost(node))
            clean(os.path.join(paths.base, "dcp"))
        dist.barrier()
        manager = _manager(persistent, paths.local(paths.node), persist_every=None)
        loop = Loop(model, opt, manager)
        stall = stalls(loop, paths.base, repeat)
        pairs = [loop.while_replicating() for _ in range(max(3, repeat))]
        loop.stalls.clear()
        per_step: dict[str, list[float]] = {"saving": [], "alone": []}
        for i in range(repeat):
            for saving in (True, False) if i % 2 else (False, True):
                per_step["saving" if saving else "alone"].append(loop.per_step(steps, saving))
        manager.close()
    finally:
        dist.barrier()
        if rank == 0:
            clean(paths.base)
    return {
        "loads": loads,
        "load_latest": load_latest,
        "stall": stall,
        "pairs": pairs,
        "per_step": per_step,
        "loop_stalls": list(loop.stalls),
        "info": {"width": d, "state_bytes": state_bytes, "local_root": os.path.dirname(paths.base)},
    }


@contextlib.contextmanager
def s3_server() -> Iterator[tuple[str, dict[str, str]] | None]:
    """A moto S3 server on loopback with a bucket: its URL prefix and the environment the
    ranks need; ``None`` without moto or s3fs (the persistent tier is a directory then)."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError:
        yield None
        return
    from _s3 import start_moto

    server, env = start_moto()
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield f"s3://{BUCKET}/run-{os.getpid()}", env
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


def run(per_rank_mib: float, repeat: int, steps: int, root: str) -> tuple[dict[str, Any], str]:
    """One launch of 4 ranks; what it measured, and where the persistent tier was."""
    with s3_server() as s3:
        if s3 is None:
            persistent = os.path.join(root, "tiers-persistent")
            env: dict[str, str] = {}
            where = f"a local directory ({persistent}; moto or s3fs not installed)"
            clean(persistent)
        else:
            persistent, env = s3
            where = f"S3 (moto server on 127.0.0.1, {persistent})"
        try:
            got = launch(bench, WORLD, env, persistent, root, per_rank_mib, repeat, steps)[0]
        finally:
            if s3 is None:
                clean(persistent)
    return got, where


def _ratio_median(pairs: list[tuple[float, float]]) -> float:
    return statistics.median(a / b for a, b in pairs)


def report(got: dict[str, Any], where: str, repeat: int) -> tuple[str, list[Target]]:
    info, loads = got["info"], got["loads"]
    d, per_rank = info["width"], info["state_bytes"]
    local_root = info["local_root"]
    kind = "tmpfs" if local_root == "/dev/shm" else "no room in /dev/shm, or none"
    head = (
        f"4 ranks as 2 nodes x 2 (SHARDSAFE_NODE), DDP MLP of {LAYERS} Linear({d}, {d}) + "
        f"AdamW, one step taken: {mib(per_rank)} of model + optimizer state per rank (every "
        f"rank holds all of it). Local directories: {local_root} ({kind}), one per node; "
        f"persistent tier: {where}. replicas=1, keep_local={KEEP_LOCAL}; local copies load "
        f'with verify="inline", the persistent tier with verify="first" (the defaults).'
    )
    persistent_s = loads["persistent"].median
    dcp_s = loads["dcp"].median
    rows = [["restore", "timed s", "reps", "x persistent", "x DCP", "load_latest s",
             *rss_headers(WORLD)]]  # fmt: skip
    for tool in RECOVERIES:
        m = loads[tool]
        own = got["load_latest"].get(tool)
        rows.append(
            [
                LABELS[tool],
                f"{m.median:.3f}",
                str(len(m.seconds)),
                f"{m.median / persistent_s:.2f}x",
                f"{m.median / dcp_s:.2f}x",
                f"{own:.3f}" if own is not None else "-",
                *rss_cells(m),
            ]
        )
    timed = (
        "Timed (slowest rank, barrier to barrier): TieredCheckpointManager(...) + "
        "load_latest(state) into fresh, zeroed objects; for DCP get_state_dict + dcp.load "
        "+ set_state_dict. Restored state compared with the saved state after each."
    )
    stall = got["stall"]
    tiers_stall, engine_stall = (statistics.median(stall[k]) for k in ("tiers", "engine"))
    in_loop = statistics.median(got["loop_stalls"]) if got["loop_stalls"] else float("nan")
    pairs = got["pairs"]
    during = statistics.median(p[0] for p in pairs)
    alone = statistics.median(p[1] for p in pairs)
    speed = _ratio_median([(p[1], p[0]) for p in pairs])
    per_step = got["per_step"]
    saving = statistics.median(per_step["saving"])
    plain = statistics.median(per_step["alone"])
    overhead = _ratio_median(list(zip(per_step["saving"], per_step["alone"]))) - 1
    costs = [
        ["measure", "value"],
        ["stall: manager.async_save, local tier only, nothing in flight (median s)",
         f"{tiers_stall:.3f}"],
        ["stall: shardsafe.async_save of the same state, same filesystem (median s)",
         f"{engine_stall:.3f}"],
        ["stall: manager.async_save inside the save-every-step loop (median s)",
         f"{in_loop:.3f}"],
        ["copy floor: one copy_ of the rank's whole state into preallocated buffers (s)",
         f"{statistics.median(stall['copy']):.3f}"],
        ["s per step while a save is written + replicated", f"{during:.3f}"],
        ["s per step right after, nothing in flight", f"{alone:.3f}"],
        ["steps per save's background work (median)",
         f"{statistics.median(p[2] for p in pairs):.0f}"],
        ["s per step, async_save (local) every step, tail wait included", f"{saving:.3f}"],
        ["s per step, no saves", f"{plain:.3f}"],
    ]  # fmt: skip
    text = (
        f"{head}\n\n**Recovery**, median of {repeat}. {timed}\n\n{table(rows)}\n\n"
        f"**Cost of local saves to the training loop** (the 16-layer MLP loop, batch "
        f"{BATCH}; stall and training pairs: {len(stall['tiers'])} and {len(pairs)})\n\n"
        f"{table(costs)}\n\n"
        "shardsafe.async_save stages about 1/4 of a DDP rank's state (the 4 ranks agree on "
        "who writes each replicated tensor); a local rank checkpoint holds all of it, so "
        "that each rank can restore from its own node, but the 2 ranks of a node write "
        "their data-parallel tensors once between them: each "
        "stages about 1/2 and links the other's part (docs/async-and-tiers.md)."
    )
    targets = []
    for tool in ("local", "peer"):
        s = loads[tool].median
        targets.append(
            Target(f"tiers: recovery from {tool} / from persistent (S3)", s / persistent_s,
                   RECOVERY_VS_PERSISTENT)
        )  # fmt: skip
        targets.append(
            Target(f"tiers: recovery from {tool} / DCP load", s / dcp_s, RECOVERY_VS_DCP)
        )
    if where.startswith("a local directory"):
        targets = [
            Target(t.label.replace("(S3)", "(local directory)"), t.value, t.limit, t.at_least)
            for t in targets
        ]
    targets += [
        Target(
            "tiers: local save stall / shardsafe.async_save stall",
            tiers_stall / engine_stall,
            STALL_VS_ASYNC_SAVE,
        ),
        Target("tiers: training speed while replicating", speed, TRAINING_SPEED, at_least=True),
        Target("tiers: extra time per step, local save every step", overhead, SAVE_EVERY_STEP),
    ]
    return text, targets


def section(per_rank_mib: float, repeat: int, steps: int, root: str) -> Section:
    got, where = run(per_rank_mib, repeat, steps, root)
    text, targets = report(got, where, repeat)
    return Section(text, targets, {}, got["info"])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mib", type=float, default=192, help="model + AdamW MiB per rank")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps per loop in the last row")
    parser.add_argument("--quick", action="store_true", help="1 MiB per rank, 1 repetition")
    parser.add_argument("--dir", default="/tmp/shardsafe-bench", help="scratch directory")
    args = parser.parse_args()
    if args.quick:
        args.mib, args.repeat, args.steps = 1, 1, 3
    os.makedirs(args.dir, exist_ok=True)
    print(f"machine: {machine()}\n\ndisk: {disk(args.dir)}\n")
    start = time.perf_counter()
    done = section(args.mib, args.repeat, args.steps, args.dir)
    took = time.perf_counter() - start
    print("## Tiered checkpoints: recovery by tier, and the cost of local saves\n")
    print(f"{done.text}\n\n{verdicts(done.targets)}\n\n_(took {took:.0f} s)_")


if __name__ == "__main__":
    main()
