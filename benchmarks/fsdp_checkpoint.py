"""FSDP2 checkpoint save/load: shardsafe (sharded layout) against torch.distributed.checkpoint.

Setup (the FSDP issue): 2 ranks, an MLP of ``--layers`` 1024x1024 Linear layers, each
layer and the root ``fully_shard``-ed, AdamW with one step taken: 16 layers is about
67 MB of weights + 134 MB of optimizer state. DCP's path is the documented one:
``get_state_dict`` -> ``dcp.save``, and ``get_state_dict`` -> ``dcp.load`` ->
``set_state_dict``. Target: shardsafe's save and load each at most 0.8x DCP's time.

Run:  python benchmarks/fsdp_checkpoint.py [--layers 16] [--repeat 3] [--dir /tmp/bench]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shardsafe
from _common import Measurement, clean, launch, machine, mib, table, timed

TARGET = 0.8


def build(layers: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def bench(rank: int, world: int, layers: int, repeat: int, root: str) -> dict[str, Any]:
    model, opt = build(layers, 0)
    model(torch.randn(8, 1024)).sum().backward()
    opt.step()
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    results: dict[str, Measurement] = {}
    fresh_model, fresh_opt = build(layers, 1)
    fresh_model(torch.randn(8, 1024)).sum().backward()
    fresh_opt.step()  # DCP loads into existing optimizer state, so give it some

    def measure(name: str, fn: Any, cleanup: Any = None) -> None:
        m = results.setdefault(name, Measurement())
        for _ in range(repeat):
            seconds, extra = timed(fn)
            m.seconds.append(seconds)
            m.rss_extra.append([extra] * world)
            dist.barrier()
            if cleanup is not None and rank == 0:
                cleanup()
            dist.barrier()

    def dcp_save(path: str) -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    def dcp_load(path: str) -> None:
        msd, osd = get_state_dict(fresh_model, fresh_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            fresh_model, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

    measure("dcp save", lambda: dcp_save(f"{root}/dcp"), lambda: clean(f"{root}/dcp"))
    measure(
        "shardsafe save (sharded)",
        lambda: shardsafe.save(f"{root}/ss", {"model": model, "optimizer": opt}),
        lambda: clean(f"{root}/ss"),
    )
    dcp_save(f"{root}/dcp")
    shardsafe.save(f"{root}/ss", {"model": model, "optimizer": opt})
    measure("dcp load", lambda: dcp_load(f"{root}/dcp"))
    measure(
        "shardsafe load (sharded)",
        lambda: shardsafe.load(f"{root}/ss", {"model": fresh_model, "optimizer": fresh_opt}),
    )
    dist.barrier()
    if rank == 0:
        clean(f"{root}/dcp")
        clean(f"{root}/ss")
    return {"results": results, "total": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/shardsafe-bench")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    print(f"machine: {machine()}\n")
    out = launch(bench, 2, args.layers, args.repeat, args.dir)[0]
    r: dict[str, Measurement] = out["results"]
    rows = [["operation", "median s"]] + [[name, f"{m.median:.3f}"] for name, m in r.items()]
    print(f"FSDP2 checkpoint, {args.layers} layers, 2 ranks, about {mib(out['total'])} of state")
    print(table(rows))
    for op in ("save", "load"):
        ratio = r[f"shardsafe {op} (sharded)"].median / r[f"dcp {op}"].median
        verdict = "MET" if ratio <= TARGET else "MISSED"
        print(f"  shardsafe {op} / dcp {op}: {ratio:.2f} (target <= {TARGET}) {verdict}")


if __name__ == "__main__":
    main()
