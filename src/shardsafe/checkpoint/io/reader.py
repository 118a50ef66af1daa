"""Reading regions of saved tensors, verified against their checksums, in bounded memory.

A rank asks for a box of a tensor (all of it, or its own shard at a new world size). The
reader finds the saved chunks that overlap the box and reads, from each, the byte span
the overlap occupies, rounded out to whole checksum blocks, exactly once: the bytes
stream through one reused buffer of at most :data:`PIECE_BYTES` (or one row of the chunk,
if larger; into a CUDA tensor through the few pinned ones of ``pinned_ring.py``), every
block's CRC32 is checked as it passes, and the rows the box needs are
copied into place. A chunk that exactly matches the request is read straight into the
result. So reading takes the result's memory plus one piece, whatever sizes (or checksum
block size) a manifest claims.

The result may be a new tensor (:meth:`CheckpointReader.read`), a live tensor the bytes
belong in (:meth:`~CheckpointReader.read_into`: a contiguous CPU tensor is read straight
into, any other through the reused buffer; a CUDA tensor through a few pinned ones, the
copies to the device overlapping the next reads, ``pinned_ring.py``), or nothing
(:meth:`~CheckpointReader.check`: the bytes are only checked, then dropped).

Files are opened lazily, each validated against the manifest (type, size, header CRC32,
header) when opened. At most :data:`MAX_OPEN_FILES` stay open; a file closed to make
room is validated again in full if it is needed again. Readers for other threads
(:meth:`~CheckpointReader.fork`) share the open files, so every thread reads the
descriptor that was validated, and none is closed while they may read it.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from ... import dtypes
from ...errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from ..format import geometry
from ..format.crc import crc32
from ..format.manifest import ChunkRecord, Manifest, TensorRecord
from ..format.safetensors_header import HeaderEntry, parse_header
from ..format.tensor_bytes import has_memory, memory
from ..storage.protocol import FileReader, Storage
from ..storage.spool import Spool
from ..storage.store_failures import StoreFailedError
from . import threaded_reads
from .pinned_ring import PinnedRing
from .safetensors_io import read_header_bytes

PIECE_BYTES = 16 << 20
CACHE_PIECE_BYTES = 256 << 10
"""Bytes read, then checksummed, in one go when reading straight into a tensor or
checking: small enough to stay in a core's cache between the copy from the page cache
and the CRC (and, on a machine whose cores are shared by several ranks, between the CRC
and the copy into place). Measured on a 2-core Xeon (2 MiB L2 per core), 192 MiB: read
and check 0.029 s in 4 MiB pieces, 0.022 s in 256-512 KiB; read into place and check
0.040 s and 0.034 s; the EP-on-4 load of ``benchmarks/parallel_layouts.py`` went from
0.89x to 0.76x DCP's time."""
MAX_OPEN_FILES = 64


def threads_for(
    cheap_rereads: bool, count_files: Callable[[], int], wanted: int | None, world: int
) -> int:
    """The threads a reader's work may use (``threaded_reads.py``): one for an object
    store (one stream, or ``cheap_rereads`` false) or for more files than a reader keeps
    open (forks share the descriptors, so none may be closed to make room); else
    ``wanted`` if given, or this rank's share of the CPUs (``world`` ranks). The files
    (``count_files``) are counted only when more than one thread is wanted."""
    if not cheap_rereads:
        return 1
    if wanted is None:
        wanted = threaded_reads.default_threads(world)
    if wanted == 1 or count_files() > MAX_OPEN_FILES:
        return 1
    return wanted


class BlockChecker:
    """The CRC32 of consecutive checksum blocks of one chunk, fed its bytes in order."""

    def __init__(self, key: str, chunk: ChunkRecord, block: int, first_block: int) -> None:
        self.key, self.chunk, self.block = key, chunk, block
        self.index, self._crc, self._filled = first_block, 0, 0

    def feed(self, data: memoryview) -> None:
        while data.nbytes:
            take = min(self.block - self._filled, data.nbytes)
            self._crc = crc32(data[:take], self._crc)
            self._filled += take
            data = data[take:]
            if self._filled == self.block:
                self._check()

    def finish(self) -> None:
        """The stream ended at the chunk's end: check the last, partial block."""
        if self._filled:
            self._check()

    def _check(self) -> None:
        if self._crc != self.chunk.crc32[self.index]:
            raise CheckpointCorruptError(
                f"checksum mismatch in {self.chunk.file}, tensor {self.key!r} (chunk at offsets "
                f"{list(self.chunk.offsets)}, block {self.index}): the data file is damaged"
            )
        self.index, self._crc, self._filled = self.index + 1, 0, 0


class CheckpointReader:
    """Reads verified regions of a checkpoint's tensors (see the module docstring)."""

    def __init__(
        self,
        storage: Storage,
        manifest: Manifest,
        *,
        keep_header_bytes: bool = False,
        piece_bytes: int = PIECE_BYTES,
        cuda_piece_bytes: int | None = None,
        spool: Spool | None = None,
    ) -> None:
        self.storage = storage
        self._spool = spool
        """Where an object store's bytes are kept between two reads (``spool.py``)."""
        self.piece_bytes = max(piece_bytes, 1)
        self.cuda_piece_bytes = max(cuda_piece_bytes or self.piece_bytes, 1)
        """Bytes per piece copied to a CUDA tensor (``pinned_ring.py``)."""
        self._check_piece_bytes = min(self.piece_bytes, CACHE_PIECE_BYTES)
        """Bytes read per piece that is checked right after (while still in cache)."""
        self.manifest = manifest
        self.header_bytes: dict[str, bytes] = {}
        """With ``keep_header_bytes``: each opened file's raw header (for ``verify``)."""
        self._keep_header_bytes = keep_header_bytes
        self._files = _OpenFiles()
        self._owns_files = True
        self._reading = False
        """A fork between ``__enter__`` and ``close``: its owner closes no file meanwhile."""
        self._buffer: torch.Tensor | None = None
        self.wrote = False
        """Whether the last :meth:`read_into` wrote into its target (when it raised: if
        not, the target is untouched, ``in_place.fill``)."""
        self._pinned = PinnedRing(self.cuda_piece_bytes)
        """The staging buffers for CUDA destinations: page-locked, so copies go by DMA,
        and several, so the copies overlap the reads (``pinned_ring.py``)."""

    def fork(self) -> CheckpointReader:
        """A reader for another thread (``threaded_reads.py``), with buffers of its own
        and this reader's open files: each file is opened and validated once, and the
        descriptor validated is the one every thread reads, in every pass of a load. Once
        forked, no file is closed to make room until this reader closes (the caller
        bounds the files a threaded load opens by :data:`MAX_OPEN_FILES`), and this
        reader's ``close`` waits for every fork used in a ``with`` to leave it."""
        if self._spool is not None:
            raise ValueError("a reader that records into a spool reads on one thread")
        fork = CheckpointReader(
            self.storage,
            self.manifest,
            piece_bytes=self.piece_bytes,
            cuda_piece_bytes=self.cuda_piece_bytes,
        )
        fork._files, fork._owns_files = self._files, False
        self._files.shared = True
        return fork

    def close(self) -> None:
        if self._owns_files:
            self._files.close()  # once no fork is reading
        elif self._reading:
            self._reading = False
            self._files.leave()

    def __enter__(self) -> CheckpointReader:
        if not self._owns_files and not self._reading:  # a fork, on its thread
            self._reading = True
            self._files.join()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading tensors

    def read(
        self, key: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """The box ``offsets``/``shape`` (default: everything) of tensor ``key``, on CPU."""
        rec = self.manifest.tensors[key]
        box = box_of(rec, offsets, shape)
        pieces = self._pieces(key, rec, box)  # every file checked before allocating
        out = torch.empty(box[1], dtype=rec.dtype, device="cpu")  # whatever the default
        if out.numel():
            self._fill(key, rec, box, pieces, out)
        return out

    def read_into(
        self,
        key: str,
        offsets: tuple[int, ...] | None,
        shape: tuple[int, ...] | None,
        out: torch.Tensor,
    ) -> None:
        """Fill ``out`` (any device and layout, the box's shape and dtype) with the box.

        ``out`` is written as the bytes arrive, before the last checksum of the box has
        been checked: a mismatch leaves it partly overwritten, unless it came before the
        first byte was written (:attr:`wrote` says which).
        """
        self.wrote = False
        rec = self.manifest.tensors[key]
        box = box_of(rec, offsets, shape)
        if out.dtype != rec.dtype or tuple(out.shape) != box[1]:
            raise ValueError(f"read_into({key!r}): out is not the box's dtype and shape")
        pieces = self._pieces(key, rec, box)
        if out.numel():
            with torch.no_grad():
                self._fill(key, rec, box, pieces, out.detach())

    def check(
        self, key: str, offsets: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> None:
        """Read and CRC-check every byte the box needs, keeping none (memory: one piece)."""
        rec = self.manifest.tensors[key]
        box = box_of(rec, offsets, shape)
        for chunk, overlap in self._pieces(key, rec, box):
            rel = (tuple(o - c for o, c in zip(overlap[0], chunk.offsets)), overlap[1])
            if math.prod(box[1]):
                self._check_rows(key, rec, chunk, rel)

    def wide_rows(self, key: str) -> bool:
        """Whether reading ``key`` may take a buffer larger than a piece: one of its rows
        (dim-0 slices) is (``read``, and ``read_into`` unless it reads straight in)."""
        rec = self.manifest.tensors[key]
        return math.prod(rec.shape[1:]) * dtypes.itemsize(rec.dtype) > self.piece_bytes

    def _pieces(
        self, key: str, rec: TensorRecord, box: geometry.Box
    ) -> list[tuple[ChunkRecord, geometry.Box]]:
        found = [
            (chunk, overlap)
            for chunk in rec.chunks
            if (overlap := geometry.intersect((chunk.offsets, chunk.shape), box)) is not None
        ]
        # A hostile manifest can claim any shape, but the chunks must tile it and each must
        # exist on disk: check them before anything is allocated.
        for chunk, _ in found:
            self._entry(key, rec, chunk)
        # Chunks never overlap, so they cover the box iff their overlaps add up to it. A
        # parsed manifest's chunks tile every tensor; a rank checkpoint's view holds only
        # the rank's own pieces (``tiers/rank_checkpoint.py``), and a box outside them must
        # not come back half-filled.
        if sum(math.prod(overlap[1]) for _, overlap in found) != math.prod(box[1]):
            raise CheckpointMismatchError(
                f"tensor {key!r}: the checkpoint holds {_boxes(found)} of it, which do not "
                f"cover the region this rank needs (offsets {list(box[0])}, shape "
                f"{list(box[1])})"
            )
        return found

    def _fill(
        self,
        key: str,
        rec: TensorRecord,
        box: geometry.Box,
        pieces: list[tuple[ChunkRecord, geometry.Box]],
        out: torch.Tensor,
    ) -> None:
        # Straight into the target's memory only where that memory holds exactly its
        # elements; a wrapper subclass or a view with a pending conjugation or negation
        # is written by its own copy_.
        direct = (
            out.device.type == "cpu"
            and out.is_contiguous()
            and not (out.is_conj() or out.is_neg())
            and has_memory(out)
        )
        for chunk, overlap in pieces:
            if direct and overlap == box and chunk.offsets == box[0] and chunk.shape == box[1]:
                self._read_whole(key, rec, chunk, out)
                continue
            rel = (tuple(o - c for o, c in zip(overlap[0], chunk.offsets)), overlap[1])
            dest = tuple(slice(o - b, o - b + n) for o, b, n in zip(overlap[0], box[0], overlap[1]))
            self._read_rows(key, rec, chunk, rel, out[dest])

    def _read_whole(
        self, key: str, rec: TensorRecord, chunk: ChunkRecord, out: torch.Tensor
    ) -> None:
        reader, entry = self._entry(key, rec, chunk)
        view = memory(out)
        checker = BlockChecker(key, chunk, self.manifest.block_bytes, 0)
        step = self._check_piece_bytes
        for start in range(0, view.nbytes, step):
            # Each piece is checked right after it is read, while it is still in cache.
            piece = view[start : start + step]
            self.wrote = True
            reader.read_into(entry.start + start, piece)
            checker.feed(piece)
        checker.finish()

    def _check_rows(
        self, key: str, rec: TensorRecord, chunk: ChunkRecord, rel: geometry.Box
    ) -> None:
        """Stream the blocks covering the rows of ``chunk`` that ``rel`` needs through
        their checksums, in pieces small enough to be checked while still in cache (as
        ``_read_whole``'s are) whatever a row's size."""
        reader, entry = self._entry(key, rec, chunk)
        begin, _, _, end = self._span(rec, chunk, rel, entry.nbytes)
        checker = BlockChecker(
            key, chunk, self.manifest.block_bytes, begin // self.manifest.block_bytes
        )
        self._stream(reader, entry.start + begin, end - begin, checker)
        if end == entry.nbytes:
            checker.finish()

    def _span(
        self, rec: TensorRecord, chunk: ChunkRecord, rel: geometry.Box, nbytes: int
    ) -> tuple[int, int, int, int]:
        """Byte offsets in ``chunk``: the whole checksum blocks around the rows (dim-0
        slices) ``rel`` needs (``begin``, ``end``) and the rows themselves (``lo``, ``hi``)."""
        block = self.manifest.block_bytes
        row_bytes = _row_bytes(rec, chunk)
        first_row, rows = (rel[0][0], rel[1][0]) if chunk.shape else (0, 1)
        lo, hi = first_row * row_bytes, (first_row + rows) * row_bytes
        return lo // block * block, lo, hi, min(-(-hi // block) * block, nbytes)

    def _read_rows(
        self,
        key: str,
        rec: TensorRecord,
        chunk: ChunkRecord,
        rel: geometry.Box,
        dest: torch.Tensor,
    ) -> None:
        """Stream the blocks covering the rows (dim-0 slices) of ``chunk`` that ``rel`` needs,
        check them, and copy ``rel`` of each row into ``dest``."""
        reader, entry = self._entry(key, rec, chunk)
        block = self.manifest.block_bytes
        row_bytes = _row_bytes(rec, chunk)
        rows = rel[1][0] if chunk.shape else 1
        begin, lo, hi, end = self._span(rec, chunk, rel, entry.nbytes)
        checker = BlockChecker(key, chunk, block, begin // block)
        self._stream(reader, entry.start + begin, lo - begin, checker)  # before the rows
        cuda = dest.device.type == "cuda"
        piece_bytes = self.piece_bytes
        if cuda and dest.is_contiguous():
            # A non-contiguous CUDA target takes a device copy of each piece on its way
            # (torch's copy_): the host-sized pieces keep that copy small.
            piece_bytes = self.cuda_piece_bytes
        per_piece = max(1, piece_bytes // max(row_bytes, 1))
        inner = (slice(None), *(slice(o, o + n) for o, n in zip(rel[0][1:], rel[1][1:])))
        stream = torch.cuda.current_stream(dest.device) if cuda else None
        try:
            for r in range(0, rows, per_piece):
                n = min(per_piece, rows - r)
                nbytes = n * row_bytes
                slot, raw = self._pinned.take(nbytes) if cuda else (0, self._piece(nbytes))
                view = memory(raw)
                reader.read_into(entry.start + lo + r * row_bytes, view)
                checker.feed(view)
                if not row_bytes:
                    continue
                self.wrote = True
                if chunk.shape:
                    rows_read = raw.view(rec.dtype).reshape((n, *chunk.shape[1:]))
                    dest[r : r + n].copy_(rows_read[inner], non_blocking=cuda)
                else:  # a 0-d tensor: its one element
                    dest.copy_(raw.view(rec.dtype).reshape(()), non_blocking=cuda)
                if cuda:  # queued: the buffer is refilled once this copy has run
                    self._pinned.sent(slot, stream)
        finally:
            if cuda:  # every copy has landed when the read returns (or raises)
                self._pinned.drain()
        self._stream(reader, entry.start + hi, end - hi, checker)  # after the rows
        if end == entry.nbytes:
            checker.finish()

    def _stream(self, reader: FileReader, offset: int, nbytes: int, checker: BlockChecker) -> None:
        """Feed ``nbytes`` at ``offset`` to ``checker``, one piece at a time."""
        step = self._check_piece_bytes
        for start in range(0, nbytes, step):
            view = memory(self._piece(min(step, nbytes - start)))
            reader.read_into(offset + start, view)
            checker.feed(view)

    def _piece(self, nbytes: int) -> torch.Tensor:
        """A reused buffer of ``nbytes`` (grown only for a row larger than a piece)."""
        held = self._buffer
        if held is None or held.numel() < nbytes:
            self._buffer = held = None  # free the smaller one before allocating its successor
            held = torch.empty(max(nbytes, 0), dtype=torch.uint8, device="cpu")
            self._buffer = held
        return held[:nbytes]

    # -- verifying

    def verify_all(
        self,
        skip_files: set[str] | None = None,
        checked_files: set[str] | None = None,
        threads: int = 1,
    ) -> list[str]:
        """Check every chunk of every tensor (but those of tensors with chunks in
        ``skip_files``, and the chunks in ``checked_files``, whose bytes were checked as
        they were written), on up to ``threads`` threads (``threaded_reads.py``: each
        takes a run of files, about equal in bytes); return one line per problem found.
        Memory: one piece per thread, whatever the sizes."""
        skip, checked = skip_files or set(), checked_files or set()
        by_file: dict[str, list[tuple[str, TensorRecord, ChunkRecord]]] = {}
        for key, rec in self.manifest.tensors.items():
            if skip and any(chunk.file in skip for chunk in rec.chunks):
                continue
            for chunk in rec.chunks:
                if chunk.file not in checked:
                    by_file.setdefault(chunk.file, []).append((key, rec, chunk))
        # File by file: each opened once, and a thread's run holds whole files mostly.
        items = [item for chunks in by_file.values() for item in chunks]
        outcome = threaded_reads.run(
            self,
            items,
            CheckpointReader._problem_in,
            threads=threads,
            sizes=[math.prod(c.shape) * dtypes.itemsize(r.dtype) for _, r, c in items],
        )
        outcome.raise_first()  # not a checksum's problem (an I/O error): as on one thread
        problems: dict[str, list[str]] = {}
        for i, (key, _, _) in enumerate(items):
            found = outcome.results[i]
            if found is not None:
                problems.setdefault(key, []).append(found)
        # One line per problem, in the manifest's tensor order.
        return [line for key in self.manifest.tensors for line in problems.get(key, [])]

    def _problem_in(self, item: tuple[str, TensorRecord, ChunkRecord]) -> str | None:
        """What is wrong with one chunk's bytes (``verify_all``), or ``None``."""
        key, rec, chunk = item
        try:
            reader, entry = self._entry(key, rec, chunk)
            checker = BlockChecker(key, chunk, self.manifest.block_bytes, 0)
            self._stream(reader, entry.start, entry.nbytes, checker)
            checker.finish()
        except CheckpointCorruptError as e:
            return str(e)
        return None

    def check_files(self) -> dict[str, str]:
        """Open every data file and check its size and header; ``{file: problem}``."""
        problems = {}
        for name in self.manifest.files:
            try:
                self._file(name)
            except StoreFailedError:
                raise  # the store's failure, not the file's
            except CheckpointError as e:
                problems[name] = str(e)
        return problems

    # -- files

    def _file(self, name: str) -> tuple[FileReader, dict[str, HeaderEntry]]:
        files = self._files
        with files.lock:  # one thread opens and validates a file; all then read it
            if name in files.open:
                files.open.move_to_end(name)
                return files.open[name]
            if name in files.failed:
                raise files.failed[name]
            try:
                opened = self._validated(name, files.identities)
            except CheckpointCorruptError as e:
                files.failed[name] = e
                raise
            if len(files.open) >= MAX_OPEN_FILES and not files.shared:
                _, (oldest, _) = files.open.popitem(last=False)
                oldest.close()
            files.open[name] = opened
            return opened

    def _validated(
        self, name: str, identities: dict[str, object]
    ) -> tuple[FileReader, dict[str, HeaderEntry]]:
        """Open ``name`` and check it against the manifest: size, header CRC32, header;
        first of all, that it is the file ``name`` was when first opened (``identities``),
        before a byte of it is read."""
        reader = self.storage.open_reader(name)
        try:
            _same_file(identities, name, reader)
        except BaseException:
            reader.close()
            raise
        if self._spool is not None:
            reader = self._spool.wrap(reader)
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
        except BaseException:
            reader.close()
            raise
        return reader, headers

    def _entry(
        self, key: str, rec: TensorRecord, chunk: ChunkRecord
    ) -> tuple[FileReader, HeaderEntry]:
        reader, headers = self._file(chunk.file)
        return reader, entry_for(headers, key, rec, chunk)


class _OpenFiles:
    """The data files a reader and its forks have open, each validated (``_validated``)
    on the descriptor that is then read."""

    def __init__(self) -> None:
        self.open: OrderedDict[str, tuple[FileReader, dict[str, HeaderEntry]]] = OrderedDict()
        self.failed: dict[str, CheckpointCorruptError] = {}
        """A file found bad once is not reopened (a FIFO, a device) for its next chunk."""
        self.identities: dict[str, object] = {}
        """Which file each name was when first opened: one closed to make room and opened
        again must be the same file."""
        self.lock = threading.Condition(threading.Lock())  # no reentry: a plain lock
        self.shared = False
        """Read by several threads: no file is closed to make room (another may read it)."""
        self._forks = 0

    def join(self) -> None:
        with self.lock:
            self._forks += 1

    def leave(self) -> None:
        with self.lock:
            self._forks -= 1
            self.lock.notify_all()

    def close(self) -> None:
        """Close every file once no fork can read it any more (a fork may still be
        finishing a read if its thread was not joined, say after a second Ctrl-C)."""
        with self.lock:
            self.lock.wait_for(lambda: self._forks <= 0)
            for reader, _ in self.open.values():
                reader.close()
            self.open.clear()


def _same_file(identities: dict[str, object], name: str, opened: FileReader) -> None:
    """Refuse ``opened`` if ``name`` was another file when first opened: one closed to
    make room, then replaced, is never read."""
    identity = getattr(opened, "identity", None)
    first = identities.setdefault(name, identity)
    if identity is None or first == identity:
        return
    raise CheckpointCorruptError(
        f"data file {name} was replaced during the load: it is not the file that was "
        "opened and checked before (it was closed to keep at most "
        f"{MAX_OPEN_FILES} files open, and its name now names another file); nothing was "
        "read from the new one"
    )


def _row_bytes(rec: TensorRecord, chunk: ChunkRecord) -> int:
    """Bytes of one dim-0 slice of ``chunk`` (all of it for a 0-d tensor)."""
    return (math.prod(chunk.shape[1:]) if chunk.shape else 1) * dtypes.itemsize(rec.dtype)


def entry_for(
    headers: dict[str, HeaderEntry], key: str, rec: TensorRecord, chunk: ChunkRecord
) -> HeaderEntry:
    """The header entry of ``chunk`` (of tensor ``key``), once it matches the manifest."""
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
    return entry


def box_of(
    rec: TensorRecord, offsets: tuple[int, ...] | None, shape: tuple[int, ...] | None
) -> geometry.Box:
    """The box a request selects: ``offsets``/``shape``, or the whole tensor."""
    if offsets is not None and shape is not None:
        return offsets, shape
    return (0,) * len(rec.shape), rec.shape


def _boxes(found: list[tuple[ChunkRecord, geometry.Box]]) -> str:
    """The pieces a tensor's region overlaps, for a message (at most three named)."""
    named = [f"offsets {list(c.offsets)} shape {list(c.shape)}" for c, _ in found[:3]]
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return f"pieces at {'; '.join(named)}{more}" if found else "no piece"
