"""Python's cyclic garbage collector paused while a large acyclic document is built.

Parsing a manifest of tens of thousands of chunks (and printing ``inspect --json`` of it)
allocates millions of small dicts, lists and strings, none of them in a reference cycle.
Each allocation burst triggers collections that traverse every object still alive, so the
collector's share grew faster than the document: ``inspect --json`` of 12,000 files took
about 3x the time of 6,000 instead of 2x (``benchmarks/validation_scale.py``). Nothing
these blocks build needs the collector, and reference counting still frees everything.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside the block; the collector is re-enabled after it only
    if it was enabled before (a program that disabled it keeps it disabled)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
