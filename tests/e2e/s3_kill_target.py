"""Saves step after step to an s3:// root, printing each committed step, until killed.

Each step's state is a function of the step alone, so a test can check that whatever
``latest`` names holds exactly that step's bytes."""

from __future__ import annotations

import sys

import torch

import shardsafe


def state_of(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"big": torch.randn(6 << 20, generator=g), "step": step}  # 24 MiB: 5 parts


def main() -> None:
    root = sys.argv[1]
    manager = shardsafe.CheckpointManager(
        root, keep_last=2, storage_options={"default_block_size": 5 << 20}
    )
    newest = manager.complete_steps()
    step = newest[-1] + 1 if newest else 1
    while True:
        manager.save(step, state_of(step))
        print(f"SAVED {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
