"""The directory a save writes into: new, empty, or its own interrupted save's leftovers.

Only a directory that is empty or carries this library's marker is written into, so a
save can never delete files it did not write (a Hugging Face ``model.safetensors``).

A probe proves that every rank writes into the *same* directory: rank 0 creates
``.shardsafe-probe-<token of this save>``, every other rank looks for it before writing
anything, and rank 0 removes it before the commit. A
local path that is not shared between nodes (each node has its own ``/scratch/ckpt``)
fails there, on every rank, instead of committing a checkpoint whose data files are
scattered over machines that rank 0 cannot see.
"""

from __future__ import annotations

import uuid

from ..errors import CheckpointError
from .locations import INSTALL_HINT, is_url
from .manifest_format import MANIFEST_NAME
from .storage import Storage

INCOMPLETE_MARKER = ".shardsafe-incomplete"
"""Present while shardsafe writes a directory, removed after the commit: it tells a later
save that the files in an uncommitted directory are its own leftovers to clear."""
PROBE_PREFIX = ".shardsafe-probe-"


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


def prepare(storage: Storage) -> str:
    """Make the directory, or clear an interrupted save's leftovers; refuse anything else.

    Returns the token written into the marker, for :func:`check_shared` on other ranks.
    """
    storage.make_directory()
    abort_pending = getattr(storage, "abort_pending_uploads", None)
    if abort_pending is not None:
        abort_pending()  # an object store's uploads from a killed save into this prefix
    names = storage.names()
    if names and INCOMPLETE_MARKER not in names:
        raise CheckpointError(
            f"{storage.directory} is not empty (it holds {names[0]!r}"
            f"{f' and {len(names) - 1} more' if len(names) > 1 else ''}) and is not left over "
            "from an interrupted shardsafe save. shardsafe saves only into a new or empty "
            "directory, so that it never deletes files it did not write; pick another path."
        )
    for name in names:
        if name != INCOMPLETE_MARKER:
            storage.remove(name)  # a subdirectory is refused: shardsafe never makes one
    storage.touch(INCOMPLETE_MARKER)
    token = uuid.uuid4().hex
    storage.touch(probe_name(token))  # an empty marker: no data write, no rename
    return token


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
    """Delete a directory a failed save created, unless a manifest got committed."""
    try:
        if not storage.is_directory() or storage.exists(MANIFEST_NAME):
            return
        for name in storage.names():
            storage.remove(name)
        storage.remove_directory()
    except (OSError, CheckpointError):
        return  # best effort: a leftover is cleared by the next save into it
