"""The coordinator by job (issue 28, item 4): its parts stay small, every store key is
built by ``store_keys``, and a phase's payloads stay in the store until every rank has
read them, the last phase's too.

Two ranks run in threads over one locked ``FakeStore`` (``group=``): the Coordinator's
real code, no process group.
"""

from __future__ import annotations

import ast
import re
import threading
from pathlib import Path
from typing import Any

import pytest

import shardsafe
from shardsafe.distributed import Coordinator, Phase, agreement
from shardsafe.distributed import store_keys as keys
from tests.fake_store import FakeStore

DISTRIBUTED = Path(shardsafe.__file__).parent / "distributed"


class _LockedStore(FakeStore):
    """A FakeStore two threads can share: each counter update is one step."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def add(self, key: str, n: int) -> int:
        with self._lock:
            return super().add(key, n)


def _run_two_ranks(rank: Any) -> dict[int, Any]:
    """``rank(r)`` on ranks 0 and 1 at once; their results (or exceptions)."""
    results: dict[int, Any] = {}

    def run(r: int) -> None:
        try:
            results[r] = rank(r)
        except BaseException as e:
            results[r] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def test_the_last_phases_payloads_stay_until_every_rank_has_read_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 closes before rank 0 reads the last phase's payloads: rank 1's payload is
    still there for rank 0 (before, rank 1 deleted it as it closed), and rank 0 deletes
    every rank's once both have closed, so nothing is left behind."""
    store = _LockedStore()
    rank1_closed = threading.Event()
    read = agreement.read_payloads

    def read_late(link: Any, phase: Phase) -> list[Any]:
        if link.rank == 0:
            assert rank1_closed.wait(10)
        return read(link, phase)

    monkeypatch.setattr(agreement, "read_payloads", read_late)

    def rank(r: int) -> list[Any]:
        coord = Coordinator("tiers", "/t", timeout=10, group=(r, 2, store))
        coord.enter(10)
        try:
            return coord.exchange(Phase.SURVEY, {"from": r}, None)
        finally:
            coord.close()
            if r == 1:
                rank1_closed.set()

    results = _run_two_ranks(rank)
    assert results == {0: [{"from": 0}, {"from": 1}], 1: [{"from": 0}, {"from": 1}]}
    assert [k for k in store.data if "/ok/" in k] == []


def test_earlier_payloads_go_once_every_rank_posted_the_next_phase() -> None:
    store = _LockedStore()
    seen: dict[int, list[str]] = {}

    def rank(r: int) -> list[Any]:
        coord = Coordinator("save", "/s", timeout=10, group=(r, 2, store))
        coord.enter(10)
        try:
            first = coord.exchange(Phase.COLLECT, {"r": r}, None)
            coord.exchange(Phase.WRITE, None, None)
            seen[r] = sorted(k for k in store.data if "/ok/" in k)
            return first
        finally:
            coord.close()

    results = _run_two_ranks(rank)
    assert results[0] == results[1] == [{"r": 0}, {"r": 1}]
    # After the second phase each rank had deleted its own collect payload (the other
    # rank's may still have been there, a moment before its owner deleted it).
    for r in (0, 1):
        assert keys.payload(Phase.COLLECT, r) not in seen[r]
    assert [k for k in store.data if "/ok/" in k] == []


def test_a_failed_phase_is_agreed_and_leaves_no_payload_behind() -> None:
    store = _LockedStore()

    def rank(r: int) -> Any:
        coord = Coordinator("save", "/f", timeout=10, group=(r, 2, store))
        coord.enter(10)
        try:
            with coord.phase(Phase.WRITE) as phase:
                if r == 1:
                    raise OSError(28, "No space left on device")
                phase.payload = {"r": r}
        finally:
            coord.close()

    results = _run_two_ranks(rank)
    assert all(isinstance(e, shardsafe.CheckpointError) for e in results.values())
    assert str(results[0]) == str(results[1])
    assert str(results[0]).startswith("save failed on rank 1: OSError: [Errno 28]")
    assert [k for k in store.data if "/ok/" in k] == []


def test_every_store_key_is_built_by_store_keys() -> None:
    """No module of the package but ``store_keys`` spells a key: no f-string or literal
    passed to a store call."""
    call = re.compile(r"\.(add|set|get|check|delete_key|multi_get|multi_set|wait)\(\s*\[?f?[\"']")
    found = [
        f"{path.name}:{n}"
        for path in sorted(DISTRIBUTED.glob("*.py"))
        if path.name != "store_keys.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if call.search(line)
    ]
    assert found == []


def test_phases_are_used_as_the_enum() -> None:
    sources = {p.name: p.read_text() for p in DISTRIBUTED.glob("*.py")}
    assert not [name for name, text in sources.items() if "str(Phase." in text]
    assert not [name for name, text in sources.items() if re.search(r"\bstr\(phase\)", text)]


def test_no_module_over_400_lines_and_no_function_over_60() -> None:
    long_modules, long_functions = [], []
    for path in sorted(DISTRIBUTED.glob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 400:
            long_modules.append(path.name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                if node.end_lineno - node.lineno + 1 > 60:
                    long_functions.append(f"{path.name}:{node.name}")
    assert long_modules == [] and long_functions == []
