"""A sharded shardsafe FSDP2 checkpoint from 4 ranks -> Hugging Face sharded safetensors.

The index names every tensor once with the right total, every shard opens with
``safetensors.safe_open``, and a plain ``nn.Module`` loads the merged weights bitwise
equal to the trained model's; ``dtype="bfloat16"`` casts them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import shardsafe
from tests.distributed.test_fsdp import net, save_run
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)


def merged(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(directory / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - not a dict
                assert key not in out
                out[key] = f.get_tensor(key)
    return out


def test_sharded_fsdp_checkpoint_from_4_ranks_to_hf_shards(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    msd: dict[str, Any] = run_ranks(save_run, 4, str(src), "sharded", timeout=200)[0][0]
    assert len(shardsafe.read_manifest(src).tensors["model/0.weight"].chunks) == 4

    dst = tmp_path / "hf"
    result = shardsafe.convert(src, dst, to="hf", max_shard_size="250B", progress=False)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert sorted(weight_map) == sorted(msd)  # every tensor, once (keys of a dict)
    sizes = {k: v.numel() * v.element_size() for k, v in msd.items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    files = sorted(set(weight_map.values()))
    assert len(files) > 1 and files == sorted(p.name for p in dst.glob("model-*.safetensors"))
    assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    for name in files:  # each shard within the limit, unless it holds one larger tensor
        held = [k for k, f in weight_map.items() if f == name]
        assert sum(sizes[k] for k in held) <= 250 or len(held) == 1
    assert {n for n, _ in result.files} == {*files, "model.safetensors.index.json"}

    weights = merged(dst)
    model = net(7)
    model.load_state_dict(weights)
    for key, value in msd.items():
        assert torch.equal(model.state_dict()[key], value), key

    cast = tmp_path / "hf-bf16"
    shardsafe.convert(src, cast, to="hf", dtype="bfloat16", max_shard_size="5GB", progress=False)
    single = load_file(cast / "model.safetensors")  # small enough for one file, no index
    assert not (cast / "model.safetensors.index.json").exists()
    assert sorted(single) == sorted(msd)
    for key, value in msd.items():
        assert single[key].dtype == torch.bfloat16
        assert torch.equal(single[key], value.to(torch.bfloat16)), key
    assert math.isclose(sum(t.numel() * 2 for t in single.values()), sum(sizes.values()) / 2)
