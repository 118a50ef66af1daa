"""ZeRO checkpoint save/load: shardsafe against torch's own consolidation and the floor.

Setup (the sharded-optimizers issue): 2 ranks, an MLP of ``--layers`` 1024x1024 Linear
layers under DDP, ``ZeroRedundancyOptimizer(Adam)`` wrapped by the user, one step taken
so Adam's state exists. 16 layers is about 67 MB of weights + 134 MB of optimizer state.

Rows, all on the same state in the same processes:
  floor       one buffered write of the same bytes + fsync, by rank 0
  comm floor  the optimizer bytes rank 1 owns sent once to rank 0 as one raw tensor
  torch       consolidate_state_dict(to=0) + torch.save({model, optimizer}) + fsync
  shardsafe   save(layout="sharded") and save(layout="consolidated")
and loads of each into a fresh model + ZeRO optimizer.

Run:  python benchmarks/zero_checkpoint.py [--layers 16] [--repeat 3] [--dir /tmp/bench]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shardsafe
from _common import Measurement, clean, fsync_write, launch, machine, mib, table, timed

TARGETS = {
    "consolidated vs torch (x faster)": 12.0,
    "consolidated vs floor (x slower, max)": 2.0,
    "sharded vs floor (x slower, max)": 1.2,
    "consolidated RSS vs torch (max)": 0.3,
}


def build(layers: int, seed: int) -> tuple[nn.Module, DDP, ZeroRedundancyOptimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)])
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    return model, ddp, opt


def state_bytes(model: nn.Module, opt: ZeroRedundancyOptimizer) -> tuple[int, int, int]:
    """(model bytes, total optimizer bytes, optimizer bytes owned by rank 1)."""
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    owned = [0, 0]
    for rank, groups in enumerate(opt._partition_parameters()):
        for group in groups:
            owned[rank] += sum(2 * p.numel() * 4 + 4 for p in group["params"])
    return model_bytes, sum(owned), owned[1]


def bench(
    rank: int, world: int, layers: int, repeat: int, root: str, only: str | None = None
) -> dict[str, Any]:
    """Measure every row, or with ``only`` a single save (fresh process: clean RSS)."""
    model, ddp, opt = build(layers, 0)
    ddp(torch.randn(8, 1024)).sum().backward()
    opt.step()
    model_bytes, opt_bytes, remote_bytes = state_bytes(model, opt)
    total = model_bytes + opt_bytes
    payload = torch.empty(total, dtype=torch.uint8) if rank == 0 else None
    moving = torch.empty(remote_bytes, dtype=torch.uint8)
    state = {"model": ddp, "optimizer": opt}
    results: dict[str, Measurement] = {}

    def measure(name: str, fn: Any, cleanup: Any = None) -> None:
        m = results.setdefault(name, Measurement())
        for _ in range(repeat):
            seconds, extra = timed(fn)
            extras: list[int] = [0] * world
            dist.all_gather_object(extras, extra)
            m.seconds.append(seconds)
            m.rss_extra.append(extras)
            dist.barrier()
            if cleanup is not None and rank == 0:
                cleanup()
            dist.barrier()

    def floor() -> None:
        if rank == 0:
            assert payload is not None
            fsync_write(f"{root}/floor.bin", memoryview(payload.numpy()))

    def comm_floor() -> None:
        if rank == 1:
            dist.send(moving, 0)
        elif rank == 0:
            dist.recv(moving, 1)

    def torch_save() -> None:
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            with open(f"{root}/torch.pt", "wb") as f:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            opt._all_state_dicts = []  # what a careful user does to get the memory back

    if only == "torch":
        measure("torch consolidate+save", torch_save)
        return {"results": results}
    if only == "consolidated":
        path = f"{root}/ss-consolidated"
        measure(
            "shardsafe consolidated",
            lambda: shardsafe.save(path, state, layout="consolidated"),
            lambda: clean(path),
        )
        return {"results": results}
    measure("floor (write+fsync)", floor, lambda: clean(f"{root}/floor.bin"))
    measure("comm floor (raw send)", comm_floor)
    measure("torch consolidate+save", torch_save)
    for layout in ("sharded", "consolidated"):
        path = f"{root}/ss-{layout}"
        measure(
            f"shardsafe {layout}",
            lambda p=path, lay=layout: shardsafe.save(p, state, layout=lay),
            lambda p=path: clean(p),
        )
    # Loads, into a fresh model and optimizer each time.
    for layout in ("sharded", "consolidated"):
        path = f"{root}/ss-{layout}"
        shardsafe.save(path, state, layout=layout)
        _, ddp2, opt2 = build(layers, 1)
        measure(
            f"load shardsafe {layout}",
            lambda p=path, d=ddp2, o=opt2: shardsafe.load(p, {"model": d, "optimizer": o}),
        )
        dist.barrier()
        if rank == 0:
            clean(path)
    torch_save()
    _, ddp3, opt3 = build(layers, 1)

    def torch_load() -> None:
        sd = torch.load(f"{root}/torch.pt", map_location="cpu", weights_only=True)
        ddp3.module.load_state_dict(sd["model"])
        opt3.load_state_dict(sd["optimizer"])

    measure("load torch (torch.load+load_state_dict)", torch_load)
    dist.barrier()
    if rank == 0:
        clean(f"{root}/torch.pt")
    return {
        "results": results,
        "model_bytes": model_bytes,
        "opt_bytes": opt_bytes,
        "remote_bytes": remote_bytes,
    }


def report(out: dict[str, Any], layers: int) -> tuple[str, dict[str, float]]:
    r: dict[str, Measurement] = out["results"]
    total = out["model_bytes"] + out["opt_bytes"]
    rows = [["operation", "median s", "vs floor", "rank0 extra RSS", "rank1 extra RSS"]]
    floor = r["floor (write+fsync)"].median
    for name, m in r.items():
        rows.append(
            [
                name,
                f"{m.median:.3f}",
                f"{m.median / floor:.2f}x",
                mib(m.median_rss(0)),
                mib(m.median_rss(1)),
            ]
        )
    text = [
        f"ZeRO checkpoint, {layers} layers of 1024x1024, 2 ranks: model {mib(out['model_bytes'])}"
        f", optimizer {mib(out['opt_bytes'])}, total {mib(total)}",
        table(rows),
    ]
    cons = r["shardsafe consolidated"]
    ratios = {
        "consolidated vs torch (x faster)": r["torch consolidate+save"].median / cons.median,
        "consolidated vs floor (x slower, max)": cons.median / floor,
        "sharded vs floor (x slower, max)": r["shardsafe sharded"].median / floor,
    }
    return "\n".join(text), ratios


def memory_comparison(layers: int, root: str) -> tuple[str, dict[str, float]]:
    """Peak extra RSS of the writing rank, each tool in fresh processes."""
    torch_run = launch(bench, 2, layers, 1, root, "torch")[0]["results"]["torch consolidate+save"]
    ours = launch(bench, 2, layers, 1, root, "consolidated")[0]["results"]["shardsafe consolidated"]
    rows = [["consolidated save", "seconds", "rank0 extra RSS", "rank1 extra RSS"]]
    for name, m in (("torch consolidate+save", torch_run), ("shardsafe consolidated", ours)):
        rows.append([name, f"{m.median:.2f}", mib(m.median_rss(0)), mib(m.median_rss(1))])
    ratio = ours.median_rss(0) / max(torch_run.median_rss(0), 1)
    text = f"Peak extra RSS, {layers} layers (fresh processes per tool)\n" + table(rows)
    return text, {"consolidated RSS vs torch (max)": ratio}


def verdicts(ratios: dict[str, float], which: list[str]) -> str:
    lines = []
    for name in which:
        value, target = ratios[name], TARGETS[name]
        ok = value >= target if "faster" in name else value <= target
        lines.append(
            f"  {name}: {value:.2f} (target {'>=' if 'faster' in name else '<='} "
            f"{target}) {'MET' if ok else 'MISSED'}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
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
    print(f"machine: {machine()}\n")
    out = launch(bench, 2, args.layers, args.repeat, args.dir)[0]
    text, ratios = report(out, args.layers)
    print(text)
    print(verdicts(ratios, list(TARGETS)[:3]))
    if args.rss_layers:
        text, big = memory_comparison(args.rss_layers, args.dir)
        print("\n" + text)
        print(verdicts(big, list(TARGETS)[3:]))


if __name__ == "__main__":
    main()
