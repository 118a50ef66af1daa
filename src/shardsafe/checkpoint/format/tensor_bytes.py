"""A tensor's bytes as the format stores them: raw, contiguous, in the machine's order.

Views only, never copies: what is written, sent and checksummed is the tensor's own
memory.
"""

from __future__ import annotations

import ctypes

import torch


def has_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has memory of its own (a wrapper subclass, such as a TwoTensor,
    has none: its data lives in the tensors it wraps)."""
    try:
        tensor.untyped_storage().data_ptr()
    except Exception:  # torch raises RuntimeError or NotImplementedError
        return False
    return True


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's bytes (no copy)."""
    flat = tensor.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.view(torch.uint8)


def memory(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no copy, no numpy).

    The view keeps the tensor alive, so it stays valid however long it is held.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("memory() needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    try:
        address = tensor.data_ptr()
    except RuntimeError:
        address = 0
    if not address:  # a wrapper subclass has no memory of its own: reading 0 would crash
        raise ValueError(
            f"memory() needs a tensor with memory of its own, not a {type(tensor).__name__}"
        )
    array = (ctypes.c_ubyte * nbytes).from_address(address)
    array._shardsafe_owner = tensor  # type: ignore[attr-defined]
    return memoryview(array).cast("B")
