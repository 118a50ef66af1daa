"""Every shardsafe benchmark in one invocation, on the same machine, with the targets.

Sections: ZeRO save/load against torch's consolidation, Lightning and the floors;
peak memory of a consolidated save; Lightning's save_checkpoint and resume with its own
DDP strategy against ShardsafeDDPStrategy; plain DDP and FSDP2 against
torch.distributed.checkpoint; pipeline x data parallel and expert parallel state on 4
ranks against torch.distributed.checkpoint, with the bytes each rank wrote; the stall of
``ShardsafeDDPStrategy(async_save=True)``, and Accelerate's ``save_state``/``load_state``
against ``shardsafe.accelerate``'s (each when its package is installed); tiered
checkpoints on 2 simulated nodes x 2 ranks (recovery from the local, peer and persistent
tiers against DCP, and what local saves cost the training loop); ZeRO save time against
state size at 2 and 4 ranks; coordination (time and store requests) of a tiny state at 2
to 64 ranks; a summary table and every target, MET or MISSED. Prints markdown, then
writes the same text into ``--results`` (default ``docs/performance.md``, the one home of
the figures) between its ``<!-- run_all: begin -->`` and ``<!-- run_all: end -->`` lines,
keeping the hand-written rest of the page, and the save-time plot to ``--plot``. A full
run takes 12-22 minutes on 2 cores (11.9 in the last one recorded in the page);
``--quick`` is a tiny smoke run (about a minute) that writes its results under ``--dir``
(``performance.md``, created with just the markers and the report) unless
``--results``/``--plot`` are given.

Run:  python benchmarks/run_all.py [--quick] [--dir /tmp/shardsafe-bench]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _coordination as coordination
import _dcp_compare as dcp_compare
import _results_page
import accelerate_state
import async_checkpoint
import lightning_async
import lightning_strategy
import manifest_scale
import parallel_layouts
import scaling
import tiered_recovery
import validation_scale
import zero_checkpoint as zero
from _common import Target, clean, disk, machine, mib, table, verdicts
from _report import Section
from _timed_notes import NOTES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass(frozen=True)
class Config:
    zero_layers: int = 16  # ~200 MB: the main ZeRO comparison, 2 ranks
    rss_layers: int = 48  # ~600 MB: the memory target
    dcp_layers: int = 16
    scale_layers: tuple[int, ...] = (4, 16, 64)  # ~50, 200, 800 MB
    worlds: tuple[int, ...] = (2, 4)
    repeat: int = 5
    scale_repeat: int = 3
    big_repeat: int = 2  # for torch's path on states over 400 MiB
    manifest_sizes: tuple[tuple[int, int], ...] = ((100, 1000),)  # 100,000 chunk records
    manifest_versions: tuple[int, ...] = (1, 2)
    async_layers: int = 16
    async_quick: bool = False  # every tool for the first setup only (async_checkpoint.FEWEST)
    coordination_worlds: tuple[int, ...] = (2, 8, 16, 32, 64)  # tiny state: the agreement
    coordination_repeat: int = 3
    parallel_mib: float = 192  # model + AdamW per rank: PP x DP and EP, 4 ranks
    tiers_mib: float = 192  # model + AdamW per rank: tiered checkpoints, 2 nodes x 2 ranks
    tiers_repeat: int = 3
    tiers_steps: int = 8  # training steps per loop, with and without a local save each
    validation_repeat: int = 3
    integration_layers: int = 16  # 192 MiB per rank: Lightning async, Accelerate
    integration_repeat: int = 7


QUICK = Config(
    2, 2, 2, (1, 2), (2,), 1, 1, 1, ((10, 100),), manifest_versions=(2,),
    async_layers=2, async_quick=True, coordination_worlds=(2, 4), coordination_repeat=1,
    parallel_mib=1, tiers_mib=1, tiers_repeat=1, tiers_steps=3, validation_repeat=1,
    integration_layers=2, integration_repeat=1,
)  # fmt: skip


class Report:
    """Prints each block as it is ready and keeps it for the results file."""

    def __init__(self) -> None:
        self.blocks: list[str] = []
        self.targets: list[Target] = []
        self.summary: list[list[str]] = []

    def add(self, text: str) -> None:
        print(text + "\n", flush=True)
        self.blocks.append(text)

    def section(self, title: str, run: Callable[[], Section]) -> Section:
        start = time.perf_counter()
        done = run()
        self.targets += [t for t in done.targets if t.limit is not None]
        took = f"_(section took {time.perf_counter() - start:.0f} s)_"
        self.add(f"## {title}\n\n{done.text}\n\n{verdicts(done.targets)}\n\n{took}")
        return done

    def summarize(self, setup: str, done: Section, labels: dict[str, str]) -> None:
        """One summary row per tool: save and load medians, rank 0's peak RSS in a save."""
        for tool, ms in done.results.items():
            if tool == "comm" or "save" not in ms:  # or a row of loads only (verify=inline)
                continue
            save, load = ms["save"], ms.get("load")
            self.summary.append(
                [
                    setup,
                    labels[tool],
                    f"{save.median:.2f}",
                    f"{load.median:.2f}" if load else "-",
                    mib(save.peak_rss(0)),
                ]
            )


def summary_table(rows: list[list[str]]) -> str:
    head = ["setup", "tool", "save s", "load s", "rank 0 peak extra RSS in save"]
    return table([head, *rows])


def size(info: dict[str, int], world: int) -> str:
    return f"{mib(info['model_bytes'] + info['opt_bytes'])}, {world} ranks"


def run_all(cfg: Config, root: str, report: Report) -> list[scaling.Point]:
    lightning = zero.have_lightning()
    main = report.section(
        f"ZeRO (user-wrapped ZeroRedundancyOptimizer + Adam) under DDP, {cfg.zero_layers} "
        "layers, 2 ranks",
        lambda: zero.section(cfg.zero_layers, 2, cfg.repeat, root, lightning),
    )
    report.summarize(f"ZeRO + Adam, {size(main.info, 2)}", main, zero.LABELS)
    memory = report.section(
        f"Peak memory of a consolidated ZeRO save, {cfg.rss_layers} layers",
        lambda: zero.memory_section(cfg.rss_layers, root, lightning),
    )
    report.summarize(f"ZeRO + Adam, {size(memory.info, 2)}, 1 save", memory, zero.LABELS)
    if lightning:
        strategy = report.section(
            "Lightning: Trainer.save_checkpoint and resume, its DDP strategy against "
            f"ShardsafeDDPStrategy, ZeRO + Adam, {cfg.zero_layers} layers, 2 ranks",
            lambda: lightning_strategy.section(cfg.zero_layers, 2, cfg.repeat, root),
        )
        setup = f"Lightning ZeRO + Adam, {cfg.zero_layers} layers (load: fit to 1st step)"
        report.summarize(setup, strategy, lightning_strategy.LABELS)
    for wrap, name in (("ddp", "Plain DDP + Adam"), ("fsdp", "FSDP2 + AdamW")):
        done = report.section(
            f"{name}: shardsafe against torch.distributed.checkpoint, 2 ranks",
            functools.partial(dcp_compare.section, wrap, cfg.dcp_layers, 2, cfg.repeat, root),
        )
        report.summarize(f"{name}, {size(done.info, 2)}", done, dcp_compare.LABELS)
    for setup in parallel_layouts.SETUPS:
        name = parallel_layouts.NAMES[setup]
        done = report.section(
            f"{name}: shardsafe against torch.distributed.checkpoint, "
            f"{cfg.parallel_mib:g} MiB per rank",
            functools.partial(parallel_layouts.section, setup, cfg.parallel_mib, cfg.repeat, root),
        )
        per_rank = mib(done.info["model_bytes"] + done.info["opt_bytes"])
        report.summarize(f"{name}, {per_rank} per rank", done, parallel_layouts.LABELS)
    report.section(
        "Asynchronous save: stall, training while writing, time to durable, 2 ranks",
        lambda: async_checkpoint.section(
            async_checkpoint.SETUPS, cfg.async_layers, 2, cfg.repeat, root, cfg.async_quick
        ),
    )
    if lightning:
        report.section(
            "Lightning: ShardsafeDDPStrategy(async_save=True), the stall of a save in a fit",
            lambda: lightning_async.section(
                cfg.integration_layers, 2, cfg.integration_repeat, root
            ),
        )
    if have_accelerate():
        report.section(
            "Accelerate: save_state and load_state, Accelerate's own against shardsafe's, FSDP2",
            lambda: accelerate_state.section(
                cfg.integration_layers * 2, 2, cfg.integration_repeat, root, "fsdp2"
            ),
        )
        report.section(
            "Accelerate: save_state and load_state, Accelerate's own against shardsafe's, DDP",
            lambda: accelerate_state.section(
                cfg.integration_layers, 2, cfg.integration_repeat, root, "ddp"
            ),
        )
    report.section(
        "Tiered checkpoints: recovery by tier and the cost of local saves, 2 nodes x 2 ranks",
        lambda: tiered_recovery.section(cfg.tiers_mib, cfg.tiers_repeat, cfg.tiers_steps, root),
    )
    known = {(cfg.zero_layers, 2): scaling.Point(cfg.zero_layers, 2, main.info, main.results)}
    points: list[scaling.Point] = []

    def scale() -> Section:
        points.extend(
            scaling.run(cfg.scale_layers, cfg.worlds, cfg.scale_repeat, cfg.big_repeat, root, known)
        )
        text = scaling.times_table(points) + "\n\n" + scaling.ratios_table(points)
        return Section(text, [], {})

    report.section("ZeRO save time against state size and ranks", scale)
    report.section(
        "Coordination against ranks: tiny DDP + Adam, shardsafe and DCP",
        lambda: coordination.section(cfg.coordination_worlds, cfg.coordination_repeat, root),
    )
    report.section(
        "Parsing and validating a large manifest",
        lambda: manifest_scale.section(cfg.manifest_sizes, cfg.manifest_versions),
    )
    report.section(
        "Hostile-input validation at scale",
        lambda: validation_scale.section(cfg.validation_repeat),
    )
    return points


def have_accelerate() -> bool:
    """Whether Hugging Face Accelerate is installed (the ``accelerate`` extra)."""
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


def shown(path: str) -> str:
    """A path inside the repository relative to its root, as the docs page links it."""
    inside = os.path.abspath(path).startswith(ROOT + os.sep)
    return os.path.relpath(path, ROOT) if inside else path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repetition")
    parser.add_argument("--dir", default="/tmp/shardsafe-bench", help="scratch directory")
    parser.add_argument("--repeat", type=int, help="repetitions up to 200 MB (default 5)")
    parser.add_argument(
        "--results",
        help="markdown page whose run_all markers receive the report (default docs/performance.md)",
    )
    parser.add_argument("--plot", help="PNG plot (default benchmarks/save_time_vs_size.png)")
    args = parser.parse_args()
    cfg = QUICK if args.quick else Config()
    if args.repeat:
        cfg = replace(cfg, repeat=args.repeat, scale_repeat=args.repeat)
    results = args.results or (
        os.path.join(args.dir, "performance.md")
        if args.quick
        else os.path.join(ROOT, "docs", "performance.md")
    )
    plot = args.plot or os.path.join(args.dir if args.quick else HERE, "save_time_vs_size.png")
    _results_page.check(results)
    root = os.path.join(args.dir, "scratch")
    clean(root)
    os.makedirs(root)
    report = Report()
    command = " ".join(["python benchmarks/run_all.py", *sys.argv[1:]])
    report.add(
        "# shardsafe benchmarks\n\n"
        f"- machine: {machine()}\n- disk: {disk(root)}\n- command: `{command}`\n"
        f"- started: {datetime.datetime.now().isoformat(timespec='seconds')}\n- settings: {cfg}"
    )
    start = time.perf_counter()
    points = run_all(cfg, root, report)
    from _plot import plot_save_times

    plot_save_times(points, plot)
    took = (time.perf_counter() - start) / 60
    report.add(f"## Summary\n\n{summary_table(report.summary)}")
    report.add(
        f"## Targets\n\n{verdicts(report.targets)}\n\n"
        f"plot: `{shown(plot)}`; total time {took:.1f} min"
    )
    report.add(NOTES)
    _results_page.write(results, "\n\n".join(report.blocks))
    print(f"wrote {results} (between its run_all markers) and {plot}")
    clean(root)


if __name__ == "__main__":
    main()
