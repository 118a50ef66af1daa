"""A checkpoint under an fsspec URL (``s3://``, ``gs://``, ``memory://``): the object-store
backend of the ``Storage`` protocol (see ``storage.py``). Nothing here knows about tensors.

Object stores have no rename and no directories, but a single PUT is atomic, which is all
the manifest-last commit needs: data objects are streamed first (s3fs turns a file opened
for writing into a multipart upload of ``part_bytes`` parts, so a rank holds about two
parts whatever the object's size), and ``manifest.json`` is written last in one PUT. An
upload that fails is aborted, so no half object becomes visible.

Every name is checked by ``files.check_name`` plus the characters some stores or fsspec
give a meaning to (``?``, ``#``, ``*``, ``[``, ``\\``), so no name, from a hostile manifest
or anywhere else, addresses an object outside this checkpoint's prefix.

Listings and metadata are read with fsspec's caches invalidated first: other ranks and
other processes write the same prefix.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from collections.abc import Mapping
from typing import Any

from ...errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from . import stalled_uploads
from .files import check_name
from .lock_backends import ObjectLockBackend
from .object_reader import FsspecFileReader, ReadBudget, get_whole_s3
from .protocol import EntryKind
from .store_failures import answers, store_failed_at, store_failures, writes

DEFAULT_PART_BYTES = 8 << 20
"""Multipart part size (S3's minimum is 5 MiB); ``storage_options={"default_block_size":
N}`` sets another. An object too large for 10,000 parts of it gets larger parts."""
MAX_PARTS = 10_000
"""S3's limit on the parts of one multipart upload."""
_UNSAFE = frozenset("?#*[]\\")
READ_ATTEMPTS = 3
"""Reads of a small object replaced between the two requests of one read (GCS: the
generation looked up is gone by the GET) before ``read_small`` gives up."""

_ENV_ENDPOINT = "AWS_ENDPOINT_URL"


def check_object_name(name: str) -> str:
    """``name`` if it is a plain file name with no character a store or fsspec interprets."""
    check_name(name)
    if _UNSAFE.intersection(name) or any(ord(c) < 32 for c in name):
        raise CheckpointCorruptError(
            f"refusing object name {name!r}: not a plain file name inside the checkpoint"
        )
    return name


def check_url_segments(url: str) -> None:
    """Refuse a URL whose path has an empty or a dot segment (a trailing ``/`` allowed): an
    object store keeps ``a//b``, ``a/./b``, ``a/../b`` and ``a/b`` as different keys where a
    path would name one place, so a save and the lookups of the same place would miss each
    other (``s3://b/run//step-1`` saved where ``s3://b/run/step-1`` finds nothing). An
    empty authority (``hdfs:///user/x``) is allowed."""
    segments = url.rstrip("/").partition("://")[2].split("/")
    if segments[0] in (".", "..") or any(s in ("", ".", "..") for s in segments[1:]):
        raise CheckpointError(
            f"{url!r} has an empty, '.' or '..' segment in its path; an object store keeps "
            "'a//b', 'a/./b' and 'a/b' as different keys: write the URL with single slashes "
            "and no dot segments"
        )
    if url.startswith(("s3://", "s3a://")) and "?versionid=" in url.lower():
        # s3fs reads it as an object version, and the save failed with "Bad Request".
        raise CheckpointError(
            f"{url!r} names an object version (?versionId=), which s3fs reads from an S3 "
            "URL: a checkpoint is a prefix of objects, not one version of one; remove it"
        )


S3_CONNECT_TIMEOUT = 10
"""Seconds botocore waits for a TCP connection to the endpoint (s3fs's own default: 5)."""
S3_READ_TIMEOUT = 10
"""Seconds botocore waits for the store's next byte once a request is sent in full.

aiohttp (s3fs's HTTP client; 3.8.4 and later, and s3fs needs 3.9) starts this timer only
after the request's body has been written, and restarts it on every byte received: the
upload of a part, however large and however slow the link, is not under it, nor is the
download of a large range that keeps arriving. It is the store's silence only: between
a request sent and its answer's first byte (S3 answers a stored part in well under a
second; ``CompleteMultipartUpload`` sends its headers at once and then whitespace while
it works), or a stall in the middle of an answer. A single slower answer is not fatal:
a read timeout is tried again (:data:`S3_ATTEMPTS` times by botocore, within s3fs's 5
tries), so this needs to beat a store's usual latency, not its worst."""
S3_ATTEMPTS = 2
"""botocore's attempts per request, the first included (``total_max_attempts``; its
default is 5). s3fs tries each call 5 times around them (its ``retries``, a class
attribute that ``storage_options`` cannot set, and which also counts the tries of a
response cut short), so a timeout is ``5 * S3_ATTEMPTS`` attempts. With botocore's 5
and the 60 s timeout that was assumed, an endpoint that accepts connections and never
answers held a save for about 25 minutes (s3fs's 15 s made it about 7); now a request
to one fails after ``5 * 2 * 10`` s, about 105 s with the backoff. A ``500`` or ``503``
is retried by botocore only (once, with this default).

Only set where the user set no attempts of their own: ``config_kwargs["retries"]`` in
``storage_options``, ``AWS_MAX_ATTEMPTS``, or ``max_attempts`` in the AWS config file's
profile."""


def s3_defaults(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` for s3fs, with bounded timeouts and retries wherever they set none
    (see :data:`S3_READ_TIMEOUT` and :data:`S3_ATTEMPTS` for why these values).

    botocore's own defaults (5 attempts, each waiting up to s3fs's 15 s read timeout,
    inside s3fs's 5 tries) kept a dead endpoint from failing for minutes, and a save's
    ``timeout`` bounds ranks waiting for each other, not a request. A user's
    ``config_kwargs`` keys win one by one."""
    options = dict(options)
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", S3_CONNECT_TIMEOUT)
    config.setdefault("read_timeout", S3_READ_TIMEOUT)
    if "retries" not in config and not _attempts_configured(options.get("profile")):
        config["retries"] = {"total_max_attempts": S3_ATTEMPTS}
    if "connector_args" not in config:  # an upload the store stops reading times out too
        read = _seconds(config["read_timeout"], S3_READ_TIMEOUT)
        connect = _seconds(config["connect_timeout"], S3_CONNECT_TIMEOUT)
        sockets = stalled_uploads.connector_args(read, connect)
        if sockets is not None:
            config["connector_args"] = sockets
    options["config_kwargs"] = config
    return options


def _seconds(value: Any, default: float) -> float:
    """A timeout as botocore takes it (a number, or ``(connect, read)``), in seconds."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        value = value[1]
    return float(value) if isinstance(value, (int, float)) and value > 0 else default


def _attempts_configured(profile: str | None) -> bool:
    """Whether the environment or the AWS config file's profile sets botocore's attempts
    (``AWS_MAX_ATTEMPTS``, ``max_attempts``): a ``retries`` of ours would override it.

    Asked once per profile, environment and config file version: a botocore session
    takes about 15 ms to make, and every storage a save opens on S3 (one per step
    directory it looks into) asked again."""
    if os.environ.get("AWS_MAX_ATTEMPTS"):
        return True
    config = os.path.expanduser(os.environ.get("AWS_CONFIG_FILE", "~/.aws/config"))
    try:
        found = os.stat(config)
        version: tuple[int, int] | None = (found.st_mtime_ns, found.st_size)
    except OSError:
        version = None
    return _profile_sets_attempts(profile, os.environ.get("AWS_PROFILE"), config, version)


@functools.lru_cache(maxsize=64)
def _profile_sets_attempts(
    profile: str | None, env_profile: str | None, config: str, version: tuple[int, int] | None
) -> bool:
    """:func:`_attempts_configured`'s look into the AWS config, once per key."""
    try:
        import botocore.session  # type: ignore[import-untyped]

        found = botocore.session.Session(profile=profile).get_config_variable("max_attempts")
    except Exception:  # no botocore, or a profile it cannot read: s3fs reports that
        return False
    return found is not None


def filesystem(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it.

    For ``s3://`` the standard environment applies (botocore reads the keys and region);
    ``AWS_ENDPOINT_URL`` is passed to s3fs explicitly, since older botocore ignores it;
    timeouts and retries are bounded unless the options set them (:func:`s3_defaults`).
    """
    import fsspec.core

    options = dict(storage_options or {})
    if url.startswith(("s3://", "s3a://")):
        options = s3_defaults(options)
        if os.environ.get(_ENV_ENDPOINT):
            client = dict(options.get("client_kwargs") or {})
            if "endpoint_url" not in options and "endpoint_url" not in client:
                client["endpoint_url"] = os.environ[_ENV_ENDPOINT]
                options["client_kwargs"] = client
    fs, path = fsspec.core.url_to_fs(url, **options)
    return fs, path


def _over_limit(name: str, size: int | None, limit: int) -> CheckpointCorruptError:
    """The refusal of an object over ``limit`` bytes (``size``: ``None`` if unknown)."""
    shown = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return CheckpointCorruptError(f"{name} is {shown}, over the {limit} limit")


class FsspecFileSink:
    """A new object streamed front to back; visible only once :meth:`finish` returns."""

    def __init__(self, fs: Any, path: str, where: str, part_bytes: int) -> None:
        self.path = where
        self._fs, self._key = fs, path
        with writes(where):
            self._file: Any = fs.open(path, "wb", block_size=part_bytes)
        self._part = part_bytes
        self.written = 0

    def write(self, data: memoryview) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        # In part-sized slices, so that the file's buffer never holds more than about two
        # parts whatever the size of one write.
        with writes(self.path):
            for start in range(0, view.nbytes, self._part):
                self._file.write(view[start : start + self._part])
        self.written += view.nbytes

    def finish(self) -> int:
        try:
            with writes(self.path):
                self._file.close()  # completes the multipart upload (or the single PUT)
        except BaseException:
            self.abort()
            raise
        self._file = None
        return self.written

    def abort(self) -> None:
        if self._file is None:
            return
        file, self._file = self._file, None
        with contextlib.suppress(Exception):
            discard = getattr(file, "discard", None)
            if discard is not None:
                discard()  # s3fs: aborts the multipart upload
            file.closed = True  # so that its finaliser does not try to complete it
        with contextlib.suppress(Exception):
            if self._fs.exists(self._key):  # a store that shows objects while written
                self._fs.rm_file(self._key)


class FsspecStorage:
    """A checkpoint "directory" that is a prefix in an fsspec filesystem (see module doc).

    ``follow`` is accepted for the ``StorageFactory`` signature; object stores have no links.
    """

    cheap_rereads = False
    """A second read is a second download (``load`` keeps the first in a spool)."""
    cheap_metadata = False
    """Every name made, listed or removed is a request to the server."""

    def __init__(
        self,
        url: str,
        *,
        follow: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        fs: Any = None,
    ) -> None:
        self.directory = url.rstrip("/")
        self.follow = follow
        self.storage_options = dict(storage_options or {})
        if fs is None:
            check_url_segments(self.directory)
            fs, path = filesystem(self.directory, self.storage_options)
        else:
            path = fs._strip_protocol(self.directory)
        self.fs, self.path = fs, path.rstrip("/")
        self._budget = ReadBudget()  # one reader at a time holds read-ahead blocks
        self._part = int(self.storage_options.get("default_block_size", DEFAULT_PART_BYTES))

    def _key(self, name: str) -> str:
        return f"{self.path}/{check_object_name(name)}"

    def _fresh(self, path: str | None = None) -> None:
        self.fs.invalidate_cache(path or self.path)

    # -- the directory itself

    def is_directory(self) -> bool:
        """Whether the prefix has objects under it.

        s3fs's ``isdir`` raises what the store answered where gcsfs's answers ``False``:
        wrong credentials were a raw ``PermissionError`` naming no URL from ``verify``,
        ``inspect`` and ``read_manifest`` (and "PermissionError: ... (at s3fs/core.py)"
        from ``load``). Any error but "not found" is the ``CheckpointError`` that
        :meth:`require_directory` raises for gcsfs, naming the URL."""
        self._fresh()
        try:
            return bool(self.fs.isdir(self.path))
        except FileNotFoundError:
            return False
        except Exception as e:
            raise store_failed_at(self.directory, e) from e

    def require_directory(self) -> None:
        """Refuse a prefix with nothing under it; name an object there as one (it "did not
        exist": ``s3://b/run/latest``, the manager's pointer, is an object).

        ``isdir`` answers ``False`` for any error (fsspec's, gcsfs's), so the path is asked
        about once more, letting errors through: only "not found" is absence. A request
        the store refused (gcsfs's 403 "Forbidden") or a connection that failed was told
        "does not exist", which sends a user looking for a checkpoint that may be there."""
        if self.is_directory():
            return
        self._fresh()
        try:
            kind = self.fs.info(self.path).get("type")
        except FileNotFoundError:
            kind = None
        except Exception as e:
            raise store_failed_at(self.directory, e) from e
        if kind == "directory":  # made since isdir looked
            return
        if kind is not None:
            raise CheckpointNotFoundError(
                f"{self.directory} is an object, not a prefix; pass the checkpoint's prefix "
                "(the one holding manifest.json)"
            )
        raise CheckpointNotFoundError(f"{self.directory} does not exist")

    def make_directory(self) -> None:
        """Object stores need none; filesystems with directories (``memory://``) do.

        Never a bucket: s3fs's ``makedirs`` creates a missing bucket, so a save to a
        mistyped ``s3://bucket/...`` made a new bucket in the account and wrote there.
        Where the path's first segment is a bucket (the filesystem has ``split_path``),
        parents are not created, and a missing bucket is an error."""
        if getattr(self.fs, "split_path", None) is None:
            with contextlib.suppress(FileExistsError):
                self.fs.makedirs(self.path, exist_ok=True)
            return
        bucket = self.path.split("/", 1)[0]
        try:
            with answers(self.directory):
                self._make_prefix(bucket)
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"the bucket {bucket!r} of {self.directory} does not exist (or these "
                "credentials cannot see it); shardsafe never creates a bucket: check the "
                "URL and the endpoint, or create the bucket first"
            ) from None

    def _make_prefix(self, bucket: str) -> None:
        """``mkdir`` of the prefix without parents; ``FileNotFoundError`` if ``bucket``,
        the prefix's first segment, is missing."""
        if bucket == self.path:  # mkdir of a bucket alone creates it
            if not self.fs.exists(bucket):
                raise FileNotFoundError(bucket)
        else:
            self.fs.mkdir(self.path, create_parents=False)

    def remove_directory(self) -> None:
        """Remove the (empty) prefix where directories exist; never a bucket."""
        if "/" not in self.path.strip("/"):
            return
        with contextlib.suppress(Exception):
            self.fs.rmdir(self.path)

    def close(self) -> None:
        pass

    def __enter__(self) -> FsspecStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def where(self, name: str) -> str:
        return f"{self.directory}/{name}"

    # -- writing

    def part_bytes(self, size_hint: int) -> int:
        """The configured part size, or the smallest whole MiB that fits ``size_hint``
        bytes into S3's 10,000 parts (with room for the header): memory stays about two
        parts, and a part is never larger than an object of that size needs."""
        needed = -(-max(size_hint, 0) * 101 // 100 // MAX_PARTS)
        return max(self._part, -(-needed // (1 << 20)) << 20)

    def create(self, name: str, size_hint: int = 0) -> FsspecFileSink:
        if self.exists(name):
            raise CheckpointError(
                f"{self.where(name)} appeared while the checkpoint was being written; "
                "shardsafe never writes over an object it did not create"
            )
        part = self.part_bytes(size_hint)
        return FsspecFileSink(self.fs, self._key(name), self.where(name), part)

    def commit(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write ``data`` under ``name`` in one PUT: atomic on object stores.

        ``exclusive``: only if ``name`` does not exist (a conditional create, S3's
        ``If-None-Match: *``: ``FileExistsError`` if it does); where the filesystem has
        none, a plain PUT."""
        if exclusive:
            try:
                if not self.create_exclusive(name, data):
                    raise FileExistsError(errno.EEXIST, "exists", self.where(name))
                return
            except NotImplementedError:
                pass
        with answers(self.where(name)):
            self.fs.pipe_file(self._key(name), bytes(data))
        self._fresh()

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Write ``name`` only if it does not exist (S3's ``If-None-Match: *``), atomically.

        Returns False if it existed. Raises ``NotImplementedError`` where the filesystem
        has no conditional create.
        """
        try:
            with answers(self.where(name)):
                self.fs.pipe_file(self._key(name), bytes(data), mode="create")
        except FileExistsError:
            return False
        except TypeError as e:
            raise NotImplementedError(f"{type(self.fs).__name__} has no conditional create") from e
        finally:
            self._fresh()
        return True

    def replace_if_holds(self, name: str, old: bytes, data: bytes) -> bool:
        """Replace ``name`` with ``data`` only if it still holds exactly ``old``, atomically:
        one GET gives its bytes and their ETag, then a PUT with ``If-Match`` on that ETag
        (S3's conditional write, which moto honours too).

        Returns False if it holds anything else or is gone. Raises ``NotImplementedError``
        where the filesystem has none (only s3fs has one here; gcsfs, ``memory://``).
        """
        call = getattr(self.fs, "call_s3", None)
        if call is None:
            raise NotImplementedError(f"{type(self.fs).__name__} has no conditional replace")
        bucket, key, _ = self.fs.split_path(self._key(name))
        try:
            with answers(self.where(name)):
                return self._replace_holding(call, bucket, key, old, data)
        except FileNotFoundError:
            return False
        except OSError as e:
            code = getattr(e.__cause__, "response", {}).get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False  # changed since the GET (or replaced at the same moment)
            if code == "NotImplemented":  # an S3-compatible store without If-Match on PUT
                raise NotImplementedError(f"{self.directory} has no conditional replace") from e
            raise
        finally:
            self._fresh()

    def _replace_holding(self, call: Any, bucket: str, key: str, old: bytes, data: bytes) -> bool:
        """:meth:`replace_if_holds`'s GET and conditional PUT, errors raised as they are."""
        from fsspec.asyn import sync

        got = call("get_object", Bucket=bucket, Key=key)
        with contextlib.closing(got["Body"]) as body:
            if got.get("ContentLength") != len(old) or sync(self.fs.loop, body.read) != old:
                return False
        call("put_object", Bucket=bucket, Key=key, Body=bytes(data), IfMatch=got["ETag"])
        return True

    def abort_pending_uploads(self) -> int:
        """Abort multipart uploads left under this prefix by a killed save (S3 only): they
        are invisible in listings but billed. Called before a save writes, when every
        upload under the prefix is stale. Returns how many were aborted."""
        call = getattr(self.fs, "call_s3", None)
        if call is None or "/" not in self.path:
            return 0
        bucket, prefix = self.path.split("/", 1)
        aborted = 0
        page: dict[str, str] = {}
        with contextlib.suppress(Exception):
            while True:  # a listing returns 1,000 uploads at most: a save of more ranks
                found = call("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/", **page)
                for upload in found.get("Uploads", []):
                    call(
                        "abort_multipart_upload",
                        Bucket=bucket,
                        Key=upload["Key"],
                        UploadId=upload["UploadId"],
                    )
                    aborted += 1
                after = {
                    "KeyMarker": found.get("NextKeyMarker") or "",
                    "UploadIdMarker": found.get("NextUploadIdMarker") or "",
                }
                if not found.get("IsTruncated") or not after["KeyMarker"] or after == page:
                    break  # the last page (or a store that does not move on: stop)
                page = after
        return aborted

    def sync_directory(self) -> None:
        """Nothing to do: an object is durable once its upload completed."""

    def remove(self, name: str) -> None:
        kind = self.kind(name)
        if kind is None:
            return
        if kind == "directory":
            raise CheckpointError(
                f"{self.where(name)} is a directory (a prefix with objects under it), which "
                "shardsafe did not create; it is left in place"
            )
        with contextlib.suppress(FileNotFoundError), answers(self.where(name)):
            self.fs.rm_file(self._key(name))
        self._fresh()

    def touch(self, name: str) -> None:
        kind = self.kind(name)
        if kind is None:
            with answers(self.where(name)):
                self.fs.pipe_file(self._key(name), b"")
            self._fresh()
        elif kind != "file":
            raise CheckpointCorruptError(f"{self.where(name)} exists and is not an object")

    def names(self) -> list[str]:
        return sorted(self.names_and_kinds())

    def sizes(self) -> dict[str, int]:
        """Each object's size, from one listing (a page per 1,000 names)."""
        return {name: size for name, (_, size) in self._listing().items() if size is not None}

    def names_and_kinds(self) -> dict[str, EntryKind]:
        """One listing (a page per 1,000 names). A name that is both an object and a
        prefix (``step-5`` and ``step-5/...``) is a file, as :meth:`kind` says, which
        asks for the object first."""
        return {name: kind for name, (kind, _) in self._listing().items()}

    def _listing(self) -> dict[str, tuple[EntryKind, int | None]]:
        """Every name here, with its kind and, for an object, its size."""
        self._fresh()
        try:
            with answers(self.directory):
                entries = self.fs.ls(self.path, detail=True)
        except FileNotFoundError:
            return {}
        found: dict[str, tuple[EntryKind, int | None]] = {}
        for entry in entries:
            full = str(entry["name"]).rstrip("/")
            base = full.rsplit("/", 1)[-1]
            if full.strip("/") == self.path.strip("/") or not base:
                continue
            if entry.get("type") == "directory":
                found.setdefault(base, ("directory", None))
            else:
                found[base] = ("file", int(entry.get("size") or 0))
        return found

    # -- reading

    def _info(self, name: str) -> dict[str, Any] | None:
        key = self._key(name)
        self._fresh(key)
        try:
            with answers(self.where(name)):
                info: dict[str, Any] = self.fs.info(key)
            return info
        except FileNotFoundError:
            return None

    def kind(self, name: str) -> EntryKind | None:
        info = self._info(name)
        if info is None:
            return None
        return "directory" if info.get("type") == "directory" else "file"

    def describe(self, name: str) -> str:
        kind = self.kind(name)
        return {"file": "an object", "directory": "a prefix"}.get(kind or "", "missing")

    def exists(self, name: str) -> bool:
        return self.kind(name) is not None

    def _object_info(self, name: str) -> dict[str, Any]:
        """The metadata of the object ``name``; a missing one, or a prefix, is refused."""
        info = self._info(name)
        if info is None:
            raise CheckpointCorruptError(f"data object {self.where(name)} is missing")
        if info.get("type") == "directory":
            raise CheckpointCorruptError(f"{self.where(name)} is a prefix, not an object")
        return info

    def open_reader(self, name: str) -> FsspecFileReader:
        info = self._object_info(name)
        return FsspecFileReader(self.fs, self._key(name), int(info["size"]), name, self._budget)

    def read_small(self, name: str, limit: int) -> bytes:
        """All of the object ``name`` (at most ``limit`` bytes), as one version of it.

        Other runs replace small objects while they are read (the root lock taken over,
        ``latest`` moved, a manifest rewritten): a size looked up first and a ranged GET
        of that size read a replaced object as a mix or a truncation of two versions
        (another run's lock was "damaged: not valid JSON"). So the bytes come from one
        GET of the whole object: on S3 that GET alone (:func:`get_whole_s3`); elsewhere
        after a size lookup, pinned to the generation seen there where the store has
        them (GCS), read again if that generation is gone, up to :data:`READ_ATTEMPTS`
        times.
        """
        key = self._key(name)
        if getattr(self.fs, "call_s3", None) is not None:
            return self._read_whole_s3(name, key, limit)
        for _ in range(READ_ATTEMPTS):
            data = self._read_whole(name, key, limit)
            if data is not None:
                return data
        raise CheckpointCorruptError(
            f"{self.where(name)} was replaced each of the {READ_ATTEMPTS} times it was read: "
            "another process keeps rewriting it; try again once that process is done"
        )

    def _read_whole_s3(self, name: str, key: str, limit: int) -> bytes:
        """One GET; where it finds no object, one listing tells a prefix from nothing (as
        the HEAD and listing of ``fs.info`` did, in as many requests)."""
        try:
            size, data = get_whole_s3(self.fs, key, limit, self.where(name))
        except FileNotFoundError:
            self._fresh(key)
            with answers(self.where(name)):
                found_prefix = self.fs.isdir(key)
            if found_prefix:
                raise CheckpointCorruptError(
                    f"{self.where(name)} is a prefix, not an object"
                ) from None
            raise CheckpointCorruptError(f"data object {self.where(name)} is missing") from None
        if data is None:
            raise _over_limit(name, size, limit)
        return data

    def _read_whole(self, name: str, key: str, limit: int) -> bytes | None:
        """A size lookup, then a GET of the whole object (never a range of the size
        looked up, which a replaced object would not match); ``None`` if the object went
        between the two (read again: then it is missing, or the new one is read)."""
        info = self._object_info(name)
        size = int(info["size"])
        if size > limit:
            raise _over_limit(name, size, limit)
        if size == 0:
            return b""  # an empty object, as it was when looked up: no GET
        pin = {"generation": info["generation"]} if info.get("generation") else {}
        try:
            with store_failures(self.where(name)):
                data: bytes = self.fs.cat_file(key, **pin)
        except FileNotFoundError:
            return None
        if len(data) > limit:  # not pinned, and replaced by a larger object meanwhile
            raise _over_limit(name, len(data), limit)
        return data

    def child(self, name: str) -> FsspecStorage:
        return FsspecStorage(
            self.where(check_object_name(name)),
            storage_options=self.storage_options,
            fs=self.fs,
        )

    def remove_child(self, name: str) -> None:
        """A prefix goes with its last object; where directories exist, remove it."""
        self.child(name).remove_directory()

    def lock_backend(self) -> ObjectLockBackend:
        """The lock as an object, created conditionally where the store can
        (``lock_backends.py``)."""
        return ObjectLockBackend(self)
