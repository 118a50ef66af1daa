"""``read_small`` on an object store returns one whole version of an object replaced while
it is read.

Other runs replace small objects at any moment: the root lock (a dead run's lock taken
over), ``latest`` (moved by a save), a manifest. ``read_small`` used to ask the object's
size (a HEAD) and then GET that many bytes by range: an object replaced between the two
was read as the first bytes of the new version (another run's lock "damaged: it is not
valid JSON", seen in a five-process lock race on moto) or refused as truncated. These
tests replace the object right after a chosen request of the read, on a real moto
server, a real GCS emulator and ``memory://``: the bytes read must be the old version or
the new one, whole, with no error.
"""

from __future__ import annotations

import json
from typing import Any

import fsspec.implementations.memory
import pytest

from shardsafe.checkpoint.storage.lock import LOCK_NAME
from shardsafe.checkpoint.storage.lock_owner import read_owner
from shardsafe.checkpoint.storage.object_storage import FsspecStorage
from shardsafe.errors import CheckpointCorruptError
from tests.gcsserver import GcsServer
from tests.s3server import S3Server

OLD = json.dumps({"pid": 1, "host": "h", "token": "old", "since": 1.0}).encode()
LONGER = json.dumps({"pid": 2, "host": "h", "token": "new-" * 20, "since": 2.0}).encode()
SHORTER = json.dumps({"pid": 3, "host": "h", "since": 3.0}).encode()


def s3_replacing(s3_server: S3Server, key: str, data: bytes, after: int) -> Any:
    """An s3fs filesystem that PUTs ``data`` at ``key`` once its ``after``-th request (of
    any kind) has been answered: another process replacing the object at that moment.
    Its ``requests`` lists the methods it was asked for (the PUT not included)."""
    import s3fs

    class Replacing(s3fs.S3FileSystem):  # type: ignore[misc]
        requests: list[str] = []

        async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
            out = await super()._call_s3(method, *args, **kwargs)
            self.requests.append(method)
            if len(self.requests) == after:
                bucket, name = key.split("/", 1)
                await super()._call_s3("put_object", Bucket=bucket, Key=name, Body=data)
            return out

    return Replacing(skip_instance_cache=True, client_kwargs={"endpoint_url": s3_server.endpoint})


@pytest.mark.parametrize("new", [LONGER, SHORTER], ids=["longer", "shorter"])
def test_an_s3_object_replaced_during_read_small_is_read_as_one_whole_version(
    s3_server: S3Server, s3_bucket: str, new: bytes
) -> None:
    s3_server.put(s3_bucket, "run/latest", OLD)
    fs = s3_replacing(s3_server, f"{s3_bucket}/run/latest", new, after=1)
    got = FsspecStorage(f"s3://{s3_bucket}/run", fs=fs).read_small("latest", 1 << 16)
    assert got in (OLD, new), got
    assert fs.requests == ["get_object"]  # one request (a HEAD and a ranged GET before)


def test_an_s3_lock_taken_over_while_read_is_never_called_damaged(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """The colleague's race: a run checks the lock (a HEAD), reads it, and another run
    replaces it meanwhile; the reader gets one run's record, not "damaged"."""
    key = f"run/{LOCK_NAME}"
    s3_server.put(s3_bucket, key, OLD)
    fs = s3_replacing(s3_server, f"{s3_bucket}/{key}", LONGER, after=2)
    storage = FsspecStorage(f"s3://{s3_bucket}/run", fs=fs)
    owner = read_owner(storage, LOCK_NAME, storage.where(LOCK_NAME), empty_ok=False)
    assert owner["token"] in ("old", "new-" * 20)


def test_s3_read_small_over_the_limit_is_refused_unread_with_the_same_message(
    s3_server: S3Server, s3_bucket: str
) -> None:
    import s3fs

    s3_server.put(s3_bucket, "run/manifest.json", b"x" * (1 << 20))
    read: list[int] = []

    class Counting(s3fs.S3FileSystem):  # type: ignore[misc]
        """Counts the body bytes read from each GET."""

        async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
            out = await super()._call_s3(method, *args, **kwargs)
            if method == "get_object":
                body_read = out["Body"].read

                async def counted(*a: Any) -> bytes:
                    data: bytes = await body_read(*a)
                    read.append(len(data))
                    return data

                out["Body"].read = counted
            return out

    fs = Counting(skip_instance_cache=True, client_kwargs={"endpoint_url": s3_server.endpoint})
    storage = FsspecStorage(f"s3://{s3_bucket}/run", fs=fs)
    with pytest.raises(CheckpointCorruptError) as caught:
        storage.read_small("manifest.json", 1024)
    assert str(caught.value) == "manifest.json is 1048576 bytes, over the 1024 limit"
    assert sum(read) == 0


def test_s3_read_small_of_a_missing_object_or_a_prefix_keeps_its_message(
    s3_server: S3Server, s3_bucket: str
) -> None:
    s3_server.put(s3_bucket, "run/step-1/manifest.json", b"{}")
    s3_server.put(s3_bucket, "run/empty", b"")
    storage = FsspecStorage(f"s3://{s3_bucket}/run")
    with pytest.raises(CheckpointCorruptError) as caught:
        storage.read_small("latest", 64)
    assert str(caught.value) == f"data object s3://{s3_bucket}/run/latest is missing"
    with pytest.raises(CheckpointCorruptError) as caught:
        storage.read_small("step-1", 64)
    assert str(caught.value) == f"s3://{s3_bucket}/run/step-1 is a prefix, not an object"
    assert storage.read_small("empty", 64) == b""


def test_a_gs_object_replaced_during_read_small_is_read_as_one_whole_version(
    gcs_server: GcsServer, gcs_bucket: str
) -> None:
    import gcsfs

    path = f"{gcs_bucket}/run/latest"

    class Replacing(gcsfs.GCSFileSystem):  # type: ignore[misc]
        """Replaces the object once its size has been looked up."""

        replaced = False

        async def _info(self, *args: Any, **kwargs: Any) -> Any:
            out = await super()._info(*args, **kwargs)
            if not self.replaced:
                self.replaced = True
                await self._pipe_file(path, LONGER)
            return out

    fs = Replacing(skip_instance_cache=True, **gcs_server.options)
    fs.pipe_file(path, OLD)
    got = FsspecStorage(f"gs://{gcs_bucket}/run", fs=fs).read_small("latest", 1 << 16)
    assert got in (OLD, LONGER), got


def test_a_memory_object_replaced_during_read_small_is_read_as_one_whole_version() -> None:
    class Replacing(fsspec.implementations.memory.MemoryFileSystem):  # type: ignore[misc]
        """Replaces the object once its size has been looked up."""

        replaced = False

        def info(self, path: str, **kwargs: Any) -> Any:
            out = super().info(path, **kwargs)
            if not self.replaced:
                self.replaced = True
                self.pipe_file(path, LONGER)
            return out

    fs = Replacing(skip_instance_cache=True)
    fs.pipe_file("/objread-consistent/latest", OLD)
    try:
        storage = FsspecStorage("memory://objread-consistent", fs=fs)
        assert storage.read_small("latest", 1 << 16) in (OLD, LONGER)
        with pytest.raises(CheckpointCorruptError) as caught:
            storage.read_small("latest", 16)
        assert str(caught.value) == f"latest is {len(LONGER)} bytes, over the 16 limit"
    finally:
        fs.rm("/objread-consistent", recursive=True)
