"""Scaling: ZeRO save time against state size, and coordination against rank count.

For each (layers, ranks) point: the write floor, the comm floor, torch's
consolidate_state_dict + torch.save, and shardsafe sharded and consolidated, each tool
in fresh processes (zero_checkpoint.py says what each row times). 4, 16 and 64 layers
are about 50, 200 and 800 MB of model + Adam state.

Then, for each of ``--coordination-ranks`` (2 8 16 32 64; none: skip), a tiny DDP +
Adam state saved and loaded by shardsafe and by DCP in the same processes, with the
store requests of a shardsafe save and load (``_coordination.py``).

Run:  python benchmarks/scaling.py [--layers 4 16 64] [--ranks 2 4] [--repeat 3]
      [--big-repeat 1] [--plot save_time_vs_size.png]
      [--coordination-ranks 2 8 16 32 64] [--coordination-repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _coordination as coordination
import zero_checkpoint as zero
from _common import Target, machine, mib, table, verdicts
from _report import rss_cells
from _tools import Results

TOOLS = ("floor", "comm", "torch", "sharded", "consolidated")
GROUPS = (("floor", "comm"), ("torch",), ("sharded",), ("consolidated",))
BIG_BYTES = 400 << 20  # above this, torch's path gets ``big_repeat`` repetitions


@dataclass
class Point:
    layers: int
    world: int
    info: dict[str, Any]
    results: Results

    @property
    def total(self) -> int:
        return int(self.info["model_bytes"] + self.info["opt_bytes"])


def state_bytes(layers: int) -> int:
    """Model + Adam state of ``layers`` 1024x1024 layers: weights, biases, 2 moments, step."""
    return layers * ((1024 * 1024 + 1024) * 4 * 3 + 8)


def run(
    layers: Sequence[int],
    worlds: Sequence[int],
    repeat: int,
    big_repeat: int,
    root: str,
    known: Mapping[tuple[int, int], Point] | None = None,
) -> list[Point]:
    """Measure every point not in ``known`` (e.g. the main ZeRO run), smallest first.
    States over BIG_BYTES give torch's path (a minute a save) only ``big_repeat`` tries."""
    points = []
    for world in worlds:
        for n in layers:
            if known and (n, world) in known:
                points.append(known[(n, world)])
                continue
            results: Results = {}
            info: dict[str, Any] = {}
            for group in GROUPS:
                slow = "torch" in group and state_bytes(n) > BIG_BYTES
                r, i = zero.run(n, world, big_repeat if slow else repeat, root, [group], False)
                results.update(r)
                info.update(i)
            points.append(Point(n, world, info, results))
    return points


def times_table(points: Sequence[Point]) -> str:
    head = ["state", "ranks", "tool", "median s", "reps", "x write floor"]
    rows = [[*head, "rank 0 peak extra RSS", "other ranks' peak extra RSS"]]
    for p in points:
        floor = p.results["floor"]["save"].median
        for tool in TOOLS:
            m = p.results[tool]["save"]
            cells = [mib(p.total), str(p.world), zero.LABELS[tool], f"{m.median:.3f}"]
            cells += [str(len(m.seconds)), f"{m.median / floor:.2f}x", *rss_cells(m)]
            rows.append(cells)
    return table(rows)


def point_targets(p: Point) -> list[Target]:
    return zero.targets(p.results)


def ratios_table(points: Sequence[Point]) -> str:
    """The ZeRO save targets at every point, MET or MISSED in each cell."""
    header = [f"{t.label.removeprefix('ZeRO ')} ({t.rule})" for t in point_targets(points[0])]
    rows = [["state", "ranks", *header]]
    for p in points:
        cells = [f"{t.value:.2f} {'MET' if t.met else 'MISSED'}" for t in point_targets(p)]
        rows.append([mib(p.total), str(p.world), *cells])
    return table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--big-repeat", type=int, default=1)
    parser.add_argument("--dir", default="/tmp/shardsafe-bench")
    parser.add_argument("--plot", default="", help="write the save-time plot here (PNG)")
    parser.add_argument("--coordination-ranks", type=int, nargs="*", default=[2, 8, 16, 32, 64])
    parser.add_argument("--coordination-repeat", type=int, default=3)
    parser.add_argument("--skip-sizes", action="store_true", help="only the coordination part")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    print(f"machine: {machine()}\n")
    if args.coordination_ranks:
        done = coordination.section(args.coordination_ranks, args.coordination_repeat, args.dir)
        print(f"{done.text}\n\n{verdicts(done.targets)}\n")
    if args.skip_sizes:
        return
    points = run(args.layers, args.ranks, args.repeat, args.big_repeat, args.dir)
    print(times_table(points) + "\n")
    print(ratios_table(points))
    if args.plot:
        from _plot import plot_save_times

        plot_save_times(points, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
