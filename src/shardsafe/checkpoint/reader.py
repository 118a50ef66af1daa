"""Reading regions of saved tensors, verified against their checksums.

A rank asks for a box of a tensor (all of it, or its own shard at a new world size). The
reader finds the saved chunks that overlap the box and reads, from each, only the byte
span the overlap occupies, rounded out to whole checksum blocks; it verifies those
blocks and copies the overlap into place. A chunk that exactly matches the request is
read straight into the result, with no intermediate copy.
"""

from __future__ import annotations

import torch

from .. import dtypes
from ..errors import CheckpointCorruptError, CheckpointError
from . import geometry
from .crc import crc32
from .manifest import ChunkRecord, Manifest, TensorRecord
from .safetensors_io import HeaderEntry, memory, parse_header, read_header_bytes
from .storage import LocalFileReader, LocalStorage


class CheckpointReader:
    """Opens data files lazily; validates each file against the manifest once."""

    def __init__(
        self, storage: LocalStorage, manifest: Manifest, *, keep_header_bytes: bool = False
    ) -> None:
        self.storage = storage
        self.manifest = manifest
        self.header_bytes: dict[str, bytes] = {}
        """With ``keep_header_bytes``: each opened file's raw header (for ``verify``)."""
        self._keep_header_bytes = keep_header_bytes
        self._open: dict[str, tuple[LocalFileReader, dict[str, HeaderEntry]]] = {}
        self._failed: dict[str, CheckpointCorruptError] = {}
        """A file found bad once is not reopened (a FIFO, a device) for its next chunk."""

    def close(self) -> None:
        for reader, _ in self._open.values():
            reader.close()
        self._open.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(
        self, key: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """The box ``offsets``/``shape`` (default: everything) of tensor ``key``, on CPU."""
        rec = self.manifest.tensors[key]
        box = (
            (offsets, shape)
            if offsets is not None and shape is not None
            else ((0,) * len(rec.shape), rec.shape)
        )
        pieces = [
            (chunk, overlap)
            for chunk in rec.chunks
            if (overlap := geometry.intersect((chunk.offsets, chunk.shape), box)) is not None
        ]
        # Check each piece against its real file before allocating: a hostile manifest can
        # claim any shape, but the chunks must tile it and each must exist on disk.
        for chunk, _ in pieces:
            self._entry(key, rec, chunk)
        out = torch.empty(box[1], dtype=rec.dtype)
        if out.numel() == 0:
            return out
        for chunk, overlap in pieces:
            if overlap == box and chunk.offsets == box[0] and chunk.shape == box[1]:
                self._read_whole(key, rec, chunk, out)
                continue
            rel = (tuple(o - c for o, c in zip(overlap[0], chunk.offsets)), overlap[1])
            dest = tuple(slice(o - b, o - b + n) for o, b, n in zip(overlap[0], box[0], overlap[1]))
            out[dest] = self._read_box(key, rec, chunk, rel)
        return out

    def verify_all(self, skip_files: set[str] | None = None) -> list[str]:
        """Check every chunk of every tensor (but those with chunks in ``skip_files``);
        return one line per problem found.

        Each chunk is read block by block into one reused buffer, so memory stays at one
        checksum block whatever sizes the manifest claims.
        """
        problems = []
        buffer = memoryview(bytearray(self.manifest.block_bytes))
        skip = skip_files or set()
        for key, rec in self.manifest.tensors.items():
            if skip and any(chunk.file in skip for chunk in rec.chunks):
                continue
            for chunk in rec.chunks:
                try:
                    reader, entry = self._entry(key, rec, chunk)
                    for index, start in enumerate(range(0, entry.nbytes, len(buffer))):
                        view = buffer[: min(len(buffer), entry.nbytes - start)]
                        reader.read_into(entry.start + start, view)
                        self._verify(key, chunk, view, index)
                except CheckpointCorruptError as e:
                    problems.append(str(e))
        return problems

    def check_files(self) -> dict[str, str]:
        """Open every data file and check its size and header; ``{file: problem}``."""
        problems = {}
        for name in self.manifest.files:
            try:
                self._file(name)
            except CheckpointError as e:
                problems[name] = str(e)
        return problems

    # -- internals

    def _file(self, name: str) -> tuple[LocalFileReader, dict[str, HeaderEntry]]:
        if name not in self._open:
            if name in self._failed:
                raise self._failed[name]
            try:
                reader = self.storage.open_reader(name)
            except CheckpointCorruptError as e:
                self._failed[name] = e
                raise
            try:
                expected = self.manifest.files[name]
                if reader.size != expected:
                    raise CheckpointCorruptError(
                        f"data file {name} is {reader.size} bytes but the manifest recorded "
                        f"{expected}: it was truncated or modified after the save"
                    )
                raw = read_header_bytes(reader)
                if self._keep_header_bytes:
                    self.header_bytes[name] = raw
                headers = parse_header(name, raw, reader.size, self.manifest.header_crc32.get(name))
            except CheckpointCorruptError as e:
                reader.close()
                self._failed[name] = e
                raise
            except BaseException:
                reader.close()
                raise
            self._open[name] = (reader, headers)
        return self._open[name]

    def _entry(
        self, key: str, rec: TensorRecord, chunk: ChunkRecord
    ) -> tuple[LocalFileReader, HeaderEntry]:
        reader, headers = self._file(chunk.file)
        entry = headers.get(chunk.name)
        if entry is None:
            raise CheckpointCorruptError(
                f"{chunk.file} has no tensor {chunk.name!r}, which the manifest lists for {key!r}"
            )
        if entry.dtype != rec.dtype or entry.shape != chunk.shape:
            raise CheckpointCorruptError(
                f"{chunk.file}: tensor {chunk.name!r} is {dtypes.dtype_name(entry.dtype)}"
                f"{list(entry.shape)} in the safetensors header but "
                f"{dtypes.dtype_name(rec.dtype)}{list(chunk.shape)} in the manifest ({key!r})"
            )
        return reader, entry

    def _read_whole(
        self, key: str, rec: TensorRecord, chunk: ChunkRecord, out: torch.Tensor
    ) -> None:
        reader, entry = self._entry(key, rec, chunk)
        view = memory(out)
        reader.read_into(entry.start, view)
        self._verify(key, chunk, view, 0)

    def _read_box(
        self, key: str, rec: TensorRecord, chunk: ChunkRecord, rel: geometry.Box
    ) -> torch.Tensor:
        reader, entry = self._entry(key, rec, chunk)
        size = dtypes.itemsize(rec.dtype)
        block = self.manifest.block_bytes
        first, stop = geometry.element_span(chunk.shape, rel)
        begin = first * size // block * block
        end = min(-(-stop * size // block) * block, entry.nbytes)
        raw = torch.empty(end - begin, dtype=torch.uint8)
        view = memory(raw)
        reader.read_into(entry.start + begin, view)
        self._verify(key, chunk, view, begin // block)
        typed = raw.view(rec.dtype)
        return typed.as_strided(
            rel[1], geometry.contiguous_strides(chunk.shape), first - begin // size
        )

    def _verify(self, key: str, chunk: ChunkRecord, data: memoryview, first_block: int) -> None:
        block = self.manifest.block_bytes
        for i, start in enumerate(range(0, data.nbytes, block)):
            index = first_block + i
            if crc32(data[start : start + block], 0) != chunk.crc32[index]:
                raise CheckpointCorruptError(
                    f"checksum mismatch in {chunk.file}, tensor {key!r} (chunk at offsets "
                    f"{list(chunk.offsets)}, block {index}): the data file is damaged"
                )
