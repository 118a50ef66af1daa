"""Writing ``run_all.py``'s report into a page that also holds hand-written text.

The report's home is ``docs/performance.md``: the figures explained by hand first, then
the generated report between two marker lines, which each full run replaces (and nothing
else). Its headings are moved down two levels, under the page's own "Generated report".
"""

from __future__ import annotations

import os
import re

BEGIN = "<!-- run_all: begin -->"
END = "<!-- run_all: end -->"


def demote(text: str, levels: int = 2) -> str:
    """``# A`` -> ``### A`` (outside code fences), so the report nests under the page."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            line = "#" * levels + line
        out.append(line)
    return "\n".join(out)


def splice(page: str, report: str) -> str:
    """``page`` with what lies between its markers replaced by ``report``."""
    lines = page.split("\n")
    begins = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        raise ValueError(
            f"expected one {BEGIN!r} line and, after it, one {END!r} line; found "
            f"{len(begins)} and {len(ends)}"
        )
    return "\n".join([*lines[: begins[0] + 1], report.strip("\n"), *lines[ends[0] :]])


def check(path: str) -> None:
    """Refuse, before any benchmark runs, a page that could not receive the report."""
    if os.path.exists(path):
        with open(path) as f:
            page = f.read()
        try:
            splice(page, "")
        except ValueError as e:
            raise SystemExit(f"{path}: {e}; add them where the report goes") from None


def write(path: str, report: str) -> None:
    """Put ``report`` between the markers of ``path``; a new file holds only the markers
    and the report. A page without the markers is refused, never overwritten."""
    report = demote(report)
    if os.path.exists(path):
        with open(path) as f:
            page = f.read()
        try:
            text = splice(page, report)
        except ValueError as e:
            raise SystemExit(f"{path}: {e}; add them where the report goes") from None
    else:
        text = f"{BEGIN}\n{report.strip()}\n{END}\n"
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
