"""Streaming writes and header reads of safetensors files, with per-block CRC32.

Why not ``safetensors.torch.save_file``: it needs every tensor in memory at once, while a
consolidated save must stream tensors that arrive piece by piece from other ranks in
bounded memory. The format is simple (an 8-byte header length, a JSON header, raw
little-endian bytes), so the writer emits it directly; the test suite checks that
``safetensors.torch.load_file`` reads every file it writes. The header itself is built and
checked in ``format/safetensors_header.py``; here it is read within safetensors' limits.

Checksums: each tensor's bytes are cut into blocks of ``block_bytes``, one CRC32 each, so
a reader that needs a slice of a large tensor verifies only the blocks it reads. The
header (length prefix and JSON) has one CRC32 of its own, recorded in the manifest and
checked before the header is parsed.
"""

from __future__ import annotations

import math
import struct
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ... import dtypes
from ...errors import CheckpointCorruptError
from ..format.crc import BlockCrc, crc32
from ..format.safetensors_header import MAX_HEADER_BYTES, HeaderEntry, build_header, parse_header
from ..storage.protocol import FileReader, FileSink

_OVERLAP_MIN_BYTES = 1 << 20
_crc_pool: ThreadPoolExecutor | None = None


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


def header_length(name: str, prefix: bytes, file_size: int) -> int:
    """The header length an 8-byte length prefix declares, within safetensors' limits and
    the file's size."""
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise CheckpointCorruptError(
            f"{name} has a truncated or damaged safetensors header (declares {length} header "
            f"bytes in a {file_size}-byte file)"
        )
    return int(length)


def read_header_bytes(reader: FileReader) -> bytes:
    """The length prefix and JSON header of a file, within safetensors' limits."""
    name = reader.name
    if reader.size < 8:
        raise CheckpointCorruptError(f"{name} is truncated: {reader.size} bytes, no header")
    prefix = bytearray(8)
    reader.read_into(0, memoryview(prefix))
    length = header_length(name, bytes(prefix), reader.size)
    raw = bytearray(8 + length)
    raw[:8] = prefix
    reader.read_into(8, memoryview(raw)[8:])
    return bytes(raw)
