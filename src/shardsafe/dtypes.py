"""Dtypes by name: the ones a checkpoint's tensors can have (with their safetensors
codes), and every torch dtype a state value may mention (an AMP ``dtype`` setting).

Names are resolved from fixed tables built at import, never with ``getattr(torch,
name)``: a name from a hostile manifest such as ``_inductor`` would import a package.
"""

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
    if isinstance(_dtype := torch.__dict__.get(_name), torch.dtype):
        _SAFETENSORS_CODES[_dtype] = _code

_BY_CODE: dict[str, torch.dtype] = {code: d for d, code in _SAFETENSORS_CODES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the spelling used in the manifest."""
    return str(dtype).removeprefix("torch.")


_BY_NAME: dict[str, torch.dtype] = {dtype_name(d): d for d in _SAFETENSORS_CODES}


_ALL_NAMES = (
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "qint8", "qint32", "quint8", "quint4x2", "quint2x4",
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
)  # fmt: skip
_ANY_BY_NAME: dict[str, torch.dtype] = {
    name: dtype for name in _ALL_NAMES if isinstance(dtype := torch.__dict__.get(name), torch.dtype)
}


def all_names() -> tuple[str, ...]:
    """Every dtype name :func:`any_from_name` knows (a fixed table, for allowlists)."""
    return tuple(_ANY_BY_NAME)


def any_from_name(name: object) -> torch.dtype | None:
    """Any torch dtype by its manifest name (``"float32"``), or ``None``; never imports."""
    return _ANY_BY_NAME.get(name) if isinstance(name, str) else None


def is_supported(dtype: torch.dtype) -> bool:
    return dtype in _SAFETENSORS_CODES


_NOT_IN_TORCH_SAVE = frozenset(
    {
        *("qint8", "qint32", "quint8", "quint4x2", "quint2x4"),
        *(f"uint{bits}" for bits in range(1, 8)),
        *(f"int{bits}" for bits in range(1, 8)),
    }
)
"""Dtypes ``torch.save`` cannot write a plain tensor of: the quantized ones (a plain tensor
of one has no quantizer, and torch.save fails an internal assert) and the sub-byte ones
(``KeyError: 'dtype torch.uint4 is not recognized'``). Pinned against torch by a test."""


def torch_save_stores(dtype: torch.dtype) -> bool:
    """Whether ``torch.save`` (DCP's encoding of each chunk) writes a tensor of ``dtype``."""
    return dtype_name(dtype) not in _NOT_IN_TORCH_SAVE


def safetensors_code(dtype: torch.dtype) -> str:
    return _SAFETENSORS_CODES[dtype]


def from_name(name: object) -> torch.dtype | None:
    """The dtype a manifest names, or ``None`` if it names none we know."""
    return _BY_NAME.get(name) if isinstance(name, str) else None


def from_safetensors_code(code: object) -> torch.dtype | None:
    return _BY_CODE.get(code) if isinstance(code, str) else None


def itemsize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)
