"""Writing around the page cache (``O_DIRECT``) while a background save runs beside
training, and through it again once someone waits: the bytes on disk are exactly the
bytes written, whatever the cut, the switch or a filesystem that refuses ``O_DIRECT``.

Whether a page passed through the page cache is read back with ``mincore`` on a mapping
of the finished file (a page written around the cache is not resident). tmpfs has no
disk behind its page cache, so there the residency checks are skipped.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from shardsafe.checkpoint.background import async_save
from shardsafe.checkpoint.options import SaveOptions
from shardsafe.checkpoint.storage.direct_writes import DirectWrites
from shardsafe.checkpoint.storage.files import LocalFileSink, create_new
from shardsafe.checkpoint.storage.local import LocalStorage

PIECE = 256 << 10
PAGE = mmap.PAGESIZE
pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="Linux O_DIRECT")


@pytest.fixture(autouse=True)
def _direct_io_here(tmp_path: Path) -> None:
    """Skip where the test directory's filesystem refuses ``O_DIRECT`` (then saves write
    buffered, which every other test covers)."""
    try:
        fd = os.open(tmp_path / ".probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: {e}")
    os.close(fd)
    os.unlink(tmp_path / ".probe")


def _on_tmpfs(path: Path) -> bool:
    best, kind = "", ""
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            if str(path.resolve()).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                best, kind = point, fields[2]
    return kind == "tmpfs"


def resident_pages(path: Path) -> list[bool]:
    """Which pages of the file are in the page cache now."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        pages = -(-size // PAGE)
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(mapping)
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec):
            raise OSError(ctypes.get_errno(), "mincore")
        del anchor
        return [bool(v & 1) for v in vec]
    finally:
        mapping.close()


def _sink(directory: Path, name: str, cls: type[LocalFileSink] = LocalFileSink) -> LocalFileSink:
    fd = os.open(directory, os.O_RDONLY)
    try:
        return cls(create_new(fd, name), str(directory / name))
    finally:
        os.close(fd)


def _pieces(data: bytes, seed: int) -> list[memoryview]:
    """``data`` cut at random places: from 1 byte to a few buffers at a time."""
    rng, out, at = random.Random(seed), [], 0
    while at < len(data):
        n = rng.choice([1, 7, 4096, PIECE - 3, PIECE, 3 * PIECE + 11, rng.randrange(1, 2 * PIECE)])
        out.append(memoryview(data)[at : at + n])
        at += n
    return out


@pytest.mark.parametrize("seed", range(4))
def test_bytes_written_around_the_page_cache_are_exactly_the_file(
    tmp_path: Path, seed: int
) -> None:
    data = random.Random(seed).randbytes(9 * PIECE + 12345)
    sink = _sink(tmp_path, "f")
    sink.avoid_page_cache(threading.Event(), PIECE)
    assert sink.direct
    for piece in _pieces(data, seed):
        sink.write(piece)
    assert sink.finish() == len(data)
    if not _on_tmpfs(tmp_path):  # first: reading the file back caches it
        resident = resident_pages(tmp_path / "f")
        # Only the last partial buffer was written buffered: 9 whole buffers never were.
        assert not any(resident[: 9 * PIECE // PAGE]), sum(resident)
    assert (tmp_path / "f").read_bytes() == data


def test_once_someone_waits_the_rest_goes_through_the_page_cache(tmp_path: Path) -> None:
    data = random.Random(7).randbytes(8 * PIECE)
    hurry = threading.Event()
    sink = _sink(tmp_path, "f")
    sink.avoid_page_cache(hurry, PIECE)
    sink.write(memoryview(data)[: 3 * PIECE + 100])
    assert sink.direct
    hurry.set()
    sink.write(memoryview(data)[3 * PIECE + 100 :])
    assert not sink.direct
    assert sink.finish() == len(data)
    if not _on_tmpfs(tmp_path):
        resident = resident_pages(tmp_path / "f")
        assert not any(resident[: 3 * PIECE // PAGE])
        assert all(resident[(3 * PIECE + 100) // PAGE :])
    assert (tmp_path / "f").read_bytes() == data


def test_a_wait_before_the_first_byte_writes_it_all_buffered(tmp_path: Path) -> None:
    hurry = threading.Event()
    hurry.set()
    sink = _sink(tmp_path, "f")
    sink.avoid_page_cache(hurry, PIECE)
    assert not sink.direct
    sink.write(memoryview(b"x" * (2 * PIECE)))
    assert sink.finish() == 2 * PIECE
    assert (tmp_path / "f").read_bytes() == b"x" * (2 * PIECE)


class _Refusing(DirectWrites):
    """A filesystem that accepts the ``O_DIRECT`` flag but refuses the writes (``EINVAL``),
    after ``allowed`` of them."""

    allowed = 0

    def _write(self, view: memoryview) -> int:
        if _Refusing.allowed <= 0:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        _Refusing.allowed -= 1
        return super()._write(view)


class _RefusingSink(LocalFileSink):
    direct_writes = _Refusing


@pytest.mark.parametrize("allowed", [0, 2])
def test_a_filesystem_that_refuses_direct_writes_gets_every_byte_buffered(
    tmp_path: Path, allowed: int
) -> None:
    _Refusing.allowed = allowed
    data = random.Random(3).randbytes(5 * PIECE + 99)
    sink = _sink(tmp_path, "f", _RefusingSink)
    sink.avoid_page_cache(threading.Event(), PIECE)
    for piece in _pieces(data, 3):
        sink.write(piece)
    assert not sink.direct
    assert sink.finish() == len(data)
    assert (tmp_path / "f").read_bytes() == data


class _Full(DirectWrites):
    def _write(self, view: memoryview) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullSink(LocalFileSink):
    direct_writes = _Full


def test_a_full_disk_fails_the_write_as_it_would_buffered(tmp_path: Path) -> None:
    sink = _sink(tmp_path, "f", _FullSink)
    sink.avoid_page_cache(threading.Event(), PIECE)
    with pytest.raises(OSError) as caught:
        sink.write(memoryview(b"y" * (2 * PIECE)))
    assert caught.value.errno == errno.ENOSPC
    sink.abort()


def test_an_async_save_nobody_waits_for_stays_out_of_the_page_cache(tmp_path: Path) -> None:
    """Through the public path: a background save, polled until done, wrote its data
    file around the page cache, and loads bitwise equal."""
    import shardsafe

    torch.manual_seed(0)
    state = {"w": torch.randn(1024, 1024), "b": torch.randn(1000)}
    expected = {k: v.clone() for k, v in state.items()}
    handle = async_save(str(tmp_path / "ckpt"), {"model": state}, SaveOptions.of())
    for t in state.values():
        t.add_(1.0)  # the checkpoint is the state at the call
    deadline = time.monotonic() + 60
    while not handle.done():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    handle.wait()
    data = [p for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".safetensors"]
    assert len(data) == 1
    if not _on_tmpfs(tmp_path):
        resident = resident_pages(data[0])
        assert sum(resident) * PAGE <= PIECE, f"{sum(resident)} of {len(resident)} pages cached"
    plain = shardsafe.load(str(tmp_path / "ckpt"), {})  # plain tensors come back as saved
    for k, v in expected.items():
        assert torch.equal(plain["model"][k], v)


def test_a_blocking_save_writes_through_the_page_cache(tmp_path: Path) -> None:
    import shardsafe

    shardsafe.save(str(tmp_path / "ckpt"), {"model": {"w": torch.randn(512, 1024)}})
    (data,) = [p for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".safetensors"]
    if not _on_tmpfs(tmp_path):
        assert all(resident_pages(data))


class _Short(DirectWrites):
    """A direct write that writes only its first 4 KiB (as a signal or a nearly full disk
    may make it)."""

    def _write(self, view: memoryview) -> int:
        return super()._write(view[:4096])


class _ShortSink(LocalFileSink):
    direct_writes = _Short


def test_a_short_direct_write_is_completed_buffered(tmp_path: Path) -> None:
    data = random.Random(5).randbytes(4 * PIECE + 17)
    sink = _sink(tmp_path, "f", _ShortSink)
    sink.avoid_page_cache(threading.Event(), PIECE)
    sink.write(memoryview(data))
    assert not sink.direct
    assert sink.finish() == len(data)
    assert (tmp_path / "f").read_bytes() == data


class _WaitedDuring(DirectWrites):
    """Someone waits for the save while the second direct write is under way."""

    writes = 0

    def _write(self, view: memoryview) -> int:
        _WaitedDuring.writes += 1
        if _WaitedDuring.writes == 2:
            self._until.set()
        return super()._write(view)


class _WaitedDuringSink(LocalFileSink):
    direct_writes = _WaitedDuring


def test_a_wait_that_comes_during_one_write_call_loses_nothing(tmp_path: Path) -> None:
    _WaitedDuring.writes = 0
    data = random.Random(6).randbytes(6 * PIECE + 5)
    sink = _sink(tmp_path, "f", _WaitedDuringSink)
    sink.avoid_page_cache(threading.Event(), PIECE)
    sink.write(memoryview(data))  # one call: direct, direct (the wait), then buffered
    assert not sink.direct and _WaitedDuring.writes == 2
    assert sink.finish() == len(data)
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.parametrize("how", ["wait", "close", "next save"])
def test_waiting_for_an_async_save_finishes_it_through_the_page_cache(
    tmp_path: Path, how: str
) -> None:
    """``wait``, ``close`` and the next save (which waits for this one) each switch the
    rest of the write to buffered: the data file is then almost all in the page cache
    (without the switch, none of it but the last 256 KiB would be)."""
    import shardsafe

    state = {"model": {"w": torch.randn(4096, 4096)}}  # 64 MiB: a write of ~0.1-0.3 s
    handle = async_save(str(tmp_path / "a"), state, SaveOptions.of())
    if how == "wait":
        handle.wait()
    elif how == "close":
        handle.close()
    else:
        shardsafe.save(str(tmp_path / "b"), {"step": 1})
    (data,) = [p for p in (tmp_path / "a").iterdir() if p.suffix == ".safetensors"]
    if _on_tmpfs(tmp_path):
        pytest.skip("tmpfs: every page is in its page cache")
    resident = resident_pages(data)
    assert sum(resident) >= 0.9 * len(resident), f"{sum(resident)} of {len(resident)} pages"


class _PlainSink:
    """A user's sink written before ``avoid_page_cache`` existed: write, finish, abort."""

    def __init__(self, inner: LocalFileSink) -> None:
        self._inner = inner

    def write(self, data: memoryview) -> None:
        self._inner.write(data)

    def finish(self) -> int:
        return self._inner.finish()

    def abort(self) -> None:
        self._inner.abort()


class _PlainStorage(LocalStorage):
    def create(self, name: str, size_hint: int = 0) -> _PlainSink:  # type: ignore[override]
        return _PlainSink(LocalFileSink(create_new(self.fd, name), self.where(name)))


def test_a_storage_whose_sinks_cannot_avoid_the_page_cache_still_saves_in_the_background(
    tmp_path: Path,
) -> None:
    import shardsafe

    w = torch.randn(256, 1024)
    shardsafe.async_save(str(tmp_path / "c"), {"model": {"w": w}}, storage=_PlainStorage).wait()
    assert torch.equal(shardsafe.load(str(tmp_path / "c"), {})["model"]["w"], w)
