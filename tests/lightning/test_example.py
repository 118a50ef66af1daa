"""``examples/lightning_zero.py`` runs as the README says, Lightning starting its own ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import shardsafe
from tests.lightning.helpers import ROOT, script_environment

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_zero.py"


@pytest.mark.timeout(120)
def test_the_example_trains_saves_and_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=110,
        env=script_environment(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    lines = proc.stdout.splitlines()
    assert "training from step 0 to step 20" in lines
    assert "training from step 20 to step 30" in lines  # resumed, not started afresh
    checkpoints = run_dir / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == [
        "epoch=2-step=25.ckpt",
        "epoch=2-step=30.ckpt",
        "last.ckpt",
    ]
    last = shardsafe.load(checkpoints / "last.ckpt", {})["lightning"]
    assert (last["global_step"], last["hyper_parameters"]) == (30, {"lr": 0.01})
    assert shardsafe.read_manifest(checkpoints / "last.ckpt").world_size == 2


@pytest.mark.timeout(60)
def test_the_scripts_import_this_checkouts_shardsafe() -> None:
    """Not an installed one (an editable install of another checkout of the same
    environment): the scripts must run the code under test."""
    imported = subprocess.run(
        [sys.executable, "-c", "import shardsafe; print(shardsafe.__file__)"],
        capture_output=True,
        text=True,
        timeout=50,
        env=script_environment(),
        check=True,
    ).stdout.strip()
    assert imported == str(ROOT / "src" / "shardsafe" / "__init__.py")
