"""The storage seam: what callers need is declared by the ``Storage`` protocol, and
decided by it, never by a storage's class.

``load`` takes ``storage=`` as ``save`` does; each backend declares its capabilities
(``cheap_rereads``, ``cheap_metadata``, ``abort_pending_uploads``, ``lock_backend``,
``remove_child``; a sink's ``CacheAvoidingSink``); a local storage that says its rereads
are not cheap is loaded like an object store (through the spool); and no module outside
the storage modules checks a concrete storage class.
"""

from __future__ import annotations

import re
import socket
from collections import Counter
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe.checkpoint import loading
from shardsafe.checkpoint.storage.files import LocalFileSink, create_new
from shardsafe.checkpoint.storage.local import LocalStorage
from shardsafe.checkpoint.storage.lock import LOCK_NAME, RootLock
from shardsafe.checkpoint.storage.lock_backends import LocalLockBackend, ObjectLockBackend
from shardsafe.checkpoint.storage.object_storage import FsspecFileSink, FsspecStorage
from shardsafe.checkpoint.storage.protocol import CacheAvoidingSink, Storage

SRC = Path(shardsafe.__file__).parent
STORAGE = SRC / "checkpoint" / "storage"


class _Counting(LocalStorage):
    """A local storage that counts what is asked of it (class-wide: a factory makes one
    per directory)."""

    calls: Counter[str] = Counter()

    def open_reader(self, name: str):  # type: ignore[no-untyped-def]
        _Counting.calls["open_reader"] += 1
        return super().open_reader(name)

    def read_small(self, name: str, limit: int) -> bytes:
        _Counting.calls["read_small"] += 1
        return super().read_small(name, limit)


def test_load_reads_through_the_storage_it_is_passed(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    shardsafe.save(tmp_path / "c", {"model": model, "step": 3}, storage=_Counting)
    _Counting.calls.clear()
    out = torch.nn.Linear(4, 3)
    got = shardsafe.load(tmp_path / "c", {"model": out}, storage=_Counting)
    assert torch.equal(out.weight, model.weight) and got == {"step": 3}
    assert _Counting.calls["read_small"] >= 1  # the manifest
    assert _Counting.calls["open_reader"] >= 1  # the data file


def test_a_storage_passed_to_load_decides_where_it_reads(tmp_path: Path) -> None:
    """The factory, not the path's default: a storage that refuses to open makes the load
    fail with its error."""

    class Refusing(LocalStorage):
        def require_directory(self) -> None:
            raise shardsafe.CheckpointNotFoundError(f"refused: {self.directory}")

    shardsafe.save(tmp_path / "c", {"step": 1})
    with pytest.raises(shardsafe.CheckpointNotFoundError, match="refused: "):
        shardsafe.load(tmp_path / "c", {}, storage=Refusing)


class _DearRereads(LocalStorage):
    """A local storage that says a second read costs a second transfer."""

    cheap_rereads = False


def test_verify_first_spools_where_the_storage_says_rereads_are_not_cheap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spooled: list[int] = []
    real = loading.spool_for

    def spool_for(nbytes: int):  # type: ignore[no-untyped-def]
        spooled.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(loading, "spool_for", spool_for)
    model = torch.nn.Linear(64, 64, bias=False)
    shardsafe.save(tmp_path / "c", {"model": model})
    out = torch.nn.Linear(64, 64, bias=False)
    shardsafe.load(tmp_path / "c", {"model": out})
    assert spooled == []  # the page cache serves the second read
    out = torch.nn.Linear(64, 64, bias=False)
    shardsafe.load(tmp_path / "c", {"model": out}, storage=_DearRereads)
    assert spooled == [64 * 64 * 4] and torch.equal(out.weight, model.weight)


def test_each_backend_declares_its_capabilities(tmp_path: Path) -> None:
    local = LocalStorage(str(tmp_path))
    remote = FsspecStorage("memory://seam/run")
    for storage in (local, remote):
        assert isinstance(storage, Storage)
    assert (local.cheap_rereads, local.cheap_metadata) == (True, True)
    assert (remote.cheap_rereads, remote.cheap_metadata) == (False, False)
    assert local.abort_pending_uploads() == 0 and remote.abort_pending_uploads() == 0
    local_lock, remote_lock = local.lock_backend(), remote.lock_backend()
    assert isinstance(local_lock, LocalLockBackend) and isinstance(remote_lock, ObjectLockBackend)
    assert (local_lock.holds_exclusive, local_lock.empty_is_unwritten) == (True, True)
    assert (remote_lock.holds_exclusive, remote_lock.empty_is_unwritten) == (False, False)
    sink = LocalFileSink(create_new(local.fd, "f"), local.where("f"))
    assert isinstance(sink, CacheAvoidingSink)
    sink.abort()
    assert not isinstance(FsspecFileSink(remote.fs, "seam/run/g", "g", 5 << 20), CacheAvoidingSink)


def test_remove_child_removes_an_empty_directory_and_never_a_link(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with LocalStorage(str(tmp_path)) as root:
        root.remove_child("empty")
        with pytest.raises(NotADirectoryError):
            root.remove_child("link")
    assert not (tmp_path / "empty").exists()
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target").is_dir()


@pytest.mark.parametrize("where", ["local", "memory"])
def test_one_lock_on_either_medium(tmp_path: Path, where: str) -> None:
    """The same RootLock takes, keeps and releases the lock on a filesystem and on an
    object store; a second run (another host) is refused with the same message."""

    def open_root() -> Storage:
        if where == "local":
            return LocalStorage(str(tmp_path))
        storage = FsspecStorage(f"memory://lock-{tmp_path.name}/run")
        storage.make_directory()
        return storage

    mine, theirs = RootLock(open_root), RootLock(open_root)
    theirs.me["host"] = "elsewhere"
    mine.acquire()
    assert mine.conditional is True
    mine.acquire()  # held: a later save keeps it
    with pytest.raises(shardsafe.CheckpointError) as info:
        theirs.acquire()
    where_lock = open_root().where(LOCK_NAME)
    assert "is being written by another run (pid " in str(info.value)
    assert f"on host {socket.gethostname()}, since " in str(info.value)
    assert f"if it is already gone, delete {where_lock}." in str(info.value)
    mine.release()
    assert not open_root().exists(LOCK_NAME)


def test_nothing_outside_the_storage_package_checks_a_concrete_storage_class() -> None:
    concrete = re.compile(r"isinstance\([^)]*\b(LocalStorage|FsspecStorage)\b")
    found = [
        f"{path.relative_to(SRC)}:{n}"
        for path in SRC.rglob("*.py")
        if not path.is_relative_to(STORAGE)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if concrete.search(line) or 'avoid_page_cache"' in line
    ]
    assert found == []
