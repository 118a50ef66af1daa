"""``TrainingModule``: what a user writes to be trained by :class:`shardsafe.Trainer`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader


class TrainingModule(nn.Module):
    """An ``nn.Module`` that knows how to compute its loss and build its optimizer::

        class Regression(shardsafe.TrainingModule):
            def __init__(self):
                super().__init__()
                self.net = nn.Linear(16, 1)

            def forward(self, x):
                return self.net(x)

            def training_step(self, batch, batch_idx):
                x, y = batch
                return F.mse_loss(self(x), y)

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-3)

            def train_dataloader(self):
                return DataLoader(dataset, batch_size=32, shuffle=True)

    ``configure_optimizers`` runs after the process group exists and after the strategy
    has wrapped the model, so it may build a ``ZeroRedundancyOptimizer`` or fairscale
    ``OSS`` itself, and under ``"fsdp"`` ``self.parameters()`` are the sharded ones.
    """

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The loss of one batch, a scalar tensor; the trainer calls ``backward`` on it."""
        raise NotImplementedError(f"{type(self).__name__} must define training_step()")

    def configure_optimizers(self) -> Optimizer | tuple[Optimizer, LRScheduler]:
        """An optimizer, or ``(optimizer, lr_scheduler)``; the scheduler steps every step
        (so not ``ReduceLROnPlateau``, whose step needs a metric: refused)."""
        raise NotImplementedError(f"{type(self).__name__} must define configure_optimizers()")

    def train_dataloader(self) -> DataLoader[Any] | None:
        """The training data; ``None`` means it is passed to ``Trainer.fit`` instead.

        Only the dataset, batch size, shuffle flag and loading options are used: the
        trainer draws indices itself, so it can split them across ranks and resume in the
        middle of an epoch without loading the batches already trained on.
        """
        return None


class TrainingStep(nn.Module):
    """Makes ``forward`` run ``training_step``, so DDP and FSDP see the step as a forward.

    DDP synchronises gradients, and FSDP gathers parameters, from hooks around
    ``forward``; ``training_step`` called directly would bypass them.
    """

    def __init__(self, module: TrainingModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.module.training_step(batch, batch_idx)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"{type(self.module).__name__}.training_step() must return the loss as a "
                f"scalar tensor, got {loss!r:.100}"
            )
        return loss
