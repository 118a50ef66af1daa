"""``"zero"``: DDP, plus the module's optimizer wrapped in ``ZeroRedundancyOptimizer``.

Each rank then keeps the optimizer state of only its share of the parameters. The module
writes an ordinary ``configure_optimizers``; this strategy rebuilds that optimizer as
ZeRO with the same class, param groups and hyperparameters. Checkpointing needs nothing
special: the engine's ZeRO adapter saves each rank's share and reshards it on load.
"""

from __future__ import annotations

import inspect

from torch import nn
from torch.optim import Optimizer

from .base import Strategy
from .ddp import ddp_wrap


class ZeroStrategy(Strategy):
    """DDP with ZeRO-1 optimizer state sharding."""

    name = "zero"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return ddp_wrap(model, self)

    def wrap_optimizer(self, optimizer: Optimizer) -> Optimizer:
        # Imported here: it pulls in FSDP and DTensor, most of a second at start-up.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if callable(getattr(optimizer, "consolidate_state_dict", None)):
            return optimizer  # already sharded (ZeRO or OSS built by the module)
        # ``defaults`` may hold keys the constructor does not take (AdamW's
        # ``decoupled_weight_decay``); the param groups carry every value anyway.
        accepted = inspect.signature(type(optimizer)).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        # The groups are the same dicts, so the ZeRO wrapper and a scheduler built on
        # ``optimizer`` see the same learning rates.
        return ZeroRedundancyOptimizer(
            optimizer.param_groups, optimizer_class=type(optimizer), **defaults
        )
