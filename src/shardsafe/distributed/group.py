"""The default process group as shardsafe sees it: rank, world size, store, device."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def default_store() -> Any:
    """The key-value store ``init_process_group`` (or torchrun) created."""
    return dist.distributed_c10d._get_default_store()


def comm_device() -> torch.device:
    """Where tensors must be to travel over the default group: CUDA for NCCL, else CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
