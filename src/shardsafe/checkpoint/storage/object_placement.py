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
   first, so a reader never finds a manifest whose objects are going) and has the store
   copy the staged objects to the name (a server-side copy: no byte leaves the store),
   data first, manifest last;
3. the staged copy is deleted.

A crash in step 2 leaves the name without a manifest and the staged copy committed;
:func:`committed_copy` finds it, and loaders take it instead of the name, saying so. It is
deleted after the next save of the name succeeds. Anything at the name that shardsafe did
not write is refused before anything is written (:func:`.placement.refuse_foreign`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ...errors import CheckpointError
from ..format.manifest import MANIFEST_NAME
from .object_storage import FsspecStorage, check_object_name
from .placement import (
    _delete_replaced,
    _staging_names,
    _taken,
    refuse_foreign,
)
from .removal import delete_checkpoint


@dataclass(frozen=True)
class ObjectPlacement:
    """Where a checkpoint goes (``parent/name``, URLs) and where it is staged meanwhile
    (``staging``: the name itself when nothing committed is there to replace)."""

    parent: str
    name: str
    staging: str

    @classmethod
    def of(cls, url: str) -> ObjectPlacement:
        """The placement of ``url``; every rank computes the same one from the store."""
        parent, _, name = url.rstrip("/").rpartition("/")
        if not name or name in (".", "..") or "://" not in parent:
            raise ValueError(f"{url!r} does not name a checkpoint under a bucket")
        check_object_name(name)
        with FsspecStorage(parent) as root:
            return cls(parent, name, _staging_name(root, name))

    @property
    def path(self) -> str:
        return f"{self.parent}/{self.name}"

    @property
    def staging_path(self) -> str:
        return f"{self.parent}/{self.staging}"

    def check(self) -> None:
        """Refuse, before anything is written, a target that is not ours to replace."""
        with FsspecStorage(self.parent) as root:
            refuse_foreign(root, self.name)

    def publish(self) -> None:
        """Give the committed staged checkpoint the target's name (rank 0, after commit)."""
        with FsspecStorage(self.parent) as root:
            if self.staging != self.name:
                refuse_foreign(root, self.name)  # again: it may have changed since check()
                kind = root.kind(self.name)
                if kind is not None:
                    _delete_replaced(root, self.name, kind)
                _copy_checkpoint(root, self.staging, self.name)
            _delete_staged_leftovers(root, self.name)


def committed_copy(url: str) -> str | None:
    """The URL of the committed staged copy of ``url`` that an interrupted replacement
    left (step 2 above), if ``url`` itself holds no manifest; else ``None``."""
    placement_parent, _, name = url.rstrip("/").rpartition("/")
    if not name or "://" not in placement_parent:
        return None
    with FsspecStorage(placement_parent) as root:
        with contextlib.suppress(CheckpointError):
            if root.kind(name) == "directory" and root.child(name).exists(MANIFEST_NAME):
                return None
        for candidate in _staging_names(name):
            if root.kind(candidate) is None:
                continue
            with contextlib.suppress(CheckpointError):
                if root.child(candidate).exists(MANIFEST_NAME):
                    return root.where(candidate)
    return None


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
    """Copy the checkpoint ``root/source`` to ``root/target`` inside the store, data first
    and the manifest last (the copy's commit), then delete the source."""
    with root.child(source) as staged, root.child(target) as named:
        names = staged.names()
        if MANIFEST_NAME not in names:
            raise CheckpointError(f"{staged.directory} lost its manifest before it was published")
        for entry in [n for n in names if n != MANIFEST_NAME] + [MANIFEST_NAME]:
            root.fs.copy(staged._key(entry), named._key(entry))
        named._fresh()
    _delete_replaced(root, source, "directory")
