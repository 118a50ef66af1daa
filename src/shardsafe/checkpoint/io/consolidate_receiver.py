"""The consolidating rank: it writes every file of a consolidated checkpoint.

Bytes that live on other ranks arrive as raw ``uint8`` messages of at most half the
buffer, into two reusable receive buffers: while one message is written to disk the next
is already in flight. So the writer's extra memory is the buffer (default 64 MiB)
whatever the size of the state, and nothing is kept after the save.

A failure must not hang the senders: a writer whose disk fails keeps receiving (and
discarding) until every planned message has arrived, then removes the files it created
and raises, so that the error is agreed at the end of the write phase.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...distributed import comm_device
from ...errors import CheckpointError
from ..format.tensor_bytes import byte_view, memory
from ..plan.save_plan import FileEntry, FilePlan, SavePlan
from ..plan.transfers import Assemble, LocalBytes, Received, Step, plan_transfers
from ..storage.protocol import Storage
from .chunk_bytes import ChunkBytes
from .safetensors_io import StreamWriter
from .written import WriteOptions, WrittenFile, finish, open_file, remove_quietly, sent_whole


class ConsolidatedReceiver:
    def __init__(
        self,
        plan: SavePlan,
        sources: ChunkBytes,
        storage: Storage,
        options: WriteOptions,
        group: Any = None,
    ) -> None:
        self.plan, self.sources, self.group = plan, sources, group
        self.storage, self.options = storage, options
        self.max_message = max(options.buffer_bytes // 2, 1)
        self.steps, self.messages = plan_transfers(plan.files, self.max_message)
        self.device = comm_device() if group is None else torch.device("cpu")
        self.error: BaseException | None = None
        self._slots: list[torch.Tensor] = []
        self._pending: dict[int, dist.Work | None] = {}

    def run(self) -> dict[str, WrittenFile]:
        largest = max((m.nbytes for m in self.messages), default=0)
        self._slots = [
            torch.empty(min(self.max_message, largest), dtype=torch.uint8, device=self.device)
            for _ in range(2)
        ]
        results: dict[str, WrittenFile] = {}
        try:
            for fplan, steps in zip(self.plan.files, self.steps):
                written = self._write_file(fplan, steps)
                if written is not None:
                    results[fplan.name] = written
        except BaseException:  # a failed receive: a peer died mid-transfer
            remove_quietly(self.storage, [f.name for f in self.plan.files])
            raise
        if self.error is not None:
            remove_quietly(self.storage, [f.name for f in self.plan.files])
            raise self.error
        return results

    def _write_file(self, fplan: FilePlan, steps: list[Step]) -> WrittenFile | None:
        writer = self._open(fplan)
        try:
            for step in steps:
                if isinstance(step, LocalBytes):
                    p = step.part
                    if writer is not None:
                        for piece in self.sources.pieces(p.index, p.start, p.end):
                            writer = self._write(writer, piece)
                elif isinstance(step, Received):
                    writer = self._write(writer, memory(self._receive(step.message)))
                elif isinstance(step, Assemble):
                    writer = self._assemble(writer, step)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if writer is None:
            return None
        try:
            return finish(writer)
        except Exception as e:
            self.error = e
            writer.abort()
            return None

    def _open(self, fplan: FilePlan) -> StreamWriter | None:
        if self.error is not None:
            return None
        elsewhere = frozenset(e.name for e in sent_whole(fplan))
        try:
            return open_file(fplan, self.storage, self.options, elsewhere)
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
        self._pending[index] = (
            dist.irecv(buf, src=message.src, group=self.group) if message.nbytes else None
        )

    def _assemble(self, writer: StreamWriter | None, step: Assemble) -> StreamWriter | None:
        """A tensor split on more than dim 0 (tensor parallel): gathered whole, then written.

        This holds the whole tensor in memory, the one case where the writer's memory is
        not bounded by the buffer. Every message is received even after a failure here
        (say the allocation), so no sender is left blocked in its send.
        """
        entry: FileEntry = step.entry
        full: torch.Tensor | None = None
        try:
            full = torch.empty(entry.shape, dtype=entry.dtype, device="cpu")
        except Exception as e:
            self.error = self.error or e
        for src, message_ids in step.pieces:
            received = [self._receive(i).clone() for i in message_ids]
            if full is None or self.error is not None or src.nbytes == 0:
                # An empty piece has no messages, whoever's it is: taken for the writer's
                # own, the writer's chunk at that index was reshaped to it and failed.
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
