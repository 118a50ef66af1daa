"""A Hugging Face ``transformers.Trainer`` run that checkpoints with shardsafe.

    pip install "shardsafe[transformers]"
    torchrun --nproc-per-node 2 examples/transformers_trainer.py --stop-at 10  # "crashes"
    torchrun --nproc-per-node 2 examples/transformers_trainer.py               # resumes

A tiny GPT-2 built from a config (nothing is downloaded) learns a fixed set of token
sequences for ``--steps`` steps on the CPU (gloo; on GPUs it uses them), saving a
``checkpoint-N`` every 5 steps with ``ShardsafeTrainer``: the model as the Trainer writes
it, the optimizer and scheduler as a shardsafe checkpoint in ``checkpoint-N/shardsafe``
written by every process (no pickle). ``--stop-at K`` ends the first run after step K as
if the job had died there; the next run finds the newest checkpoint, resumes from it, and
logs the losses an uninterrupted run logs. The last checkpoint then loads with
``from_pretrained``, as any Trainer checkpoint does.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

from shardsafe.transformers import ShardsafeTrainer


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """64 fixed sequences of 12 tokens: the model learns to predict them."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (64, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAt(TrainerCallback):
    """Ends training after step ``step`` (after that step's save), as a crash would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/transformers")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stop-at", type=int)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4,
        logging_steps=1, save_steps=5, save_total_limit=2, report_to=[],
        use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0, learning_rate=1e-3,
        disable_tqdm=True,
    )  # fmt: skip
    callbacks = [] if args.stop_at is None else [StopAt(args.stop_at)]
    trainer = ShardsafeTrainer(
        model=GPT2LMHeadModel(config),
        args=training,
        train_dataset=Tokens(),
        callbacks=callbacks,
    )
    found = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
    start = 0 if found is None else int(found.rsplit("-", 1)[1])
    trainer.train(resume_from_checkpoint=found)  # None: from scratch
    if trainer.is_world_process_zero():
        print(f"resumed from {found}" if found else "no checkpoint yet: starting at step 0")
        for entry in trainer.state.log_history:
            if "loss" in entry and entry["step"] > start:
                print(f"step {entry['step']}: loss {entry['loss']}")
        newest = get_last_checkpoint(args.out)
        AutoModelForCausalLM.from_pretrained(newest)  # a Trainer checkpoint, as always
        print(f"saved {newest}: loads with from_pretrained")
    if dist.is_initialized():  # the Trainer leaves its process group to the interpreter
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
