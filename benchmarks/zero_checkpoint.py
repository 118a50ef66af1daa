"""ZeRO checkpoint save/load: shardsafe against torch's consolidation, Lightning and the floor.

Setup (the sharded-optimizers issue): N ranks (2 by default), an MLP of ``--layers``
1024x1024 Linear layers under DDP, ``ZeroRedundancyOptimizer(Adam)`` wrapped by the user,
one step taken so Adam's state exists. 16 layers is about 67 MB of weights + 134 MB of
optimizer state.

Rows; each tool runs in its own fresh processes on a state built from the same seed:
  floor        one buffered write of the same bytes (model + optimizer) + fsync, by rank 0
  comm floor   the optimizer bytes each rank > 0 owns, sent once to rank 0 as one raw tensor
  torch        consolidate_state_dict(to=0) + torch.save({model, optimizer}) + fsync on rank 0
               (then drops the consolidated copy, as a careful user does); load: every rank
               torch.load(weights_only=True) + load_state_dict into a fresh model + ZeRO
  Lightning    Trainer.save_checkpoint (see _lightning.py for exactly what is timed)
  shardsafe    save(layout="sharded") and save(layout="consolidated"); load into a fresh
               model + ZeRO optimizer

Run:  python benchmarks/zero_checkpoint.py [--layers 16] [--ranks 2] [--repeat 3] [--dir D]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Target, clean, machine, mib, table, verdicts
from _report import Section, results_table, rss_cells, rss_headers
from _tools import (
    Results,
    Tool,
    run_fresh,
    run_tools,
    scratch_path,
    shardsafe_tool,
    write_floor,
)

LABELS = {
    "floor": "floor: one write + fsync",
    "comm": "floor: cross-rank bytes, one raw send",
    "torch": "torch: consolidate_state_dict + torch.save",
    "lightning": "Lightning: Trainer.save_checkpoint",
    "sharded": "shardsafe sharded",
    "consolidated": "shardsafe consolidated",
}
LOAD_LABELS = {
    "torch": "torch: torch.load + load_state_dict",
    "lightning": "Lightning: strategy.load_checkpoint + load_*_state_dict",
}
GROUPS: tuple[tuple[str, ...], ...] = (
    ("floor", "comm"),
    ("torch",),
    ("lightning",),
    ("sharded",),
    ("consolidated",),
)
ZeroState = tuple[nn.Module, DDP, ZeroRedundancyOptimizer]


def have_lightning() -> bool:
    return importlib.util.find_spec("pytorch_lightning") is not None


def build(layers: int, seed: int) -> ZeroState:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)])
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    return model, ddp, opt


def trained(layers: int) -> ZeroState:
    model, ddp, opt = build(layers, 0)
    torch.manual_seed(1)
    ddp(torch.randn(8, 1024)).sum().backward()
    opt.step()
    return model, ddp, opt


class Case:
    """One rank's view of the benchmark; the trained state is built on first use."""

    def __init__(self, layers: int, rank: int, world: int, root: str) -> None:
        self.layers, self.rank, self.world, self.root = layers, rank, world, root
        self.info: dict[str, Any] = {}

    @cached_property
    def state(self) -> ZeroState:
        model, ddp, opt = trained(self.layers)
        owned = [0] * self.world
        for rank, groups in enumerate(opt._partition_parameters()):
            for group in groups:
                owned[rank] += sum(2 * p.numel() * 4 + 4 for p in group["params"])
        self.info.update(
            model_bytes=sum(t.numel() * t.element_size() for t in model.state_dict().values()),
            opt_bytes=sum(owned),
            owned_bytes=owned,
        )
        return model, ddp, opt

    def fresh(self) -> dict[str, Any]:
        _, ddp, opt = build(self.layers, 1)
        return {"model": ddp, "optimizer": opt}


def comm_floor(case: Case) -> Tool:
    owned = case.info["owned_bytes"]
    mine = range(1, case.world) if case.rank == 0 else [case.rank]
    # torch.ones, not empty: pages touched before the clock starts
    bufs = {r: torch.ones(owned[r], dtype=torch.uint8) for r in mine}

    def save() -> None:
        if case.rank == 0:
            for work in [dist.irecv(bufs[r], r) for r in range(1, case.world)]:
                assert work is not None
                work.wait()
        else:
            dist.send(bufs[case.rank], 0)

    return Tool(save)


def torch_tool(case: Case) -> Tool:
    model, _, opt = case.state
    path = scratch_path(case.root, "torch.pt")
    target: dict[str, Any] = {}

    def save() -> None:
        opt.consolidate_state_dict(to=0)
        if case.rank == 0:
            with open(path, "wb") as f:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            opt._all_state_dicts = []  # what a careful user does to get the memory back

    def prepare() -> None:
        save()
        target.update(case.fresh())

    def load() -> None:
        sd = torch.load(path, map_location="cpu", weights_only=True)
        target["model"].module.load_state_dict(sd["model"])
        target["optimizer"].load_state_dict(sd["optimizer"])

    return Tool(save, lambda: clean(path), load, prepare, lambda: clean(path), path)


def make_tool(name: str, case: Case) -> Tool:
    if name == "lightning":
        from _lightning import lightning_tool

        return lightning_tool(case.layers, case.rank, case.world, case.root)
    _, ddp, opt = case.state
    if name == "floor":
        return write_floor(case.info["model_bytes"] + case.info["opt_bytes"], case.rank, case.root)
    if name == "comm":
        return comm_floor(case)
    if name == "torch":
        return torch_tool(case)
    state = {"model": ddp, "optimizer": opt}
    return shardsafe_tool(name, state, case.fresh, case.root)


def bench(
    rank: int, world: int, tools: Sequence[str], layers: int, repeat: int, root: str, loads: bool
) -> dict[str, Any]:
    case = Case(layers, rank, world, root)
    return {
        "results": run_tools(tools, lambda n: make_tool(n, case), repeat, loads),
        "info": case.info,
    }


def groups(lightning: bool) -> list[tuple[str, ...]]:
    return [g for g in GROUPS if lightning or g != ("lightning",)]


def run(
    layers: int,
    world: int,
    repeat: int,
    root: str,
    tool_groups: Sequence[Sequence[str]],
    loads: bool = True,
) -> tuple[Results, dict[str, Any]]:
    return run_fresh(bench, world, tool_groups, layers, repeat, root, loads)


def title(layers: int, world: int, info: dict[str, Any]) -> str:
    total = info["model_bytes"] + info["opt_bytes"]
    return (
        f"ZeRO checkpoint, {layers} layers of 1024x1024, {world} ranks: model "
        f"{mib(info['model_bytes'])}, optimizer {mib(info['opt_bytes'])}, total {mib(total)}"
    )


def targets(r: Results) -> list[Target]:
    cons, sharded = r["consolidated"]["save"].median, r["sharded"]["save"].median
    floor = r["floor"]["save"].median
    return [
        Target(
            "ZeRO consolidated save, x faster than torch",
            r["torch"]["save"].median / cons,
            12.0,
            at_least=True,
        ),
        Target("ZeRO consolidated save / write floor", cons / floor, 2.0),
        Target("ZeRO sharded save / write floor", sharded / floor, 1.2),
    ]


def section(layers: int, world: int, repeat: int, root: str, lightning: bool) -> Section:
    """Every row (saves and loads), each tool in fresh processes."""
    r, info = run(layers, world, repeat, root, groups(lightning))
    lines = [title(layers, world, info), "", results_table(r, LABELS, world, "floor", LOAD_LABELS)]
    found = targets(r)
    if lightning:
        ratio = r["lightning"]["save"].median / r["consolidated"]["save"].median
        found.append(Target("Lightning save / shardsafe consolidated save", ratio, None))
    else:
        lines.append("\n(Lightning rows skipped: pytorch-lightning is not installed)")
    return Section("\n".join(lines), found, r, info)


def memory_section(layers: int, root: str, lightning: bool) -> Section:
    """Peak extra RSS during one consolidated save, each tool in fresh processes."""
    tools = ["torch", "consolidated"] + (["lightning"] if lightning else [])
    r, info = run(layers, 2, 1, root, [(t,) for t in tools], loads=False)
    rows = [["consolidated save", "seconds", *rss_headers(2)]]
    for t in tools:
        m = r[t]["save"]
        rows.append([LABELS[t], f"{m.median:.2f}", *rss_cells(m)])
    total = mib(info["model_bytes"] + info["opt_bytes"])
    text = f"Peak extra RSS during a save, {layers} layers ({total}), 2 ranks, fresh processes"
    value = r["consolidated"]["save"].peak_rss(0) / max(r["torch"]["save"].peak_rss(0), 1)
    target = Target(
        f"ZeRO consolidated save ({layers} layers), rank 0 peak extra RSS / torch's", value, 0.3
    )
    return Section(f"{text}\n\n{table(rows)}", [target], r, info)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--rss-layers",
        type=int,
        default=48,
        help="model size for the memory comparison (0 to skip)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/shardsafe-bench")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    lightning = have_lightning()
    print(f"machine: {machine()}\n")
    main_run = section(args.layers, args.ranks, args.repeat, args.dir, lightning)
    print(main_run.text)
    print(verdicts(main_run.targets))
    if args.rss_layers:
        memory = memory_section(args.rss_layers, args.dir, lightning)
        print("\n" + memory.text)
        print(verdicts(memory.targets))


if __name__ == "__main__":
    main()
