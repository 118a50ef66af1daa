"""shardsafe against torch.distributed.checkpoint (DCP) for plain DDP and for FSDP2.

Setup: N ranks, an MLP of ``layers`` 1024x1024 Linear layers, wrapped either in DDP with
a plain Adam (every rank holds everything), or FSDP2 (each layer and the root
``fully_shard``-ed) with AdamW (each rank holds 1/N of every tensor as a DTensor); one
step taken. 16 layers is about 67 MB of weights + 134 MB of optimizer state.

Rows; each tool runs in its own fresh processes on a state built from the same seed:
  floor       one buffered write of the whole state's bytes + fsync, by rank 0
  dcp         get_state_dict -> dcp.save; load: get_state_dict -> dcp.load ->
              set_state_dict into a fresh model + optimizer that took a step
  shardsafe   save(layout="sharded"|"consolidated"); load into a fresh model + optimizer
              that took a step, with verify="first" (the default: every byte checked,
              then read again into place) and then verify="inline" (one read)

Targets, in each verify mode: load time at most 0.8x DCP's; peak extra RSS per rank
during a load at most the largest tensor plus the 64 MiB of read buffers (68 MiB here).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import Target, mib, print_standalone, standalone_parser
from _report import Section, results_table
from _tools import Results, Tool, dcp_tool, run_fresh, run_tools, shardsafe_tool, state_nbytes
from _tools import write_floor as floor_tool

WRAPS = ("ddp", "fsdp")
LABELS = {
    "floor": "floor: one write + fsync",
    "dcp": "torch.distributed.checkpoint",
    "sharded": "shardsafe sharded",
    "consolidated": "shardsafe consolidated",
}
LOAD_LABELS = {
    "sharded": "shardsafe sharded, verify=first",
    "consolidated": "shardsafe consolidated, verify=first",
    "sharded inline": "shardsafe sharded, verify=inline",
    "consolidated inline": "shardsafe consolidated, verify=inline",
}
INLINE = "inline"
"""The verify mode measured after the default ("first") one."""
BUFFER_BYTES = 64 << 20
"""``LoadOptions.buffer_bytes``'s default: the load memory target allows it on top of the
largest tensor."""
GROUPS: tuple[tuple[str, ...], ...] = (("floor",), ("dcp",), ("sharded",), ("consolidated",))
Pair = tuple[nn.Module, torch.optim.Optimizer]


def build(wrap: str, layers: int, seed: int) -> Pair:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)])
    if wrap == "fsdp":
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    ddp = DDP(model)
    return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-4)


def stepped(wrap: str, layers: int, seed: int) -> Pair:
    model, opt = build(wrap, layers, seed)
    model(torch.randn(8, 1024)).sum().backward()
    opt.step()
    return model, opt


class Case:
    def __init__(self, wrap: str, layers: int, rank: int, root: str) -> None:
        self.wrap, self.layers, self.rank, self.root = wrap, layers, rank, root
        self.info: dict[str, Any] = {}

    @cached_property
    def state(self) -> Pair:
        model, opt = stepped(self.wrap, self.layers, 0)
        sd = model.state_dict()
        model_bytes = state_nbytes(sd)  # DTensors count in full
        largest = max(v.numel() * v.element_size() for v in sd.values())
        self.info.update(
            model_bytes=model_bytes, opt_bytes=2 * model_bytes + 4 * len(sd), largest=largest
        )
        return model, opt

    def fresh(self) -> Pair:
        return stepped(self.wrap, self.layers, 1)  # DCP loads into existing optimizer state

    def fresh_state(self) -> dict[str, Any]:
        model, opt = self.fresh()
        return {"model": model, "optimizer": opt}


def make_tool(name: str, case: Case) -> Tool:
    model, opt = case.state
    if name == "floor":
        total = case.info["model_bytes"] + case.info["opt_bytes"]
        return floor_tool(total, case.rank, case.root)
    if name == "dcp":
        return dcp_tool(model, opt, case.fresh, case.root)
    state = {"model": model, "optimizer": opt}
    return shardsafe_tool(name, state, case.fresh_state, case.root, (INLINE,))


def bench(
    rank: int,
    world: int,
    tools: Sequence[str],
    wrap: str,
    layers: int,
    repeat: int,
    root: str,
    loads: bool,
) -> dict[str, Any]:
    case = Case(wrap, layers, rank, root)
    results = run_tools(tools, lambda n: make_tool(n, case), repeat, loads)
    return {"results": results, "info": case.info}


def run(
    wrap: str, layers: int, world: int, repeat: int, root: str, loads: bool = True
) -> tuple[Results, dict[str, Any]]:
    results, info = run_fresh(bench, world, GROUPS, wrap, layers, repeat, root, loads)
    for layout in ("sharded", "consolidated"):  # the inline loads, as rows of their own
        inline = results.get(layout, {}).pop(f"load {INLINE}", None)
        if inline is not None:
            results[f"{layout} {INLINE}"] = {"load": inline}
    return results, info


def title(wrap: str, layers: int, world: int, info: dict[str, Any]) -> str:
    name = {"ddp": "DDP + Adam", "fsdp": "FSDP2 (fully_shard) + AdamW"}[wrap]
    total = info["model_bytes"] + info["opt_bytes"]
    return (
        f"{name} checkpoint, {layers} layers of 1024x1024, {world} ranks: model "
        f"{mib(info['model_bytes'])}, optimizer {mib(info['opt_bytes'])}, total {mib(total)}"
    )


def ratios(wrap: str, r: Results, info: dict[str, Any]) -> list[Target]:
    """shardsafe sharded over DCP: save (a target for FSDP2), and load in each verify mode
    (<= 0.8); then each shardsafe load's peak extra RSS on its worst rank, in MiB, against
    the largest tensor plus the read buffers."""
    name = {"ddp": "DDP", "fsdp": "FSDP2"}[wrap]
    save = r["sharded"]["save"].median / r["dcp"]["save"].median
    limit = 0.8 if wrap == "fsdp" else None
    out = [Target(f"{name} shardsafe sharded save / dcp save", save, limit)]
    dcp_load = r["dcp"]["load"].median
    modes = (("sharded", "first"), (f"sharded {INLINE}", INLINE))
    for tool, mode in modes:
        if "load" in r.get(tool, {}):
            ratio = r[tool]["load"].median / dcp_load
            label = f"{name} shardsafe sharded load (verify={mode}) / dcp load"
            out.append(Target(label, ratio, 0.8))
    rss_limit = round((info["largest"] + BUFFER_BYTES) / 2**20, 2)
    for tool in ("sharded", "consolidated", f"sharded {INLINE}", f"consolidated {INLINE}"):
        if "load" not in r.get(tool, {}):
            continue
        m = r[tool]["load"]
        worst = max(m.peak_rss(rank) for rank in range(len(m.rss_extra[0]))) / 2**20
        label = (
            f"{name} {LOAD_LABELS[tool]} load, peak extra RSS per rank in MiB "
            "(largest tensor + 64 MiB)"
        )
        out.append(Target(label, worst, rss_limit))
    return out


def section(wrap: str, layers: int, world: int, repeat: int, root: str) -> Section:
    """Run one comparison: its title + table, ratios and results."""
    r, info = run(wrap, layers, world, repeat, root)
    table = results_table(r, LABELS, world, load_labels=LOAD_LABELS)
    text = f"{title(wrap, layers, world, info)}\n\n{table}"
    return Section(text, ratios(wrap, r, info), r, info)


def cli(wrap: str, doc: str | None) -> None:
    """The command line of ddp_checkpoint.py and fsdp_checkpoint.py."""
    args = standalone_parser(doc, repeat=3).parse_args()
    print_standalone(
        args.dir, lambda: section(wrap, args.layers, args.ranks, args.repeat, args.dir)
    )
