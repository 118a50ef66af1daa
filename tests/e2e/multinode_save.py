"""A worker of the two-"node" test: one process per torchrun agent, each agent in its own
working directory. Saves a small DDP state to ``PATH/step-N`` (optionally after loading
``PATH/step-M``) and prints one line saying what happened."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import shardsafe


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--step", type=int, default=1)
    parser.add_argument("--resume-from", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    opt = torch.optim.Adam(model.parameters())
    state = {"model": model, "optimizer": opt, "step": 0}
    try:
        if args.resume_from is not None:
            extra = shardsafe.load(f"{args.path}/step-{args.resume_from}", state)
            print(f"rank {rank} RESUMED step {extra['step']}", flush=True)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        state["step"] = args.step
        shardsafe.save(f"{args.path}/step-{args.step}", state, entry_timeout=30, timeout=60)
    except shardsafe.CheckpointError as e:
        print(f"rank {rank} ERROR {e}", flush=True)
        dist.destroy_process_group()
        return 3
    print(f"rank {rank} SAVED", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
