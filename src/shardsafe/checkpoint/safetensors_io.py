"""Streaming reads and writes of the safetensors format, with per-block CRC32.

Why not ``safetensors.torch.save_file``: it needs every tensor in memory at once, while a
consolidated save must stream tensors that arrive piece by piece from other ranks in
bounded memory. The format is simple (an 8-byte header length, a JSON header, raw
little-endian bytes), so the writer emits it directly; the test suite checks that
``safetensors.torch.load_file`` reads every file it writes. Reads parse and validate the
header here too, because a reader must check a hostile header before trusting offsets.

Checksums: each tensor's bytes are cut into blocks of ``block_bytes``, one CRC32 each, so
a reader that needs a slice of a large tensor verifies only the blocks it reads. The
header (length prefix and JSON) has one CRC32 of its own, recorded in the manifest and
checked before the header is parsed.

The header rules are safetensors' own (its Rust ``Metadata::validate``): at most 10^8
header bytes, ``__metadata__`` a map of strings, and tensors packed back to back from the
start of the data section to its end, without gaps or overlaps; only duplicate names are
refused here where safetensors would keep the last. So a file this reader accepts is one
every safetensors tool can read (``test_safetensors_io`` checks the two agree).
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .. import dtypes
from ..errors import CheckpointCorruptError, CheckpointError
from .crc import crc32
from .manifest_format import MAX_NDIM
from .storage import FileReader, FileSink
from .strict_json import int_parser, why_not_json

MAX_HEADER_BYTES = 100_000_000
"""safetensors' own limit (``MAX_HEADER_SIZE``)."""
_OVERLAP_MIN_BYTES = 1 << 20
_crc_pool: ThreadPoolExecutor | None = None


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
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    array._shardsafe_owner = tensor  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


class BlockCrc:
    """CRC32 of consecutive ``block_bytes`` blocks of a byte stream fed in arbitrary pieces."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.values: list[int] = []
        self._crc = 0
        self._filled = 0

    def update(self, data: memoryview) -> None:
        while data.nbytes:
            take = min(self.block_bytes - self._filled, data.nbytes)
            self._crc = crc32(data[:take], self._crc)
            self._filled += take
            data = data[take:]
            if self._filled == self.block_bytes:
                self.values.append(self._crc)
                self._crc, self._filled = 0, 0

    def finish(self) -> tuple[int, ...]:
        if self._filled or not self.values:
            self.values.append(self._crc)
        return tuple(self.values)


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


class StreamWriter:
    """Writes one safetensors file whose tensors' bytes arrive in order, in pieces.

    Two ways to checksum, for two kinds of save:

    * ``cache_bytes=0`` (a blocking save, where wall time is all that counts): the CRC of
      each piece runs on a helper thread while the piece is written (both release the
      GIL), so checksums add almost nothing to the wall time.
    * ``cache_bytes>0`` (a background save, which must take as little as it can from the
      training running beside it): one thread checksums then writes each piece of at
      most ``cache_bytes``, while it is still in the core's cache. The bytes cross the
      memory bus once instead of twice, and no second thread competes for a core; with a
      fast CRC (``crc.py``) the write is no slower, since the disk sets its pace.
    """

    def __init__(
        self,
        sink: FileSink,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        block_bytes: int,
        checksummed_elsewhere: frozenset[str] = frozenset(),
        *,
        cache_bytes: int = 0,
    ) -> None:
        self._sink = sink
        self._cache_bytes = cache_bytes
        self._names = [name for name, _, _ in entries]
        self._elsewhere = checksummed_elsewhere
        self._sizes = [math.prod(s) * dtypes.itemsize(d) for _, d, s in entries]
        self._block_bytes = block_bytes
        self._index = 0
        self._left = self._sizes[0] if self._sizes else 0
        self._crc = BlockCrc(block_bytes)
        self._crcs: dict[str, tuple[int, ...]] = {}
        self._skip_empty()
        try:
            header = build_header(entries)
            self.header_crc32 = crc32(memoryview(header), 0)
            """CRC32 of the length prefix and JSON header, recorded in the manifest."""
            sink.write(memoryview(header))
        except BaseException:
            sink.abort()
            raise

    def write(self, data: memoryview) -> None:
        """Append the next bytes of the stream (may span several tensors)."""
        data = data.cast("B") if data.format != "B" else data
        while data.nbytes:
            if self._index >= len(self._sizes):
                raise ValueError("more bytes written than the header declares")
            take = min(self._left, data.nbytes)
            self._write_piece(data[:take])
            data = data[take:]
            self._left -= take
            self._skip_empty()

    def _write_piece(self, piece: memoryview) -> None:
        if self._names[self._index] in self._elsewhere:
            self._sink.write(piece)
            return
        if self._cache_bytes:
            for at in range(0, piece.nbytes, self._cache_bytes):
                part = piece[at : at + self._cache_bytes]
                self._crc.update(part)
                self._sink.write(part)
            return
        if piece.nbytes < _OVERLAP_MIN_BYTES:
            self._crc.update(piece)
            self._sink.write(piece)
            return
        pending: Future[None] = _pool().submit(self._crc.update, piece)
        try:
            self._sink.write(piece)
        finally:
            pending.result()

    def _skip_empty(self) -> None:
        while self._index < len(self._sizes) and self._left == 0:
            if self._names[self._index] not in self._elsewhere:
                self._crcs[self._names[self._index]] = self._crc.finish()
            self._crc = BlockCrc(self._block_bytes)
            self._index += 1
            self._left = self._sizes[self._index] if self._index < len(self._sizes) else 0

    def abort(self) -> None:
        """Close the file after a failure (the caller removes it)."""
        self._sink.abort()

    def finish(self) -> tuple[int, dict[str, tuple[int, ...]]]:
        """fsync and close; return the file size and each tensor's block CRCs."""
        if self._index < len(self._sizes):
            raise ValueError(f"tensor {self._names[self._index]!r} was not fully written")
        return self._sink.finish(), self._crcs


def _pool() -> ThreadPoolExecutor:
    global _crc_pool
    if _crc_pool is None:
        _crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardsafe-crc")
    return _crc_pool


def read_header(reader: FileReader, expected_crc32: int | None = None) -> dict[str, HeaderEntry]:
    """Parse and validate a safetensors header; every offset is checked against the file.

    With ``expected_crc32`` (from the manifest) the header's bytes are checked against it
    before they are parsed.
    """
    return parse_header(reader.name, read_header_bytes(reader), reader.size, expected_crc32)


def read_header_bytes(reader: FileReader) -> bytes:
    """The length prefix and JSON header of a file, within safetensors' limits."""
    name = reader.name
    if reader.size < 8:
        raise CheckpointCorruptError(f"{name} is truncated: {reader.size} bytes, no header")
    prefix = bytearray(8)
    reader.read_into(0, memoryview(prefix))
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES or 8 + length > reader.size:
        raise CheckpointCorruptError(
            f"{name} has a truncated or damaged safetensors header (declares {length} header "
            f"bytes in a {reader.size}-byte file)"
        )
    raw = bytearray(8 + length)
    raw[:8] = prefix
    reader.read_into(8, memoryview(raw)[8:])
    return bytes(raw)


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
