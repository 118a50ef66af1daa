"""Pipeline-parallel checkpoints through the tools: ``shardsafe inspect`` names the rank
that wrote each key, and the converters (to DCP, Hugging Face, ``torch.save``) turn a
checkpoint saved by two pipeline stages into the whole model, bitwise.

The PP=2 checkpoint is saved as ``test_pipeline_parallel.py`` saves it (stages split as
torchtitan splits them, trained with ``torch.distributed.pipelining``); what every
converted checkpoint must hold is the union of the two stages' state before the save.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from tests.distributed import layouts as L
from tests.distributed.test_pipeline_parallel import _save_pp
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)
SRC = str(Path(__file__).resolve().parents[2] / "src")
STAGE_0 = ("tok.", "layers.0.", "layers.1.")  # of 4 layers: stage 1 holds the rest


def stage_of_key(key: str) -> int:
    name = key.split("/")[1]
    return 0 if name.startswith(STAGE_0) else 1


@pytest.fixture(scope="module")
def pp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A PP=2 checkpoint (two steps trained) and the union of its stages' state."""
    path = tmp_path_factory.mktemp("pp2") / "ckpt"
    expected = L.merged(*run_ranks(_save_pp, 2, str(path), 2))
    return path, expected


def fresh_whole() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The whole model, other weights, one step taken: optimizer state exists and differs."""
    model = L.Net(seed=1)
    opt = L.adamw(model)
    sched = L.scheduler(opt)
    L.train_whole(model, opt, sched, 1)
    return model, opt, sched


def inspect(path: Path, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "shardsafe", "inspect", *args, str(path)],
        capture_output=True,
        text=True,
        timeout=50,
        env=env,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout


# ---------------------------------------------------------------------------- converters


def test_pp2_checkpoint_converts_to_dcp_that_dcp_load_restores_bitwise(
    pp2: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path, expected = pp2
    dst = tmp_path / "dcp"
    shardsafe.convert(path, dst, to="dcp", progress=False)
    model, opt, _ = fresh_whole()
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=str(dst))  # one process, no process group
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    want = dict(expected)
    want.pop("scheduler")
    L.assert_same(want, L.snapshot(model, opt))


def test_pp2_checkpoint_converts_to_hf_weights_of_the_whole_model(
    pp2: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    path, expected = pp2
    dst = tmp_path / "hf"
    shardsafe.convert(path, dst, to="hf", progress=False)
    weights = load_file(dst / "model.safetensors")
    model_keys = {k.split("/", 1)[1]: v for k, v in expected.items() if k.startswith("model/")}
    assert set(weights) == set(model_keys)  # both stages' weights and buffers, nothing else
    for key, value in model_keys.items():
        assert weights[key].dtype == value.dtype and torch.equal(weights[key], value), key
    model = L.Net(seed=1)
    model.load_state_dict(weights)  # strict: the whole model, every key
    L.assert_same({k: v for k, v in expected.items() if k.startswith("model/")}, L.snapshot(model))


def test_pp2_checkpoint_converts_to_one_torch_file_of_the_whole_state(
    pp2: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path, expected = pp2
    dst = tmp_path / "whole.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the pickle warning, asserted elsewhere
        shardsafe.convert(path, dst, to="torch", progress=False)
    raw = torch.load(dst, weights_only=True)
    want = dict(expected)
    assert raw["scheduler"] == want.pop("scheduler")  # equal on both stages: one value
    optimizer_state = raw["optimizer"]["state"]
    for key, value in want.items():
        kind, name = key.split("/", 1)
        if kind == "model":
            got = raw["model"][name]
        elif kind == "optimizer":
            fqn, state_name = name.rsplit("/", 1)
            got = optimizer_state[fqn][state_name]
        else:
            continue
        assert got.dtype == value.dtype and torch.equal(got, value), key
    model, opt, _ = fresh_whole()
    set_state_dict(model, opt, model_state_dict=raw["model"], optim_state_dict=raw["optimizer"])
    L.assert_same(want, L.snapshot(model, opt))


# ---------------------------------------------------------------------------- inspect


def test_inspect_shows_which_stage_wrote_each_key(pp2: tuple[Path, dict[str, Any]]) -> None:
    path, _ = pp2
    doc = json.loads(inspect(path, "--json"))
    files = [f"shard-0000{r}-of-00002.safetensors" for r in (0, 1)]
    assert [(w["rank"], w["files"]) for w in doc["writers"]] == [(0, files[:1]), (1, files[1:])]
    assert [f["writer"] for f in doc["files"]] == [0, 1]
    for t in doc["tensors"]:
        assert t["writers"] == [stage_of_key(t["key"])], t["key"]
    for w in doc["writers"]:
        mine = [t for t in doc["tensors"] if t["writers"] == [w["rank"]]]
        assert w["tensors"] == len(mine) > 0
        assert w["bytes"] == next(f["bytes"] for f in doc["files"] if f["name"] == w["files"][0])

    text = inspect(path)
    assert re.search(r"^TENSOR\s.*\sWRITTEN BY RANK$", text, re.M)
    assert re.search(r"^model/layers\.0\.lin\.weight\s.*\s0$", text, re.M)
    assert re.search(r"^optimizer/out\.weight/exp_avg\s.*\s1$", text, re.M)
    for w in doc["writers"]:
        row = rf"^\s*{w['rank']}\s+{re.escape(w['files'][0])}\s+{w['tensors']}\s+.*\s1\.00$"
        assert re.search(row, text, re.M), text


def _save_pp_dp(rank: int, world: int, path: str) -> list[str]:
    """PP x DP 2 x 2: stage ``rank // 2``, its two replicas alike; one zero-gradient
    step, so AdamW state exists. Returns this rank's keys."""
    stage = L.stage_of(L.Net(layers=8), rank // 2, 2)
    opt = L.adamw(stage)
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    shardsafe.save(path, {"model": stage, "optimizer": opt})
    return sorted(L.snapshot(stage, opt))


def test_inspect_shows_a_replicated_stage_written_once_by_one_of_its_replicas(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ppdp"
    held = run_ranks(_save_pp_dp, 4, str(path))
    doc = json.loads(inspect(path, "--json"))
    assert [w["rank"] for w in doc["writers"]] == [0, 1, 2, 3]
    for t in doc["tensors"]:
        holders = {r for r in range(4) if t["key"] in held[r]}
        assert holders in ({0, 1}, {2, 3}), t["key"]
        (writer,) = t["writers"]  # once, by one of the stage's replicas
        assert writer in holders, t["key"]
    sizes = [w["bytes"] for w in doc["writers"]]
    assert max(sizes) <= 1.25 * sum(sizes) / len(sizes), sizes
    assert sum(w["tensors"] for w in doc["writers"]) == len(doc["tensors"])
