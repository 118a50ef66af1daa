"""Rank 0's record of a run: ``metrics.jsonl`` and the progress bar."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from typing import Any, TextIO

from .._text import silence_stdout
from ..checkpoint.format.strict_json import int_parser, why_not_json
from ..checkpoint.storage.files import describe_mode
from ..errors import CheckpointCorruptError, CheckpointError


class MetricsLog:
    """Appends ``{"step": int, "loss": float}`` per step to ``metrics.jsonl``.

    Opening it for a run that starts after step ``S`` first drops every line with a
    step above ``S`` (steps a crashed run logged after its last checkpoint, which the
    resumed run trains again), so the file never holds a step twice. Each line is
    flushed as it is written, so a run killed at any moment leaves whole lines behind.
    """

    def __init__(self, path: str, *, after_step: int) -> None:
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        _drop_after(path, after_step)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the run

    def log(self, step: int, loss: float) -> None:
        self._file.write(json.dumps({"step": step, "loss": loss}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Every whole line of a ``metrics.jsonl`` (a line cut short by a crash is skipped)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for number, line in enumerate(lines, 1):
        record = _parsed(line, path, number)
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _parsed(line: str, path: str, number: int) -> Any:
    """One line's JSON, or ``None`` for a line a crash cut short. ``NaN`` is accepted (a
    loss can be NaN, and ``log`` writes it so); a line no crash could leave (a number of
    thousands of digits, nesting deeper than the parser recurses) is a damaged file, named,
    never the interpreter's ``ValueError`` or ``RecursionError``."""
    try:
        return json.loads(line, parse_int=int_parser())
    except json.JSONDecodeError:
        return None
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else why_not_json(e)
        raise CheckpointCorruptError(
            f"{path} is damaged: line {number} is not a metrics record ({why}). Delete that "
            "line (or the file: it is only a log) and start again."
        ) from None


def _drop_after(path: str, step: int) -> None:
    if not os.path.lexists(path):
        return
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        # A FIFO made the run wait forever before step 1; a directory failed with a bare
        # errno; a link was followed out of the run's directory.
        raise _not_a_metrics_file(path, mode)
    kept = [r for r in _our_records(path) if r["step"] <= step]
    temporary = f"{path}.tmp"
    with _open_temporary(temporary) as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(temporary, path)


def _our_records(path: str) -> list[dict[str, Any]]:
    """The records of a metrics file about to be rewritten; one holding a line ``log``
    never writes is refused.

    Rewritten with the run's records only, a ``metrics.jsonl`` of the user's own (another
    tool's log, notes) in a reused ``run_dir`` was replaced by the new run's lines without
    a word. A line a crash cut short can only be the last one (each is flushed whole), so
    an unreadable line is foreign anywhere else.
    """
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        lines = f.read().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        record = _parsed(line, path, number)
        if _is_ours(record):
            records.append(record)
        elif record is not None or number != len(lines):  # not cut short by a crash
            shown = line if len(line) <= 80 else f"{line[:77]}..."
            raise CheckpointError(
                f"{path} holds a line shardsafe did not write (line {number}: {shown!r}); "
                "it would be rewritten with this run's records. Move it away (or choose "
                "another run_dir) and start again"
            )
    return records


def _is_ours(record: Any) -> bool:
    """Whether ``record`` is one ``MetricsLog.log`` writes: ``{"step": int, "loss": x}``."""
    return (
        isinstance(record, dict)
        and record.keys() == {"step", "loss"}
        and isinstance(record["step"], int)
        and not isinstance(record["step"], bool)
        and isinstance(record["loss"], (int, float))
        and not isinstance(record["loss"], bool)
    )


def _open_temporary(path: str) -> TextIO:
    """``path`` truncated for writing, where it is a regular file or absent (a stale one
    a crash left is reused); anything else is refused, not opened by name.

    ``open(path, "w")`` wrote through a link there, over the file it named outside the
    run's directory (which ``os.replace`` then made ``metrics.jsonl`` a link to), and
    waited forever before step 1 on a FIFO."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o666)
    except OSError:
        mode = os.lstat(path).st_mode if os.path.lexists(path) else stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise _not_a_metrics_file(path, mode) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # a FIFO that a reader held open
        os.close(fd)
        raise _not_a_metrics_file(path, mode)
    return open(fd, "w", encoding="utf-8")


def _not_a_metrics_file(path: str, mode: int) -> CheckpointError:
    return CheckpointError(
        f"{path} is {describe_mode(mode)}, not the run's metrics file; move it away (or "
        "choose another run_dir) and start again"
    )


PROGRESS_EVERY_S = 5.0
"""Without a bar: a progress line at the first step, then at most this often."""


class ProgressBar:
    """Rank 0's progress: tqdm's bar (step, loss, it/s) on a terminal with tqdm installed;
    otherwise (no tqdm, or stderr is a log or a pipe) plain lines on stdout, at the first
    step and then at most every ``every_s`` seconds, so that a run is never silent.
    """

    def __init__(
        self, *, total: int, initial: int, enabled: bool, every_s: float = PROGRESS_EVERY_S
    ) -> None:
        self._bar: Any = None
        self._lines = False
        self._total, self._step, self._every_s = total, initial, every_s
        self._last: tuple[int, float] | None = None
        """The step and time of the last line printed."""
        if not enabled:
            return
        if _is_terminal(sys.stderr):
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is optional: plain lines instead
                pass
            else:
                self._bar = tqdm(total=total, initial=initial, unit="step")
                return
        self._lines = True

    def update(self, loss: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            self._bar.update(1)
        if not self._lines:
            return
        self._step += 1
        now = time.monotonic()
        if self._last is not None and now - self._last[1] < self._every_s:
            return
        rate = ""
        if self._last is not None and now > self._last[1]:
            rate = f", {(self._step - self._last[0]) / (now - self._last[1]):.3g} steps/s"
        say(f"step {self._step}/{self._total}, loss {loss:.4g}{rate}")
        self._last = (self._step, now)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


def say(message: str) -> None:
    """A line for the user on stdout (rank 0 only calls this), flushed at once."""
    try:
        print(f"shardsafe: {message}", file=sys.stdout, flush=True)
    except BrokenPipeError:  # `shardsafe fit | head -1`: the run goes on, unheard (it
        silence_stdout()  # stopped there, and a launched rank 0 failed with a traceback)
