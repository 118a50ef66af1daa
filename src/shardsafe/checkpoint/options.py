"""What ``save`` and ``load`` take, in one place each: keyword-only, validated dataclasses.

``shardsafe.save``, ``CheckpointManager.save`` and the Trainer all build a
:class:`SaveOptions`; its defaults are the only ones (the public functions' signatures
name them from here). A wrong value fails here, naming the field and what it accepts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypedDict, get_args

from .format.manifest_format import LAYOUTS, Layout
from .storage.locations import check_options, open_storage
from .storage.protocol import Storage

DEFAULT_BUFFER_BYTES = 64 << 20
DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_UNTRUSTED_BYTES = 1 << 30
VerifyMode = Literal["first", "inline"]
"""How ``load`` checks checksums against restoring (see :class:`LoadOptions`)."""
VERIFY_MODES: tuple[VerifyMode, ...] = get_args(VerifyMode)


class StorageFactory(Protocol):
    """Makes the storage layer for a checkpoint directory: a ``Storage`` (``LocalStorage``
    or a subclass of it, ``FsspecStorage``); ``follow=False``: the directory itself must
    not be a symlink."""

    def __call__(self, directory: str, *, follow: bool = ...) -> Storage: ...


def storage_factory(
    storage: StorageFactory | None, storage_options: Mapping[str, Any] | None
) -> StorageFactory:
    """``storage`` if given, else the default: a local directory or, for a URL, fsspec."""
    if storage is not None:
        return storage
    return functools.partial(open_storage, storage_options=storage_options)


def opener_of(
    path: str, storage: StorageFactory | None, storage_options: Mapping[str, Any] | None
) -> Callable[[], Storage]:
    """What opens ``path``'s storage when called: inside a save's or load's agreement, so
    that a client one node cannot make fails every rank. ``storage_options`` given for a
    local path are a usage error, raised now, before the ranks meet."""
    if storage is None:
        check_options(path, storage_options)
    return functools.partial(storage_factory(storage, storage_options), path)


@dataclass(frozen=True, kw_only=True)
class SaveHooks:
    """Code to run on rank 0 inside a save, so that its failure is agreed like any other.

    ``before_write`` runs once every rank has arrived and before any data is written (the
    manager takes its lock and checks the step there); ``after_commit`` runs right after
    ``manifest.json`` is committed (the manager moves ``latest`` and applies retention).
    An exception in either fails the save on every rank; after ``after_commit`` raises,
    the checkpoint is committed all the same.
    """

    before_write: Callable[[], None] | None = None
    after_commit: Callable[[], None] | None = None


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How to save. See ``shardsafe.save`` for what each field does."""

    layout: Layout = "sharded"
    entry_timeout: float = 60.0
    timeout: float = DEFAULT_TIMEOUT_S
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    storage: StorageFactory | None = None
    hooks: SaveHooks = field(default_factory=SaveHooks)
    storage_options: Mapping[str, Any] | None = None
    """For an object-store URL: fsspec's options (credentials, ``endpoint_url``,
    ``default_block_size``: the multipart part size)."""
    verify_replicas: bool = False
    """Every rank holding a replicated tensor (or a copy of a shard) checksums its copy,
    and copies that differ are an agreed error naming the tensor and the ranks (nothing is
    written)."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not one of {LAYOUTS}")
        # As LoadOptions: "64MB" failed with a raw TypeError, 6.7e7 and "yes" were taken.
        _check_buffer(self.buffer_bytes)
        if not isinstance(self.verify_replicas, bool):
            raise ValueError(f"verify_replicas={self.verify_replicas!r} must be True or False")
        check_seconds("entry_timeout", self.entry_timeout)
        check_seconds("timeout", self.timeout)
        _mapping_or_none(self.storage_options)

    @classmethod
    def of(cls, options: SaveOptions | None = None, /, **overrides: Any) -> SaveOptions:
        """``options`` (or the defaults) with ``overrides`` applied; unknown names refused."""
        base = options or cls()
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise TypeError(
                f"unknown save option(s) {sorted(unknown)}; the options are "
                f"{sorted(cls.__dataclass_fields__)}"
            )
        fields = {name: getattr(base, name) for name in cls.__dataclass_fields__}
        return cls(**{**fields, **overrides})


class SaveKeywords(TypedDict, total=False):
    """:class:`SaveOptions`'s fields as keyword arguments, for the entry points that take
    those of :func:`shardsafe.save` (``async_save``, the manager's): typed once, here, and
    checked by :meth:`SaveOptions.of`, which refuses an unknown name."""

    layout: Layout
    entry_timeout: float
    timeout: float
    buffer_bytes: int
    storage: StorageFactory | None
    hooks: SaveHooks
    storage_options: Mapping[str, Any] | None
    verify_replicas: bool


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How to load. See ``shardsafe.load`` for what each field does."""

    strict: bool = True
    entry_timeout: float = 60.0
    timeout: float = DEFAULT_TIMEOUT_S
    untrusted_bytes_limit: int = DEFAULT_UNTRUSTED_BYTES
    storage: StorageFactory | None = None
    """Makes the storage layer for the directory, as :attr:`SaveOptions.storage` does."""
    storage_options: Mapping[str, Any] | None = None
    verify: VerifyMode = "first"
    """``"first"``: every byte this rank needs is read and CRC-checked before anything is
    restored, then read again straight into the live tensors, checked again (a second
    read, from the page cache locally; from an object store, from a local temporary file
    the first read kept, see ``spool.py``, so nothing is downloaded twice). ``"inline"``:
    one read, each piece checked as it is copied into a live tensor; a corrupt byte is
    found with the objects partly restored, and the error says which. Either way only
    one tensor's worth of bytes plus ``buffer_bytes`` is held beyond the live objects."""
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    """The read buffers' budget: half pageable; half pinned for CUDA targets, four pieces
    of at most 4 MiB (``io/pinned_ring.py``). A single row larger than that is read
    through one buffer of its size."""
    read_threads: int | None = None
    """Threads this rank reads local files with (``io/threaded_reads.py``); ``None``: its
    share of the CPUs (the CPUs it may run on divided by the processes on its node,
    ``LOCAL_WORLD_SIZE``), 1 to 4. An object store is read on one thread."""

    def __post_init__(self) -> None:
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict={self.strict!r} must be True or False")
        if self.verify not in VERIFY_MODES:
            raise ValueError(
                f"verify={self.verify!r} is not one of {VERIFY_MODES}: 'first' restores "
                "nothing until every byte is verified (two reads), 'inline' reads once"
            )
        _check_buffer(self.buffer_bytes)
        check_seconds("entry_timeout", self.entry_timeout)
        check_seconds("timeout", self.timeout)
        _mapping_or_none(self.storage_options)
        threads = self.read_threads
        if threads is not None and (
            not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 64
        ):
            raise ValueError(
                f"read_threads={threads!r} must be a number of threads from 1 to 64, or None "
                "for this rank's share of the CPUs"
            )
        if not isinstance(self.untrusted_bytes_limit, int) or self.untrusted_bytes_limit < 0:
            raise ValueError(
                f"untrusted_bytes_limit={self.untrusted_bytes_limit!r} must be a number of "
                "bytes, 0 or more"
            )

    @classmethod
    def of(cls, **overrides: Any) -> LoadOptions:
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise TypeError(
                f"unknown load option(s) {sorted(unknown)}; the options are "
                f"{sorted(cls.__dataclass_fields__)}"
            )
        return cls(**overrides)


class LoadKeywords(TypedDict, total=False):
    """:class:`LoadOptions`' fields as keyword arguments, for the entry points that take
    those of :func:`shardsafe.load` (the managers' ``load_latest``): typed once, here, and
    checked by :meth:`LoadOptions.of`, which refuses an unknown name."""

    strict: bool
    entry_timeout: float
    timeout: float
    untrusted_bytes_limit: int
    storage: StorageFactory | None
    storage_options: Mapping[str, Any] | None
    verify: VerifyMode
    buffer_bytes: int
    read_threads: int | None


def _check_buffer(size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool):
        raise ValueError(f"buffer_bytes={size!r} must be an int, a number of bytes (1 MiB or more)")
    if size < 1 << 20:
        raise ValueError(f"buffer_bytes={size!r} is too small; use at least 1 MiB")


MAX_TIMEOUT_S = 1e9
"""The longest a rank can wait for another (about 31 years): longer, a thread's timer and
the store's timeout (gloo's, in a C int) overflow."""


def check_seconds(name: str, value: float) -> None:
    """Refuse a wait the ranks cannot make: ``inf`` passed here and failed on 2 ranks
    with a raw ``OverflowError`` (a timer's thread, the store's timeout), one rank
    blaming the other for dying."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not 0 < value < math.inf:  # NaN too
        raise ValueError(f"{name}={value!r} must be a positive number of seconds")
    if value > MAX_TIMEOUT_S:
        raise ValueError(
            f"{name}={value!r} is more than the {MAX_TIMEOUT_S:.0e} seconds (about 31 years) "
            "a rank can wait for another; pass a smaller number of seconds"
        )


def _mapping_or_none(value: Any) -> None:
    if value is not None and not isinstance(value, Mapping):
        raise ValueError(f"storage_options={value!r} must be a dict of fsspec options or None")
