"""The trainer's progress on rank 0: tqdm's bar on a terminal with tqdm installed, plain
lines otherwise (no tqdm, or output to a log or a pipe), so that a run is never silent.

A real pseudo-terminal stands in for the user's terminal; "tqdm is missing" is an import
that fails, as it does where tqdm is not installed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import struct
import sys
import termios
from collections.abc import Iterator

import pytest

from shardsafe.trainer.metrics import ProgressBar


@contextlib.contextmanager
def terminal() -> Iterator[int]:
    """stderr on a real pseudo-terminal, as a user's shell has it (set inside the test:
    capsys replaces sys.stderr when the test starts); yields its reading end."""
    reader, writer = os.openpty()
    fcntl.ioctl(writer, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # 80 columns
    stream = os.fdopen(writer, "w", buffering=1)
    saved, sys.stderr = sys.stderr, stream
    try:
        yield reader
    finally:
        sys.stderr = saved
        stream.close()
        os.close(reader)


def everything_on(reader: int) -> str:
    """What has been written to the terminal so far."""
    chunks = []
    while select.select([reader], [], [], 0.2)[0]:
        chunks.append(os.read(reader, 65536))
    return b"".join(chunks).decode(errors="replace")


def run_steps(bar: ProgressBar, losses: list[float]) -> None:
    for loss in losses:
        bar.update(loss)
    bar.close()


def test_without_a_terminal_a_line_at_the_first_step_then_every_few_seconds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_steps(ProgressBar(total=60, initial=20, enabled=True), [1.5, 1.25, 1.0])
    assert capsys.readouterr().out == "shardsafe: step 21/60, loss 1.5\n"  # then 5 s pass
    run_steps(ProgressBar(total=60, initial=0, enabled=True, every_s=0.0), [0.5, 0.25])
    first, second = capsys.readouterr().out.splitlines()
    assert first == "shardsafe: step 1/60, loss 0.5"
    assert second.startswith("shardsafe: step 2/60, loss 0.25, ") and second.endswith(" steps/s")
    run_steps(ProgressBar(total=60, initial=0, enabled=False), [0.5])  # ranks other than 0
    assert capsys.readouterr() == ("", "")


def test_on_a_terminal_without_tqdm_plain_lines_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    with terminal():
        run_steps(ProgressBar(total=8, initial=0, enabled=True), [2.0, 1.0])
    assert capsys.readouterr().out == "shardsafe: step 1/8, loss 2\n"


def test_on_a_terminal_with_tqdm_its_bar(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    with terminal() as reader:
        run_steps(ProgressBar(total=8, initial=0, enabled=True), [2.0, 1.0])
        shown = everything_on(reader)
    assert capsys.readouterr().out == ""  # no line: the bar is on the terminal
    assert "2/8" in shown and "loss=1" in shown, shown
