"""Lightning's save_checkpoint and resume: its own DDP strategy against ShardsafeDDPStrategy.

Setup (the original bug report): N ranks (2), a LightningModule holding an MLP of
``--layers`` 1024x1024 Linear layers that returns ``ZeroRedundancyOptimizer(Adam)`` from
``configure_optimizers``, under DDP, fitted one step so that Adam's state exists. 16
layers is about 64 MiB of weights + 128 MiB of optimizer state.

Rows; each tool runs in its own fresh processes (Lightning joins the benchmark's ranks):
  Lightning        Trainer(strategy="ddp"): save_checkpoint consolidates the ZeRO state on
                   rank 0 (pickles broadcast to every rank) and torch.saves one file; an
                   fsync of it on rank 0 is added, as every other row fsyncs
  shardsafe        Trainer(strategy=ShardsafeDDPStrategy(layout=...)): save_checkpoint
                   writes a shardsafe directory from every rank (sharded or consolidated)
  resume rows      a fresh Trainer and module, fit(ckpt_path=<that checkpoint>) timed from
                   the call to the start of the first training step, on the slowest rank

Targets: shardsafe's save at least 12x faster than Lightning's, rank 0's peak extra RSS
during it at most 0.1x Lightning's, and its resume no slower than Lightning's.

Run:  python benchmarks/lightning_strategy.py [--layers 16] [--repeat 3] [--dir D]
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    Measurement,
    PeakRSS,
    Target,
    clean,
    fsync_file,
    mib,
    print_standalone,
    standalone_parser,
)
from _report import Section, results_table
from _tools import Results, Tool, run_fresh, run_tool, scratch_path

LABELS = {
    "lightning": "Lightning 2.x DDP: Trainer.save_checkpoint",
    "sharded": "ShardsafeDDPStrategy sharded: Trainer.save_checkpoint",
    "consolidated": "ShardsafeDDPStrategy consolidated: Trainer.save_checkpoint",
}
LOAD_LABELS = {
    "lightning": "Lightning 2.x DDP: fit(ckpt_path=...) to the first step",
    "sharded": "ShardsafeDDPStrategy sharded: fit(ckpt_path=...) to the first step",
    "consolidated": "ShardsafeDDPStrategy consolidated: fit(ckpt_path=...) to the first step",
}
GROUPS: tuple[tuple[str, ...], ...] = (("lightning",), ("sharded",), ("consolidated",))


def strategy(tool: str) -> Any:
    if tool == "lightning":
        return "ddp"
    from shardsafe.lightning import ShardsafeDDPStrategy

    return ShardsafeDDPStrategy(layout=tool)


def save_tool(tool: str, layers: int, rank: int, world: int, root: str) -> tuple[Tool, Any]:
    """The timed save, and the fitted trainer it saves from."""
    from _lightning import fitted_trainer

    trainer = fitted_trainer(layers, world, root, strategy(tool))
    path = scratch_path(root, f"{tool}.ckpt")

    def save() -> None:
        trainer.save_checkpoint(path)
        if tool == "lightning" and rank == 0:
            fsync_file(path)

    return Tool(save, lambda: clean(path), path=path), trainer


def resume_seconds(tool: str, layers: int, world: int, root: str, path: str) -> tuple[float, int]:
    """Seconds from ``fit(ckpt_path=path)`` to the first training step, and the extra RSS."""
    import pytorch_lightning as pl

    from _lightning import ZeroMLP, data, make_trainer

    first_step: list[float] = []

    class FirstStep(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            first_step.append(time.perf_counter())

    trainer = make_trainer(world, root, strategy(tool), max_steps=2, callbacks=[FirstStep()])
    module, loader = ZeroMLP(layers, seed=1), data(world)
    dist.barrier()
    with PeakRSS() as rss:
        start = time.perf_counter()
        trainer.fit(module, loader, ckpt_path=path)
    return first_step[0] - start, rss.extra


def measure_resume(tool: str, layers: int, world: int, root: str, repeat: int) -> Measurement:
    """Resume from the checkpoint at ``root/<tool>-resume.ckpt`` ``repeat`` times; the
    slowest rank's time each time."""
    path = f"{root}/{tool}-resume.ckpt"
    m = Measurement()
    for _ in range(repeat):
        seconds, extra = resume_seconds(tool, layers, world, root, path)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, (seconds, extra))
        m.seconds.append(max(s for s, _ in every))
        m.rss_extra.append([e for _, e in every])
    return m


def bench(
    rank: int, world: int, tools: Sequence[str], layers: int, repeat: int, root: str
) -> dict[str, Any]:
    results: Results = {}
    for tool in tools:
        timed, trainer = save_tool(tool, layers, rank, world, root)
        results[tool] = run_tool(timed, repeat, loads=False)
        resume_from = scratch_path(root, f"{tool}-resume.ckpt")
        trainer.save_checkpoint(resume_from)
        del trainer, timed
        results[tool]["load"] = measure_resume(tool, layers, world, root, repeat)
        dist.barrier()
        if rank == 0:
            clean(resume_from)
        dist.barrier()
    return {"results": results, "info": {}}


def run(layers: int, world: int, repeat: int, root: str) -> Results:
    results, _ = run_fresh(bench, world, GROUPS, layers, repeat, root)
    return results


def targets(r: Results) -> list[Target]:
    lightning = r["lightning"]
    found = []
    for layout in ("sharded", "consolidated"):
        ours = r[layout]
        found += [
            Target(
                f"ShardsafeDDPStrategy {layout} save, x faster than Lightning's",
                lightning["save"].median / ours["save"].median,
                12.0,
                at_least=True,
            ),
            Target(
                f"ShardsafeDDPStrategy {layout} save, rank 0 peak extra RSS / Lightning's",
                ours["save"].peak_rss(0) / max(lightning["save"].peak_rss(0), 1),
                0.1,
            ),
            Target(
                f"ShardsafeDDPStrategy {layout} resume (fit to the first step) / Lightning's",
                ours["load"].median / lightning["load"].median,
                1.0,
            ),
        ]
    return found


def section(layers: int, world: int, repeat: int, root: str) -> Section:
    r = run(layers, world, repeat, root)
    total = mib(layers * (1024 * 1024 + 1024) * 4 * 3)
    title = (
        f"Lightning with a user-wrapped ZeRO Adam under DDP, {layers} layers of 1024x1024 "
        f"(~{total} of model + optimizer state), {world} ranks"
    )
    table = results_table(r, LABELS, world, floor=None, load_labels=LOAD_LABELS)
    return Section(f"{title}\n\n{table}", targets(r), r)


def main() -> None:
    args = standalone_parser(__doc__, repeat=3).parse_args()
    print_standalone(args.dir, lambda: section(args.layers, args.ranks, args.repeat, args.dir))


if __name__ == "__main__":
    main()
