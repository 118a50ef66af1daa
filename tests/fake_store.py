"""A dict-backed key-value store standing in for torch's TCPStore in unit tests.

It is not a mock of ``torch.distributed``: the Coordinator and the Heartbeat run their
real code over it, in one process, where a test needs no ranks of its own. It has the
calls they make (``add``, ``set``, ``get``, ``check``, ``delete_key``, and ``multi_get``
when asked for) and no ``wait``, so waits poll. Values are kept as given and read back as
bytes, as a TCPStore returns them; a counter is an ``int`` that ``add`` creates at 0.

``multi_get`` is there only with ``FakeStore(multi_get=True)``: code that reads several
keys checks for it (``hasattr``) and otherwise reads one key at a time, so a test picks
the path it means (the Heartbeat reads each beat with ``add(key, 0)`` without it, which
counts a rank that never beat as a beat of 0).

``on_first_read``, when set, runs inside the first counter read (``add(key, 0)``) and is
then cleared; the read returns the value from before the hook ran. That is where a slow
rank's posts can land between two reads of a real TCPStore.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class FakeStore:
    """A dict-backed key-value store with the calls the Coordinator makes."""

    def __init__(self, *, multi_get: bool = False) -> None:
        self.data: dict[str, Any] = {}
        self.on_first_read: Callable[[], Any] | None = None
        if multi_get:
            self.multi_get = self._multi_get

    def add(self, key: str, n: int) -> int:
        if n == 0 and self.on_first_read is not None:
            hook, self.on_first_read = self.on_first_read, None
            value = self.data.get(key, 0)
            hook()
            return int(value)
        self.data[key] = self.data.get(key, 0) + n
        return int(self.data[key])

    def set(self, key: str, value: str) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes:
        return str(self.data[key]).encode()

    def _multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None
