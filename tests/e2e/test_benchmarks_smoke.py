"""A smoke run of the benchmarks: ``run_all.py --quick`` at a tiny size, end to end.

Benchmarks are not tests; this only checks that the one command still runs and prints
its tables and verdicts, and that it writes its report between the markers of the page it
is given, keeping the rest (the repository's ``docs/performance.md`` is never touched).
It needs pytorch-lightning and matplotlib, which the test extra installs (CI runs it);
it is skipped without them.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning", reason="needs the bench extra (pytorch-lightning)")
pytest.importorskip("matplotlib", reason="needs the bench extra (matplotlib)")

ROOT = Path(__file__).resolve().parents[2]
RUN_ALL = ROOT / "benchmarks" / "run_all.py"
PAGE = (
    "# Performance\n\nhand-written, kept\n\n"
    "<!-- run_all: begin -->\nstale report\n<!-- run_all: end -->\n\nafter, kept\n"
)
SECTIONS = (
    "## ZeRO (user-wrapped",
    "## Peak memory of a consolidated ZeRO save",
    "## Lightning: Trainer.save_checkpoint and resume",
    "## Plain DDP + Adam",
    "## FSDP2 + AdamW",
    "## PP x DP (2 x 2) on 4 ranks: shardsafe against torch.distributed.checkpoint",
    "## EP on 4 ranks: shardsafe against torch.distributed.checkpoint",
    "## Asynchronous save",
    "## Tiered checkpoints",
    "## ZeRO save time against state size",
    "## Coordination against ranks",
    "## Parsing and validating a large manifest",
    "## Summary",
    "## Targets",
    "## What is timed",
)
HEADERS = (
    "| op ",
    "| tool ",
    "| median s ",
    "| x write floor ",
    "rank 0 peak extra RSS",
    "| state ",
    "| store requests / save ",
    "| shardsafe bytes written ",
)
ROWS = (
    "torch: consolidate_state_dict + torch.save",
    "Lightning: Trainer.save_checkpoint",
    "ShardsafeDDPStrategy sharded: Trainer.save_checkpoint",
    "ShardsafeDDPStrategy consolidated: fit(ckpt_path=...) to the first step",
    "shardsafe sharded",
    "shardsafe consolidated",
    "torch.distributed.checkpoint",
    "floor: one write + fsync",
    "floor: cross-rank bytes, one raw send",
    "floor: each rank writes 1/N of the bytes + fsync",
    "shardsafe sharded, verify=inline",
    "shardsafe async_save",
    "DCP async_save, default stager",
)
VERDICT = re.compile(r"^- (.+): [\d.]+ \(target [<>]= [\d.]+\) (MET|MISSED)$", re.MULTILINE)


@pytest.mark.timeout(540)
def test_run_all_quick_prints_tables_and_verdicts(tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    page.write_text(PAGE)
    docs_page = (ROOT / "docs" / "performance.md").read_bytes()
    proc = subprocess.run(
        [sys.executable, str(RUN_ALL), "--quick", "--dir", str(tmp_path), "--results", str(page)],
        capture_output=True,
        text=True,
        timeout=530,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    for text in SECTIONS + HEADERS + ROWS:
        assert text in out, f"{text!r} missing from the output:\n{out}"
    summary = out.split("## Targets", 1)[1]
    found = {name for name, _ in VERDICT.findall(summary)}
    # 3 ZeRO speed, 1 ZeRO memory, 6 Lightning strategy (speed, memory, resume x 2); DDP
    # and FSDP2: load in each verify mode against DCP, 4 load RSS (layout x mode); FSDP2 save;
    # 10 async (stall/copy, training, durable for DDP, FSDP2 and ZeRO; stall/DCP for DDP:
    # --quick runs DCP for the first setup only),
    # 2 store requests per save (2 and 4 ranks; the time targets start at 32 ranks);
    # PP x DP and EP: save, load in each verify mode against DCP, busiest writer's bytes;
    # 7 tiered (recovery from local and from a peer against S3 and against DCP, the stall,
    # training speed while replicating, a local save every step); 6 hostile-input
    # validation times (benchmarks/validation_scale.py); 1 Lightning async stall; with
    # Accelerate installed, its save and async stall under FSDP2 and under DDP
    accelerate = importlib.util.find_spec("accelerate") is not None
    assert len(found) == 57 + (4 if accelerate else 0), summary
    assert any("lightning async" in name for name in found)
    assert accelerate == any("accelerate fsdp2" in name for name in found)
    assert any("busiest writer" in name for name in found)
    assert any("store requests per save" in name for name in found)
    assert any("FSDP2" in name for name in found) and any("RSS" in name for name in found)
    results = page.read_text()
    before, report = results.split("<!-- run_all: begin -->\n")
    report, after = report.split("\n<!-- run_all: end -->\n")
    assert before == "# Performance\n\nhand-written, kept\n\n"
    assert after == "\nafter, kept\n"
    assert "stale report" not in report and "machine:" in report
    # Its headings sit under the page's own: "## Targets" printed is "#### Targets" there.
    assert "\n#### Targets\n" in report and report.startswith("### shardsafe benchmarks")
    assert (ROOT / "docs" / "performance.md").read_bytes() == docs_page
    assert (tmp_path / "save_time_vs_size.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_the_gpu_benchmark_runs_its_every_row_on_the_cpu(tmp_path: Path) -> None:
    """``gpu_checkpoint.py`` is run on GPU machines only (CI has none): ``--device cpu``
    goes through the same code, so it cannot rot unseen."""
    script = ROOT / "benchmarks" / "gpu_checkpoint.py"
    args = ["--device", "cpu", "--width", "32", "--layers", "2", "--repeat", "1"]
    proc = subprocess.run(
        [sys.executable, str(script), *args, "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for row in (
        "| floor: one copy into preallocated pinned host buffers",
        "| shardsafe async_save ",
        "| TieredCheckpointManager async_save (local tier)",
        "| DCP async_save, default stager",
        "| shardsafe load, verify=first",
        "| TieredCheckpointManager load_latest (local tier)",
        "| DCP load (get_state_dict, dcp.load, set_state_dict)",
    ):
        assert row in proc.stdout, proc.stdout
    assert len(VERDICT.findall(proc.stdout)) == 3, proc.stdout  # the fourth has no target
    assert "gpu: shardsafe load (verify=first) / DCP load" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # its scratch directory is removed
