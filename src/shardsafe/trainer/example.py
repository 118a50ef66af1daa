"""The built-in example that ``shardsafe fit`` trains without ``--module``.

A small MLP *student* learns to imitate a fixed, randomly initialised *teacher* MLP on
synthetic inputs. Everything (teacher, data, the student's initial weights) comes from
the seed, so nothing is downloaded and every run with the same seed is the same run.
The loss falls steadily from about 1, which makes a working setup visible at a glance.

The learning-rate schedule (linear warm-up, then inverse square root) depends only on
the step, never on ``max_steps``: a finished run can be extended by resuming it with a
larger ``--max-steps`` and it continues exactly as a longer run would have.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset

from .module import TrainingModule

OPTIMIZERS = ("adamw", "zero", "oss")
WARMUP_STEPS = 10


def learning_rate_factor(step: int) -> float:
    """Linear warm-up over ``WARMUP_STEPS``, then decay as ``1/sqrt(step)``."""
    step += 1
    return min(step / WARMUP_STEPS, math.sqrt(WARMUP_STEPS / step))


class ExampleModule(TrainingModule):
    """A student MLP regressing a fixed random teacher MLP (see the module docstring).

    ``optimizer``: ``"adamw"``, or ``"zero"``/``"oss"`` for an AdamW wrapped by this
    module itself in ``ZeroRedundancyOptimizer`` / fairscale ``OSS``, the case of a user
    who shards the optimizer inside ``configure_optimizers`` under plain ``"ddp"``.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        optimizer: str = "adamw",
        features: int = 16,
        hidden: int = 64,
        outputs: int = 4,
        samples: int = 4096,
        batch_size: int = 32,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is not one of {OPTIMIZERS}")
        self.optimizer_kind = optimizer
        self.batch_size = batch_size
        self.lr = lr
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(samples, features, generator=generator, device="cpu")
        with torch.no_grad():
            teacher = _mlp(features, hidden, outputs, generator)
            targets = teacher(inputs)
            targets = (targets - targets.mean(0)) / targets.std(0)
        self.data = TensorDataset(inputs, targets)
        self.net = _mlp(features, hidden, outputs, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> tuple[Optimizer, LambdaLR]:
        optimizer: Optimizer
        if self.optimizer_kind == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(
                self.parameters(), optimizer_class=torch.optim.AdamW, lr=self.lr
            )
        elif self.optimizer_kind == "oss":
            from fairscale.optim import OSS

            optimizer = OSS(self.parameters(), optim=torch.optim.AdamW, lr=self.lr)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return optimizer, LambdaLR(optimizer, learning_rate_factor)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


def _mlp(features: int, hidden: int, outputs: int, generator: torch.Generator) -> nn.Sequential:
    """An MLP whose weights come from ``generator``, not from the global RNG."""
    net = nn.Sequential(
        nn.Linear(features, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, outputs),
    )
    with torch.no_grad():
        for layer in net:
            if isinstance(layer, nn.Linear):
                bound = 1 / math.sqrt(layer.in_features)
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)
    return net
