"""Plain-text helpers shared by the commands: byte sizes, natural order, aligned tables.

No dependencies beyond the standard library, so every command can import it at the top.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")
_DIGITS = re.compile(r"(\d+)")


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``: binary units, because file sizes are powers of two."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in _UNITS:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            break
    text = f"{value:.1f}"
    return f"{text.removesuffix('.0')} {unit}"


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders ``layers.2`` before ``layers.10``, as a reader expects."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in _DIGITS.split(text) if part
    )


def printable(text: str) -> str:
    """``text`` with control characters escaped, so a hostile key cannot drive the terminal."""
    return text if text.isprintable() else repr(text)[1:-1]


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def table(rows: Sequence[Sequence[str]], right: Sequence[int] = (), indent: str = "") -> list[str]:
    """Rows of cells as aligned lines; columns listed in ``right`` are right-aligned.

    An empty row becomes an empty line (a visual group separator). Trailing spaces are
    stripped so the output diffs cleanly.
    """
    widths: list[int] = []
    for row in rows:
        for i, cell in enumerate(row):
            if i == len(widths):
                widths.append(0)
            widths[i] = max(widths[i], len(cell))
    lines = []
    for row in rows:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append((indent + "  ".join(cells)).rstrip() if row else "")
    return lines
