"""The safetensors header: built for a file's tensors, and parsed as hostile input.

The header rules are safetensors' own (its Rust ``Metadata::validate``): at most 10^8
header bytes, ``__metadata__`` a map of strings, and tensors packed back to back from the
start of the data section to its end, without gaps or overlaps; only duplicate names are
refused here where safetensors would keep the last. So a file this parser accepts is one
every safetensors tool can read (``test_safetensors_io`` checks the two agree). The
header's own CRC32 is recorded in the manifest and checked before it is parsed.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch

from ... import dtypes
from ...errors import CheckpointCorruptError, CheckpointError
from .crc import crc32
from .manifest_format import MAX_NDIM
from .strict_json import int_parser, why_not_json

MAX_HEADER_BYTES = 100_000_000
"""safetensors' own limit (``MAX_HEADER_SIZE``)."""


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Absolute offset of the first data byte in the file."""
    nbytes: int


def build_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The length prefix and JSON header for tensors laid out back to back, in order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * dtypes.itemsize(dtype)
        header[name] = {
            "dtype": dtypes.safetensors_code(dtype),
            "shape": list(shape),
            "data_offsets": [pos, pos + n],
        }
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    if len(raw) > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"a data file would hold {len(entries)} tensors, whose names make a safetensors "
            f"header of {len(raw)} bytes, over safetensors' limit of {MAX_HEADER_BYTES}"
        )
    return struct.pack("<Q", len(raw)) + raw


def parse_header(
    name: str, raw: bytes, file_size: int, expected_crc32: int | None = None
) -> dict[str, HeaderEntry]:
    """Validate header bytes (from :func:`read_header_bytes`) of a file of ``file_size``."""
    if expected_crc32 is not None and crc32(memoryview(raw), 0) != expected_crc32:
        raise CheckpointCorruptError(
            f"{name} has a damaged safetensors header: its CRC32 does not match the one in "
            "the manifest (the file was modified or corrupted after the save)"
        )
    header = _parse_header(name, memoryview(raw)[8:])
    data_start = len(raw)
    data_len = file_size - data_start
    entries = {}
    for key, rec in header.items():
        if key == "__metadata__":
            if not (isinstance(rec, dict) and all(isinstance(v, str) for v in rec.values())):
                raise CheckpointCorruptError(
                    f"{name}'s safetensors __metadata__ is not a map of strings"
                )
            continue
        entries[key] = _header_entry(name, key, rec, data_start, data_len)
    _check_packed(name, entries, data_start, data_len)
    return entries


def _parse_header(name: str, raw: memoryview) -> dict[str, object]:
    try:
        header = json.loads(
            bytes(raw).decode("utf-8"), object_pairs_hook=_unique_keys, parse_int=int_parser()
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else why_not_json(e)
        raise CheckpointCorruptError(f"{name} has a damaged safetensors header ({why})") from None
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{name}'s safetensors header is not an object")
    return header


def _check_packed(file: str, entries: dict[str, HeaderEntry], start: int, length: int) -> None:
    """Tensors lie back to back and fill the data section, as the safetensors spec says:
    no tensor may share bytes with another (or a small file could back any number of
    tensors, and a reader allocate far more than it holds), and no byte is unaccounted."""
    end, last = start, ""
    for e in sorted(entries.values(), key=lambda e: (e.start, e.nbytes)):
        if e.start < end:
            raise CheckpointCorruptError(
                f"{file}: tensor {e.name!r} in the safetensors header overlaps tensor {last!r}"
            )
        if e.start > end:
            raise CheckpointCorruptError(
                f"{file}: the safetensors header leaves bytes {end - start}..{e.start - start} "
                f"of the data section before tensor {e.name!r} unused"
            )
        end, last = e.start + e.nbytes, e.name
    if end != start + length:
        raise CheckpointCorruptError(
            f"{file}: the safetensors header accounts for {end - start} bytes of data, but the "
            f"file's data section holds {length}"
        )


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate tensor names")
    return dict(pairs)


def _header_entry(file: str, key: str, rec: object, data_start: int, data_len: int) -> HeaderEntry:
    def bad(problem: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{file}: tensor {key!r} in the safetensors header {problem}")

    if not isinstance(rec, dict):
        raise bad("is not an object")
    dtype = dtypes.from_safetensors_code(rec.get("dtype"))
    if dtype is None:
        raise bad(f"has unknown dtype {rec.get('dtype')!r}")
    shape, offs = rec.get("shape"), rec.get("data_offsets")
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_NDIM
        and all(type(n) is int and n >= 0 for n in shape)
    ):
        raise bad("has an invalid shape")
    if not (isinstance(offs, list) and len(offs) == 2 and all(type(n) is int for n in offs)):
        raise bad("has invalid data_offsets")
    begin, end = offs
    nbytes = math.prod(shape) * dtypes.itemsize(dtype)
    if not 0 <= begin <= end <= data_len:
        raise CheckpointCorruptError(
            f"{file} is truncated or damaged: tensor {key!r} claims bytes {begin}..{end} but "
            f"the data section holds {data_len}"
        )
    if end - begin != nbytes:
        # A product of forged dimensions may have more digits than str() converts.
        need = nbytes if nbytes < 1 << 64 else "over 2**64"
        raise bad(f"occupies {end - begin} bytes but its shape and dtype need {need}")
    if math.prod(max(n, 1) for n in shape) >= 1 << 63:  # empty, yet no torch.empty makes it
        raise bad(f"has a shape too large for any tensor ({len(shape)} dimensions)")
    return HeaderEntry(key, dtype, tuple(shape), data_start + begin, nbytes)
