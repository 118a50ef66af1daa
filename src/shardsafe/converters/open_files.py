"""A converter's source files, opened on demand, a bounded number at a time."""

from __future__ import annotations

from collections import OrderedDict

from ..checkpoint.io.reader import MAX_OPEN_FILES, _same_file
from ..checkpoint.storage.protocol import FileReader, Storage


class OpenFiles:
    """The files of one source checkpoint, opened without following links.

    At most half the process's descriptor limit stay open (``_open_limit``): DCP writes a
    file per rank (and per writer thread), and a Hugging Face index may name any number of
    shards, so a checkpoint of a thousand files would otherwise exhaust a default limit of
    1,024 (``Too many open files``), while closing them sooner would reopen every file for
    every tensor (an FSDP tensor has a chunk in each). A file closed to make room and
    needed again must be the file first opened (``_same_file``)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.open: OrderedDict[str, FileReader] = OrderedDict()
        self.identities: dict[str, object] = {}
        self.limit = _open_limit()

    def get(self, name: str) -> FileReader:
        reader = self.open.get(name)
        if reader is not None:
            self.open.move_to_end(name)
            return reader
        if len(self.open) >= self.limit:
            self.open.popitem(last=False)[1].close()
        reader = self.storage.open_reader(name)
        try:
            _same_file(self.identities, name, reader)
        except BaseException:
            reader.close()
            raise
        self.open[name] = reader
        return reader

    def close(self) -> None:
        for reader in self.open.values():
            reader.close()
        self.open.clear()


def _open_limit() -> int:
    """How many source files may stay open: half the soft ``RLIMIT_NOFILE`` (the rest
    is the process's own), at least ``MAX_OPEN_FILES`` (``load``'s bound)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no such limit here (Windows)
        return MAX_OPEN_FILES
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(MAX_OPEN_FILES, min(soft // 2, 1 << 16))
