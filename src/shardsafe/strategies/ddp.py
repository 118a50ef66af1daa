"""``"ddp"``: every rank holds the whole model; gradients are averaged by DDP.

The optimizer is whatever ``configure_optimizers`` returns, including a ZeRO or OSS
optimizer the module builds itself: the checkpoint engine handles its sharded state.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .base import Strategy


def ddp_wrap(model: nn.Module, strategy: Strategy) -> nn.Module:
    """Wrap ``model`` in DDP on the strategy's device (DDP broadcasts rank 0's weights)."""
    model = model.to(strategy.device)
    device_ids = [strategy.device.index] if strategy.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


class DDPStrategy(Strategy):
    """Data parallel: one full replica per rank."""

    name = "ddp"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return ddp_wrap(model, self)
