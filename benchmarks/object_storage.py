"""shardsafe against DCP's ``FsspecWriter``/``FsspecReader``, both writing to the same local
S3 API server (moto on 127.0.0.1, started here), for plain DDP and for FSDP2.

Setup as in ``_dcp_compare.py``: an MLP of ``layers`` 1024x1024 Linear layers, DDP with
Adam or FSDP2 with AdamW, one step taken; 16 layers is about 192 MiB of state. Each tool
runs in fresh ranks; times are medians over ``--repeat`` saves (then loads into a fresh
model and optimizer), peak extra RSS the maximum of any rank during a save, compared
with the state that rank holds. moto keeps objects in its own memory, in this process,
so the absolute numbers say little about a real store: the ratios are what matters.

    python benchmarks/object_storage.py [--layers 16] [--world 2] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardsafe
from _common import Target, launch, measure, mib, table, verdicts
from _dcp_compare import stepped


def _own_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes this rank holds: its local shards for FSDP2, everything for DDP."""
    total = 0
    tensors = [*model.state_dict().values()]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _remove(url: str) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    if fs.exists(path):
        fs.rm(path, recursive=True)


def bench(
    rank: int,
    world: int,
    env: dict[str, str],
    tool: str,
    wrap: str,
    layers: int,
    url: str,
    repeat: int,
) -> Any:
    os.environ.update(env)  # ranks come from a forkserver started before the server
    model, opt = stepped(wrap, layers, 0)
    own = _own_bytes(model, opt)
    fresh_model, fresh_opt = stepped(wrap, layers, 1)
    path = f"{url}/{tool.split('-')[0]}-{wrap}"

    def save() -> None:
        if tool == "dcp":
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, storage_writer=FsspecWriter(path))
        else:
            shardsafe.save(path, {"model": model, "optimizer": opt})

    def load() -> None:
        if tool == "dcp":
            msd, osd = get_state_dict(fresh_model, fresh_opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, storage_reader=FsspecReader(path))
            set_state_dict(fresh_model, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
        else:  # "shardsafe" verifies every byte first (two reads), "shardsafe-inline" once
            verify = "inline" if tool == "shardsafe-inline" else "first"
            shardsafe.load(path, {"model": fresh_model, "optimizer": fresh_opt}, verify=verify)

    # One untimed round trip first: botocore's service models and the S3 client load once
    # per process (tens of MiB of RSS), for both tools alike.
    save()
    load()
    dist.barrier()
    if rank == 0:
        _remove(path)
    saves = measure(save, repeat, cleanup=lambda: _remove(path))
    save()
    dist.barrier()
    loads = measure(load, repeat)
    dist.barrier()
    if rank == 0:
        _remove(path)
    return saves.median, loads.median, max(saves.peak_rss(r) for r in range(world)), own


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 layers, 1 repetition")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.repeat = 2, 1
    from _s3 import start_moto

    server, env = start_moto()
    os.environ.update(env)
    import boto3

    boto3.client("s3").create_bucket(Bucket="shardsafe-bench")
    url = "s3://shardsafe-bench/run"
    rows = [["state", "tool", "save s", "load s", "peak extra RSS / rank state"]]
    targets = []
    try:
        for wrap in ("ddp", "fsdp"):
            got = {}
            for tool in ("dcp", "shardsafe", "shardsafe-inline"):
                save_s, load_s, peak, own = launch(
                    bench, args.world, env, tool, wrap, args.layers, url, args.repeat
                )[0]
                got[tool] = (save_s, load_s, peak, own)
                rows.append(
                    [
                        wrap,
                        tool,
                        f"{save_s:.3f}",
                        f"{load_s:.3f}",
                        f"{mib(peak)} / {mib(own)} = {peak / own:.2f}",
                    ]
                )
            dcp_save, dcp_load, _, _ = got["dcp"]
            save_s, load_s, peak, own = got["shardsafe"]
            inline_load = got["shardsafe-inline"][1]
            targets += [
                Target(f"{wrap}: shardsafe save / DCP save (S3)", save_s / dcp_save, 1.0),
                Target(
                    f"{wrap}: shardsafe load (verify=first) / DCP load (S3)", load_s / dcp_load, 1.0
                ),
                Target(
                    f"{wrap}: shardsafe load (verify=inline) / DCP load (S3)",
                    inline_load / dcp_load,
                    1.0,
                ),
                Target(f"{wrap}: shardsafe peak extra RSS / rank state", peak / own, 0.25),
            ]
    finally:
        server.stop()
    print(f"## Object storage (moto S3 on loopback): {args.world} ranks, {args.layers} layers")
    print()
    print(table(rows))
    print()
    print(verdicts(targets))


if __name__ == "__main__":
    main()
