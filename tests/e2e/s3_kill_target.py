"""Saves step after step to an s3:// root, printing each committed step, until killed.

    python tests/e2e/s3_kill_target.py ROOT [--rank R --world-size W --port P]

Each step's state is a function of the step alone, so a test can check that whatever
``latest`` names holds exactly that step's bytes. With several ranks (a gloo group on
127.0.0.1:P), each step also runs one ``all_reduce`` (what DDP does in a training step)
and the two replicated tensors are written by different ranks in the sharded layout, so
killing either rank kills it in the middle of its own uploads. Every rank prints
``saving <step> <t>`` before and ``saved <step> <t>`` after each save (``t`` from
``time.monotonic()``), so the test can aim its kill inside a save.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist

import shardsafe


def state_of(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {  # 2 x 12 MiB: 3 parts each
        "big": torch.randn(3 << 20, generator=g),
        "other": torch.randn(3 << 20, generator=g),
        "step": step,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.world_size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{args.port}",
            rank=args.rank,
            world_size=args.world_size,
            timeout=datetime.timedelta(seconds=60),
        )
    manager = shardsafe.CheckpointManager(
        args.root, keep_last=2, storage_options={"default_block_size": 5 << 20}
    )
    newest = manager.complete_steps()
    step = newest[-1] + 1 if newest else 1
    while True:
        if args.world_size > 1:
            dist.all_reduce(torch.ones(1))
        print(f"saving {step} {time.monotonic()}", flush=True)
        # As kill_target.py: a rank killed between two saves is named at the next save's
        # entry within the survivor's deadline (kills.SURVIVOR_EXIT_S), not the 60 s default.
        manager.save(step, state_of(step), entry_timeout=10.0)
        print(f"saved {step} {time.monotonic()}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
