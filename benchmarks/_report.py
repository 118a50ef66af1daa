"""Turning measurements into tables: one row per (operation, tool), medians and peaks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from _common import Measurement, Target, mib, table
from _tools import Results


@dataclass
class Section:
    """One benchmark's outcome: its text (title and table), ratios and raw results."""

    text: str
    targets: list[Target]
    results: Results
    info: dict[str, Any] = field(default_factory=dict)


def rss_headers(world: int) -> list[str]:
    other = "rank 1" if world == 2 else f"ranks 1-{world - 1}"
    return ["rank 0 peak extra RSS", f"{other} peak extra RSS"]


def rss_cells(m: Measurement) -> list[str]:
    """Rank 0's peak extra RSS, and every other rank's (``a / b / c MiB``)."""
    others = [m.peak_rss(r) / 2**20 for r in range(1, len(m.rss_extra[0]))]
    return [mib(m.peak_rss(0)), " / ".join(f"{v:,.0f}" for v in others) + " MiB"]


def results_table(
    results: Results,
    labels: Mapping[str, str],
    world: int,
    floor: str | None = "floor",
    load_labels: Mapping[str, str] | None = None,
) -> str:
    """Saves first, then loads; ``x write floor`` is each save's median over the floor's.
    ``load_labels`` names the load rows where they differ from ``labels``."""
    floor_s = results[floor]["save"].median if floor and floor in results else None
    rows = [["op", "tool", "median s", "reps", "x write floor", "on disk", *rss_headers(world)]]
    for op in ("save", "load"):
        for tool, ms in results.items():
            if op not in ms:
                continue
            m = ms[op]
            ratio = f"{m.median / floor_s:.2f}x" if floor_s and op == "save" else "-"
            names = (load_labels or {}) if op == "load" else {}
            label = names.get(tool) or labels.get(tool, tool)
            reps = str(len(m.seconds))
            size = mib(m.file_bytes) if m.file_bytes else "-"
            rows.append([op, label, f"{m.median:.3f}", reps, ratio, size, *rss_cells(m)])
    return table(rows)


def ratio(results: Results, num: str, den: str, op: str = "save") -> float:
    return results[num][op].median / results[den][op].median
