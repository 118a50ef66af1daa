"""Sending a rank checkpoint to another rank over the tiers' own gloo group.

One transfer, between a sender and a receiver that both know it is due::

    sender -> receiver   [has it, manifest bytes]         (tag DATA)
    receiver -> sender   [go on?]                          (tag CONTROL)
    sender -> receiver   the manifest
    receiver -> sender   [go on?]   (the manifest parsed, and is the expected rank's and step's)
    sender -> receiver   every data file the manifest names, in pieces of PIECE_BYTES
    receiver -> sender   [committed?]

The receiver writes the files into its node's directory, checks every byte against the
manifest's checksums and every header, and only then commits the manifest (atomically,
last), so a replica is a checkpoint exactly when it is whole and verified. The sizes it
receives are the manifest's, checked by the parser before anything is allocated. A
sender that cannot read its own file still sends as many bytes as it promised (zeros),
so the two never fall out of step; the receiver's checksums refuse them.

Two tags keep the directions apart: with two nodes, ranks ``a`` and ``b`` replicate to
each other at once, so ``a`` sends data to ``b`` while acknowledging ``b``'s data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse
from ..checkpoint.format.tensor_bytes import memory
from ..checkpoint.io.reader import CheckpointReader
from ..checkpoint.storage.local import LocalStorage
from ..errors import CheckpointError
from . import rank_checkpoint

DATA, CONTROL = 1, 2
PIECE_BYTES = 32 << 20
"""Bytes sent per message: large enough that gloo's per-message cost vanishes, small
enough that the buffer stays a small fraction of a rank's state."""


def _send_ints(group: Any, dst: int, values: list[int], tag: int) -> None:
    dist.send(torch.tensor(values, dtype=torch.int64), dst, group=group, tag=tag)


def _recv_ints(group: Any, src: int, count: int, tag: int) -> list[int]:
    out = torch.zeros(count, dtype=torch.int64)
    dist.recv(out, src, group=group, tag=tag)
    return [int(v) for v in out.tolist()]


def send(group: Any, dst: int, source: LocalStorage | None) -> bool:
    """Send the committed rank checkpoint in ``source`` (``None``: this rank has none, and
    says so) to rank ``dst``; True once ``dst`` has committed it."""
    raw, manifest = _own(source)
    _send_ints(group, dst, [int(manifest is not None), len(raw)], DATA)
    if manifest is None or source is None or not _recv_ints(group, dst, 1, CONTROL)[0]:
        return False
    dist.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), dst, group=group, tag=DATA)
    if not _recv_ints(group, dst, 1, CONTROL)[0]:
        return False
    buffer = _buffer(manifest)
    for name in sorted(manifest.files):
        _send_file(group, dst, source, name, manifest.files[name], buffer)
    return bool(_recv_ints(group, dst, 1, CONTROL)[0])


def _own(source: LocalStorage | None) -> tuple[bytes, Manifest | None]:
    if source is None:
        return b"", None
    try:
        raw = source.read_small(MANIFEST_NAME, MAX_MANIFEST_BYTES)
        return raw, parse(raw, source.where(MANIFEST_NAME))
    except (CheckpointError, OSError):
        return b"", None


def _send_file(
    group: Any, dst: int, source: LocalStorage, name: str, size: int, buffer: torch.Tensor
) -> None:
    """Send ``size`` bytes of ``name``: zeros where it cannot be read (see the module
    docstring)."""
    reader = None
    with contextlib.suppress(CheckpointError, OSError):
        reader = source.open_reader(name)
    try:
        for offset in range(0, size, PIECE_BYTES):
            piece = buffer[: min(PIECE_BYTES, size - offset)]
            try:
                if reader is None:
                    raise OSError(f"{name} could not be opened")
                reader.read_into(offset, memory(piece))
            except (CheckpointError, OSError):
                piece.zero_()
            dist.send(piece, dst, group=group, tag=DATA)
    finally:
        if reader is not None:
            reader.close()


def receive(
    group: Any, src: int, *, rank: int, step: int, target: Callable[[], LocalStorage]
) -> bool:
    """Receive rank ``rank``'s checkpoint of ``step`` from ``src`` into ``target()``
    (made only once the manifest is accepted); True once verified and committed."""
    has, length = _recv_ints(group, src, 2, DATA)
    if not has:
        return False
    accept = 0 < length <= MAX_MANIFEST_BYTES
    _send_ints(group, src, [int(accept)], CONTROL)
    if not accept:
        return False
    raw_tensor = torch.empty(length, dtype=torch.uint8)
    dist.recv(raw_tensor, src, group=group, tag=DATA)
    raw = raw_tensor.numpy().tobytes()
    manifest = _expected(raw, rank, step)
    storage = None
    if manifest is not None:
        # Made before the sender is told to go on: a receiver that cannot make it (a link
        # in its place, a full disk) refuses here, never leaving the sender mid-file.
        with contextlib.suppress(CheckpointError, OSError):
            storage = target()
    _send_ints(group, src, [int(storage is not None)], CONTROL)
    if manifest is None or storage is None:
        return False
    committed = False
    try:
        buffer = _buffer(manifest)
        for name in sorted(manifest.files):
            _receive_file(group, src, storage, name, manifest.files[name], buffer)
        with contextlib.suppress(CheckpointError, OSError):
            committed = _commit_if_whole(storage, manifest, raw)
    finally:
        _send_ints(group, src, [int(committed)], CONTROL)
        storage.close()
    return committed


def _expected(raw: bytes, rank: int, step: int) -> Manifest | None:
    try:
        manifest = parse(raw, f"the manifest of rank {rank}'s checkpoint of step {step}")
        saved_rank, _, saved_step = rank_checkpoint.saved_by(manifest)
    except CheckpointError:
        return None
    return manifest if (saved_rank, saved_step) == (rank, step) else None


def _receive_file(
    group: Any, src: int, storage: LocalStorage, name: str, size: int, buffer: torch.Tensor
) -> None:
    """Receive ``size`` bytes into the new file ``name``; receive (and drop) them all
    even if the file cannot be written, so that the sender is not left waiting."""
    sink = None
    with contextlib.suppress(CheckpointError, OSError):
        sink = storage.create(name, size)
    for offset in range(0, size, PIECE_BYTES):
        piece = buffer[: min(PIECE_BYTES, size - offset)]
        dist.recv(piece, src, group=group, tag=DATA)
        if sink is not None:
            try:
                sink.write(memory(piece))
            except (CheckpointError, OSError):
                sink.abort()
                sink = None
    if sink is not None:
        try:
            sink.finish()
        except (CheckpointError, OSError):
            sink.abort()


def _commit_if_whole(storage: LocalStorage, manifest: Manifest, raw: bytes) -> bool:
    """Check every file's header and every byte against ``manifest``; commit it if all pass."""
    with CheckpointReader(storage, manifest) as reader:
        if reader.check_files() or reader.verify_all():
            return False
    storage.commit(MANIFEST_NAME, raw)
    return True


def _buffer(manifest: Manifest) -> torch.Tensor:
    """The piece buffer: :data:`PIECE_BYTES`, or the largest file if smaller."""
    return torch.empty(min(PIECE_BYTES, max(manifest.files.values(), default=0)), dtype=torch.uint8)
