"""Plain-text helpers shared by the commands: byte sizes, natural order, aligned tables.

No dependencies beyond the standard library, so every command can import it at the top.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")
_DIGITS = re.compile(r"([0-9]+)")


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``: binary units, because file sizes are powers of two.

    Integer arithmetic throughout, so any int works (a hostile manifest may record sizes
    no float can hold).
    """
    if n < 1024:
        return f"{n} B"
    unit, scale = _UNITS[0], 1024
    for unit in _UNITS:
        if n < scale * 1024 or unit == _UNITS[-1]:
            break
        scale *= 1024
    tenths = (n * 10 + scale // 2) // scale
    whole, frac = divmod(tenths, 10)
    return f"{whole}.{frac} {unit}".replace(".0 ", " ")


def natural_key(text: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key that orders ``layers.2`` before ``layers.10``, as a reader expects.

    Only ASCII digits count as numbers, compared by length then text (never converted
    to int), so any key sorts: ``x1²``, or a run of 10,000 digits.
    """
    key = []
    for part in _DIGITS.split(text):
        if not part:
            continue
        if part.isascii() and part.isdigit():
            digits = part.lstrip("0") or "0"
            key.append((0, len(digits), digits))
        else:
            key.append((1, 0, part))
    return tuple(key)


def printable(text: str) -> str:
    """``text`` with control characters escaped, so a hostile key cannot drive the terminal."""
    return terminal_safe(text)


def terminal_safe(text: str) -> str:
    """``text`` with every character a terminal could act on escaped (``\\x1b``,
    ``\\u202e``): controls, formats (bidi overrides), separators but the space, and
    unassigned code points. What a checkpoint holds is printed through this."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


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
