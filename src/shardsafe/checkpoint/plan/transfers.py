"""Cutting the bytes of a consolidated save that must cross ranks into bounded messages.

Pure: no process group. From the save plan's files, the rank that writes them
(``CONSOLIDATING_RANK``) gets its steps in file order (write bytes it holds, write a
received message, assemble a tensor split on more than dim 0), and every sender the
messages it must send, in the order they are received.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .offer import ChunkOffer
from .save_plan import CONSOLIDATING_RANK, FileEntry, FilePlan

COALESCE_BELOW_BYTES = 1 << 20
"""Chunks smaller than this share messages; larger ones are sent as their own slices."""


@dataclass(frozen=True)
class Part:
    """Bytes ``[start, end)`` of chunk ``index`` of the sending rank."""

    index: int
    start: int
    end: int


@dataclass
class Message:
    src: int
    parts: list[Part] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(p.end - p.start for p in self.parts)


@dataclass(frozen=True)
class LocalBytes:
    """The writer's own bytes, written straight from its chunk."""

    part: Part


@dataclass(frozen=True)
class Received:
    message: int


@dataclass(frozen=True)
class Assemble:
    """A tensor split on more than dim 0: gathered whole, then written (rare: e.g. TP)."""

    entry: FileEntry
    pieces: tuple[tuple[ChunkOffer, tuple[int, ...]], ...]
    """Each source chunk with the messages carrying it (empty when it is the writer's)."""


Step = LocalBytes | Received | Assemble


def plan_transfers(
    files: list[FilePlan], max_message_bytes: int, writer: int = CONSOLIDATING_RANK
) -> tuple[list[list[Step]], list[Message]]:
    """Cut what must cross ranks into messages of at most ``max_message_bytes``.

    Returns, per file, the writer's steps in file order, and all messages in the order the
    writer receives them (each sender sends its own messages in that same order).
    """
    messages: list[Message] = []
    steps_per_file: list[list[Step]] = []
    for plan in files:
        steps: list[Step] = []
        open_msg: Message | None = None
        for entry in plan.entries:
            if not entry.streamable:
                open_msg = None
                pieces = []
                for src in entry.sources:
                    ids = () if src.rank == writer else _split(src, messages, max_message_bytes)
                    pieces.append((src, ids))
                steps.append(Assemble(entry, tuple(pieces)))
                continue
            for src in entry.sources:
                if src.rank == writer:
                    open_msg = None
                    if src.nbytes:
                        steps.append(LocalBytes(Part(src.index, 0, src.nbytes)))
                    continue
                # Large chunks travel as slices of themselves (no copy on the sender);
                # only small ones are packed together to save per-message overhead.
                alone = src.nbytes >= COALESCE_BELOW_BYTES
                if alone:
                    open_msg = None
                start = 0
                while start < src.nbytes:
                    if (
                        open_msg is None
                        or open_msg.src != src.rank
                        or open_msg.nbytes >= max_message_bytes
                    ):
                        open_msg = Message(src.rank)
                        messages.append(open_msg)
                        steps.append(Received(len(messages) - 1))
                    take = min(src.nbytes - start, max_message_bytes - open_msg.nbytes)
                    open_msg.parts.append(Part(src.index, start, start + take))
                    start += take
                if alone:
                    open_msg = None
        steps_per_file.append(steps)
    return steps_per_file, messages


def _split(src: ChunkOffer, messages: list[Message], limit: int) -> tuple[int, ...]:
    ids = []
    for start in range(0, max(src.nbytes, 1), limit):
        if src.nbytes == 0:
            break
        messages.append(Message(src.rank, [Part(src.index, start, min(start + limit, src.nbytes))]))
        ids.append(len(messages) - 1)
    return tuple(ids)
