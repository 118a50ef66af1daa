"""A rank that sends its bytes to the consolidating rank, which writes every file.

It checksums the tensors it sends whole first (in parallel with the writer, which is
busy with its own bytes meanwhile), then sends its messages in the order the writer
receives them (``transfers.py``): raw ``uint8`` tensors, point-to-point, never pickled,
each a slice of the tensor itself where it can be (no copy).

A failure must not hang the writer: a sender that cannot produce a message sends zeros of
the right size, and raises its error only after the last send, so that it is agreed at
the end of the write phase.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...distributed import comm_device
from ..format.crc import BlockCrc
from ..plan.save_plan import CONSOLIDATING_RANK, SavePlan
from ..plan.transfers import Message, plan_transfers
from .chunk_bytes import ChunkBytes
from .written import WriteOptions, WrittenFile, sent_whole


class ConsolidatedSender:
    def __init__(
        self,
        plan: SavePlan,
        rank: int,
        sources: ChunkBytes,
        options: WriteOptions,
        group: Any = None,
    ) -> None:
        self.plan, self.rank, self.sources, self.options = plan, rank, sources, options
        self.group = group
        _, self.messages = plan_transfers(plan.files, max(options.buffer_bytes // 2, 1))
        self.device = comm_device() if group is None else torch.device("cpu")
        self.error: BaseException | None = None

    def run(self) -> dict[str, WrittenFile]:
        results = self._checksum_own_entries()
        for message in self.messages:
            if message.src == self.rank:
                dist.send(self._payload(message), dst=CONSOLIDATING_RANK, group=self.group)
        if self.error is not None:
            raise self.error
        return results

    def _checksum_own_entries(self) -> dict[str, WrittenFile]:
        results: dict[str, WrittenFile] = {}
        for fplan in self.plan.files:
            for entry in sent_whole(fplan):
                src = entry.sources[0]
                if src.rank != self.rank:
                    continue
                crc = BlockCrc(self.options.block_bytes)
                try:
                    for piece in self.sources.pieces(src.index, 0, src.nbytes):
                        crc.update(piece)
                except Exception as e:  # raised after the sends, which must still happen
                    self.error = self.error or e
                result = results.setdefault(fplan.name, {"bytes": 0, "crc": {}, "header_crc32": -1})
                result["crc"][entry.name] = list(crc.finish())
        return results

    def _payload(self, message: Message) -> torch.Tensor:
        try:
            views = [self.sources.view(p.index)[p.start : p.end] for p in message.parts]
            payload = views[0] if len(views) == 1 else torch.cat(views)
            return payload.to(self.device)
        except Exception as e:  # keep the protocol going; raised after the last send
            self.error = self.error or e
            return torch.zeros(message.nbytes, dtype=torch.uint8, device=self.device)
