"""The attack modules' fixtures: one pristine checkpoint per layout (saved once per
module), fresh copies of it, and the global generators given back after each test."""

from __future__ import annotations

import linecache
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardsafe
from tests.unit.attacks.common import CFG, LAYOUTS, MASK, X, optimizer_tensors, trained, weights


def save_state() -> dict[str, Any]:
    model, opt = trained(0)
    return {
        "model": model,
        "optimizer": opt,
        "rng": shardsafe.RNGState(),
        "x": X,
        "mask": MASK,
        "cfg": dict(CFG),
    }


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    """Loads of RNGState restore the global generators; give them back after each test."""
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    numpy_state = np.random.get_state()
    yield
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    np.random.set_state(numpy_state)


@pytest.fixture(autouse=True)
def _test_source_in_linecache(request: pytest.FixtureRequest) -> None:
    """The test module's source is read before a test runs, not while it records opens.

    Without CUDA, ``torch.manual_seed`` (in ``make_model``) queues the CUDA seed with
    ``traceback.format_stack()``, which reads every frame's source file through
    ``linecache``. When fixtures and tests shared one file, ``pristine``'s own
    ``make_model`` had cached that file before any test ran; now the test module is
    cached here, so that a ``make_model`` inside ``recorded_opens()`` does not show up as
    the code under attack opening a file outside the checkpoint.
    """
    linecache.getlines(str(request.path))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One checkpoint per layout: model, Adam state, RNG, two plain tensors and a dict."""
    root = tmp_path_factory.mktemp("pristine")
    state = save_state()
    for layout in LAYOUTS:
        shardsafe.save(root / layout, state, layout=layout)
    return {
        "root": root,
        "model": weights(state["model"]),
        "optimizer": optimizer_tensors(state["optimizer"]),
    }


@pytest.fixture
def copy_of(pristine: dict[str, Any], tmp_path: Path) -> Callable[[str], Path]:
    def make(layout: str = "sharded") -> Path:
        dest = tmp_path / "downloads" / f"ckpt-{layout}"
        shutil.copytree(pristine["root"] / layout, dest)
        return dest

    return make
