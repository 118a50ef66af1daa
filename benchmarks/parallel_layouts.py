"""Pipeline x data parallel and expert parallel state: shardsafe against
torch.distributed.checkpoint (DCP), and how evenly each spreads the writing.

Setups, 4 ranks, about ``--mib`` MiB (192 by default) of model + AdamW state per rank,
built without training (one AdamW step on zero gradients creates the state, then the
moments are filled with random values; every replica of a tensor gets the same values):

* **PP x DP, 2 x 2**: 32 Linear(d, d) layers named as torchtitan names them
  (``layers.<i>``), split into 2 pipeline stages of 16; rank r holds stage r // 2, so
  each stage is replicated on 2 ranks and must be written once, by one of them.
* **EP on 4**: 16 experts (``experts.<e>.w1``/``w2``, Linear(d, 2d) and Linear(2d, d)
  without bias), 4 plain per-rank modules named by their global index on each rank, and a
  small router (Linear(d, 16)) replicated on every rank.

``d`` is 1024 at 192 MiB per rank (smaller for a smoke run). Rows, all in the same
processes, alternating (the order rotates each repetition), the median of ``repeat``:

  floor       every rank writes 1/N of the distinct bytes in one buffered write + fsync,
              in parallel: what N writers cannot go below on this disk
  dcp         get_state_dict -> dcp.save of the rank's plain state dicts (DCP's planner
              deduplicates the replicated keys too); load: get_state_dict on a fresh
              model + AdamW -> dcp.load -> set_state_dict
  shardsafe   save(layout="sharded"); load into a fresh model + AdamW, with verify="first"
              (the default: every byte checked, then read again into place) and then
              verify="inline" (one read)

Bytes per writer: for shardsafe, from its manifest (``shardsafe inspect``'s ``writers``:
the data file each rank wrote); for DCP, the size of each rank's ``.distcp`` file.

Targets, per setup: shardsafe save, and load in each verify mode, at most 0.8x DCP's
time; no shardsafe writer above 1.25x the mean bytes per writer.

Run:  python benchmarks/parallel_layouts.py [--mib 192] [--repeat 3] [--setups pp-dp,ep]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import zlib
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from torch import nn

from _common import (
    Measurement,
    Target,
    clean,
    disk_bytes,
    fsync_write,
    launch,
    machine,
    measure,
    mib,
    table,
    verdicts,
)
from _report import Section, results_table
from _tools import Results, Tool, dcp_tool, scratch_path, shardsafe_tool, state_nbytes

SETUPS = ("pp-dp", "ep")
WORLD = 4
LABELS = {
    "floor": "floor: each rank writes 1/N of the bytes + fsync",
    "dcp": "torch.distributed.checkpoint",
    "sharded": "shardsafe sharded",
}
LOAD_LABELS = {
    "sharded": "shardsafe sharded, verify=first",
    "sharded inline": "shardsafe sharded, verify=inline",
}
INLINE = "inline"
"""The verify mode measured besides the default ("first": every byte checked before any
is put in place, then read again)."""
NAMES = {"pp-dp": "PP x DP (2 x 2) on 4 ranks", "ep": "EP on 4 ranks"}
TIME_RATIO = 0.8
BALANCE = 1.25
STAGES, LAYERS = 2, 32  # PP x DP: 16 layers per stage
EXPERTS_PER_RANK = 4
Pair = tuple[nn.Module, torch.optim.Optimizer]


def width(per_rank_mib: float) -> int:
    """``d`` such that a rank's 16 d^2 parameters with AdamW's two moments (3 copies)
    take ``per_rank_mib``: 1024 at 192 MiB."""
    return max(8, round(math.sqrt(per_rank_mib * 2**20 / 4 / 3 / 16)))


class Stage(nn.Module):
    """Pipeline stage ``stage``: layers ``layers.<i>`` of the whole model's 32."""

    def __init__(self, d: int, stage: int) -> None:
        super().__init__()
        per = LAYERS // STAGES
        layers = range(stage * per, (stage + 1) * per)
        self.layers = nn.ModuleDict({str(i): nn.Linear(d, d) for i in layers})


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, 2 * d, bias=False)
        self.w2 = nn.Linear(2 * d, d, bias=False)


class ExpertShard(nn.Module):
    """A replicated router and this rank's experts, named by their global index."""

    def __init__(self, d: int, rank: int, world: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, EXPERTS_PER_RANK * world, bias=False)
        first = rank * EXPERTS_PER_RANK
        self.experts = nn.ModuleDict(
            {str(e): Expert(d) for e in range(first, first + EXPERTS_PER_RANK)}
        )


def _fill(name: str, t: torch.Tensor, seed: int, positive: bool = False) -> None:
    """Values that depend on the tensor's name and the seed only: replicas agree."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    with torch.no_grad():
        if positive:
            t.uniform_(0.0, 1e-4, generator=g)
        else:
            t.normal_(0.0, 0.02, generator=g)


def build(setup: str, per_rank_mib: float, rank: int, world: int, seed: int) -> Pair:
    """This rank's module and AdamW, state initialized (no training)."""
    d = width(per_rank_mib)
    model: nn.Module = (
        Stage(d, rank * STAGES // world) if setup == "pp-dp" else ExpertShard(d, rank, world)
    )
    for name, p in model.named_parameters():
        _fill(name, p, seed)
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    opt.step()  # zero gradients: creates exp_avg, exp_avg_sq and step
    opt.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        state = opt.state[p]
        _fill(f"{name}/exp_avg", state["exp_avg"], seed)
        _fill(f"{name}/exp_avg_sq", state["exp_avg_sq"], seed, positive=True)
    return model, opt


class Case:
    def __init__(self, setup: str, per_rank_mib: float, rank: int, world: int, root: str):
        self.setup, self.mib, self.rank, self.world = setup, per_rank_mib, rank, world
        self.root = root
        self.state = build(setup, per_rank_mib, rank, world, 0)
        model, opt = self.state
        opt_bytes = sum(state_nbytes(s) for s in opt.state.values())
        self.info: dict[str, Any] = {
            "width": width(per_rank_mib),
            "model_bytes": state_nbytes(model.state_dict()),
            "opt_bytes": opt_bytes,
        }

    def fresh(self) -> Pair:
        return build(self.setup, self.mib, self.rank, self.world, 1)

    def fresh_state(self) -> dict[str, Any]:
        model, opt = self.fresh()
        return {"model": model, "optimizer": opt}


def floor_tool(share: int, rank: int, root: str) -> Tool:
    """Every rank writes ``share`` bytes to a file of its own, in parallel, then fsync."""
    payload = torch.ones(share, dtype=torch.uint8)
    path = scratch_path(root, "floor")
    if rank == 0:
        os.makedirs(path)
    dist.barrier()
    file = os.path.join(path, f"{rank}.bin")
    return Tool(lambda: fsync_write(file, memoryview(payload.numpy())), path=path)


def alternate(
    calls: dict[str, Callable[[], Any]], repeat: int, tools: dict[str, Tool] | None = None
) -> dict[str, Measurement]:
    """``repeat`` rounds, each timing every call once, the order rotating each round; with
    ``tools`` (saves), each tool's ``cleanup`` runs after its call, on rank 0. Loads are
    timed from a trimmed heap (see ``_common.trim_heap``)."""
    out = {name: Measurement() for name in calls}
    names = list(calls)
    for i in range(repeat):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            if tools is not None:
                m = measure(calls[name], 1, tools[name].cleanup)
            else:
                m = measure(calls[name], 1, trim=True)
            out[name].seconds += m.seconds
            out[name].rss_extra += m.rss_extra
    return out


def writer_bytes(path: str) -> dict[int, int]:
    """shardsafe: bytes each rank wrote, from the manifest (as ``shardsafe inspect``)."""
    import shardsafe

    return {w.rank: w.bytes for w in shardsafe.inspect(path).writers if w.rank is not None}


def dcp_writer_bytes(path: str) -> dict[int, int]:
    """DCP: each rank's ``__<rank>_<n>.distcp`` files (empty ones: that rank wrote none)."""
    out: dict[int, int] = {}
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            size = os.path.getsize(os.path.join(path, name))
            if size:
                rank = int(name[2:].split("_")[0])
                out[rank] = out.get(rank, 0) + size
    return out


def bench(
    rank: int, world: int, setup: str, per_rank_mib: float, repeat: int, root: str
) -> dict[str, Any]:
    case = Case(setup, per_rank_mib, rank, world, root)
    model, opt = case.state
    distinct = _distinct_bytes(case)
    state = {"model": model, "optimizer": opt}
    tools = {
        "floor": floor_tool(distinct // world, rank, root),
        "dcp": dcp_tool(model, opt, case.fresh, root),
        "sharded": shardsafe_tool("sharded", state, case.fresh_state, root, (INLINE,)),
    }
    results: Results = {name: {} for name in tools}
    for name, m in alternate({n: t.save for n, t in tools.items()}, repeat, tools).items():
        results[name]["save"] = m
    for t in tools.values():
        if t.prepare_load is not None:
            t.prepare_load()
    dist.barrier()
    if rank == 0:
        assert tools["sharded"].path and tools["dcp"].path
        case.info["writers"] = writer_bytes(tools["sharded"].path)
        case.info["dcp_writers"] = dcp_writer_bytes(tools["dcp"].path)
        for name, t in tools.items():
            results[name]["save"].file_bytes = disk_bytes(t.path) if t.path else 0
    loads = {n: t.load for n, t in tools.items() if t.load is not None}
    loads[f"sharded {INLINE}"] = (tools["sharded"].variants or {})[INLINE]
    for name, m in alternate(loads, repeat).items():
        results.setdefault(name, {})["load"] = m
    dist.barrier()
    if rank == 0:
        for t in tools.values():
            clean(t.path or "")
    dist.barrier()
    return {"results": results, "info": case.info | {"distinct_bytes": distinct}}


def _distinct_bytes(case: Case) -> int:
    """Bytes of the state counted once however many ranks hold them (keys by name)."""
    model, opt = case.state
    mine = {f"model/{k}": v.numel() * v.element_size() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for k, v in state.items():
            mine[f"optimizer/{names[id(p)]}/{k}"] = v.numel() * v.element_size()
    every: list[dict[str, int]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    merged: dict[str, int] = {}
    for d in every:
        merged.update(d)
    return sum(merged.values())


def run(setup: str, per_rank_mib: float, repeat: int, root: str) -> tuple[Results, dict[str, Any]]:
    out = launch(bench, WORLD, setup, per_rank_mib, repeat, root)[0]
    return out["results"], out["info"]


def title(setup: str, info: dict[str, Any]) -> str:
    per_rank = info["model_bytes"] + info["opt_bytes"]
    d = info["width"]
    shape = (
        f"{LAYERS} Linear({d}, {d}) layers in {STAGES} stages, rank r holds stage r // 2"
        if setup == "pp-dp"
        else f"{EXPERTS_PER_RANK} experts of Linear({d}, {2 * d}) + Linear({2 * d}, {d}) per "
        f"rank, router Linear({d}, {EXPERTS_PER_RANK * WORLD}) on every rank"
    )
    return (
        f"{NAMES[setup]}, AdamW: {shape}; per rank model "
        f"{mib(info['model_bytes'])} + optimizer {mib(info['opt_bytes'])} = {mib(per_rank)}; "
        f"distinct state {mib(info['distinct_bytes'])}"
    )


def _mib1(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def writers_table(info: dict[str, Any]) -> str:
    ss, dc = info["writers"], info["dcp_writers"]
    rows = [["rank", "shardsafe bytes written", "x mean", "DCP bytes written", "x mean"]]
    ss_mean = sum(ss.values()) / len(ss)
    dc_mean = sum(dc.values()) / len(dc) if dc else 0
    for rank in range(WORLD):
        a, b = ss.get(rank, 0), dc.get(rank, 0)
        rows.append(
            [
                str(rank),
                _mib1(a),
                f"{a / ss_mean:.2f}",
                _mib1(b),
                f"{b / dc_mean:.2f}" if dc_mean else "-",
            ]
        )
    return table(rows)


def targets(setup: str, r: Results, info: dict[str, Any]) -> list[Target]:
    name = NAMES[setup]
    out = []
    save = r["sharded"]["save"].median / r["dcp"]["save"].median
    out.append(Target(f"{name} shardsafe sharded save / dcp save", save, TIME_RATIO))
    for tool, mode in (("sharded", "first"), (f"sharded {INLINE}", INLINE)):
        load = r[tool]["load"].median / r["dcp"]["load"].median
        label = f"{name} shardsafe sharded load (verify={mode}) / dcp load"
        out.append(Target(label, load, TIME_RATIO))
    ss = info["writers"]
    balance = max(ss.values()) / (sum(ss.values()) / len(ss))
    label = f"{name} shardsafe bytes of the busiest writer / mean per writer ({len(ss)} writers)"
    out.append(Target(label, balance, BALANCE))
    dc = info["dcp_writers"]
    if dc:
        dcp_balance = max(dc.values()) / (sum(dc.values()) / len(dc))
        label = f"{name} DCP bytes of the busiest writer / mean per writer ({len(dc)} writers)"
        out.append(Target(label, dcp_balance, None))
    return out


def section(setup: str, per_rank_mib: float, repeat: int, root: str) -> Section:
    r, info = run(setup, per_rank_mib, repeat, root)
    text = (
        f"{title(setup, info)}\n\n{results_table(r, LABELS, WORLD, load_labels=LOAD_LABELS)}\n\n"
        f"Bytes each rank wrote (shardsafe: from its manifest; DCP: its .distcp files):\n\n"
        f"{writers_table(info)}"
    )
    return Section(text, targets(setup, r, info), r, info)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mib", type=float, default=192, help="model + AdamW MiB per rank")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--dir", default="/tmp/shardsafe-bench")
    args = parser.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    print(f"machine: {machine()}\n")
    for setup in args.setups.split(","):
        done = section(setup, args.mib, args.repeat, args.dir)
        print(f"## {NAMES[setup]}\n\n{done.text}\n\n{verdicts(done.targets)}\n", flush=True)


if __name__ == "__main__":
    main()
