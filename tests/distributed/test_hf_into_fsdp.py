"""A Hugging Face checkpoint (``save_pretrained``, tied weights) converted to shardsafe
loads strictly into the same model under FSDP2 on 2 ranks: the tie is understood, each
rank reads its shards, and the logits equal the original's bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from tests.harness import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(180)


def gpt2(seed: int) -> Any:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


def logits(model: Any) -> torch.Tensor:
    ids = torch.arange(12).reshape(2, 6) % 64
    with torch.no_grad():
        return model(ids).logits


def load_sharded(rank: int, world: int, path: str) -> Any:
    from torch.distributed.fsdp import fully_shard

    model = gpt2(seed=1)  # other weights: everything must come from the checkpoint
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    shardsafe.load(path, {"model": model})  # strict
    tied = model.lm_head.weight is model.transformer.wte.weight
    return tied, logits(model)


def test_a_tied_hf_model_loads_strictly_into_fsdp2_on_2_ranks(tmp_path: Path) -> None:
    original = gpt2(seed=0)
    original.save_pretrained(tmp_path / "hf")  # without lm_head.weight: tied
    shardsafe.convert(tmp_path / "hf", tmp_path / "ckpt")
    results = run_ranks(load_sharded, 2, str(tmp_path / "ckpt"))
    expected = logits(original)
    for tied, got in results:
        assert tied
        assert torch.equal(got, expected)
