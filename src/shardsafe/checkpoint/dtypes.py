"""The dtypes a checkpoint can hold, by their manifest name and their safetensors code."""

from __future__ import annotations

import torch

_SAFETENSORS_CODES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.complex64: "C64",
}
for _name, _code in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
):
    if hasattr(torch, _name):
        _SAFETENSORS_CODES[getattr(torch, _name)] = _code

_BY_CODE: dict[str, torch.dtype] = {code: d for d, code in _SAFETENSORS_CODES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the spelling used in the manifest."""
    return str(dtype).removeprefix("torch.")


_BY_NAME: dict[str, torch.dtype] = {dtype_name(d): d for d in _SAFETENSORS_CODES}


def is_supported(dtype: torch.dtype) -> bool:
    return dtype in _SAFETENSORS_CODES


def safetensors_code(dtype: torch.dtype) -> str:
    return _SAFETENSORS_CODES[dtype]


def from_name(name: object) -> torch.dtype | None:
    """The dtype a manifest names, or ``None`` if it names none we know."""
    return _BY_NAME.get(name) if isinstance(name, str) else None


def from_safetensors_code(code: object) -> torch.dtype | None:
    return _BY_CODE.get(code) if isinstance(code, str) else None


def itemsize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)
