"""Ctrl-C around a background save never lets the next save write into its staged copy,
and never lets a manager give up its root while the save still writes.

One process, a real SIGINT (sent by a timer thread, raised in the main thread as
Python's ``KeyboardInterrupt``), and a first save held back by a slow ``before_write``
hook so that it is still in flight when the interrupt lands. The checks are what a user
would find afterwards: the first checkpoint holds the state at its own call, bitwise.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointManager
from shardsafe.checkpoint import background
from shardsafe.checkpoint.options import SaveHooks

pytestmark = pytest.mark.timeout(60)

HELD_S = 2.0
"""How long the first save waits before it writes: it is in flight while the test acts."""


def held_back() -> SaveHooks:
    return SaveHooks(before_write=lambda: time.sleep(HELD_S))


def interrupt_in(seconds: float) -> None:
    """Ctrl-C to this process in ``seconds`` (the main thread raises it)."""
    threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT)).start()


def loaded(path: Path) -> torch.Tensor:
    got = {"t": torch.empty(1000)}
    shardsafe.load(path, got)
    return got["t"]


def test_a_save_whose_wait_for_the_one_in_flight_is_interrupted_waits_again(
    tmp_path: Path,
) -> None:
    """The interrupted call (in its wait for save a) took save a off the list of saves in
    flight: the next one staged into the buffers a was still writing from, and a was
    committed holding the next save's values, its checksums matching them."""
    t = torch.zeros(1000)
    first = shardsafe.async_save(tmp_path / "a", {"t": t}, hooks=held_back())
    interrupt_in(0.3)
    with pytest.raises(KeyboardInterrupt):
        shardsafe.async_save(tmp_path / "b", {"t": t})
    assert not first.done()  # still in flight: what this test is about
    t.fill_(7.0)  # the training goes on
    shardsafe.async_save(tmp_path / "b", {"t": t}).wait()
    first.wait()
    assert torch.equal(loaded(tmp_path / "a"), torch.zeros(1000))
    assert torch.equal(loaded(tmp_path / "b"), torch.full((1000,), 7.0))


def _interrupted_start(started: bool) -> Any:
    """``Thread.start`` of the writer interrupted by Ctrl-C: once the thread runs (in its
    wait for the thread), or before the thread is made."""
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name != "shardsafe-save":
            return real(self)
        if started:
            real(self)
        raise KeyboardInterrupt

    return start


def test_a_writer_interrupted_in_its_start_once_running_stays_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``async_save`` raised the interrupt and forgot its writer, which went on to commit:
    the next save staged into the same buffers, as above."""
    t = torch.zeros(1000)
    monkeypatch.setattr(threading.Thread, "start", _interrupted_start(started=True))
    with pytest.raises(KeyboardInterrupt):
        shardsafe.async_save(tmp_path / "a", {"t": t}, hooks=held_back())
    monkeypatch.undo()
    assert len(background._IN_FLIGHT) == 1
    t.fill_(7.0)
    second = shardsafe.async_save(tmp_path / "b", {"t": t})  # waited for a first
    assert [second] == background._IN_FLIGHT
    second.wait()
    assert torch.equal(loaded(tmp_path / "a"), torch.zeros(1000))
    assert torch.equal(loaded(tmp_path / "b"), torch.full((1000,), 7.0))


def test_a_writer_interrupted_before_its_thread_was_made_is_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No writer will ever end that run: it is not waited for (the next save would hang),
    and nothing of it is committed."""
    monkeypatch.setattr(background, "THREAD_START_S", 0.5)
    monkeypatch.setattr(threading.Thread, "start", _interrupted_start(started=False))
    with pytest.raises(KeyboardInterrupt):
        shardsafe.async_save(tmp_path / "a", {"t": torch.zeros(1000)})
    monkeypatch.undo()
    assert background._IN_FLIGHT == []
    shardsafe.async_save(tmp_path / "b", {"t": torch.ones(1000)}).wait()
    assert not (tmp_path / "a" / "manifest.json").exists()
    assert torch.equal(loaded(tmp_path / "b"), torch.ones(1000))


def test_a_managers_interrupted_wait_leaves_close_to_wait_and_keep_the_lock(
    tmp_path: Path,
) -> None:
    """``wait()`` forgot the save before waiting for it: after a Ctrl-C there, ``close()``
    returned at once and removed the root's lock while the save still wrote, committed,
    moved ``latest`` and applied retention."""
    manager = CheckpointManager(tmp_path / "root", keep_last=1)
    handle = manager.async_save(1, {"t": torch.zeros(1000)}, hooks=held_back())
    lock = tmp_path / "root" / ".shardsafe.lock"
    interrupt_in(0.3)
    with pytest.raises(KeyboardInterrupt):
        manager.wait()
    assert lock.exists() and not handle.done()
    manager.close()  # waits for the save, then gives the root up
    assert handle._finished.is_set() and not lock.exists()
    assert manager.latest() == str(tmp_path / "root" / "step-000000001")


def test_a_managers_interrupted_close_keeps_the_lock_until_closed_again(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "root", keep_last=1)
    handle = manager.async_save(1, {"t": torch.zeros(1000)}, hooks=held_back())
    lock = tmp_path / "root" / ".shardsafe.lock"
    interrupt_in(0.3)
    with pytest.raises(KeyboardInterrupt):
        manager.close()
    assert lock.exists() and not handle.done()
    manager.close()
    assert not lock.exists()
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["latest", "step-000000001"]
