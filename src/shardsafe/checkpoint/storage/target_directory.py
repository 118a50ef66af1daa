"""The directory a save writes into: new, empty, or its own interrupted save's leftovers.

Only a directory that is empty or carries this library's marker is written into, and of
what it holds a save clears only the regular files an interrupted save recorded in that
marker as its own writing (``leftovers.py`` has the exact rules); anything else refuses
the save, with nothing deleted. So a save never deletes files it did not write (a Hugging
Face ``model.safetensors``, a ``my_notes.txt``), and never through a symlink.

A probe proves that every rank writes into the *same* directory: rank 0 creates
``.shardsafe-probe-<token of this save>``, every other rank looks for it before writing
anything, and rank 0 removes it before the commit. A
local path that is not shared between nodes (each node has its own ``/scratch/ckpt``)
fails there, on every rank, instead of committing a checkpoint whose data files are
scattered over machines that rank 0 cannot see.
"""

from __future__ import annotations

import uuid

from ...errors import CheckpointError
from ..format.manifest_format import MANIFEST_NAME
from .leftovers import INCOMPLETE_MARKER, PROBE_PREFIX, own_leftovers, partition, record
from .locations import INSTALL_HINT, is_url
from .protocol import Storage

__all__ = [
    "INCOMPLETE_MARKER",
    "check_shared",
    "prepare",
    "probe_name",
    "record_plan",
    "refuse_committed",
    "refuse_unusable",
    "remove_uncommitted",
]


def refuse_committed(storage: Storage) -> bool:
    """Whether the directory exists already; refuse one that holds a committed checkpoint."""
    existed = storage.is_directory()
    if existed and storage.exists(MANIFEST_NAME):
        raise CheckpointError(
            f"{storage.directory} already holds a committed checkpoint; shardsafe never "
            "overwrites one. Save to a new directory (CheckpointManager does this per step) "
            "or delete it first."
        )
    storage.close()  # reopened when written: rank 0 may create it in between
    return existed


def refuse_unusable(storage: Storage) -> None:
    """What a save into ``storage`` refuses before it writes, found without writing (a
    converter's dry run): a committed checkpoint, or files that are not an interrupted
    save's."""
    refuse_committed(storage)
    names = storage.names() if storage.is_directory() else []
    if names:
        own_leftovers(storage, names)


def prepare(storage: Storage) -> str:
    """Make the directory, or clear an interrupted save's leftovers; refuse anything else.

    Returns the token of this save's probe, for :func:`check_shared` on other ranks.
    """
    storage.make_directory()
    names = storage.names()
    leftovers = own_leftovers(storage, names) if names else []  # refuses anything not ours
    # An object store's uploads under a prefix that is empty or ours: a killed save's
    # (a survivor may have removed its objects, leaving the dead rank's upload).
    storage.abort_pending_uploads()
    if names:
        _clear(storage, leftovers)
        storage.remove(INCOMPLETE_MARKER)  # the old record: this save writes its own
    # Empty until rank 0 has planned (``record_plan``): this save's only files until then
    # are the marker and its probe, which an empty marker lets the next save clear.
    storage.touch(INCOMPLETE_MARKER)
    token = uuid.uuid4().hex
    storage.touch(probe_name(token))  # an empty marker: no data write, no rename
    return token


def record_plan(storage: Storage, token: str, data_files: list[str]) -> None:
    """Record in the marker, durably, every name this save may create (rank 0, once it
    has planned and before any rank writes a data file), so that the next save clears
    exactly these if this one is interrupted (``leftovers.py``)."""
    record(storage, [probe_name(token), *data_files])


def _clear(storage: Storage, leftovers: list[str]) -> None:
    """Remove an interrupted save's leftovers, each only if it is still a regular file;
    the marker that covers them stays until they are gone."""
    for name in leftovers:
        if storage.kind(name) == "file":
            storage.remove(name)  # unlinks the name itself: never follows a link


def probe_name(token: str) -> str:
    """The empty file by which rank 0 shows other ranks the directory of this save."""
    return f"{PROBE_PREFIX}{token}"


def check_shared(storage: Storage, token: str, rank: int) -> None:
    """Refuse to write unless this rank sees rank 0's probe of this save."""
    try:
        why = None if storage.kind(probe_name(token)) == "file" else "this save's probe is missing"
    except (OSError, CheckpointError) as e:
        why = f"it is not there for this rank ({type(e).__name__}: {e})"
    if why is None:
        return
    where = "store or credentials" if is_url(storage.directory) else "filesystem"
    raise CheckpointError(
        f"rank {rank} cannot see the checkpoint directory {storage.directory} that rank 0 "
        f"is writing: {why}. The path is not shared between the nodes, so rank 0 cannot "
        "see the other nodes' files and the checkpoint could never be complete in one "
        f"place (a different {where} per node). Save to a shared filesystem that every "
        "node mounts at the same path, or to an object-store URL "
        f"(s3://bucket/prefix, with {INSTALL_HINT}). Nothing was committed."
    )


def remove_uncommitted(storage: Storage) -> None:
    """Delete a directory a failed save created, unless a manifest got committed: the
    save's own files by the rules of ``leftovers.py`` and its unfinished uploads, then the
    directory if that left it empty. Anything else in it (someone else's file) stays, and
    so does the directory."""
    try:
        if not storage.is_directory() or storage.exists(MANIFEST_NAME):
            return
        names = storage.names()
        if names and INCOMPLETE_MARKER not in names:
            return  # the save failed before it marked the directory: nothing in it is its
        # A killed rank's unfinished upload (an object store's): invisible in listings but
        # billed, and nothing clears it if no save comes to this prefix again.
        storage.abort_pending_uploads()
        if names:
            ours, foreign = partition(storage, names)
            _clear(storage, ours)
            storage.remove(INCOMPLETE_MARKER)
            if foreign:
                return
        storage.remove_directory()
    except Exception:
        # Best effort: a leftover is cleared by the next save into it. Any failure (an
        # object store's client raises its own classes, not OSError: the store gone
        # mid-save) is dropped, or it replaced the agreed error on rank 0 alone.
        return
