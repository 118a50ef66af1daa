"""A ``transformers.Trainer`` run on a tiny GPT-2 built from a config (nothing downloaded),
started by ``torchrun`` from ``test_trainer.py``: ``--trainer shardsafe`` uses
``ShardsafeTrainer``, ``plain`` the Trainer itself. Checkpoints every 5 steps (the newest
2 kept); rank 0 writes the per-step losses to ``OUT/losses.json``."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import shardsafe
from shardsafe.transformers import ShardsafeTrainer
from tests.clean_exit import end_process


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (64, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def slowed(kind: type[Trainer], seconds: float) -> type[Trainer]:
    """``kind`` whose main process takes ``seconds`` more to write ``model.safetensors``
    (as a model of several GB does), while the others go straight on."""

    class Slowed(kind):  # type: ignore[valid-type,misc]
        def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
            super()._save(output_dir, state_dict)
            if self.args.should_save:
                time.sleep(seconds)

    return Slowed


def shorten_default_entry_timeout(seconds: float) -> None:
    """Make shardsafe's own default wait for the other processes (60 s) ``seconds`` in
    ``ShardsafeTrainer``'s saves, where it is not given explicitly: a test of which wait
    the Trainer uses then shows it with a model write of a few seconds instead of 65."""
    import shardsafe.transformers.trainer as module
    from shardsafe.checkpoint.options import SaveOptions

    def options(**given: Any) -> SaveOptions:
        return SaveOptions(**{"entry_timeout": seconds, **given})

    module.SaveOptions = options  # type: ignore[attr-defined,assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--trainer", choices=["shardsafe", "plain"], default="shardsafe")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--resume")
    parser.add_argument("--slow-model-write", type=float, default=0.0)
    parser.add_argument("--default-entry-timeout", type=float)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4,
        logging_steps=1, save_steps=5, save_total_limit=2, report_to=[], use_cpu=True,
        seed=0, data_seed=0, learning_rate=1e-3, disable_tqdm=True,
    )  # fmt: skip
    kind = ShardsafeTrainer if args.trainer == "shardsafe" else Trainer
    if args.default_entry_timeout is not None:
        shorten_default_entry_timeout(args.default_entry_timeout)
    if args.slow_model_write:
        kind = slowed(kind, args.slow_model_write)
    trainer = kind(model=GPT2LMHeadModel(config), args=training, train_dataset=Tokens())
    try:
        trainer.train(resume_from_checkpoint=args.resume)
    except shardsafe.CheckpointError as e:
        # Each rank's error in a file: torchrun stops the other ranks as soon as one exits,
        # so the tests could not read every rank's from the output. The barrier in
        # end_process keeps both until both have written (an agreed error leaves the
        # group working).
        rank = int(os.environ.get("RANK", 0))
        with open(os.path.join(args.out, f"error-{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        end_process(1)
    if trainer.is_world_process_zero():
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(losses, f)
    end_process(0)  # the Trainer leaves its gloo group to the interpreter's teardown


if __name__ == "__main__":
    main()
