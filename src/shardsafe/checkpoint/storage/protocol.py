"""What the engine needs of a checkpoint directory's bytes: the :class:`Storage` protocol.

Nothing here knows about tensors. The interface is deliberately tiny (after
torchsnapshot): named files inside one directory, written sequentially and fsynced, read
by byte range. What a caller may rely on beyond that is declared here as capabilities
(``cheap_rereads``, ``cheap_metadata``, ``lock_backend``, ``abort_pending_uploads``,
:class:`CacheAvoidingSink`), so that no caller checks which storage it holds. Two
implementations: ``local.py`` (a directory on a filesystem) and ``object_storage.py`` (an
object-store prefix, through fsspec).
"""

from __future__ import annotations

import threading
from typing import Literal, Protocol, runtime_checkable

from .lock_backends import LockBackend

__all__ = [
    "CacheAvoidingSink",
    "EntryKind",
    "FileReader",
    "FileSink",
    "Storage",
]


EntryKind = Literal["file", "directory", "symlink", "other"]
"""What a name in a storage is (:meth:`Storage.kind`); an object store has only files
and directories (prefixes)."""


class FileSink(Protocol):
    """A new file or object, written front to back. A sink that can keep its bytes out
    of the page cache is also a :class:`CacheAvoidingSink`."""

    def write(self, data: memoryview) -> None: ...

    def finish(self) -> int:
        """Flush and fsync; return the number of bytes written."""
        ...

    def abort(self) -> None: ...


@runtime_checkable
class CacheAvoidingSink(FileSink, Protocol):
    """A sink that can write around the page cache (a local file: ``O_DIRECT``), so that
    a background save does not evict the training's pages. A capability: a sink without
    it (an upload, or a user's sink older than it) is written the usual way."""

    def avoid_page_cache(self, until: threading.Event, piece_bytes: int) -> None:
        """Keep the bytes out of the page cache, in pieces of ``piece_bytes``, until
        ``until`` is set; called before the first write."""
        ...


class FileReader(Protocol):
    """One object opened for ranged reads; ``read_into`` fills a view from an offset.

    Where its storage has ``cheap_rereads``, a load may call ``read_into`` from several
    threads at once (``io/threaded_reads.py``): it must not depend on a file position
    (``os.preadv``, as ``LocalFileReader``, is what it needs)."""

    name: str
    size: int

    def read_into(self, offset: int, out: memoryview) -> None: ...
    def mapping_path(self) -> str | None:
        """A path naming this very open file (``/proc/self/fd/N``), for a reader that must
        memory-map it by name (``torch.load(mmap=True)``); ``None`` where there is none."""
        ...

    def close(self) -> None: ...
    def __enter__(self) -> FileReader: ...
    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class Storage(Protocol):
    """What the engine needs from where a checkpoint lives: named byte objects in one
    directory (or object-store prefix), never tensors.

    :class:`LocalStorage` (POSIX) and ``object_storage.FsspecStorage`` (``s3://`` and the
    other fsspec URLs) implement it. Every ``name`` is a plain file name checked by
    ``files.check_name``: nothing can address an object outside the directory.

    * writing: ``create`` (a new object, streamed; ``finish`` makes it visible),
      ``commit`` (one object written atomically: the manifest, ``latest``), ``touch``,
      ``remove``, ``sync_directory`` (make earlier creations durable before a commit);
    * reading: ``open_reader`` (ranged reads), ``read_small``, ``names``, ``kind``,
      ``names_and_kinds``, ``sizes``, ``exists``, ``describe``;
    * the directory: ``is_directory``, ``require_directory``, ``make_directory``,
      ``remove_directory`` (once empty), ``child``, ``remove_child`` (a child directory,
      once empty, never through a link), ``where`` (for messages), ``close``;
    * capabilities, what callers decide by instead of by the class:
      ``cheap_rereads``, ``cheap_metadata``, ``abort_pending_uploads`` and
      ``lock_backend`` (and, on a sink, :class:`CacheAvoidingSink`).
    """

    directory: str

    @property
    def cheap_rereads(self) -> bool:
        """Whether reading the same bytes a second time costs no second transfer (a local
        file comes from the page cache). ``load(verify="first")`` reads every byte twice:
        where this is False it keeps the first read in a local spool (``spool.py``)."""
        ...

    @property
    def cheap_metadata(self) -> bool:
        """Whether creating, listing and removing small files costs no round trip to a
        server (a local or shared filesystem). A background save then prepares its
        directory at the call, to plan before staging (``background._plan_first``)."""
        ...

    def abort_pending_uploads(self) -> int:
        """Abort uploads a killed save left unfinished under this directory (invisible
        but billed on an object store); return how many. Nothing to do on a filesystem."""
        ...

    def lock_backend(self) -> LockBackend:
        """How a lock file is created and replaced atomically on this medium
        (``lock_backends.py``), for the one lock that holds the rules (``lock.RootLock``)."""
        ...

    def is_directory(self) -> bool: ...
    def require_directory(self) -> None: ...
    def make_directory(self) -> None: ...
    def remove_directory(self) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Storage: ...
    def __exit__(self, *exc: object) -> None: ...
    def where(self, name: str) -> str: ...
    def create(self, name: str, size_hint: int = 0) -> FileSink:
        """A new object; ``size_hint``: the bytes it will hold, if known (an object
        store sizes its upload parts by it). Once its ``finish`` returns, the object
        and its name are durable: a save commits its manifest without syncing again."""
        ...

    def commit(self, name: str, data: bytes, *, exclusive: bool = False) -> None: ...
    def sync_directory(self) -> None: ...
    def remove(self, name: str) -> None: ...
    def touch(self, name: str) -> None: ...
    def names(self) -> list[str]: ...
    def kind(self, name: str) -> EntryKind | None: ...
    def sizes(self) -> dict[str, int]:
        """The size of every regular file (object) in the directory, from one listing."""
        ...

    def names_and_kinds(self) -> dict[str, EntryKind]:
        """Every name in the directory with its ``kind``, from one listing where the
        medium's listing says what each is (an object store: one request, where ``names``
        then ``kind`` of each asked the store twice per name)."""
        ...

    def describe(self, name: str) -> str: ...
    def exists(self, name: str) -> bool: ...
    def open_reader(self, name: str) -> FileReader: ...
    def read_small(self, name: str, limit: int) -> bytes: ...
    def child(self, name: str) -> Storage: ...
    def remove_child(self, name: str) -> None: ...
