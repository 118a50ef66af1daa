"""Rank 0's record of a run: ``metrics.jsonl`` and the progress bar."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from ..checkpoint.strict_json import int_parser, why_not_json
from ..errors import CheckpointCorruptError


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
    if not os.path.exists(path):
        return
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(temporary, path)


class ProgressBar:
    """tqdm's bar (step, loss, it/s) on rank 0; silent when stderr is not a terminal.

    tqdm is optional: without it the bar is simply absent.
    """

    def __init__(self, *, total: int, initial: int, enabled: bool) -> None:
        self._bar: Any = None
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover - tqdm is an optional dependency
            return
        # disable=None: tqdm turns itself off when stderr is not a TTY (logs, CI).
        self._bar = tqdm(total=total, initial=initial, unit="step", disable=None)

    def update(self, loss: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def say(message: str) -> None:
    """A line for the user on stdout (rank 0 only calls this), flushed at once."""
    print(f"shardsafe: {message}", file=sys.stdout, flush=True)
