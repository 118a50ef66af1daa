"""A training script for the local-tier tests: the built-in example with a local tier,
and a rank that SIGKILLs itself on demand.

    python tests/e2e/local_tier_train.py --run-dir DIR --local-dir LOCAL [--devices 2]
        [--max-steps 10] [--checkpoint-every 5] [--local-every 1] [--resume latest]
        [--step-delay 0.2] [--async-save] [--kill-rank 1 --kill-step 8]

``--kill-rank R --kill-step S``: rank ``R`` sends itself SIGKILL at the start of its
``S``-th step, in the first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0,
or unset), so a run under ``torchrun --max-restarts 1`` dies once and recovers by itself.
Runs under the Trainer's own launcher (``--devices N``) or under torchrun.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import torch

import shardsafe
from shardsafe.trainer.example import ExampleModule


class KillableExample(ExampleModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(seed=args.seed)
        self.args = args
        self.steps_taken = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_taken += 1
        args = self.args
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        rank = int(os.environ.get("RANK", "0"))
        if first_attempt and (rank, self.steps_taken) == (args.kill_rank, args.kill_step):
            print(f"killing rank {rank} at its step {self.steps_taken}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.step_delay:
            time.sleep(args.step_delay)
        return super().training_step(batch, batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--local-dir", required=True)
    parser.add_argument("--local-every", type=int, default=1)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    trainer = shardsafe.Trainer(
        strategy=args.strategy,
        devices=args.devices,
        max_steps=args.max_steps,
        checkpoint_every=args.checkpoint_every,
        run_dir=args.run_dir,
        seed=args.seed,
        async_save=args.async_save,
        local_checkpoint_dir=args.local_dir,
        local_every=args.local_every,
    )
    trainer.fit(KillableExample(args), resume=args.resume)


if __name__ == "__main__":
    main()
