"""Saving under a name that may already hold a checkpoint, on an object store.

An object store has no rename, so the swap of :mod:`.placement` is not available there.
A name with no committed checkpoint under it (nothing at all, or what an interrupted save
left) is saved into directly: ``manifest.json``, written last, commits it, as for any
``shardsafe.save`` to a URL. A name holding a committed checkpoint (Lightning's
``last.ckpt``, saved again at every save) is replaced in three steps, each of which
leaves at least one complete checkpoint:

1. the new checkpoint is saved and committed under the sibling prefix
   ``.<name>.shardsafe-partial`` (the first such name without a committed checkpoint);
2. rank 0, once it is committed, deletes the old checkpoint under the name (its manifest
   first, so a reader never finds a manifest whose objects are going), marks the name
   with the record of what it is about to copy (``leftovers.record``: a crash mid-copy
   leaves objects the next save recognises as its own and clears), and has the store
   copy the staged objects there (server-side copies, several at once, no byte
   downloaded; each copy's size checked), data first, manifest last, then the mark goes;
3. the staged copy is deleted.

A crash in step 2 leaves the name without a manifest and the staged copy committed;
:func:`committed_copy` finds it (the newest, if crashes left several), and the Lightning
strategies' loaders (and their local tier, comparing steps) take it instead of the name,
saying so; ``shardsafe.load`` of the name reports it missing and names neither. It is
deleted after the next save of the name succeeds. Once the new checkpoint has its name,
a failure to clear what it replaced only warns: the save has succeeded.

Errors: a store's client raises more than ``OSError`` (botocore's connection, timeout
and credential errors are not); every call into the store here turns them into a
:class:`~shardsafe.CheckpointError` naming the URL (:func:`store_errors`), so a caller
that agrees errors across ranks, or warns, sees one kind.

Anything at the name that shardsafe did not write is refused before anything is written
(:func:`.placement.refuse_foreign`). Every rank must use the same placement:
``replacing.py`` has rank 0 compute it and tell the others.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ...errors import CheckpointError
from ..format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, parse
from .leftovers import INCOMPLETE_MARKER, record
from .object_storage import FsspecStorage, check_object_name, check_url_segments
from .placement import _delete_replaced, _staging_names, _taken, refuse_foreign
from .removal import delete_checkpoint, warn
from .store_failures import store_errors

COPY_THREADS = 16
"""Server-side copies in flight at once while publishing."""


@dataclass(frozen=True)
class ObjectPlacement:
    """Where a checkpoint goes (``parent/name``, URLs) and where it is staged meanwhile
    (``staging``: the name itself when nothing committed is there to replace)."""

    parent: str
    name: str
    staging: str
    storage_options: Mapping[str, Any] | None = field(default=None, compare=False)

    @classmethod
    def of(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> ObjectPlacement:
        """The placement of ``url``, from what the store holds now."""
        parent, name = split(url)
        with store_errors(url), FsspecStorage(parent, storage_options=storage_options) as root:
            return cls(parent, name, _staging_name(root, name), storage_options)

    @property
    def path(self) -> str:
        return f"{self.parent}/{self.name}"

    @property
    def staging_path(self) -> str:
        return f"{self.parent}/{self.staging}"

    def _root(self) -> FsspecStorage:
        return FsspecStorage(self.parent, storage_options=self.storage_options)

    def check(self) -> None:
        """Refuse, before anything is written, a target that is not ours to replace."""
        with store_errors(self.path), self._root() as root:
            refuse_foreign(root, self.name)

    def publish(self) -> None:
        """Give the committed staged checkpoint the target's name (rank 0, after commit)."""
        with store_errors(self.path), self._root() as root:
            if self.staging != self.name:
                refuse_foreign(root, self.name)  # again: it may have changed since check()
                with self._naming_failed():
                    kind = root.kind(self.name)
                    if kind is not None:
                        _delete_replaced(root, self.name, kind)
                self._require_cleared(root)
                with self._naming_failed():
                    _copy_checkpoint(root, self.staging, self.name)
            try:
                _delete_staged_leftovers(root, self.name)
            except Exception as e:  # published: what is left is cleared by the next save
                warn(
                    f"the checkpoint is published under {self.path}; older staged copies "
                    f"beside it could not be listed or deleted ({_described(e)}): the next "
                    "save of the name deletes them"
                )

    @contextlib.contextmanager
    def _naming_failed(self) -> Iterator[None]:
        """Any failure while the name is cleared or copied to: say where the new
        checkpoint is, and that the name's lookups find it."""
        try:
            yield
        except Exception as e:  # any store error: the message says where the checkpoint is
            raise CheckpointError(
                f"the new checkpoint is committed under {self.staging_path}, but giving it "
                f"the name {self.path} failed ({_described(e)}); the older checkpoint under "
                f"that name may be gone. Resume from {self.staging_path} (fit(ckpt_path=...) "
                "of the name finds it by itself); the next save of the name clears both."
            ) from e

    def _require_cleared(self, root: FsspecStorage) -> None:
        """Nothing may be left under the name before the copy starts. The deletion leaves
        what shardsafe wrote in place when it finds objects it did not write (they appeared
        after the check): copying beside them would mix new data with the old."""
        if root.kind(self.name) is None:
            return
        with root.child(self.name) as left:
            names = sorted(left.names())
        if not names:
            # Only a folder marker (a zero-byte ``name/`` object: the S3 console's "Create
            # folder", S3A, gcsfuse), which the listing hides as the deletion's checks do:
            # it was refused here after the old checkpoint was deleted, "(it holds [])",
            # and each replacement of the name failed the same way (found in review).
            return
        older = (
            "the older checkpoint, whole, which the name's lookups still find"
            if MANIFEST_NAME in names
            else "no committed checkpoint"
        )
        raise CheckpointError(
            f"the new checkpoint is committed under {self.staging_path} only: objects "
            f"shardsafe did not write appeared under {self.path} while it was being replaced "
            f"(it holds {names[:5]}), so nothing there was deleted past them and nothing was "
            f"copied; the name holds {older}. Load the new checkpoint by passing "
            f"{self.staging_path} itself, and move the foreign objects away before the next "
            "save of the name (which refuses them)."
        )


def split(url: str) -> tuple[str, str]:
    """``(parent URL, name)`` of a checkpoint URL (a trailing ``/`` allowed); refuses one
    that names no object under a bucket, or whose path has an empty or a dot segment: an
    object store keeps ``a//b``, ``a/./b`` and ``a/b`` as different keys, where a path
    would name one place, so the save and the lookups would miss each other. An empty
    authority (``hdfs:///user/x/name``) is allowed."""
    scheme, found, rest = url.rstrip("/").partition("://")
    segments = rest.split("/")
    if not found or not scheme or len(segments) < 2 or not any(segments[:-1]):
        raise CheckpointError(
            f"{url!r} does not name a checkpoint under a bucket (scheme://bucket/.../name)"
        )
    check_url_segments(url)
    check_object_name(segments[-1])
    return f"{scheme}://{'/'.join(segments[:-1])}", segments[-1]


def _described(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def committed_copy(url: str, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The URL of the newest committed staged copy of ``url`` that an interrupted
    replacement left (step 2 above), if ``url`` itself holds no manifest; else ``None``.
    One listing of the parent, then one request per staged copy found."""
    parent, name = split(url)
    with store_errors(url), FsspecStorage(parent, storage_options=storage_options) as root:
        present = set(root.names())
        if name in present and _has_manifest(root, name):
            return None
        found = []
        for order, candidate in enumerate(_staging_names(name)):
            if candidate in present:
                stamp = _manifest_time(root, candidate)
                if stamp is not None:
                    found.append((stamp, order, candidate))
    if not found:
        return None
    return root.where(max(found)[2])


def _has_manifest(root: FsspecStorage, name: str) -> bool:
    with contextlib.suppress(CheckpointError):
        return root.child(name).exists(MANIFEST_NAME)
    return False


def _manifest_time(root: FsspecStorage, name: str) -> float | None:
    """When ``root/name``'s manifest was written (the store's own time; 0 where the store
    gives none), or ``None`` if it has none."""
    try:
        info = root.child(name)._info(MANIFEST_NAME)
    except CheckpointError:
        return None
    if info is None:
        return None
    for key in ("LastModified", "last_modified", "mtime", "updated", "created"):
        when = info.get(key)
        if when is None:
            continue
        with contextlib.suppress(ValueError, TypeError, OverflowError):
            if isinstance(when, str):
                return datetime.datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
            if isinstance(when, datetime.datetime):
                return when.timestamp()
            return float(when)
    return 0.0  # unknown: the staging order decides (see committed_copy)


def _delete_staged_leftovers(root: FsspecStorage, name: str) -> None:
    """Delete the committed staged copies of ``name`` a crash left, found in one listing
    (not one request per possible staging name)."""
    present = set(root.names())
    for candidate in _staging_names(name):
        if candidate in present and root.kind(candidate) == "directory":
            with contextlib.suppress(CheckpointError):
                delete_checkpoint(root, candidate)


def _staging_name(root: FsspecStorage, name: str) -> str:
    """``name`` if nothing committed is there; else the first free staging name."""
    if not _committed(root, name):
        return name
    for candidate in _staging_names(name):
        if not _taken(root, candidate):
            return candidate
    raise CheckpointError(
        f"{root.directory} holds {len(_staging_names(name))} committed leftovers "
        f".{name}.shardsafe-partial*; delete them"
    )


def _committed(root: FsspecStorage, name: str) -> bool:
    """Whether ``root/name`` holds anything but an interrupted save's leftovers: a
    committed checkpoint, or an object (a Lightning ``.ckpt``, or something foreign that
    ``check`` will refuse)."""
    kind = root.kind(name)
    if kind is None:
        return False
    if kind != "directory":
        return True
    with root.child(name) as existing:
        return existing.exists(MANIFEST_NAME)


def _copy_checkpoint(root: FsspecStorage, source: str, target: str) -> None:
    """Copy the checkpoint ``root/source`` to ``root/target`` inside the store: exactly the
    data files its manifest names, each checked against the source's listing first and
    the target's after, the target marked as a save in progress until the manifest
    (copied last) commits it; then delete the source (best effort: a staged copy left
    behind is cleared by the next save). ``cp_file``: one object to one object, no
    pattern expansion of the names."""
    with root.child(source) as staged, root.child(target) as named:
        raw = staged.read_small(MANIFEST_NAME, MAX_MANIFEST_BYTES)
        files = dict(parse(raw, staged.where(MANIFEST_NAME)).files)
        _check_sizes(staged, files, "before it was published")
        record(named, [*files, MANIFEST_NAME])  # a crash from here leaves our own leftovers
        pool = ThreadPoolExecutor(min(COPY_THREADS, max(1, len(files))))
        try:
            copies = [pool.submit(_copy_one, staged, named, name) for name in files]
            for copy in copies:
                copy.result()
        finally:
            pool.shutdown(cancel_futures=True)  # after a failure, no copy still starts
        _check_sizes(named, files, "after it was copied")
        _copy_one(staged, named, MANIFEST_NAME)
        try:  # committed: the marker left behind is cleared by the next save of the name
            named.remove(INCOMPLETE_MARKER)
        except Exception as e:
            warn(f"the checkpoint is published under {root.where(target)}; {_described(e)}")
    try:
        _delete_replaced(root, source, "directory")
    except Exception as e:
        warn(
            f"the checkpoint is published under {root.where(target)}; its staged copy "
            f"{root.where(source)} could not be deleted ({e}): the next save of the name "
            "deletes it"
        )


def _copy_one(staged: FsspecStorage, named: FsspecStorage, name: str) -> None:
    staged.fs.cp_file(staged._key(name), named._key(name))


def _check_sizes(where: FsspecStorage, files: dict[str, int], when: str) -> None:
    """Every file the manifest names is under ``where`` with its size (one listing)."""
    where._fresh()
    listed = {
        str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: e.get("size")
        for e in where.fs.ls(where.path, detail=True)
    }
    wrong = [n for n, size in files.items() if listed.get(n) != size]
    if wrong:
        got = ", ".join(f"{n}: {listed.get(n, 'missing')}" for n in wrong[:3])
        raise CheckpointError(
            f"{where.directory} does not hold the files its manifest names {when} ({got}, "
            f"expected {', '.join(str(files[n]) for n in wrong[:3])} bytes)"
        )
