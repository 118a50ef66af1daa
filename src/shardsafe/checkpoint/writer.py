"""Carrying out a save plan on one rank: streaming tensor bytes into data files.

Sharded layout: each rank writes its own files from memory; no communication.

Consolidated layout: rank 0 writes every file. Bytes that live on other ranks arrive as
raw ``uint8`` messages (point-to-point, never pickled) of at most half the buffer, into
two reusable receive buffers: while one message is written to disk the next is already
in flight. So the writer's extra memory is the buffer (default 64 MiB) whatever the
size of the state, and nothing is kept after the save.

A failure mid-transfer must not hang the peer: a writer whose disk fails keeps receiving
(and discarding) until every planned message has arrived, and a sender that cannot
produce a message sends zeros of the right size; both report the error afterwards, at
the agreement that follows this phase.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .entries import Chunk
from .planner import (
    WRITER_RANK,
    Assemble,
    FileEntry,
    FilePlan,
    LocalBytes,
    Message,
    Received,
    SavePlan,
)
from .planner import plan_transfers as _plan_transfers
from .safetensors_io import BlockCrc, StreamWriter, byte_view, memory
from .storage import LocalStorage


class FileResult(TypedDict):
    """What a rank reports about one file it wrote (or, ``bytes`` 0, checksummed)."""

    bytes: int
    crc: dict[str, list[int]]
    header_crc32: int
    """-1 from a rank that only checksummed tensors another rank wrote."""


@dataclass
class WriteOptions:
    block_bytes: int
    buffer_bytes: int


def write_plan(
    plan: SavePlan, rank: int, chunks: list[Chunk], storage: LocalStorage, options: WriteOptions
) -> tuple[dict[str, FileResult], BaseException | None]:
    """Write this rank's share of ``plan``; return the files written and any error."""
    sources = _ChunkBytes(chunks, options.buffer_bytes)
    if plan.layout == "sharded" or plan.world_size == 1:
        return _write_local_files(plan.files_of(rank), sources, storage, options)
    return _ConsolidatedTransfer(plan, rank, sources, storage, options).run()


class _ChunkBytes:
    """Flat byte views of this rank's chunks, made contiguous on first use."""

    def __init__(self, chunks: list[Chunk], piece_bytes: int) -> None:
        self.chunks = chunks
        self.piece_bytes = max(piece_bytes // 2, 1 << 20)
        self._cache: dict[int, torch.Tensor] = {}

    def view(self, index: int) -> torch.Tensor:
        if index not in self._cache:
            self._cache.clear()  # one tensor at a time: bounded extra memory
            self._cache[index] = byte_view(self.chunks[index].tensor.detach().contiguous())
        return self._cache[index]

    def pieces(self, index: int, start: int, end: int) -> Iterator[memoryview]:
        """Host memory for bytes ``[start, end)`` of a chunk, device tensors copied piecewise."""
        flat = self.view(index)
        if flat.device.type == "cpu":
            yield memory(flat)[start:end]
            return
        for s in range(start, end, self.piece_bytes):
            yield memory(flat[s : min(s + self.piece_bytes, end)].cpu())


def _write_local_files(
    files: list[FilePlan], sources: _ChunkBytes, storage: LocalStorage, options: WriteOptions
) -> tuple[dict[str, FileResult], BaseException | None]:
    results: dict[str, FileResult] = {}
    writer: StreamWriter | None = None
    try:
        for fplan in files:
            writer = _open(fplan, storage, options)
            for entry in fplan.entries:
                (src,) = entry.sources
                for piece in sources.pieces(src.index, 0, src.nbytes):
                    writer.write(piece)
            results[fplan.name] = _finish(writer)
            writer = None
    except Exception as e:
        if writer is not None:
            writer.abort()
        return results, e
    return results, None


def _open(
    fplan: FilePlan,
    storage: LocalStorage,
    options: WriteOptions,
    checksummed_elsewhere: frozenset[str] = frozenset(),
) -> StreamWriter:
    header = [(e.name, e.dtype, e.shape) for e in fplan.entries]
    return StreamWriter(
        storage.create(fplan.name), header, options.block_bytes, checksummed_elsewhere
    )


def _sent_whole(fplan: FilePlan) -> list[FileEntry]:
    """Entries whose bytes are one other rank's chunk: that rank checksums them itself,
    in parallel with the writer, instead of the writer checksumming everything."""
    return [e for e in fplan.entries if len(e.sources) == 1 and e.sources[0].rank != WRITER_RANK]


def _finish(writer: StreamWriter) -> FileResult:
    size, crcs = writer.finish()
    return {
        "bytes": size,
        "crc": {name: list(v) for name, v in crcs.items()},
        "header_crc32": writer.header_crc32,
    }


def comm_device() -> torch.device:
    """Where tensors must be to travel over the default group: CUDA for NCCL, else CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _ConsolidatedTransfer:
    def __init__(
        self,
        plan: SavePlan,
        rank: int,
        sources: _ChunkBytes,
        storage: LocalStorage,
        options: WriteOptions,
    ) -> None:
        self.plan, self.rank, self.sources = plan, rank, sources
        self.storage, self.options = storage, options
        self.max_message = max(options.buffer_bytes // 2, 1)
        self.steps, self.messages = _plan_transfers(plan.files, self.max_message)
        self.device = comm_device()
        self.error: BaseException | None = None

    def run(self) -> tuple[dict[str, FileResult], BaseException | None]:
        if self.rank == WRITER_RANK:
            return self._receive_and_write()
        # Checksums first: the writer is busy with its own bytes meanwhile.
        results = self._checksum_own_entries()
        self._send()
        return results, self.error

    # -- senders

    def _checksum_own_entries(self) -> dict[str, FileResult]:
        results: dict[str, FileResult] = {}
        for fplan in self.plan.files:
            for entry in _sent_whole(fplan):
                src = entry.sources[0]
                if src.rank != self.rank:
                    continue
                crc = BlockCrc(self.options.block_bytes)
                try:
                    for piece in self.sources.pieces(src.index, 0, src.nbytes):
                        crc.update(piece)
                except Exception as e:  # reported at the agreement; the sends still happen
                    self.error = self.error or e
                result = results.setdefault(fplan.name, {"bytes": 0, "crc": {}, "header_crc32": -1})
                result["crc"][entry.name] = list(crc.finish())
        return results

    def _send(self) -> None:
        for message in self.messages:
            if message.src == self.rank:
                dist.send(self._payload(message), dst=WRITER_RANK)

    def _payload(self, message: Message) -> torch.Tensor:
        try:
            views = [self.sources.view(p.index)[p.start : p.end] for p in message.parts]
            payload = views[0] if len(views) == 1 else torch.cat(views)
            return payload.to(self.device)
        except Exception as e:  # keep the protocol going; report at the agreement
            self.error = self.error or e
            return torch.zeros(message.nbytes, dtype=torch.uint8, device=self.device)

    # -- the writer

    def _receive_and_write(self) -> tuple[dict[str, FileResult], BaseException | None]:
        self._slots = [
            torch.empty(
                min(self.max_message, max((m.nbytes for m in self.messages), default=0)),
                dtype=torch.uint8,
                device=self.device,
            )
            for _ in range(2)
        ]
        self._pending: dict[int, dist.Work | None] = {}
        results: dict[str, FileResult] = {}
        for fplan, steps in zip(self.plan.files, self.steps):
            writer = self._open(fplan)
            try:
                for step in steps:
                    if isinstance(step, LocalBytes):
                        p = step.part
                        if writer is not None:
                            for piece in self.sources.pieces(p.index, p.start, p.end):
                                writer = self._write(writer, piece)
                    elif isinstance(step, Received):
                        data = self._receive(step.message)
                        writer = self._write(writer, memory(data))
                    else:
                        writer = self._assemble(writer, step)
            except BaseException:  # a failed receive: a peer died mid-transfer
                if writer is not None:
                    writer.abort()
                raise
            if writer is not None:
                try:
                    results[fplan.name] = _finish(writer)
                except Exception as e:
                    self.error = e
                    writer.abort()
        return results, self.error

    def _open(self, fplan: FilePlan) -> StreamWriter | None:
        if self.error is not None:
            return None
        elsewhere = frozenset(e.name for e in _sent_whole(fplan))
        try:
            return _open(fplan, self.storage, self.options, elsewhere)
        except Exception as e:
            self.error = e
            return None

    def _write(self, writer: StreamWriter | None, data: memoryview) -> StreamWriter | None:
        if writer is None or self.error is not None:
            return None
        try:
            writer.write(data)
            return writer
        except Exception as e:
            self.error = e
            writer.abort()
            return None

    def _receive(self, index: int) -> torch.Tensor:
        """Wait for message ``index`` and start receiving the next one into the other slot."""
        try:
            self._post(index)
            work = self._pending.pop(index)
            if work is not None:
                work.wait()
            self._post(index + 1)
        except RuntimeError as e:  # the process group's error names no rank: name it
            src = self.messages[index].src
            raise CheckpointError(
                f"lost the connection to rank {src} while receiving its data ({e}); rank "
                f"{src} has probably died (killed, out of memory)"
            ) from e
        data = self._slots[index % 2][: self.messages[index].nbytes]
        return data if data.device.type == "cpu" else data.cpu()

    def _post(self, index: int) -> None:
        if index >= len(self.messages) or index in self._pending:
            return
        message = self.messages[index]
        buf = self._slots[index % 2][: message.nbytes]
        self._pending[index] = dist.irecv(buf, src=message.src) if message.nbytes else None

    def _assemble(self, writer: StreamWriter | None, step: Assemble) -> StreamWriter | None:
        """A tensor split on more than dim 0 (tensor parallel): gathered whole, then written.

        This holds the whole tensor in memory, the one case where the writer's memory is
        not bounded by the buffer. Every message is received even after a failure here
        (say the allocation), so no sender is left blocked in its send.
        """
        entry: FileEntry = step.entry
        full: torch.Tensor | None = None
        try:
            full = torch.empty(entry.shape, dtype=entry.dtype)
        except Exception as e:
            self.error = self.error or e
        for src, message_ids in step.pieces:
            received = [self._receive(i).clone() for i in message_ids]
            if full is None or self.error is not None:
                continue
            try:
                flat = torch.cat(received) if message_ids else self.sources.view(src.index).cpu()
                box = tuple(slice(o, o + n) for o, n in zip(src.offsets, src.shape))
                full[box] = flat.view(src.dtype).reshape(src.shape)
            except Exception as e:
                self.error = self.error or e
        if full is None:
            return None
        return self._write(writer, memory(byte_view(full)))
