"""The save-time plot: median save seconds against state size, log-log, a panel per rank count."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter


class Point(Protocol):
    """One measured size (``scaling.Point``): what the plot reads of it."""

    world: int
    results: Any

    @property
    def total(self) -> int: ...


STYLES = {
    "torch": ("torch: consolidate_state_dict + torch.save", "tab:red", "o"),
    "consolidated": ("shardsafe consolidated", "tab:blue", "s"),
    "sharded": ("shardsafe sharded", "tab:green", "^"),
    "floor": ("floor: one write + fsync", "black", "x"),
    "comm": ("floor: cross-rank bytes, one raw send", "gray", "+"),
}


def plot_save_times(points: Sequence[Point], path: str) -> None:
    worlds = sorted({p.world for p in points})
    fig, axes = plt.subplots(
        1, len(worlds), figsize=(6 * len(worlds), 4.5), squeeze=False, sharey=True
    )
    for ax, world in zip(axes[0], worlds):
        mine = sorted((p for p in points if p.world == world), key=lambda p: p.total)
        for tool, (label, color, marker) in STYLES.items():
            xs = [p.total / 1e6 for p in mine]
            ys = [p.results[tool]["save"].median for p in mine]
            ls = ":" if tool in ("floor", "comm") else "-"
            ax.plot(xs, ys, ls, color=color, marker=marker, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([p.total / 1e6 for p in mine])
        ax.set_xticklabels([f"{p.total / 1e6:.0f}" for p in mine])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("state size (MB: model + Adam state)")
        ax.set_ylabel("save time, median (s)")
        ax.set_title(f"ZeRO (Adam) save, {world} ranks")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
