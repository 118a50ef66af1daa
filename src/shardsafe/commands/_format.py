"""Aligned plain-text tables, the commands' only layout device.

Byte sizes, natural order and terminal escaping are the library's (``shardsafe._text``),
since its reports and converters use them too. Standard library only, so every command
can import this at the top.
"""

from __future__ import annotations

from collections.abc import Sequence


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
