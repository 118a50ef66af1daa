"""Training strategies, by the name ``Trainer(strategy=...)`` takes.

Each is a small sibling of :class:`~shardsafe.strategies.base.Strategy`; none subclasses
another. Adding one means writing a subclass and listing it here.
"""

from __future__ import annotations

from .base import Environment, Strategy
from .ddp import DDPStrategy
from .fsdp import FSDPStrategy
from .single import SingleStrategy
from .zero import ZeroStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (SingleStrategy, DDPStrategy, ZeroStrategy, FSDPStrategy)
}

__all__ = ["STRATEGIES", "Environment", "Strategy"]
