"""A write-only file object over a storage sink, for writers that want a file
(``torch.save``, ``zipfile``): it counts its position and cannot seek, so ``zipfile``
writes data descriptors, which every zip reader, torch's included, accepts."""

from __future__ import annotations

from typing import Any

from ..checkpoint.storage.protocol import FileSink


class SinkStream:
    """Write-only, position-counting file object over ``sink``."""

    def __init__(self, sink: FileSink) -> None:
        self.sink, self.pos = sink, 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sink.write(view)
        self.pos += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        return None
