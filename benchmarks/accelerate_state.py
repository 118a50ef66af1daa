"""Hugging Face Accelerate's save_state/load_state against shardsafe.accelerate's.

Setup: N ranks (2) joined by Accelerate (``Accelerator(cpu=True)`` over the gloo group
the launcher made), an MLP of ``--layers`` Linear(1024, 1024) and AdamW, prepared by
Accelerate and stepped once so that Adam's state exists. ``--layout ddp``: 16 layers is
64 MiB of weights + 128 MiB of optimizer state, 192 MiB per rank (every rank holds all of
it). ``--layout fsdp2`` (the issue's layout): Accelerate's
``FullyShardedDataParallelPlugin(fsdp_version=2)`` shards 32 layers, 192 MiB per rank;
Accelerate's save_state then writes through torch.distributed.checkpoint (its default
``SHARDED_STATE_DICT``). Accelerate enables that plugin only on accelerator devices; on
the CPU its shared state is switched to FSDP as it would be on GPUs, and its own
``prepare`` does the sharding.

Rows, each timed on the slowest rank from a barrier to the call's return on every rank,
each right after a training step; shardsafe's rows first, then Accelerate's (interleaved,
an async save right after Accelerate's load_state, which swaps the optimizer's state for
freshly unpickled tensors, stalled every other time for 0.11-0.16 s instead of 0.05 s):
  Accelerate          accelerator.save_state(dir): the main process writes
                      model.safetensors and a pickled optimizer.bin (the others wait in a
                      barrier), each process its RNG pickle; an fsync of every file on
                      rank 0 is added, as shardsafe fsyncs what it writes
  shardsafe           save_state(accelerator, dir): every rank writes a part, manifest last
  shardsafe async     save_state(accelerator, dir, async_save=True): the stall (until the
                      call returns and training may go on); time to durable is wait()
  loads               accelerator.load_state(dir) against load_state(accelerator, dir)

Targets (issue 30): shardsafe's save at most 0.5x Accelerate's time; the async stall at
most 0.2x Accelerate's save (which stalls for all of it).

Run:  python benchmarks/accelerate_state.py [--layout fsdp2|ddp] [--layers N] [--repeat 7] [--dir D]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Target, clean, launch, print_standalone, slowest, standalone_parser
from _report import Section


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    begun = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - begun)


def _fsync_tree(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _accelerator(layout: str) -> Any:
    """Accelerate's accelerator for ``layout`` (see the docstring for FSDP2 on the CPU)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if layout == "ddp":
        return Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        shared["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    return accelerator


def bench(
    rank: int, world: int, layers: int, repeat: int, root: str, layout: str
) -> dict[str, list[float]]:
    warnings.simplefilter("ignore")
    from shardsafe.accelerate import load_state, save_state

    accelerator = _accelerator(layout)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(8, 1024)).sum().backward()
    optimizer.step()
    out: dict[str, list[float]] = {k: [] for k in ("acc", "ours", "stall", "durable")}
    out.update({"acc load": [], "ours load": []})

    def fresh(name: str) -> str:
        path = f"{root}/{name}"
        if rank == 0:
            clean(path)
        dist.barrier()
        return path

    def step() -> None:  # every measurement follows a training step, as in training
        model(torch.randn(8, 1024)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for i in range(repeat):  # shardsafe's rows first, then Accelerate's (see the docstring)
        path = fresh(f"shardsafe-async-{i}")
        step()
        dist.barrier()
        begun = time.perf_counter()
        handle = save_state(accelerator, path, async_save=True)
        out["stall"].append(slowest(time.perf_counter() - begun))
        handle.wait()
        out["durable"].append(slowest(time.perf_counter() - begun))
        fresh(f"shardsafe-async-{i}")
        path = fresh("shardsafe")
        step()
        out["ours"].append(_timed(lambda path=path: save_state(accelerator, path)))
        step()
        out["ours load"].append(_timed(lambda path=path: load_state(accelerator, path)))
    for _ in range(repeat):
        path = fresh("accelerate")

        def accelerate_save(path: str = path) -> None:
            accelerator.save_state(path)
            if rank == 0:
                _fsync_tree(path)

        step()
        out["acc"].append(_timed(accelerate_save))
        step()
        out["acc load"].append(_timed(lambda path=path: accelerator.load_state(path)))
    for name in ("accelerate", "shardsafe", "shardsafe-async"):
        fresh(name)
    accelerator.free_memory()
    return out


def section(layers: int, ranks: int, repeat: int, root: str, layout: str = "ddp") -> Section:
    """The table and the targets (for this script and ``run_all.py``)."""
    got = launch(bench, ranks, layers, repeat, root, layout)[0]
    med = {k: statistics.median(v) for k, v in got.items()}
    state_mib = layers * (1024 * 1024 + 1024) * 4 * 3 / 2**20
    if layout == "fsdp2":
        state_mib /= ranks
    what = "DDP + AdamW" if layout == "ddp" else "FSDP2 (Accelerate's plugin) + AdamW"
    rows = [
        ("Accelerate: accelerator.save_state (+ fsync)", med["acc"]),
        ("shardsafe.accelerate.save_state", med["ours"]),
        ("shardsafe.accelerate.save_state(async_save=True): stall", med["stall"]),
        ("shardsafe.accelerate.save_state(async_save=True): to durable", med["durable"]),
        ("Accelerate: accelerator.load_state", med["acc load"]),
        ("shardsafe.accelerate.load_state", med["ours load"]),
    ]
    text = "\n".join(
        [
            f"Accelerate save_state/load_state against shardsafe.accelerate, {ranks} ranks, "
            f"{what}, {state_mib:.0f} MiB of state per rank, medians of {repeat} "
            "(slowest rank, barrier to return)",
            "",
            "| row | seconds | x Accelerate's save |",
            "|---|---|---|",
            *(f"| {label} | {s:.3f} | {s / med['acc']:.2f} |" for label, s in rows),
        ]
    )
    targets = [
        Target(
            f"accelerate {layout}: shardsafe save / Accelerate save_state",
            med["ours"] / med["acc"],
            0.5,
        ),
        Target(
            f"accelerate {layout}: shardsafe async stall / Accelerate save_state",
            med["stall"] / med["acc"],
            0.2,
        ),
        Target(
            f"accelerate {layout}: shardsafe load / Accelerate load_state",
            med["ours load"] / med["acc load"],
            None,
        ),
    ]
    return Section(text, targets, {})


def main() -> None:
    parser = standalone_parser(__doc__, repeat=7, layers=None)  # default: 192 MiB per rank
    parser.add_argument("--layout", choices=("ddp", "fsdp2"), default="fsdp2")
    args = parser.parse_args()
    layers = args.layers or (16 if args.layout == "ddp" else 16 * args.ranks)
    print_standalone(
        args.dir, lambda: section(layers, args.ranks, args.repeat, args.dir, args.layout)
    )


if __name__ == "__main__":
    main()
