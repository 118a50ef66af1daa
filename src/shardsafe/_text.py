"""Plain text about checkpoints, for people: byte sizes, natural order, terminal safety.

The library's reports (``verify``, ``inspect``), the converters' summaries and the command
line all speak this way, so it lives below all of them (and so does silencing stdout
once its reader has left). Standard library only.
"""

from __future__ import annotations

import os
import re
import sys

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


def silence_stdout() -> None:
    """Point stdout at /dev/null once its reader has left (``shardsafe ... | head -1``),
    so that later lines, and the interpreter's final flush, do not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
