"""Asynchronous saves: how long training stands still, how fast it goes meanwhile, and
when the checkpoint is durable. shardsafe against DCP's ``async_save`` (its default
stager, and ``DefaultStager`` with async staging) and torch-checkpointing.

Setups (2 ranks, 16 layers of 1024x1024, one step taken, as in the other benchmarks):
DDP + Adam, FSDP2 + AdamW, and a user-wrapped ZeRO Adam under DDP (which neither DCP nor
torch-checkpointing can save: only shardsafe's rows). Each tool runs in fresh processes;
one warm-up save first (buffers are allocated once, by every tool), then ``repeat``
measured saves.

* **stall**: from the call until the caller may change its tensors: the call itself for
  shardsafe (it returns once staged) and DCP's default; plus the wait for staging for
  DCP's async stager (``staging_completion``) and torch-checkpointing (``manager.lock()``,
  which an optimizer step must take). The slowest rank counts.
* **copy floor**: one ``copy_`` of every tensor the rank's state holds into preallocated
  buffers: what staging cannot go below.
* **time to durable**: from the call until the checkpoint is committed (``wait()``, the
  future's result), against shardsafe's blocking ``save`` of the same state. Each
  measured save is paired with a blocking save right after it, in the same processes,
  and the median of the pairs' ratios counts: this disk's speed moves by a fifth between
  launches, more than the difference measured.
* **training while writing**: steps per second of the training loop while a save is
  being written (the loop steps from the call until the write is done, at least three
  steps), over steps per second of the same loop, as many steps, run right after with no
  save; median of five such pairs.

CPU only here, so "pinned" options are off (they need CUDA): DCP's ``DefaultStager`` is
used with async staging (and shared memory off, as a thread writes), torch-checkpointing
with its CPU configuration (no pinned memory, shared memory on: a process writes).

Run:  python benchmarks/async_checkpoint.py [--repeat 5] [--setups ddp,fsdp,zero]
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist

from _common import Target, clean, launch, print_standalone, slowest, standalone_parser, table
from _report import Section
from _tools import scratch_path

SETUPS = ("ddp", "fsdp", "zero")
TOOLS = {
    "ddp": ("copy", "raw", "sync", "async", "dcp", "dcp-stager", "tc"),
    "fsdp": ("copy", "raw", "sync", "async", "dcp", "dcp-stager", "tc"),
    "zero": ("copy", "raw", "sync", "async"),
}
LABELS = {
    "copy": "floor: one copy into preallocated buffers",
    "raw": "floor: that copy, then a thread os.write()s and fsyncs it",
    "sync": "shardsafe save (blocking)",
    "async": "shardsafe async_save",
    "dcp": "DCP async_save, default stager",
    "dcp-stager": "DCP async_save, DefaultStager (async staging)",
    "tc": "torch-checkpointing (async)",
}


def build(setup: str, layers: int) -> tuple[Any, Any]:
    """The model (wrapped) and optimizer, one step taken."""
    from torch import nn

    torch.manual_seed(0)
    model: Any = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)])
    if setup == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        if setup == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4
            )
        else:
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    step(model, opt)
    return model, opt


def step(model: Any, opt: Any) -> None:
    """One training step (the loop whose speed a background write must not take)."""
    model(torch.randn(32, 1024)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _tensors(model: Any, opt: Any) -> list[torch.Tensor]:
    local = getattr(opt, "optim", opt)
    out = [getattr(v, "_local_tensor", v) for v in model.state_dict().values()]
    for state in local.state.values():
        out += [getattr(v, "_local_tensor", v) for v in state.values() if torch.is_tensor(v)]
    return out


class Saver:
    """One tool: ``start()`` begins a save, returns when tensors may change; ``finish()``
    returns when it is durable; ``cleanup()`` removes it (rank 0)."""

    def __init__(self, tool: str, model: Any, opt: Any, root: str) -> None:
        self.tool, self.model, self.opt, self.root = tool, model, opt, root
        self.path = scratch_path(root, tool)
        self.pending: Any = None
        self.n = 0
        if tool in ("copy", "raw"):
            self.sources = _tensors(model, opt)
            self.buffers = [t.detach().clone() for t in self.sources]
        if tool == "tc":
            self.manager = _tc_manager()
        if tool in ("dcp", "dcp-stager") and not _DCP_GROUP:
            _DCP_GROUP.append(dist.new_group(backend="gloo"))  # made on every rank, now

    def _state(self) -> dict[str, Any]:
        if self.tool in ("sync", "async"):
            return {"model": self.model, "optimizer": self.opt}
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def start(self) -> None:
        import shardsafe

        self.n += 1
        target = f"{self.path}/{self.n}"
        if self.tool in ("copy", "raw"):
            for buf, src in zip(self.buffers, self.sources):
                buf.copy_(src)
            if self.tool == "raw":
                self.pending = _RAW.submit(_raw_write, f"{target}.{dist.get_rank()}", self.buffers)
        elif self.tool == "sync":
            shardsafe.save(target, self._state())
        elif self.tool == "async":
            self.pending = shardsafe.async_save(target, self._state())
        elif self.tool in ("dcp", "dcp-stager"):
            self.pending = _dcp_start(self.tool, self._state(), target)
        else:
            self.pending = self.manager.save(target, self._state())
            with self.manager.lock():  # what an optimizer step waits for
                pass

    def done(self) -> bool:
        """Whether the write started by ``start()`` has finished (without waiting)."""
        if self.pending is None:
            return True
        if self.tool == "dcp-stager":
            return bool(self.pending.upload_completion.done())
        return bool(self.pending.done())

    def finish(self) -> None:
        if self.pending is None:
            return
        if self.tool == "async":
            self.pending.wait()
        elif self.tool == "dcp-stager":
            self.pending.upload_completion.result()
        else:
            self.pending.result()
        self.pending = None
        if self.tool == "raw":
            dist.barrier()  # every rank's file is written before rank 0 removes them

    def cleanup(self) -> None:
        if dist.get_rank() == 0:
            clean(self.path)


_DCP_GROUP: list[Any] = []
_RAW = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raw-writer")


def _raw_write(path: str, buffers: list[torch.Tensor]) -> None:
    """What any in-process writer must do at least: the bytes into one file, fsynced,
    from a thread at the lowest CPU priority (as shardsafe's writer runs)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for buffer in buffers:
            view = memoryview(buffer.numpy()).cast("B")
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _dcp_start(tool: str, state: dict[str, Any], path: str) -> Any:
    """DCP's documented asynchronous use: its background thread runs collectives, so it
    gets a gloo group of its own (on the training's group they would interleave with
    the training's own and hang)."""
    import torch.distributed.checkpoint as dcp

    if not _DCP_GROUP:
        _DCP_GROUP.append(dist.new_group(backend="gloo"))
    group = _DCP_GROUP[0]
    if tool == "dcp":
        return dcp.async_save(state, checkpoint_id=path, process_group=group)
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=False,  # CUDA only
        use_shared_memory=False,  # the writer is a thread
        use_async_staging=True,
        use_non_blocking_copy=False,  # CUDA only
    )
    response = dcp.async_save(
        state, checkpoint_id=path, process_group=group, async_stager=DefaultStager(options)
    )
    response.staging_completion.result()  # the caller may change its tensors only now
    return response


def _tc_manager() -> Any:
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import AsyncCheckpointSaverConfig
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    staging = CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False)
    # O_DIRECT (its default) fails with EINVAL on this machine's overlay filesystem.
    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    config = CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(staging_config=staging), storage_config=storage
    )
    return CheckpointManager(config)


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - start)


def bench(rank: int, world: int, tool: str, setup: str, layers: int, repeat: int, root: str) -> Any:
    torch.set_num_threads(1)
    model, opt = build(setup, layers)
    saver = Saver(tool, model, opt, root)
    saver.start()  # warm-up: staging buffers, process pools, file layout
    saver.finish()
    blocking = Saver("sync", model, opt, root) if tool != "copy" else None
    stalls, durables, ratios = [], [], []
    for _ in range(repeat):
        dist.barrier()
        begun = time.perf_counter()
        saver.start()
        stalls.append(slowest(time.perf_counter() - begun))
        saver.finish()
        durables.append(slowest(time.perf_counter() - begun))
        saver.cleanup()
        if blocking is not None:  # the same state, saved blocking, right after
            ratios.append(durables[-1] / _timed(blocking.start))
            blocking.cleanup()
    out = {"stall": statistics.median(stalls), "durable": statistics.median(durables)}
    if ratios:
        out["durable_ratio"] = statistics.median(ratios)
    if tool in ("raw", "async", "dcp", "dcp-stager", "tc"):
        out["training"] = _training_ratio(saver, model, opt, trials=min(5, repeat))
    return out


def _training_ratio(saver: Saver, model: Any, opt: Any, *, trials: int) -> float:
    """Steps per second while a save is written, over steps per second with none.

    ``trials`` pairs of trials (five in a full run, one in ``--quick``'s smoke run),
    median of their ratios. In each pair the loop first steps from
    the call until the write is done (at least three steps), then steps as many times
    again with no save; both loops are the same code (each step ends with the agreed
    "is every rank's write done" all-reduce), run back to back, so the pair sees the
    same machine and the ratio measures the save, not the noise between two moments.
    """
    ratios = []
    for _ in range(trials):
        during, steps = _stepped(saver, model, opt, save=True)
        alone, _ = _stepped(saver, model, opt, save=False, steps=steps)
        ratios.append(alone / during)
    return statistics.median(ratios)


def _stepped(
    saver: Saver, model: Any, opt: Any, *, save: bool, steps: int = 0
) -> tuple[float, int]:
    """Mean seconds per step of the slowest rank, and the steps taken: until the save
    started at the call is done (``save``), else exactly ``steps``."""
    dist.barrier()
    begun, taken = time.perf_counter(), 0
    if save:
        saver.start()
    while (taken < 3 or not _all_done(saver)) if save else taken < steps:
        step(model, opt)
        if not save:
            _all_done(saver)  # the same per-step agreement as the loop with a save
        taken += 1
    seconds = slowest(time.perf_counter() - begun) / taken
    if save:
        saver.finish()
        saver.cleanup()
    return seconds, taken


def _all_done(saver: Saver) -> bool:
    """Whether every rank's write is done (one agreed answer, so all ranks step alike)."""
    flag = torch.tensor([0 if saver.done() else 1])
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def have_torch_checkpointing() -> bool:
    """torch-checkpointing is a peer, not a dependency: its rows need the bench extra."""
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError:
        return False
    return True


FEWEST = ("copy", "async")
"""The tools a setup's table and targets need: ``--quick`` runs only these for every setup
but the first (a smoke run checks that each setup runs, not each peer again)."""


def run(
    setup: str, layers: int, world: int, repeat: int, root: str, every_tool: bool = True
) -> dict[str, Any]:
    """Every tool of ``setup`` (those installed; :data:`FEWEST` unless ``every_tool``),
    each in fresh processes."""
    tools = [t for t in TOOLS[setup] if t != "tc" or have_torch_checkpointing()]
    tools = tools if every_tool else [t for t in tools if t in FEWEST]
    return {tool: launch(bench, world, tool, setup, layers, repeat, root)[0] for tool in tools}


def section(
    setups: tuple[str, ...],
    layers: int,
    world: int,
    repeat: int,
    root: str,
    quick: bool = False,
) -> Section:
    blocks, targets = [], []
    for setup in setups:
        got = run(setup, layers, world, repeat, root, every_tool=not quick or setup == setups[0])
        rows = [["tool", "stall s", "x copy floor", "time to durable s", "x blocking save",
                 "training while writing"]]  # fmt: skip
        for tool, m in got.items():
            rows.append(
                [
                    LABELS[tool],
                    f"{m['stall']:.3f}",
                    f"{m['stall'] / got['copy']['stall']:.2f}x",
                    f"{m['durable']:.3f}" if tool != "copy" else "-",
                    f"{m['durable_ratio']:.2f}x" if tool != "copy" else "-",
                    f"{m['training']:.0%}" if "training" in m else "-",
                ]
            )
        name = {"ddp": "DDP + Adam", "fsdp": "FSDP2 + AdamW", "zero": "ZeRO (Adam) under DDP"}
        blocks.append(f"**{name[setup]}**, {world} ranks, {layers} layers\n\n{table(rows)}")
        targets += _targets(setup, got)
    return Section("\n\n".join(blocks), targets, {})


def _targets(setup: str, got: dict[str, Any]) -> list[Target]:
    a = got["async"]
    copy = got["copy"]["stall"]
    out = [Target(f"{setup}: async stall / copy floor", a["stall"] / copy, 2.0)]
    if "dcp" in got:
        ratio = a["stall"] / got["dcp"]["stall"]
        out.append(Target(f"{setup}: async stall / DCP async stall", ratio, 0.5))
    # The plain writer's figure is printed with the target: on a machine whose cores the
    # training fills, it is what the page cache and writeback alone cost.
    raw = f" (plain writer thread: {got['raw']['training']:.2f})" if "raw" in got else ""
    name = f"{setup}: training speed while writing{raw}"
    out.append(Target(name, a["training"], 0.9, at_least=True))
    name = f"{setup}: async time to durable / blocking save"
    out.append(Target(name, a["durable_ratio"], 1.3))
    return out


def main() -> None:
    parser = standalone_parser(__doc__, repeat=5)
    parser.add_argument("--setups", default=",".join(SETUPS))
    args = parser.parse_args()
    setups = tuple(args.setups.split(","))
    print_standalone(
        args.dir, lambda: section(setups, args.layers, args.ranks, args.repeat, args.dir)
    )


if __name__ == "__main__":
    main()
