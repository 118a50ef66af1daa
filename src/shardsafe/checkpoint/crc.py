"""CRC32, as fast as the machine allows, always with zlib's values.

``zlib.crc32`` runs at about 2 GB/s, slower than writing to the page cache, so on a
busy machine it would set the pace of a save. python-isal (``pip install
shardsafe[fast]``) computes the same CRC32 at over 10 GB/s; when it is installed it is
used, otherwise zlib is. The checksums in a checkpoint are identical either way, so a
checkpoint written with one verifies with the other.
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
