"""docs/performance.md is the one home of the figures: ``run_all.py`` writes its report
between the page's two marker lines and keeps the hand-written rest (``_results_page``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def results_page() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "_results_page", ROOT / "benchmarks" / "_results_page.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_results_page", module)
    spec.loader.exec_module(module)
    return module


page = results_page()
REPORT = "# shardsafe benchmarks\n\n- machine: x\n\n## Targets\n\n- a: 1 (target <= 2) MET\n"


def test_the_report_replaces_only_what_lies_between_the_markers(tmp_path: Path) -> None:
    path = tmp_path / "performance.md"
    path.write_text(f"# Hand\n\nkept\n\n{page.BEGIN}\nold\n{page.END}\n\nkept too\n")
    page.write(str(path), REPORT)
    assert path.read_text() == (
        f"# Hand\n\nkept\n\n{page.BEGIN}\n### shardsafe benchmarks\n\n- machine: x\n\n"
        f"#### Targets\n\n- a: 1 (target <= 2) MET\n{page.END}\n\nkept too\n"
    )
    page.write(str(path), REPORT)  # again: the same page, not a second report
    assert path.read_text().count("#### Targets") == 1


def test_a_new_page_holds_the_markers_and_the_report(tmp_path: Path) -> None:
    path = tmp_path / "performance.md"
    page.write(str(path), REPORT)
    text = path.read_text()
    assert text.startswith(f"{page.BEGIN}\n### shardsafe benchmarks\n")
    assert text.endswith(f"MET\n{page.END}\n")


@pytest.mark.parametrize(
    "text", ["# Hand-written only\n", "<!-- run_all: end -->\n<!-- run_all: begin -->\n"]
)
def test_a_page_without_its_markers_is_refused_before_anything_runs(
    tmp_path: Path, text: str
) -> None:
    path = tmp_path / "performance.md"
    path.write_text(text)
    with pytest.raises(SystemExit, match="run_all: begin"):
        page.check(str(path))
    with pytest.raises(SystemExit):
        page.write(str(path), REPORT)
    assert path.read_text() == text


def test_headings_move_down_but_not_inside_code() -> None:
    assert page.demote("# A\n```text\n# not a heading\n```\n## B") == (
        "### A\n```text\n# not a heading\n```\n#### B"
    )


def test_the_repository_page_holds_one_generated_report() -> None:
    text = (ROOT / "docs" / "performance.md").read_text()
    assert text.count(page.BEGIN) == 1 and text.count(page.END) == 1
    report = text.split(page.BEGIN + "\n", 1)[1].split(page.END, 1)[0]
    assert report.startswith("### shardsafe benchmarks") and "#### Targets" in report
    assert not (ROOT / "benchmarks" / "results.md").exists()  # one home, not two
