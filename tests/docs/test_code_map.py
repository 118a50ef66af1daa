"""The map of the code in ``docs/design.md`` matches the code.

The drawing names every module of the engine in its layer (``checkpoint/format/``,
``storage/``, ``plan/``, ``io/`` and the phase modules on top), and the table beside it
describes each of them: a module added, moved or removed without the map changing fails
here. (Which layer may import which is pinned by ``tests/unit/test_layering.py``.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "src" / "shardsafe" / "checkpoint"
LAYERS = ("format", "storage", "plan", "io")


def _drawing() -> list[str]:
    page = (ROOT / "docs" / "design.md").read_text()
    section = page.split("## Map of the code", 1)[1]
    return section.split("```text\n", 1)[1].split("```", 1)[0].splitlines()


def _drawn(row_start: str) -> set[str]:
    """The module names drawn in the row that starts with ``row_start`` and the lines
    continuing it (indented, up to the next arrow)."""
    lines = _drawing()
    start = next(i for i, line in enumerate(lines) if line.startswith(row_start))
    row = [lines[start][len(row_start) :]]
    for line in lines[start + 1 :]:
        if not line.startswith(" " * 10) or line.strip() in {"|", "v"}:
            break
        row.append(line)
    words = re.findall(r"[a-z_]+", " ".join(row))
    return {w for w in words if (ENGINE.joinpath(*_folder(row_start), f"{w}.py")).exists()}


def _folder(row_start: str) -> tuple[str, ...]:
    for layer in LAYERS:
        if row_start.strip().startswith(f"checkpoint/{layer}/"):
            return (layer,)
    return ()


def _modules(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}


@pytest.mark.parametrize("layer", LAYERS)
def test_the_drawing_names_every_module_of_each_layer(layer: str) -> None:
    drawn = _drawn(f" checkpoint/{layer}/")
    assert drawn == _modules(ENGINE / layer), f"checkpoint/{layer}/ in docs/design.md"


def test_the_drawing_names_every_phase_module() -> None:
    assert _drawn(" checkpoint/  the phases:") == _modules(ENGINE)


def test_the_table_describes_every_engine_module() -> None:
    page = (ROOT / "docs" / "design.md").read_text().split("## Map of the code", 1)[1]
    described = set(re.findall(r"`([a-z_]+)\.py`", page))
    every = _modules(ENGINE).union(*(_modules(ENGINE / layer) for layer in LAYERS))
    assert every - described == set()
