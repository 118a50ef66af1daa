"""What a save may delete in the directory it writes: only what an interrupted shardsafe
save recorded as its own writing, never anything else.

While a save writes a directory, the directory holds the marker ``.shardsafe-incomplete``:

1. ``target_directory.prepare`` creates it empty, before rank 0 has planned (the save has
   then written nothing but the marker and its probe);
   retention (``removal.py``) instead writes at once a record of the files it deletes,
   marked as a deletion (``"deleting": true``), so that a deletion interrupted after the
   manifest went is told from a save interrupted before it came (:func:`is_deletion`);
2. once rank 0 has planned, before any rank writes a data file, it is replaced, atomically
   and durably (``Storage.commit``: fsynced and renamed, or one PUT), by a record of every
   name this save may create: its data files, its probe, and the temporary names of its
   manifest's and its marker's commits (:func:`record`);
3. it is removed after the manifest is committed.

The next save into a directory that holds the marker clears (:func:`own_leftovers`):

* if the marker holds a valid record: each name it lists that is still a regular file
  and has one of shardsafe's own names (:data:`OURS`);
* if the marker is empty (a save killed before it planned, which had then written only
  its probe) or is not a valid record (damaged, not strict JSON, over
  :data:`MAX_MARKER_BYTES`, unreadable): only regular files with the names no one but
  shardsafe gives (:data:`INTERNAL`: a probe, a commit's temporary file). A data file
  (``*.safetensors``) then refuses the save: no record says it is shardsafe's, and a
  ``model.safetensors`` is as likely a user's. A shardsafe older than the record left
  empty markers beside its data files; such a directory is refused, listing them.

Anything else present refuses the save, with nothing deleted and a bounded listing of what
is there: a name not listed, a name that is not shardsafe's (``my_notes.txt``), a symlink
(never followed, never removed), a directory, FIFO, socket or device, a ``manifest.json``
(a committed checkpoint is never cleared), and a marker that is not itself a regular file.
A directory without the marker is not shardsafe's: only an empty one is written into.
Object stores follow the same rules (an object is a regular file; a prefix with objects
under it is a directory).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ...errors import CheckpointError
from ..format.manifest_format import MANIFEST_NAME
from ..format.strict_json import load_json_bytes
from .local import commit_temp_name
from .locations import is_url
from .protocol import Storage

INCOMPLETE_MARKER = ".shardsafe-incomplete"
"""Present while shardsafe writes a directory, removed after the commit (module doc)."""
PROBE_PREFIX = ".shardsafe-probe-"
MARKER_FORMAT = "shardsafe-incomplete"
MARKER_VERSION = 1
MAX_MARKER_BYTES = 16 << 20
"""About 400,000 data file names fit. A larger marker is read as no record."""
MAX_NAME_CHARS = 255
SHOWN = 5
"""How many entries a refusal names (then a count of the rest)."""

_INTERNAL = (
    r"\.shardsafe-incomplete|\.manifest\.json\.tmp-[0-9]+"
    r"|\.\.shardsafe-incomplete\.tmp-[0-9]+|\.shardsafe-probe-[0-9a-f]{32}"
)
INTERNAL = re.compile(_INTERNAL, re.ASCII)
"""The names only shardsafe gives: its marker, probes and commits' temporary files."""
OURS = re.compile(
    rf"manifest\.json|{_INTERNAL}|[A-Za-z0-9_][A-Za-z0-9_.\-]{{0,200}}\.safetensors", re.ASCII
)
"""The names shardsafe writes inside a checkpoint directory."""


def marker_bytes(names: list[str], *, deleting: bool = False) -> bytes:
    """The marker's record of ``names``, the names a save may create (or, ``deleting``,
    the names a deletion removes)."""
    doc: dict[str, object] = {
        "format": MARKER_FORMAT,
        "version": MARKER_VERSION,
        "names": sorted(set(names)),
    }
    if deleting:
        doc["deleting"] = True  # read as version 1 by a shardsafe that does not know it
    return json.dumps(doc).encode()


def record(storage: Storage, names: list[str], *, deleting: bool = False) -> None:
    """Replace the marker, atomically and durably, by a record of ``names`` plus the
    temporary names of this process's commits (the manifest's, the marker's own)."""
    temporary = [commit_temp_name(MANIFEST_NAME), commit_temp_name(INCOMPLETE_MARKER)]
    storage.commit(INCOMPLETE_MARKER, marker_bytes([*names, *temporary], deleting=deleting))


def own_leftovers(storage: Storage, names: list[str]) -> list[str]:
    """The entries among ``names`` (the directory's listing) that the next save clears
    (module docstring), the marker excluded; refuse if anything else is there."""
    clear, foreign = partition(storage, names)
    if foreign:
        raise _refusal(storage, foreign)
    return clear


def partition(storage: Storage, names: list[str]) -> tuple[list[str], list[str]]:
    """``names`` (the directory's listing, the marker excluded) split into what the marker
    lets a save clear and everything else; refuse a directory without a marker."""
    if INCOMPLETE_MARKER not in names or storage.kind(INCOMPLETE_MARKER) != "file":
        raise _not_ours(storage, names)
    recorded = recorded_names(storage)
    clear, foreign = [], []
    for name in names:
        if name == INCOMPLETE_MARKER:
            continue
        if _ours(name, recorded) and storage.kind(name) == "file":
            clear.append(name)
        else:
            foreign.append(name)
    return clear, foreign


def _ours(name: str, recorded: frozenset[str] | None) -> bool:
    """Whether ``name`` is one the marker lets a save clear, if it is a regular file."""
    if recorded is None:
        return INTERNAL.fullmatch(name) is not None
    return name != MANIFEST_NAME and OURS.fullmatch(name) is not None and name in recorded


def recorded_names(storage: Storage) -> frozenset[str] | None:
    """The names the marker's record lists; ``None`` if it holds no valid record (empty,
    damaged, too large, unreadable): then only :data:`INTERNAL` names may be cleared."""
    doc = _valid_record(storage)
    return None if doc is None else frozenset(doc["names"])


def is_deletion(storage: Storage) -> bool:
    """Whether the marker holds a valid record of a deletion (``removal.py``): a directory
    without its manifest that holds one was a checkpoint whose deletion was interrupted,
    not a save that never committed."""
    doc = _valid_record(storage)
    return doc is not None and doc.get("deleting") is True


def _valid_record(storage: Storage) -> dict[str, Any] | None:
    """The marker's record, if it holds a valid one (see :func:`recorded_names`)."""
    try:
        raw = storage.read_small(INCOMPLETE_MARKER, MAX_MARKER_BYTES)
        doc = load_json_bytes(raw, storage.where(INCOMPLETE_MARKER)) if raw else None
    except (OSError, CheckpointError):
        return None
    if not (
        isinstance(doc, dict)
        and doc.get("format") == MARKER_FORMAT
        and doc.get("version") == MARKER_VERSION
        and isinstance(doc.get("names"), list)
    ):
        return None
    listed = doc["names"]
    if not all(type(n) is str and 0 < len(n) <= MAX_NAME_CHARS for n in listed):
        return None
    return doc


def listing(storage: Storage, names: list[str]) -> str:
    """The first :data:`SHOWN` of ``names`` with what each is, and how many more."""
    shown = [f"{name!r} ({_what(storage, name)})" for name in sorted(names)[:SHOWN]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def _what(storage: Storage, name: str) -> str:
    """What ``name`` is, for a listing (an object store says "an object", "a prefix")."""
    try:
        if storage.kind(name) == "file" and not is_url(storage.directory):
            return "a regular file"  # ``describe`` tells what is *not* a regular file
        return storage.describe(name)
    except (OSError, CheckpointError):
        return "unreadable"


def _not_ours(storage: Storage, names: list[str]) -> CheckpointError:
    """No marker (or one that is not a regular file): nothing in the directory is ours."""
    return CheckpointError(
        f"{storage.directory} is not empty (it holds {listing(storage, names)}) and is not "
        "left over from an interrupted shardsafe save. shardsafe saves only into a new or "
        "empty directory, so that it never deletes files it did not write; pick another "
        "path, or empty this one yourself."
    )


def _refusal(storage: Storage, foreign: list[str]) -> CheckpointError:
    """A marker, and beside the leftovers it covers, ``foreign`` entries it does not."""
    return CheckpointError(
        f"{storage.directory} holds an interrupted shardsafe save's leftovers, but also "
        f"{listing(storage, foreign)}, which that save did not record as its own writing. "
        "A save deletes only regular files an interrupted save recorded in its "
        f"{INCOMPLETE_MARKER} marker, so nothing was deleted. Move those entries away (or "
        "delete them, if they are not needed) and save again, or save to another path."
    )
