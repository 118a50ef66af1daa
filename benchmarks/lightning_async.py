"""The training stall of ShardsafeDDPStrategy(async_save=True), against one copy of the state.

Setup: N ranks (2), the Lightning benchmark's module (``--layers`` Linear(1024, 1024) under
DDP, ``ZeroRedundancyOptimizer(Adam)`` from ``configure_optimizers``: 16 layers is 64 MiB
of weights per rank and a 64 MiB share of Adam's state), fitted with
``ShardsafeDDPStrategy(async_save=True)``. A callback calls ``trainer.save_checkpoint`` at
the end of each of ``--repeat`` training steps, after the previous save has committed,
and times the call on the slowest rank (barrier to return): the stall training sees.

Floor: ``copy_`` of everything the rank holds (its module's tensors and its ZeRO shard of
Adam's state) into preallocated buffers, the least an asynchronous save must do before
the tensors may change. Target (issue 30): the stall at most 2x the floor.

Run:  python benchmarks/lightning_async.py [--layers 16] [--repeat 5] [--dir D]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Target, clean, launch, print_standalone, slowest, standalone_parser
from _report import Section


def bench(rank: int, world: int, layers: int, repeat: int, root: str) -> dict[str, Any]:
    import pytorch_lightning as pl

    from _lightning import ZeroMLP, data, make_trainer
    from shardsafe.lightning import ShardsafeDDPStrategy

    stalls: list[float] = []

    class TimedSaves(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if len(stalls) >= repeat:
                return
            path = f"{root}/lightning-async-{len(stalls)}.ckpt"
            trainer.strategy._finish_in_flight()  # each save timed from a quiet start
            dist.barrier()
            begun = time.perf_counter()
            trainer.save_checkpoint(path)
            stalls.append(slowest(time.perf_counter() - begun))

    strategy = ShardsafeDDPStrategy(async_save=True)
    trainer = make_trainer(world, root, strategy, max_steps=repeat + 1, callbacks=[TimedSaves()])
    module = ZeroMLP(layers)
    trainer.fit(module, data(world))
    optimizer = trainer.optimizers[0]
    held = [t for t in module.state_dict().values()]
    held += [v for s in optimizer.optim.state.values() for v in s.values() if torch.is_tensor(v)]
    buffers = [torch.empty_like(t) for t in held]
    floors = []
    for _ in range(repeat):
        dist.barrier()
        begun = time.perf_counter()
        torch._foreach_copy_(buffers, held)
        floors.append(slowest(time.perf_counter() - begun))
    dist.barrier()
    if rank == 0:
        for i in range(repeat):
            clean(f"{root}/lightning-async-{i}.ckpt")
    held_mib = sum(t.numel() * t.element_size() for t in held) / 2**20
    return {"stalls": stalls, "floors": floors, "held_mib": held_mib}


def section(layers: int, ranks: int, repeat: int, root: str) -> Section:
    """The stall table and its target (for this script and ``run_all.py``)."""
    got = launch(bench, ranks, layers, repeat, root)[0]
    stall, floor = statistics.median(got["stalls"]), statistics.median(got["floors"])
    text = (
        f"ShardsafeDDPStrategy(async_save=True), ZeRO Adam, {ranks} ranks, "
        f"{got['held_mib']:.0f} MiB held per rank, medians of {repeat}\n\n"
        "| measure | seconds |\n|---|---|\n"
        f"| trainer.save_checkpoint inside fit: stall | {stall:.3f} |\n"
        f"| floor: one copy_ of what the rank holds | {floor:.3f} |\n\n"
        f"stalls: {[round(s, 3) for s in got['stalls']]}"
    )
    target = Target("lightning async: stall / one copy of the state", stall / floor, 2.0)
    return Section(text, [target], {})


def main() -> None:
    args = standalone_parser(__doc__, repeat=5).parse_args()
    print_standalone(args.dir, lambda: section(args.layers, args.ranks, args.repeat, args.dir))


if __name__ == "__main__":
    main()
