"""The bug shardsafe exists for, in PyTorch Lightning: ZeRO inside a LightningModule, under DDP.

    pip install "shardsafe[lightning]"
    python examples/lightning_zero.py [--run-dir runs/lightning_zero]

A LightningModule returns ``ZeroRedundancyOptimizer(Adam)`` from ``configure_optimizers``
and trains under plain DDP on 2 CPU processes (Lightning starts the second one by running
this script again). With Lightning's own strategy every save consolidates the optimizer
onto rank 0 through pickles; with ``ShardsafeDDPStrategy`` each rank writes its own shard
and nothing is pickled. ``ModelCheckpoint`` saves every 5 steps (the newest 2, plus
``last.ckpt``); each checkpoint is a directory. The script then resumes from ``last`` and
trains on to step 30, and prints what the newest checkpoint holds.

The run directory must be new (``--run-dir``): ``ModelCheckpoint`` would version names in
a directory holding an earlier run's checkpoints.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader, TensorDataset

import shardsafe
from shardsafe.lightning import ShardsafeDDPStrategy


class Regression(pl.LightningModule):
    """A small MLP fitting a fixed random linear rule (synthetic data, nothing downloaded)."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()  # plain numbers: saved as JSON in the checkpoint
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_start(self) -> None:
        if self.trainer.is_global_zero:
            print(f"training from step {self.global_step} to step {self.trainer.max_steps}")

    def configure_optimizers(self) -> Any:
        # The user-wrapped ZeRO optimizer: each rank keeps the Adam state of its own share.
        zero = ZeroRedundancyOptimizer(
            self.parameters(), optimizer_class=torch.optim.Adam, lr=self.hparams["lr"]
        )
        schedule = torch.optim.lr_scheduler.StepLR(zero, step_size=10, gamma=0.5)
        return {"optimizer": zero, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(640, 16, generator=g)
        y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(640, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def trainer(run_dir: str, max_steps: int) -> pl.Trainer:
    checkpoints = ModelCheckpoint(
        dirpath=os.path.join(run_dir, "checkpoints"),
        every_n_train_steps=5,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
    )
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardsafeDDPStrategy(layout="sharded"),
        max_steps=max_steps,
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=run_dir,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/lightning_zero")
    args = parser.parse_args()
    for name in ("pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LeafSpec")  # Lightning's, under torch 2.13
    torch.manual_seed(0)  # the same initial weights in both processes

    first = trainer(args.run_dir, max_steps=20)
    first.fit(Regression())
    if first.is_global_zero:
        loss = float(first.callback_metrics["train_loss"])
        print(f"trained to step {first.global_step}, loss {loss:.4f}")
    # Resume from the newest checkpoint (any world size would do) and train on to step 30.
    second = trainer(args.run_dir, max_steps=30)
    model = Regression()
    second.fit(model, ckpt_path="last")

    if second.is_global_zero:
        last = os.path.join(args.run_dir, "checkpoints", "last.ckpt")
        manifest = shardsafe.read_manifest(last)
        loss = float(second.callback_metrics["train_loss"])
        print(f"trained to step {second.global_step}, loss {loss:.4f}")
        print(f"checkpoints: {sorted(os.listdir(os.path.dirname(last)))}")
        print(f"{last}: layout {manifest.layout}, saved by {manifest.world_size} ranks, files")
        for name, size in sorted(manifest.files.items()):
            print(f"  {name}  {size:,} bytes")
        print(f"inspect it with: shardsafe inspect {last}")


if __name__ == "__main__":
    main()
