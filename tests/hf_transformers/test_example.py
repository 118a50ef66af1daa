"""``examples/transformers_trainer.py`` runs as its docstring says, under ``torchrun`` on 2
CPU processes: after a run stopped at step 10, the next resumes from ``checkpoint-10``
and logs the losses an uninterrupted run logs, bit for bit, ending with the same weights."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import RUN_EXAMPLE_THEN_EXIT, free_port, launched

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "transformers_trainer.py"


def run(tmp_path: Path, out: str, *args: str) -> str:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), RUN_EXAMPLE_THEN_EXIT, str(EXAMPLE), "--out", out, *args,
    ]  # fmt: skip
    return launched(argv, tmp_path)


def losses(log: str) -> dict[int, str]:
    return {int(s): loss for s, loss in re.findall(r"^step (\d+): loss (\S+)$", log, re.M)}


def test_a_stopped_run_resumes_with_the_uninterrupted_losses_and_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    first = run(tmp_path, "runs/a", "--stop-at", "10")
    assert "no checkpoint yet: starting at step 0" in first
    assert sorted(losses(first)) == list(range(1, 11))
    second = run(tmp_path, "runs/a")
    assert "resumed from runs/a/checkpoint-10" in second
    assert "saved runs/a/checkpoint-20: loads with from_pretrained" in second
    whole = run(tmp_path, "runs/b")
    assert losses(first) | losses(second) == losses(whole)
    assert sorted(losses(whole)) == list(range(1, 21))
    folder = tmp_path / "runs/a/checkpoint-20"
    assert (folder / "shardsafe" / "manifest.json").is_file()
    assert not [p.name for p in folder.iterdir() if p.name in {"optimizer.pt", "scheduler.pt"}]
    resumed = load_file(folder / "model.safetensors")
    uninterrupted = load_file(tmp_path / "runs/b/checkpoint-20/model.safetensors")
    assert sorted(resumed) == sorted(uninterrupted)
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name], tensor), name
