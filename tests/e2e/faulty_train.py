"""A training script for the e2e tests: the built-in example, with faults on demand.

    python tests/e2e/faulty_train.py --strategy ddp --devices 2 --max-steps 10 \
        --checkpoint-every 5 --run-dir DIR [--resume latest] [--step-delay 0.3]
        [--fail-rank 1 --fail-step 3 [--fail-in step|save]]

``--step-delay`` slows every step so that a test can kill the run part-way; ``--fail-*``
raise on one rank only, in ``training_step`` or inside the checkpoint engine's write.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

import shardsafe
from shardsafe.trainer.example import ExampleModule


class FaultyExample(ExampleModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(seed=args.seed, optimizer=args.example_optimizer)
        self.args = args

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_taken = getattr(self, "steps_taken", 0) + 1
        if self.args.step_delay:
            time.sleep(self.args.step_delay)
        rank = int(os.environ.get("RANK", "0"))
        args = self.args
        if (args.fail_in, rank, self.steps_taken) == ("step", args.fail_rank, args.fail_step):
            raise RuntimeError(f"injected failure in training_step on rank {rank}")
        return super().training_step(batch, batch_idx)


def fail_save_of(step: int, rank: int) -> None:
    """Make this rank's write of checkpoint ``step`` raise, inside the engine's save."""
    from shardsafe.checkpoint import saving
    from shardsafe.checkpoint.manager import step_dir_name

    original = saving.write_plan

    def write_plan(plan: Any, rank_: int, chunks: Any, storage: Any, *rest: Any) -> Any:
        if storage.directory.rstrip("/").endswith(step_dir_name(step)):
            raise OSError(f"injected write failure on rank {rank}")  # as a failed write
        return original(plan, rank_, chunks, storage, *rest)

    saving.write_plan = write_plan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--example-optimizer", default="adamw")
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=0)
    parser.add_argument("--fail-in", choices=("step", "save"), default="step")
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()

    if args.fail_in == "save" and int(os.environ.get("RANK", "-1")) == args.fail_rank:
        fail_save_of(args.fail_step, args.fail_rank)
    torch.manual_seed(args.seed)
    trainer = shardsafe.Trainer(
        strategy=args.strategy,
        devices=args.devices,
        max_steps=args.max_steps,
        checkpoint_every=args.checkpoint_every,
        run_dir=args.run_dir,
        seed=args.seed,
        async_save=args.async_save,
    )
    trainer.fit(FaultyExample(args), resume=args.resume)


if __name__ == "__main__":
    main()
