"""A worker of the two-"node" tiered tests: one process per torchrun agent, each agent
with its own node-local directory (``LOCAL_BASE/node<GROUP_RANK>``) and one persistent
tier (an ``s3://`` URL) shared by both.

Resumes with ``load_latest``, trains to ``--steps`` (a local save every step, a
persistent one every ``--persist-every``), printing ``restored <step> <tier>`` and one
``loss <step> <float.hex>`` line per step. ``--kill-at K`` SIGKILLs every worker once
step K's local checkpoint is written and replicated (on the agents' first attempt
only, so that ``--max-restarts`` can recover); ``--kill-rank R`` kills rank R alone."""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import shardsafe


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("persistent")
    parser.add_argument("local_base")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--persist-every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-rank", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": opt, "rng": shardsafe.RNGState()}
    manager = shardsafe.TieredCheckpointManager(
        args.persistent,
        os.path.join(args.local_base, f"node{os.environ['GROUP_RANK']}"),
        local_every=1,
        persist_every=args.persist_every,
        replicas=1,
        timeout=60,
    )
    manager.load_latest(state)
    restored = manager.restored
    start = restored.step if restored else 0
    print(f"restored {start} {restored.tier if restored else 'none'}", flush=True)
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(16, 8) + rank
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"loss {step} {loss.item().hex()}", flush=True)
        manager.async_save(step, state)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step == args.kill_at and first_attempt:
            manager.wait()  # written and replicated
            dist.barrier()
            if args.kill_rank in (None, rank):
                os.kill(os.getpid(), signal.SIGKILL)
            dist.barrier()  # the others wait here until their agent stops them
    manager.close()
    dist.destroy_process_group()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
