"""``"single"``: one process, no process group, no wrapping."""

from __future__ import annotations

from torch import nn

from .base import Strategy


class SingleStrategy(Strategy):
    """Train in this process only; ``devices`` must be 1."""

    name = "single"
    uses_process_group = False

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)
