"""CRC32, as fast as the machine allows, always with zlib's values.

``zlib.crc32`` runs at about 2 GB/s, slower than writing to the page cache, so it would
set the pace of every save and load (on an H200 a load into CUDA tensors took 2.6x as
long). python-isal, a dependency of shardsafe where it has wheels, computes the same
CRC32 at over 10 GB/s; when it is installed it is used, otherwise zlib is. The checksums
in a checkpoint are identical either way, so a checkpoint written with one verifies with
the other.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

Crc32 = Callable[[memoryview, int], int]

crc32: Crc32 = zlib.crc32
"""``crc32(data, start)``: zlib-compatible CRC32 of ``data`` continuing from ``start``."""
ACCELERATED = False

try:
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # the optional accelerator is absent: zlib it is
    pass
else:
    crc32, ACCELERATED = _isal_crc32, True


class BlockCrc:
    """CRC32 of consecutive ``block_bytes`` blocks of a byte stream fed in arbitrary pieces."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.values: list[int] = []
        self._crc = 0
        self._filled = 0

    def update(self, data: memoryview) -> None:
        while data.nbytes:
            take = min(self.block_bytes - self._filled, data.nbytes)
            self._crc = crc32(data[:take], self._crc)
            self._filled += take
            data = data[take:]
            if self._filled == self.block_bytes:
                self.values.append(self._crc)
                self._crc, self._filled = 0, 0

    def finish(self) -> tuple[int, ...]:
        if self._filled or not self.values:
            self.values.append(self._crc)
        return tuple(self.values)
