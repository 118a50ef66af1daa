"""Train a small classifier with shardsafe's Trainer: crash-safe checkpoints, exact resume.

    python examples/train.py --strategy ddp --devices 2 --run-dir runs/blobs
    python examples/train.py --strategy ddp --devices 2 --run-dir runs/blobs \
        --max-steps 80 --resume latest            # continue the same run

``--devices 2`` makes this process start two workers itself (it runs this script again,
as torchrun would). Started by torchrun instead, the Trainer joins torchrun's processes:

    torchrun --nproc-per-node 2 examples/train.py --strategy ddp --devices 2 --run-dir runs/b2

Both give exactly the same losses (``runs/*/metrics.jsonl``).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardsafe


class Blobs(shardsafe.TrainingModule):
    """Classify points drawn around eight random centres (synthetic, nothing downloaded)."""

    def __init__(self, classes: int = 8, features: int = 10, samples: int = 2048) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        centres = torch.randn(classes, features, generator=g) * 2
        labels = torch.randint(classes, (samples,), generator=g)
        points = centres[labels] + torch.randn(samples, features, generator=g)
        self.data = TensorDataset(points, labels)
        self.net = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
        return optimizer, scheduler

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=16, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp", choices=["single", "ddp", "zero", "fsdp"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--run-dir", default="runs/blobs")
    parser.add_argument("--resume", default=None, help="'latest' or a checkpoint path")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial weights in every run (and every process)
    trainer = shardsafe.Trainer(
        strategy=args.strategy,
        devices=args.devices,
        max_steps=args.max_steps,
        checkpoint_every=args.checkpoint_every,
        run_dir=args.run_dir,
    )
    trainer.fit(Blobs(), resume=args.resume)


if __name__ == "__main__":
    main()
