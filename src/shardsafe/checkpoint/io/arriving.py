"""Checking a data file's bytes as they arrive, in order, before they are ever read back.

A replica received from a peer (``tiers/transfer.py``) is checked before it is committed.
Written first and then read back to be checked, every byte would cross the memory bus
once more; checked in the receive buffer on its way to the file, it does not. The checks
are the reader's own (:class:`~shardsafe.checkpoint.io.reader.CheckpointReader`): the
header's length prefix within safetensors' limits, its CRC32 and contents against the
manifest, and every block of every tensor stored in the file against its CRC32.
"""

from __future__ import annotations

import bisect

from ...errors import CheckpointCorruptError, CheckpointError
from ..format.manifest import ChunkRecord, Manifest, TensorRecord
from ..format.safetensors_header import parse_header
from .reader import BlockChecker, entry_for
from .safetensors_io import header_length

Piece = tuple[str, TensorRecord, ChunkRecord]
"""A tensor piece a manifest stores in a file: its key, its tensor, its chunk."""


def pieces_by_file(manifest: Manifest) -> dict[str, list[Piece]]:
    """Every file's pieces, in one pass over the manifest (not one pass per file)."""
    found: dict[str, list[Piece]] = {name: [] for name in manifest.files}
    for key, rec in manifest.tensors.items():
        for chunk in rec.chunks:
            found.setdefault(chunk.file, []).append((key, rec, chunk))
    return found


class ArrivingFile:
    """Data file ``name`` of ``manifest``, fed its bytes in order (:meth:`feed`); once all
    have arrived, :meth:`finish` says what is wrong with them, or ``None``. A problem stops
    the checking; the bytes may go on arriving. ``pieces``: the file's, from
    :func:`pieces_by_file`. Stricter than the reader in one way: the header must list
    exactly the manifest's pieces, so that every byte of the file is checked."""

    def __init__(self, manifest: Manifest, name: str, pieces: list[Piece]) -> None:
        self.manifest, self.name, self.size = manifest, name, manifest.files[name]
        self._pieces = pieces
        self._head = bytearray()
        self._head_bytes: int | None = None  # the length prefix's, once it has arrived
        self._starts: list[int] = []
        self._spans: list[tuple[int, int, BlockChecker]] | None = None
        self._at = 0
        self.problem: str | None = None

    def feed(self, data: memoryview) -> None:
        if self.problem is None:
            try:
                self._feed(data)
            except CheckpointError as e:
                self.problem = str(e)

    def finish(self) -> str | None:
        """What is wrong with the file, all of it having arrived; ``None``: nothing."""
        if self.problem is None and (self._spans is None or self._at != self.size):
            self.problem = f"{self.name}: {self._at} of its {self.size} bytes arrived"
        if self.problem is None:
            try:
                for _, _, checker in self._spans or []:
                    checker.finish()
            except CheckpointError as e:
                self.problem = str(e)
        return self.problem

    def _feed(self, data: memoryview) -> None:
        while self._spans is None and data.nbytes:
            wanted = 8 if self._head_bytes is None else self._head_bytes
            take = min(wanted - len(self._head), data.nbytes)
            self._head += data[:take]
            data, self._at = data[take:], self._at + take
            if len(self._head) < wanted:
                return
            if self._head_bytes is None:  # the prefix is in: now the header it declares
                self._head_bytes = 8 + header_length(self.name, bytes(self._head), self.size)
            if len(self._head) == self._head_bytes:
                self._spans = self._tensors(bytes(self._head))
                self._starts = [start for start, _, _ in self._spans]
                self._head = bytearray()
        if not data.nbytes:
            return
        begin, end = self._at, self._at + data.nbytes
        self._at = end
        spans = self._spans
        assert spans is not None
        # The last piece starting at or before ``begin`` (pieces do not overlap; two
        # records of one piece start together), and on.
        last = bisect.bisect_right(self._starts, begin) - 1
        index = bisect.bisect_left(self._starts, self._starts[last]) if last >= 0 else 0
        while index < len(spans) and spans[index][0] < end:
            start, stop, checker = spans[index]
            low, high = max(start, begin), min(stop, end)
            if low < high:
                checker.feed(data[low - begin : high - begin])
            index += 1

    def _tensors(self, header: bytes) -> list[tuple[int, int, BlockChecker]]:
        """Where each tensor piece stored in this file lies, with its checker; the header
        checked against the manifest first (``parse_header`` refuses overlaps and gaps)."""
        manifest = self.manifest
        headers = parse_header(self.name, header, self.size, manifest.header_crc32.get(self.name))
        listed = {chunk.name for _, _, chunk in self._pieces}
        unlisted = sorted(set(headers) - listed)
        if unlisted:
            raise CheckpointCorruptError(
                f"{self.name} holds tensors its manifest does not list: {unlisted[:3]}"
            )
        spans = []
        for key, rec, chunk in self._pieces:
            entry = entry_for(headers, key, rec, chunk)
            checker = BlockChecker(key, chunk, manifest.block_bytes, 0)
            spans.append((entry.start, entry.start + entry.nbytes, checker))
        return sorted(spans, key=lambda span: span[0])
