"""A Hugging Face Accelerate training script that checkpoints with shardsafe.

    pip install "shardsafe[accelerate]"
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --steps 40
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --steps 80

(``--multi_gpu`` only picks Accelerate's torchrun launcher; the script asks for the CPU
unless CUDA is there, and the processes talk over gloo.) The second command resumes at
step 40 and trains to 80; run with the same ``--steps`` again, it resumes and has nothing
left to train. A small MLP with dropout, AdamW and a step scheduler over a
shuffled dataloader with a generator of its own (see the comment there) trains for
``--steps`` steps, saving every ``--every`` steps with ``shardsafe.accelerate.save_state``
in the background into ``--run-dir/checkpoints`` (automatic naming, the newest 2 kept).
A second run finds the newest complete checkpoint with ``load_state``, skips the batches
already seen in that epoch, and trains on: its losses are those an uninterrupted run
would have logged, bit for bit.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import ProjectConfiguration, set_seed

import shardsafe
from shardsafe.accelerate import load_state, save_state


class Progress:
    """The step reached, registered for checkpointing like any Accelerate custom object."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", default="runs/accelerate")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        project_config=ProjectConfiguration(
            project_dir=args.run_dir, automatic_checkpoint_naming=True, total_limit=2
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Dropout(0.1), torch.nn.Tanh(), torch.nn.Linear(64, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 16, generator=generator)
    data = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin())
    # A generator of its own: without one, each new iterator of the loader (the one that
    # skips the batches already seen, made right after the restore, included) draws a seed
    # from torch's global RNG, and the dropout masks after a resume are no longer those of
    # an uninterrupted run.
    loader = torch.utils.data.DataLoader(
        data, batch_size=8, shuffle=True, generator=torch.Generator()
    )
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    try:
        load_state(accelerator)  # the newest complete checkpoint, if any
        accelerator.print(f"resumed at step {progress.step}")
    except shardsafe.CheckpointNotFoundError:
        accelerator.print("no checkpoint yet: starting at step 0")
    per_epoch = len(loader)
    saving = None
    while progress.step < args.steps:
        seen = progress.step % per_epoch
        batches = accelerator.skip_first_batches(loader, seen) if seen else loader
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.step += 1
            if progress.step % args.every == 0:
                saving = save_state(accelerator, async_save=True)  # staged; written meanwhile
                accelerator.print(f"step {progress.step}: loss {loss.item()}, saved")
            if progress.step == args.steps:
                break
        if seen:  # the loader that skipped did not move the epoch on: move it here
            loader.set_epoch(loader.iteration + 1)
    if saving is not None:
        accelerator.print(
            f"saved {saving.wait()}"
        )  # the last save, committed before the processes end
    accelerator.free_memory()  # the model before the process group (see the docs page)
    accelerator.end_training()


if __name__ == "__main__":
    main()
