"""Every ```python block of README.md and docs/*.md runs as shown, and every link resolves.

Each block is written to a file and run as a script in a process of its own (forked from a
server that has imported torch and Lightning already, ``tests/forked_scripts.py``: as
``python script.py`` but for the imports' seconds), with a temporary directory as its
working directory, and must exit 0; on failure the test shows the block's page and line,
and its stderr. A block preceded by an HTML comment
``<!-- run: torchrun --nproc-per-node N -->`` runs under
``python -m torch.distributed.run --nproc-per-node N --master-port <free port>`` (gloo, on
CPU), as a reader would start it. ``bash``, ``text`` and ``jsonc`` blocks are not run.

Two things differ from a reader's copy and paste, both so that runs never share state:

* a block that names ``s3://`` gets a real S3 API server on loopback (moto, the tests'
  ``s3_server``), emptied before the block, holding one empty bucket named ``bucket``,
  with its endpoint and credentials in the environment (``AWS_ENDPOINT_URL``, ...), where
  botocore finds them as it would a real store's;
* paths under ``/dev/shm/`` are redirected into the block's temporary directory.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.forked_scripts import run_script

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
RUN = re.compile(r"^<!--\s*run:\s*(.*?)\s*-->$")
TORCHRUN = re.compile(r"^torchrun --nproc-per-node (\d+)$")
SECONDS = 100  # per block; the slowest (Lightning on 2 processes) takes about 12 s


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    lang: str
    code: str
    run: str | None  # the <!-- run: ... --> directive before it, if any

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, with the ``<!-- run: ... -->`` line before each."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        directive = RUN.match(before.strip())
        found.append(
            Block(
                str(page.relative_to(ROOT)),
                i + 1,
                opening.group(1),
                "\n".join(lines[i + 1 : end]) + "\n",
                directive.group(1) if directive else None,
            )
        )
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL if b.lang == "python"]


def test_every_block_says_what_it_is() -> None:
    """No bare fences: code is python or bash, everything else text or jsonc; a run
    directive is only ever given to a python block, and only in a known form."""
    for b in ALL:
        assert b.lang in {"python", "bash", "text", "jsonc"}, f"{b.name}: ```{b.lang}"
        if b.run is not None:
            assert b.lang == "python" and TORCHRUN.match(b.run), f"{b.name}: {b.run}"


def test_there_are_examples_to_run() -> None:
    pages = {b.page for b in PYTHON}
    assert "README.md" in pages and len(pages) >= 6, pages


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def s3_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """A moto server emptied of everything but one empty bucket named ``bucket``."""
    server = request.getfixturevalue("s3_server")
    reset = urllib.request.Request(f"{server.endpoint}/moto-api/reset", method="POST")
    urllib.request.urlopen(reset, timeout=30).close()
    server.client().create_bucket(Bucket="bucket")
    return dict(server.env)


@pytest.mark.timeout(SECONDS + 20)
@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_example_runs(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    code = block.code.replace("/dev/shm/", f"{tmp_path}/shm/")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if "s3://" in code:
        env.update(s3_env(request))
    command = [sys.executable, str(script)]
    if block.run is not None:
        launch = TORCHRUN.match(block.run)
        assert launch, block.run
        command[1:1] = [
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            launch.group(1),
            "--master-port",
            str(free_port()),
        ]
    if block.run is None:  # forked with torch imported already: otherwise the same
        proc = run_script(command[1:], env, SECONDS, cwd=str(tmp_path))
    else:
        proc = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SECONDS
        )
    assert proc.returncode == 0, (
        f"{block.name} exited {proc.returncode}\n--- code\n{code}\n"
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )


LINK = re.compile(r"\]\(([^)\s]+)\)")
ANCHOR = re.compile(r'<a (?:id|name)="([^"]+)"')


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text()
    found = set(ANCHOR.findall(text))
    fenced = False
    seen: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_resolve(page: Path) -> None:
    """Every relative link names a file that exists, and an anchor that one of its
    headings (or an ``<a id>``) makes."""
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_in_the_index_and_the_readme() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "README.md":
            assert f"]({page.name}" in index, f"docs/README.md does not link {page.name}"
            assert f"](docs/{page.name}" in readme, f"README.md does not link {page.name}"
