"""Sending a rank checkpoint to another rank over the tiers' own gloo group.

One transfer, between a sender and a receiver that both know it is due::

    sender -> receiver   [has it, manifest bytes, step]   (tag DATA)
    receiver -> sender   [go on?, step]                    (tag CONTROL)
    sender -> receiver   the manifest
    receiver -> sender   [go on?]   (the manifest parsed, and is the expected rank's and step's)
    receiver -> sender   [wanted?] per data file, in name order   (only if it goes on)
    sender -> receiver   every wanted data file, in pieces of PIECE_BYTES
    receiver -> sender   [committed?]

The receiver checks every byte against the manifest's checksums as it arrives, in
cache-sized pieces, each written to the file in its node's directory once checked
(``checkpoint/io/arriving.py``: no byte is read back from the disk to be checked), then
each file's size and header on disk, and only then commits the manifest (atomically,
last), so a replica is a checkpoint exactly when it is whole and verified. The sizes it
receives are the manifest's, checked by the parser before anything is allocated. A
sender that cannot read its own file still sends as many bytes as it promised (zeros),
so the two never fall out of step; the receiver's checksums refuse them.

**Files the receiver holds already are not sent.** Data-parallel ranks hold the same
large tensors, and a rank checkpoint keeps its small chunks in a file apart
(``rank_checkpoint.SMALL_APART_BYTES``), so the receiver's own checkpoint of the same
step often has a byte-identical data file: the same name, size and header checksum, and
the same tensors with the same block checksums. The receiver then hard-links its own
file into the replica (the same node, the same filesystem; never through a symbolic
link) and does not ask for it: a data-parallel step is replicated by sending the
manifest and the small file. Before the commit every byte of the replica is checked
against the sender's checksums, linked or received, through the replica's own names:
an own file damaged since it was written, or swapped for another between the comparison
and the link, fails that check and the replica is not committed (the step is then not
replicated, as after any failed check). Two different 16 MiB blocks with equal CRC32s
would be taken for equal (a chance of 2^-32 per block, and only where replicas have
diverged).

Both ends name the step they are at, and refuse (:class:`StepsDiffer`, on both) a
transfer between ranks that saved different steps: replication pairs the ranks' local
saves in order, so the step numbers tell that a caller passed different ones.

Two tags keep the directions apart: with two nodes, ranks ``a`` and ``b`` replicate to
each other at once, so ``a`` sends data to ``b`` while acknowledging ``b``'s data.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse
from ..checkpoint.format.tensor_bytes import memory
from ..checkpoint.io.arriving import ArrivingFile, Piece, pieces_by_file
from ..checkpoint.io.reader import CACHE_PIECE_BYTES, CheckpointReader
from ..checkpoint.manager import loadable_manifest
from ..checkpoint.storage.local import LocalStorage
from ..errors import CheckpointError
from . import rank_checkpoint

DATA, CONTROL = 1, 2
PIECE_BYTES = 32 << 20
"""Bytes sent per message: large enough that gloo's per-message cost vanishes, small
enough that the buffer stays a small fraction of a rank's state."""


def _send_ints(group: Any, dst: int, values: list[int], tag: int) -> None:
    if not values:  # the receiver expects none either
        return
    dist.send(torch.tensor(values, dtype=torch.int64, device="cpu"), dst, group=group, tag=tag)


def _recv_ints(group: Any, src: int, count: int, tag: int) -> list[int]:
    if count == 0:
        return []
    out = torch.zeros(count, dtype=torch.int64, device="cpu")
    dist.recv(out, src, group=group, tag=tag)
    return [int(v) for v in out.tolist()]


class StepsDiffer(CheckpointError):
    """The two ends of a transfer are at different steps: ``ours`` here, ``theirs`` there."""

    def __init__(self, ours: int, theirs: int) -> None:
        super().__init__(f"this rank is at step {ours}, the other at step {theirs}")
        self.ours, self.theirs = ours, theirs


def send(group: Any, dst: int, source: LocalStorage | None, step: int) -> bool:
    """Send the committed rank checkpoint of ``step`` in ``source`` (``None``: this rank
    has none, and says so) to rank ``dst``; True once ``dst`` has committed it. Raises
    :class:`StepsDiffer` if ``dst`` expects another step."""
    return _send(group, dst, source, *manifest_of(source), step)


def _send(
    group: Any,
    dst: int,
    source: LocalStorage | None,
    raw: bytes,
    manifest: Manifest | None,
    step: int,
) -> bool:
    """:func:`send`, given the manifest of ``source`` (as bytes, and parsed)."""
    _send_ints(group, dst, [int(manifest is not None), len(raw), step], DATA)
    go, theirs = _recv_ints(group, dst, 2, CONTROL)
    if theirs != step:
        raise StepsDiffer(step, theirs)
    if manifest is None or source is None or not go:
        return False
    dist.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), dst, group=group, tag=DATA)
    if not _recv_ints(group, dst, 1, CONTROL)[0]:
        return False
    names = _wanted(sorted(manifest.files), _recv_ints(group, dst, len(manifest.files), CONTROL))
    buffer = _buffer({name: manifest.files[name] for name in names})
    for name in names:
        _send_file(group, dst, source, name, manifest.files[name], buffer)
    return bool(_recv_ints(group, dst, 1, CONTROL)[0])


def send_from(
    group: Any,
    dst: int,
    open_source: Callable[[], LocalStorage],
    step: int,
    unopened: Callable[[Exception], None],
) -> bool:
    """:func:`send` of the checkpoint ``open_source()`` opens. One that cannot be opened
    (its node's directory unusable), or whose manifest cannot be read or does not parse
    (removed or damaged since it was committed), is sent as none, so that ``dst`` hears
    of it at once instead of waiting for this rank until the timeout; then
    ``unopened(error)``, and False. (A manifest that went unread was sent as none in
    silence: the step was not replicated, and neither end said so.)"""
    with contextlib.ExitStack() as opened:
        try:
            source = opened.enter_context(open_source())
            raw, manifest = _read_manifest(source)
        except (CheckpointError, OSError) as e:
            send(group, dst, None, step)
            unopened(e)
            return False
        return _send(group, dst, source, raw, manifest, step)


def _wanted(names: list[str], flags: list[int]) -> list[str]:
    return [name for name, want in zip(names, flags) if want]


def manifest_of(source: LocalStorage | None) -> tuple[bytes, Manifest | None]:
    """The committed manifest of ``source`` (as bytes, and parsed); ``(b"", None)`` if
    there is none that parses."""
    if source is None:
        return b"", None
    try:
        return _read_manifest(source)
    except (CheckpointError, OSError):
        return b"", None


def _read_manifest(source: LocalStorage) -> tuple[bytes, Manifest]:
    """The committed manifest of ``source``, as bytes and parsed; raises if there is none
    that parses."""
    raw = source.read_small(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    return raw, parse(raw, source.where(MANIFEST_NAME))


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


@dataclass
class Arrived:
    """A rank checkpoint received into ``storage`` (open; the caller closes it), not yet
    committed: ``received``, its data files that arrived, every byte checked as it
    arrived; ``skipped``, those not asked for (linked, or to be linked)."""

    storage: LocalStorage
    manifest: Manifest
    raw: bytes
    received: set[str]
    skipped: set[str]
    problem: str | None
    """Why not every received file arrived, passed its checks and was written (the
    first file's problem), or ``None``."""
    linked: set[str] = field(default_factory=set)
    """Skipped files linked since, whose bytes a node-mate checked as they arrived."""

    @functools.cached_property
    def fingerprints(self) -> dict[str, tuple[int, str]]:
        """Its data files' :func:`fingerprints`, from the manifest it arrived with."""
        return fingerprints(self.manifest)

    def commit(self, checked: AbstractSet[str] = frozenset()) -> bool:
        """Commit it if every file's header and every byte not ``received``, ``linked``
        or ``checked`` (already known to hold the manifest's bytes) passes; whether it
        did (if not, :attr:`problem` says why)."""
        if self.problem is not None:
            return False
        known = self.received | self.linked | checked
        try:
            self.problem = _commit_if_whole(self.storage, self.manifest, self.raw, known)
        except (CheckpointError, OSError) as e:
            self.problem = f"could not be committed: {e}"
        return self.problem is None


def receive(
    group: Any,
    src: int,
    *,
    rank: int,
    step: int,
    target: Callable[[], LocalStorage],
    held: Callable[[], LocalStorage] | None = None,
    trusted: Mapping[str, tuple[int, int]] | None = None,
) -> str | None:
    """Receive rank ``rank``'s checkpoint of ``step`` from ``src`` into ``target()``
    (made only once the manifest is accepted); ``None`` once verified and committed, else
    why not (:data:`NOT_SENT` if ``src`` had none to send).
    ``held()``: a committed checkpoint on this node whose identical data files are linked
    instead of received (this rank's own of the same step; see the module docstring);
    ``trusted``: the identity (device, inode) of each of its data files as this rank
    wrote or linked them, whose bytes a link to the same inode needs no check of.
    Raises :class:`StepsDiffer` if ``src`` sends another step."""

    def link(manifest: Manifest, storage: LocalStorage) -> set[str]:
        return _link_identical(manifest, held, storage) if held is not None else set()

    arrived = _arrive(group, src, rank=rank, step=step, target=target, skip=link)
    if isinstance(arrived, str):
        return arrived
    committed = False
    try:
        committed = arrived.commit(_still_ours(arrived.storage, arrived.skipped, trusted or {}))
    finally:
        try:  # the sender may be gone: its error is raised, the directory still closed
            _send_ints(group, src, [int(committed)], CONTROL)
        finally:
            arrived.storage.close()
    return None if committed else arrived.problem or "could not be committed"


def receive_uncommitted(
    group: Any,
    src: int,
    *,
    rank: int,
    step: int,
    target: Callable[[], LocalStorage],
    skip: AbstractSet[str],
) -> Arrived:
    """As :func:`receive`, but without the data files ``skip`` names (another rank of
    this node receives them, to be linked) and without the commit: the checked arrival,
    for the caller to complete, commit and close. Raises :class:`NotReceived`, saying
    why, if it did not arrive whole (the sender is told either way)."""
    arrived = _arrive(
        group, src, rank=rank, step=step, target=target, skip=lambda m, _: set(skip) & set(m.files)
    )
    if isinstance(arrived, str):
        raise NotReceived(f"rank {rank}'s copy from rank {src} {arrived}")
    try:
        _send_ints(group, src, [int(arrived.problem is None)], CONTROL)
    except BaseException:
        arrived.storage.close()
        raise
    if arrived.problem is not None:
        arrived.storage.close()
        raise NotReceived(f"rank {rank}'s copy from rank {src} {arrived.problem}")
    return arrived


NOT_SENT = "was not sent: the sender has no committed copy that parses"
"""Why a copy did not arrive when its sender had none (its own write failed, or its copy
could not be opened or read: the sender said so already)."""


class NotReceived(CheckpointError):
    """A copy that did not arrive whole (:func:`receive_uncommitted`); the message says
    why."""


def _arrive(
    group: Any,
    src: int,
    *,
    rank: int,
    step: int,
    target: Callable[[], LocalStorage],
    skip: Callable[[Manifest, LocalStorage], set[str]],
) -> Arrived | str:
    """The receiving side of the protocol up to the last message (see the module
    docstring): why not, if it ended before the files (the sender has stopped too); else
    the arrival, the sender waiting for the last message. The data files ``skip`` names
    (given the manifest and the made directory) are not asked for."""
    has, length, theirs = _recv_ints(group, src, 3, DATA)
    accept = bool(has) and theirs == step and 0 < length <= MAX_MANIFEST_BYTES
    _send_ints(group, src, [int(accept), step], CONTROL)
    if theirs != step:
        raise StepsDiffer(step, theirs)
    if not has:
        return NOT_SENT
    if not accept:
        return f"was refused: its manifest's announced size, {length} bytes, is out of bounds"
    raw_tensor = torch.empty(length, dtype=torch.uint8, device="cpu")
    dist.recv(raw_tensor, src, group=group, tag=DATA)
    raw = raw_tensor.numpy().tobytes()
    manifest = _expected(raw, rank, step)
    storage = None
    why = f"was refused: its manifest does not parse, or is not rank {rank}'s of step {step}"
    if manifest is not None:
        # Made before the sender is told to go on: a receiver that cannot make it (a link
        # in its place, a full disk) refuses here, never leaving the sender mid-file. Any
        # error refuses it, a warning made an error by the user's filter too (raised, it
        # left the sender waiting for this answer until the timeout).
        try:
            storage = target()
        except Exception as e:
            why = f"was refused: its directory could not be made: {e}"
    _send_ints(group, src, [int(storage is not None)], CONTROL)
    if manifest is None or storage is None:
        return why
    try:
        names = sorted(manifest.files)
        skipped = skip(manifest, storage)
        _send_ints(group, src, [int(name not in skipped) for name in names], CONTROL)
        names = [name for name in names if name not in skipped]
        buffer = _buffer({name: manifest.files[name] for name in names})
        pieces = pieces_by_file(manifest)
        problems = [
            _receive_file(group, src, storage, ArrivingFile(manifest, name, pieces[name]), buffer)
            for name in names
        ]
    except BaseException:
        try:  # the sender may be gone: its error is raised, the directory still closed
            _send_ints(group, src, [0], CONTROL)
        finally:
            storage.close()
        raise
    problem = next((p for p in problems if p is not None), None)
    return Arrived(storage, manifest, raw, set(names), skipped, problem)


def _expected(raw: bytes, rank: int, step: int) -> Manifest | None:
    try:
        manifest = parse(raw, f"the manifest of rank {rank}'s checkpoint of step {step}")
        saved_rank, _, saved_step = rank_checkpoint.saved_by(manifest)
    except CheckpointError:
        return None
    return manifest if (saved_rank, saved_step) == (rank, step) else None


def _receive_file(
    group: Any, src: int, storage: LocalStorage, arriving: ArrivingFile, buffer: torch.Tensor
) -> str | None:
    """Receive the data file ``arriving`` checks into a new file of its name, each
    cache-sized piece fed to the check and then written while it is still in cache (a
    block's CRC32 is compared once the block is whole: nothing is committed before
    ``finish``); ``None`` if all arrived, passed and were written, else what went wrong.
    They are all received whatever happens, so that the sender is not left waiting."""
    name, size = arriving.name, arriving.size
    sink, unwritten = None, ""
    try:
        sink = storage.create(name, size)
    except (CheckpointError, OSError) as e:
        unwritten = str(e)
    for offset in range(0, size, PIECE_BYTES):
        piece = buffer[: min(PIECE_BYTES, size - offset)]
        dist.recv(piece, src, group=group, tag=DATA)
        for start in range(0, piece.numel(), CACHE_PIECE_BYTES):
            view = memory(piece[start : start + CACHE_PIECE_BYTES])
            arriving.feed(view)
            if sink is not None and arriving.problem is None:
                try:
                    sink.write(view)
                except (CheckpointError, OSError) as e:
                    sink.abort()
                    sink, unwritten = None, str(e)
    problem = arriving.finish()
    if problem is not None:
        if sink is not None:
            sink.abort()
        return f"arrived damaged: {problem}"
    if sink is None:
        return f"could not be written: {unwritten}"
    try:
        sink.finish()
    except (CheckpointError, OSError) as e:
        sink.abort()
        return f"could not be written: {e}"
    return None


def _commit_if_whole(
    storage: LocalStorage, manifest: Manifest, raw: bytes, received: set[str] | None = None
) -> str | None:
    """Check every file's header and every byte against ``manifest`` (but the bytes of
    ``received`` files, checked as they arrived), a linked file's as a received one's
    (read through the replica's own name: what is checked is what is committed); commit
    it if all pass (``None``), else say what failed."""
    with CheckpointReader(storage, manifest) as reader:
        problems = [*reader.check_files().values()] or reader.verify_all(checked_files=received)
    if problems:
        return f"failed its last check: {problems[0]}"
    storage.commit(MANIFEST_NAME, raw)
    return None


def _still_ours(
    storage: LocalStorage, linked: set[str], trusted: Mapping[str, tuple[int, int]]
) -> set[str]:
    """The ``linked`` files of ``storage`` that are the very inodes this rank wrote or
    linked at its own save of the step (``trusted``): their bytes are the ones its own
    manifest's checksums were computed from as they were written, and equal the
    sender's (``_same_file``), so they are not read again. Any other file (swapped in
    since) is checked byte by byte."""
    found = set()
    for name in linked:
        with contextlib.suppress(OSError):
            stat = os.stat(name, dir_fd=storage.fd, follow_symlinks=False)
            if trusted.get(name) == (stat.st_dev, stat.st_ino):
                found.add(name)
    return found


def _link_identical(
    theirs: Manifest, held: Callable[[], LocalStorage], storage: LocalStorage
) -> set[str]:
    """Hard-link into ``storage`` each data file of ``held()`` identical to one ``theirs``
    names (see the module docstring); the names linked. Any problem: nothing linked
    for that file, which is then received."""
    linked: set[str] = set()
    # Only a shortcut: whatever goes wrong, the files not linked are received.
    with contextlib.suppress(Exception), held() as own:
        ours = loadable_manifest(own)
        pieces = pieces_by_file(theirs), pieces_by_file(ours)
        for name in sorted(theirs.files):
            if not _same_file(theirs, ours, name, pieces):
                continue
            with contextlib.suppress(OSError):
                os.link(name, name, src_dir_fd=own.fd, dst_dir_fd=storage.fd, follow_symlinks=False)
                if storage.kind(name) == "file":
                    linked.add(name)
                else:  # a link or a FIFO swapped in for our file: not ours to keep
                    storage.remove(name)
    return linked


def _same_file(
    theirs: Manifest, ours: Manifest, name: str, pieces: tuple[dict[str, list[Piece]], ...]
) -> bool:
    """Whether data file ``name`` holds the same bytes in both checkpoints, as far as the
    manifests' sizes and checksums tell (``pieces``: each manifest's, by file)."""
    if name not in ours.files:
        return False
    mine = fingerprint(theirs, name, pieces[0][name])
    return mine is not None and mine == fingerprint(ours, name, pieces[1][name])


def fingerprint(manifest: Manifest, name: str, pieces: list[Piece]) -> str | None:
    """A digest of what ``manifest`` says data file ``name`` holds (``pieces``: its
    tensor pieces): its size, its header's checksum, and every piece with its block
    checksums. Two files of equal fingerprints hold the same bytes, as far as checksums
    tell (see the module docstring); ``None`` (never equal) without a header checksum."""
    header = manifest.header_crc32.get(name)
    if header is None:
        return None
    contents = sorted(
        (key, str(rec.dtype), list(rec.shape), c.name, list(c.offsets), list(c.shape), c.crc32)
        for key, rec, c in pieces
    )
    described = [manifest.files[name], manifest.block_bytes, header, contents]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()


def fingerprints(manifest: Manifest) -> dict[str, tuple[int, str]]:
    """Every data file of ``manifest`` that has a :func:`fingerprint`: its size and
    fingerprint."""
    pieces = pieces_by_file(manifest)
    found = {name: fingerprint(manifest, name, pieces[name]) for name in manifest.files}
    return {name: (manifest.files[name], f) for name, f in found.items() if f is not None}


def _buffer(files: dict[str, int]) -> torch.Tensor:
    """The piece buffer: :data:`PIECE_BYTES`, or the largest of ``files`` if smaller."""
    return torch.empty(
        min(PIECE_BYTES, max(files.values(), default=0)), dtype=torch.uint8, device="cpu"
    )
