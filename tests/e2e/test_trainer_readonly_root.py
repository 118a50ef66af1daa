"""``shardsafe fit --resume latest`` into a read-only ``run_dir/checkpoints`` is refused
before the first step, naming the directory: it trained to the end, then died at the
first save with a bare 'Permission denied' naming the lock's temporary file. A run that
never saves there resumes from it as before.

The test runs as root, which ignores file permissions: the refused run drops the DAC
capabilities with ``setpriv`` first (skipped where it is missing).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.trainer_helpers import run

SHARDSAFE = Path(sys.executable).parent / "shardsafe"
NO_DAC = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--ambient-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
]


def read_only(tree: Path, writable: bool = False) -> None:
    """Make every directory and file under ``tree`` (and itself) read-only, or writable."""
    for directory, _, files in os.walk(tree):
        for name in files:
            (Path(directory) / name).chmod(0o644 if writable else 0o444)
        Path(directory).chmod(0o755 if writable else 0o555)


@pytest.mark.timeout(60)
def test_resume_into_a_read_only_checkpoint_directory_is_refused_before_training(
    tmp_path: Path,
) -> None:
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: file permissions would not apply")
    command = [str(SHARDSAFE)] if SHARDSAFE.exists() else [sys.executable, "-m", "shardsafe"]
    fit = [*command, "fit", "--run-dir", "run", "--checkpoint-every", "2"]
    run(*fit, "--max-steps", "2", cwd=tmp_path)
    checkpoints = tmp_path / "run" / "checkpoints"
    metrics = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    read_only(checkpoints)
    try:
        prefix = NO_DAC if os.geteuid() == 0 else []
        proc = subprocess.run(
            [*prefix, *fit, "--max-steps", "4", "--resume", "latest"],
            capture_output=True,
            text=True,
            timeout=45,
            cwd=tmp_path,
        )
        # A run that never saves (no --checkpoint-every) may resume from it: a read-only
        # directory of checkpoints to fine-tune from (refused by the first fix: review).
        tuned = [*command, "fit", "--run-dir", "run", "--max-steps", "3", "--resume", "latest"]
        resumed = subprocess.run(
            [*prefix, *tuned], capture_output=True, text=True, timeout=45, cwd=tmp_path
        )
    finally:
        read_only(checkpoints, writable=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "no checkpoint saved (checkpoint_every is not set)" in resumed.stdout
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        "shardsafe: error: cannot create files in run/checkpoints (Permission denied), "
        "where the checkpoints belong: make run/checkpoints writable (chmod u+w "
        "run/checkpoints, or run as its owner), or save into another root (run_dir); "
        "nothing was written\n"
    ) in proc.stderr, proc.stderr
    assert "step 3/4" not in proc.stdout + proc.stderr
    lines = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    assert lines.startswith(metrics) and lines.count(b"\n") == metrics.count(b"\n") + 1
    assert sorted(os.listdir(checkpoints)) == ["latest", "step-000000002"]
