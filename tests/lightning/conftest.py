"""Uninterrupted reference runs, one per optimizer, shared by the tests that compare to them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.lightning.helpers import run

OPTIMIZERS = ("zero", "oss", "plain")


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``uninterrupted(optimizer)``: the root of a 15-step, 2-rank run that was never stopped
    (``"fsdp"``: a plain Adam over FSDP2 under ShardsafeModelParallelStrategy)
    (checkpoints at steps 5, 10 and 15, the newest two kept, plus ``last.ckpt``; after fit,
    ``trainer.save_checkpoint("final.ckpt")`` twice). Each runs once per session."""
    done: dict[str, Path] = {}

    def get(optimizer: str) -> Path:
        if optimizer not in done:
            root = tmp_path_factory.mktemp(f"whole-{optimizer}")
            which = (
                ("--optimizer", "plain", "--fsdp")
                if optimizer == "fsdp"
                else ("--optimizer", optimizer)
            )
            run(root, *which, "--save-last", "--save-at-end", "final.ckpt")
            done[optimizer] = root
        return done[optimizer]

    return get
