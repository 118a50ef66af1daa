"""``"fsdp"``: FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded.

Every module that directly owns parameters becomes one FSDP unit (unless it shares one
with another module: a tied weight stays in the root's unit), and the step wrapper is
the root, so parameters are gathered whichever submodules ``training_step`` calls. The
parameters become DTensors; the optimizer, built afterwards in ``configure_optimizers``,
holds DTensor state. The engine's adapters save each rank's local shard at its global
offsets, so nothing here is checkpoint-specific.

``fully_shard`` does not broadcast: ranks would start from different weights if the
module was initialised differently on each, so rank 0's weights are broadcast first.
"""

from __future__ import annotations

from torch import nn

from .base import Strategy, broadcast_from_rank0


class FSDPStrategy(Strategy):
    """Fully sharded data parallel (FSDP2); runs on CPU with gloo and on CUDA with NCCL."""

    name = "fsdp"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = model.to(self.device)
        broadcast_from_rank0(model)
        mesh = init_device_mesh(self.device.type, (self.env.world_size,))
        shared = _shared_parameters(model)
        # Reversed pre-order: every unit is sharded before any of its ancestors.
        for sub in reversed(list(model.modules())):
            direct = [id(p) for p in sub.parameters(recurse=False)]
            if sub is not model and direct and not shared.intersection(direct):
                fully_shard(sub, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model


def _shared_parameters(model: nn.Module) -> set[int]:
    """Parameters that several modules own directly (an embedding tied to the output
    layer). They stay in the root unit, which is gathered for the whole step: in a unit
    of their own module the other one would meet them sharded, and torch refuses a
    parameter in two units ("shared with a parameter already managed by another FSDP
    group")."""
    owners: dict[int, int] = {}
    for sub in model.modules():
        for p in sub.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {key for key, count in owners.items() if count > 1}
