"""PyTorch Lightning 2.x with a user's ZeRO optimizer, run inside our own ranks.

``pl.Trainer(accelerator="cpu", devices=world, strategy="ddp")`` in processes that the
launcher started with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set and the gloo group already
initialized: Lightning's ``LightningEnvironment`` sees LOCAL_RANK, so it launches nothing,
and its DDP strategy reuses the existing process group. ``trainer.fit`` takes one step
(max_steps=1) so Adam's state exists; the LightningModule builds the same MLP from the
same seed and returns ``ZeroRedundancyOptimizer(Adam, lr=1e-4)`` from configure_optimizers.

Timed save: ``trainer.save_checkpoint(path)`` (on every rank: ``consolidate_state_dict``
on all ranks, ``torch.save`` into a BytesIO and a write on rank 0, a barrier) plus an
fsync of the file on rank 0, which Lightning does not do and every other row does.
Timed load, as ``fit(ckpt_path=...)`` restores (without running a fit): every rank
``strategy.load_checkpoint(path)`` (torch.load), ``strategy.load_model_state_dict`` and
``strategy.load_optimizer_state_dict``, into the trainer's own module and optimizer.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader, TensorDataset

from _common import clean, fsync_file
from _tools import Tool, scratch_path


class ZeroMLP(pl.LightningModule):
    def __init__(self, layers: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).sum()

    def configure_optimizers(self) -> ZeroRedundancyOptimizer:
        return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)


def _quiet() -> None:
    for name in ("pytorch_lightning", "lightning_fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")


def make_trainer(world: int, root: str, strategy: Any, max_steps: int, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU Trainer joining the ranks the benchmark launched (LOCAL_RANK is set)."""
    _quiet()
    return pl.Trainer(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **kwargs,
    )


def data(world: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    torch.manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(8 * world, 1024)), batch_size=8)


def fitted_trainer(layers: int, world: int, root: str, strategy: Any = "ddp") -> pl.Trainer:
    """Fitted one step, so that Adam's state exists."""
    trainer = make_trainer(world, root, strategy, max_steps=1)
    trainer.fit(ZeroMLP(layers), data(world))
    return trainer


def lightning_tool(layers: int, rank: int, world: int, root: str) -> Tool:
    trainer = fitted_trainer(layers, world, root)
    path = scratch_path(root, "lightning.ckpt")

    def save() -> None:
        trainer.save_checkpoint(path)
        if rank == 0:
            fsync_file(path)

    def load() -> None:
        ckpt = trainer.strategy.load_checkpoint(path)
        trainer.strategy.load_model_state_dict(ckpt)
        trainer.strategy.load_optimizer_state_dict(ckpt)

    return Tool(save, lambda: clean(path), load, save, lambda: clean(path), path)
