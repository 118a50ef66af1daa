"""The owner record of a root lock (``.shardsafe.lock``), read as hostile input.

The root lock (``lock.py``, on a local filesystem or an object store alike) writes
``{"pid", "host", "started", "token", "since"}`` and reads it back to decide whether
a root is its own, whether its owner is alive, and what to tell the user. Anyone who can
write the root can also write this file, so it is parsed strictly (``strict_json``:
bounded depth and digits) and every field is checked here, once, for every medium: a pid
that ``os.kill`` cannot take, a ``since`` that ``time.localtime`` cannot format or a host
that is not text would otherwise fail deep inside the lock as an ``OverflowError`` or a
``TypeError`` that names no file. A lock that fails these checks is *damaged*: the save
stops with a :class:`CheckpointError` that names the lock, says what is wrong with it and
what to do, and writes nothing (a damaged lock cannot say whose run it was, so it is never
taken over).
"""

from __future__ import annotations

from typing import Any

from ...errors import CheckpointCorruptError, CheckpointError
from ..format.strict_json import load_json_bytes
from .protocol import Storage

MAX_LOCK_BYTES = 1 << 16
"""A lock this library writes is about 150 bytes."""
MAX_PID = (1 << 31) - 1
"""The largest ``pid_t``: any larger number is no process ``os.kill`` can ask about."""
MAX_HOST_CHARS = 255
"""A fully qualified host name's limit (``gethostname`` returns at most this)."""
MAX_FIELD_CHARS = 128
"""``started`` (a kernel clock tick count) and ``token`` (32 hex digits) are far shorter."""
MAX_SINCE = 1e11
"""Seconds since the epoch (the year 5138): any larger ``since`` is not a real time."""


def damaged_lock(where: str, problem: str) -> CheckpointError:
    """The error for a lock that names no valid owner: what is wrong, and what to do."""
    return CheckpointError(
        f"the lock {where} is damaged: {problem}. shardsafe cannot tell which run owns this "
        "root, so it wrote nothing. Make sure no other run is saving into this root, then "
        f"delete {where} and save again."
    )


def read_owner(storage: Storage, name: str, where: str, *, empty_ok: bool) -> dict[str, Any]:
    """The checked owner record of the lock ``name`` in ``storage`` (``where``: its path or
    URL, for messages); ``{}`` if there is no lock, or (``empty_ok``) an empty one.

    ``empty_ok``: a local lock may be empty when a shardsafe older than its hard-link
    claim died between creating and writing it (``lock.py`` takes it over after a grace
    period); an object-store lock is written in one PUT, so an empty one is damaged.
    """
    return read_lock(storage, name, where, empty_ok=empty_ok)[0]


def read_lock(
    storage: Storage, name: str, where: str, *, empty_ok: bool
) -> tuple[dict[str, Any], bytes]:
    """:func:`read_owner`, and the bytes it was read from (``b""`` if there is no lock): a
    dead run's lock is taken over only while it still holds exactly these bytes, so two
    runs that read the same dead lock cannot both take it over (``lock_backends.py``)."""
    try:
        if storage.kind(name) is None:
            return {}, b""
        raw = storage.read_small(name, MAX_LOCK_BYTES)
    except FileNotFoundError:
        return {}, b""
    except CheckpointCorruptError as e:  # not a regular file, too large, or gone meanwhile
        if _gone(storage, name):
            return {}, b""
        raise damaged_lock(where, str(e)) from None
    except OSError as e:
        raise CheckpointError(f"cannot read the lock {where}: {e}") from e
    if not raw and empty_ok:
        return {}, raw
    return parse_owner(raw, where), raw


def _gone(storage: Storage, name: str) -> bool:
    """Whether the lock vanished (its owner released it while it was being read)."""
    try:
        return storage.kind(name) is None
    except (OSError, CheckpointError):
        return False


def parse_owner(raw: bytes, where: str) -> dict[str, Any]:
    """The owner record in ``raw``, every field checked (module docstring); a damaged
    lock raises :func:`damaged_lock`."""
    if not raw:
        raise damaged_lock(where, "it is empty")
    try:
        doc = load_json_bytes(raw, where)
    except CheckpointCorruptError as e:
        raise damaged_lock(where, "it " + str(e).removeprefix(f"{where} ")) from None
    if not isinstance(doc, dict):
        raise damaged_lock(where, f"it holds a JSON {type(doc).__name__}, not an object")
    problem = owner_problem(doc)
    if problem is not None:
        raise damaged_lock(where, problem)
    return {
        "pid": doc["pid"],
        "host": doc["host"],
        "started": doc.get("started"),
        "token": doc.get("token"),
        "since": float(doc["since"]),
    }


def owner_problem(doc: dict[str, Any]) -> str | None:
    """What is wrong with an owner record, or ``None`` if every field is valid."""
    pid: Any = doc.get("pid")
    host: Any = doc.get("host")
    since: Any = doc.get("since")
    if type(pid) is not int or not 0 < pid <= MAX_PID:
        return f"its 'pid' is {_shown(pid)}, not a process id (1 to {MAX_PID})"
    if not _text(host, MAX_HOST_CHARS) or not host:
        return f"its 'host' is {_shown(host)}, not a host name of 1 to {MAX_HOST_CHARS} characters"
    for field in ("started", "token"):
        value = doc.get(field)
        if value is not None and not _text(value, MAX_FIELD_CHARS):
            limit = f"text of {MAX_FIELD_CHARS} characters or less"
            return f"its {field!r} is {_shown(value)}, not {limit}"
    # A comparison, not float(): NaN fails it, and an int of any size is compared exactly.
    if type(since) not in (int, float) or not 0 <= since <= MAX_SINCE:
        return f"its 'since' is {_shown(since)}, not a time in seconds since the epoch"
    return None


def _text(value: Any, limit: int) -> bool:
    return type(value) is str and len(value) <= limit


def _shown(value: Any) -> str:
    """A field's value for a message, cut short (it may be anything, of any size)."""
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'}"
    if type(value) is int and abs(value) >= 10**20:  # no str(): it may exceed the
        return f"a number of about {int(value.bit_length() * 0.30103) + 1} digits"  # int limit
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
