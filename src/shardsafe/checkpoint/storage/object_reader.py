"""Ranged reads of the objects of one object-store prefix, for ``FsspecStorage.open_reader``.

Requests, not bytes, are what object stores charge in latency, so small reads (headers,
biases, the small pieces the checkpoint reader asks for) are served from one cached
block, fetched by a single ranged GET of :data:`READ_AHEAD_BYTES`. Once the reads have
gone through two blocks in a row, the reader is plainly walking the object in order (a
rank reading its file of a sharded checkpoint), and the next block is fetched in the
background while this one is used: the GET's latency overlaps the CRC checks and copies
instead of adding to them (only for fsspec's asynchronous backends, s3fs and gcsfs,
whose calls are safe from a second thread). Reads of at least a block are fetched as
several ranged GETs in flight at once, straight into the caller's buffer.

Memory: the readers of one storage share one :class:`ReadBudget`: only the two readers
used last hold blocks, so a load holds at most four blocks (96 MiB) however many objects
it has open (a load at a new world size reads parts of many shard files).

A small object read whole (``read_small``: locks, ``latest``, manifests) is not read by
range: see :func:`get_whole_s3`.

A response whose body stops short of its length is fetched again, as s3fs fetches its
own, and a read the store fails is told as such (:mod:`.store_failures`).
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ...errors import CheckpointCorruptError
from .store_failures import (
    cut_short,
    failed_read,
    garbled,
    is_cut_short,
    is_garbled,
    store_failures,
)

READ_AHEAD_BYTES = 24 << 20
"""The cached block (and the one fetched ahead): a 96 MiB shard file is 4 GETs."""
HOLDERS = 2
"""Readers that keep their blocks at once (see :class:`ReadBudget`): at most
``2 * HOLDERS`` blocks, 96 MiB, per load."""
PARALLEL_RANGE_BYTES = 8 << 20
"""A read of at least :data:`READ_AHEAD_BYTES` is fetched as ranged GETs of this size,
several in flight at once."""


def get_whole_s3(fs: Any, path: str, limit: int, name: str) -> tuple[int | None, bytes | None]:
    """The object at ``path`` of the s3fs filesystem ``fs`` (``name``, for messages) in one
    GET: ``(its size, its bytes)``, or ``(its size, None)`` if it is over ``limit`` bytes.

    One GET, not a HEAD then a ranged GET: the body and its length come from one response,
    so they are one version of the object, even if another process replaces it meanwhile.
    The response's Content-Length refuses an object over ``limit`` before its body is
    read, and no more than ``limit + 1`` bytes are ever read (a store that sends no
    Content-Length: the size is then ``None``). The request is retried as s3fs retries
    its own, and a body cut short is fetched again up to ``fs.retries`` times in all.
    Raises ``FileNotFoundError`` if there is no such object.
    """
    from fsspec.asyn import sync

    bucket, key, _ = fs.split_path(path)

    async def get() -> tuple[int | None, bytes | None]:
        with store_failures(name):
            got = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        size = got.get("ContentLength")
        body = got["Body"]
        try:
            if size is not None and size > limit:
                return int(size), None  # refused unread: closing drops the connection
            data = await _read_at_most(body, limit + 1)
        finally:
            body.close()
        if len(data) > limit:
            return size, None
        if size is not None and len(data) != size:
            raise CheckpointCorruptError(
                f"{name} is truncated: the store said it holds {size} bytes but sent {len(data)}"
            )
        return size, data

    async def get_whole() -> tuple[int | None, bytes | None]:
        # Only a body cut short, or one that did not match the store's checksum of it
        # (botocore checks it as the body is read), is fetched again here: ``_call_s3``
        # retries the request as s3fs does (a second layer of retries around it multiplied them: 250
        # requests and 226 s before a dead endpoint's error, not 50).
        tries = max(1, int(getattr(fs, "retries", 5)))
        attempt = 0
        while True:
            try:
                return await get()
            except Exception as e:
                attempt += 1
                if not (is_cut_short(e) or is_garbled(e)):
                    failed = failed_read(name, e)  # the body's read is outside ``get``'s
                    if failed is e:
                        raise
                    raise failed from e
                if attempt == tries:
                    told = cut_short if is_cut_short(e) else garbled
                    raise told(name, e, tries) from e
                await asyncio.sleep(min(0.1 * 1.7 ** (attempt - 1), 2.0))

    result: tuple[int | None, bytes | None] = sync(fs.loop, get_whole)
    return result


async def _read_at_most(body: Any, most: int) -> bytes:
    """At most ``most`` bytes of a streamed body, to its end (a read may return fewer
    bytes than asked while more follow)."""
    chunks: list[bytes] = []
    left = most
    while left > 0:
        chunk: bytes = await body.read(left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class ReadBudget:
    """Which readers of a storage may hold blocks: the :data:`HOLDERS` used last.

    Two, not one: a rank commonly alternates between two objects, its own shard file and
    the one holding the replicated tensors (FSDP2's AdamW ``step`` scalars are stored
    once, in rank 0's file), and a single holder would drop and refetch a block at every
    switch."""

    def __init__(self) -> None:
        self._holders: list[FsspecFileReader] = []

    def take(self, reader: FsspecFileReader) -> None:
        if self._holders and self._holders[-1] is reader:
            return
        if reader in self._holders:
            self._holders.remove(reader)
        self._holders.append(reader)
        while len(self._holders) > HOLDERS:
            self._holders.pop(0).drop_blocks()

    def give_back(self, reader: FsspecFileReader) -> None:
        if reader in self._holders:
            self._holders.remove(reader)


class FsspecFileReader:
    """One object read by byte range (ranged GETs); its size fixed at open."""

    def __init__(
        self, fs: Any, path: str, size: int, name: str, budget: ReadBudget | None = None
    ) -> None:
        self.name, self.size = name, size
        self._fs, self._path = fs, path
        self._budget = budget or ReadBudget()
        self._block_start, self._block = 0, b""
        self._next: tuple[int, Future[bytes]] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._can_prefetch = bool(getattr(fs, "async_impl", False))

    def mapping_path(self) -> str | None:
        return None  # an object: nothing to map

    def read_into(self, offset: int, out: memoryview) -> None:
        view = out.cast("B") if out.format != "B" else out
        if not view.nbytes:
            return
        end = offset + view.nbytes
        if end > self.size:
            raise CheckpointCorruptError(
                f"{self.name} is truncated: expected bytes up to offset {end}, but the "
                f"object ends at {self.size}"
            )
        self._budget.take(self)
        if view.nbytes >= READ_AHEAD_BYTES:
            self._get_parallel(offset, view)
            return
        at = offset
        while at < end:  # a read across the end of a block takes the rest from the next
            start = self._block_start
            if not start <= at < start + len(self._block):
                start = self._move_to(at)
            take = min(end, start + len(self._block)) - at
            view[at - offset : at - offset + take] = memoryview(self._block)[at - start :][:take]
            at += take

    def _move_to(self, offset: int) -> int:
        """Make the block hold ``offset`` (and what follows it); return its start."""
        following = self._block_start + len(self._block)
        sequential = bool(self._block) and following <= offset < following + READ_AHEAD_BYTES
        start = following if sequential else offset
        ahead, self._next = self._next, None
        self._block = b""  # never three blocks at once
        if ahead is not None and ahead[0] == start:
            self._block = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].cancel()  # a jump: the block fetched ahead is not needed
            self._block = self._get(start, self._block_end(start))
        self._block_start = start
        if sequential and self._can_prefetch and start + len(self._block) < self.size:
            following = start + len(self._block)
            future = self._executor().submit(self._get, following, self._block_end(following))
            self._next = (following, future)
        return start

    def _block_end(self, start: int) -> int:
        return min(self.size, start + READ_AHEAD_BYTES)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardsafe-read-ahead")
        return self._pool

    def _get_parallel(self, offset: int, view: memoryview) -> None:
        """A large range as several ranged GETs in flight at once (fsspec's ``cat_ranges``,
        concurrent in s3fs): no more memory than the range itself."""
        starts = list(range(offset, offset + view.nbytes, PARALLEL_RANGE_BYTES))
        ends = [min(s + PARALLEL_RANGE_BYTES, offset + view.nbytes) for s in starts]
        parts = self._fs.cat_ranges([self._path] * len(starts), starts, ends)
        for start, end, data in zip(starts, ends, parts):
            if isinstance(data, FileNotFoundError):
                raise CheckpointCorruptError(f"data object {self.name} is missing")
            if isinstance(data, BaseException):
                raise failed_read(self.name, data) from data
            self._check_length(start, end, data)
            view[start - offset : end - offset] = data

    def _get(self, start: int, end: int) -> bytes:
        try:
            with store_failures(self.name):
                data: bytes = self._fs.cat_file(self._path, start=start, end=end)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"data object {self.name} is missing") from None
        self._check_length(start, end, data)
        return data

    def _check_length(self, start: int, end: int, data: bytes) -> None:
        if len(data) != end - start:
            raise CheckpointCorruptError(
                f"{self.name} is truncated: expected bytes up to offset {end}, but the "
                f"object ends at {start + len(data)}"
            )

    def drop_blocks(self) -> None:
        """Free the cached block and the one fetched ahead (another reader reads now)."""
        ahead, self._next, self._block = self._next, None, b""
        if ahead is not None:
            ahead[1].cancel()

    def close(self) -> None:
        self.drop_blocks()
        self._budget.give_back(self)
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> FsspecFileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
