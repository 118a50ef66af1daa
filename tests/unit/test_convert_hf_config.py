"""``convert(to="hf", config=...)``: the configuration travels with the weights, so that
``AutoModelForCausalLM.from_pretrained(folder)`` loads the folder, logits bitwise equal.
Tiny models built from configs: nothing is downloaded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(120)


def llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def gpt2() -> Any:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def logits(model: Any) -> torch.Tensor:
    ids = torch.arange(12).reshape(2, 6) % 64
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2-tied"])
@pytest.mark.parametrize("shard_size", ["5GB", "20KB"], ids=["one-file", "sharded-index"])
def test_a_converted_model_loads_with_from_pretrained_bitwise(
    tmp_path: Path, make: Any, shard_size: str
) -> None:
    model = make()
    shardsafe.save(tmp_path / "ckpt", {"model": model})
    result = shardsafe.convert(
        tmp_path / "ckpt",
        tmp_path / "hf",
        to="hf",
        config=model.config,
        generation_config=model.generation_config,
        max_shard_size=shard_size,
    )
    names = [name for name, _ in result.files]
    assert "config.json" in names and "generation_config.json" in names
    if shard_size == "20KB":
        assert names[-1] == "model.safetensors.index.json"  # the index is still last
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded) is type(model)
    assert torch.equal(logits(loaded), logits(model))


def test_a_folder_save_pretrained_wrote_gives_both_files(tmp_path: Path) -> None:
    model = llama()
    model.config.save_pretrained(tmp_path / "original")
    model.generation_config.save_pretrained(tmp_path / "original")
    shardsafe.save(tmp_path / "ckpt", {"model": model})
    shardsafe.convert(tmp_path / "ckpt", tmp_path / "hf", to="hf", config=tmp_path / "original")
    assert sorted(os.listdir(tmp_path / "hf")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert (tmp_path / "hf" / "config.json").read_bytes() == (
        tmp_path / "original" / "config.json"
    ).read_bytes()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(logits(loaded), logits(model))


def test_the_command_line_takes_the_config_file(tmp_path: Path) -> None:
    from shardsafe.cli import main

    model = gpt2()
    model.config.save_pretrained(tmp_path / "original")
    shardsafe.save(tmp_path / "ckpt", {"model": model})
    code = main(
        [
            "convert",
            str(tmp_path / "ckpt"),
            str(tmp_path / "hf"),
            "--to",
            "hf",
            "--config",
            str(tmp_path / "original" / "config.json"),
        ]
    )
    assert code == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(logits(loaded), logits(model))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"to": "torch", "config": {"model_type": "llama"}}, "they apply to to='hf'"),
        ({"to": "hf", "config": {"hidden_size": 32}}, "config has no 'model_type'"),
        ({"to": "hf", "config": 42}, "is not a configuration"),
        ({"to": "hf", "config": "/nonexistent/config.json"}, "cannot read the config.json"),
    ],
    ids=["not-hf", "no-model-type", "not-a-config", "missing-file"],
)
def test_a_wrong_config_is_refused_before_anything_is_read(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        shardsafe.convert(tmp_path / "absent", tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_config_that_is_not_a_json_object_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(["a", "list"]))
    with pytest.raises(ValueError, match="does not hold a JSON object"):
        shardsafe.convert(
            tmp_path / "absent", tmp_path / "out", to="hf", config=tmp_path / "config.json"
        )


@pytest.mark.timeout(60)
def test_a_config_that_is_a_fifo_or_no_json_is_a_usage_error_never_a_hang(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--config`` naming a named pipe (or a folder whose config.json is one) blocked the
    conversion for ever; one that is not JSON was exit status 1, not a usage error."""
    from shardsafe.cli import main

    shardsafe.save(tmp_path / "ckpt", {"model": torch.nn.Linear(2, 2)})
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "folder" / "config.json")
    (tmp_path / "bad.json").write_text("{not json")
    base = ["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf", "--config"]
    assert main([*base, str(tmp_path / "folder")]) == 2
    assert capsys.readouterr().err == (
        "shardsafe convert: error: cannot read the config.json to write beside the weights: "
        f"{tmp_path / 'folder' / 'config.json'} is not a regular file (a named pipe (FIFO))\n"
    )
    assert main([*base, str(tmp_path / "bad.json")]) == 2
    assert capsys.readouterr().err.startswith(
        f"shardsafe convert: error: {tmp_path / 'bad.json'} is not valid JSON: "
    )
    assert not (tmp_path / "hf").exists()


class ListConfig:
    """A config object whose ``to_dict`` does not give a dict."""

    def to_dict(self) -> list[str]:
        return ["a", "list"]


def test_a_config_object_that_gives_no_json_object_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"the config\.json to write is not a JSON object but list"
    ):
        shardsafe.convert(tmp_path / "absent", tmp_path / "out", to="hf", config=ListConfig())
    assert not (tmp_path / "out").exists()


def test_a_tied_model_from_save_pretrained_loads_strictly(tmp_path: Path) -> None:
    """GPT-2's save_pretrained leaves out lm_head.weight (tied to the embedding): the tie
    fills it, so a strict load does not call it missing."""
    model = gpt2()
    model.save_pretrained(tmp_path / "hf")
    shardsafe.convert(tmp_path / "hf", tmp_path / "ckpt")
    assert "model/lm_head.weight" not in shardsafe.read_manifest(tmp_path / "ckpt").tensors
    fresh = transformers.GPT2LMHeadModel(model.config).eval()
    shardsafe.load(tmp_path / "ckpt", {"model": fresh})
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(logits(fresh), logits(model))


def test_weights_of_another_dtype_are_refused_with_the_cast_that_loads_them(
    tmp_path: Path,
) -> None:
    model = llama()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    shardsafe.convert(tmp_path / "hf", tmp_path / "ckpt")
    live = transformers.LlamaForCausalLM(model.config).eval()  # float32
    with pytest.raises(shardsafe.CheckpointMismatchError) as refused:
        shardsafe.load(tmp_path / "ckpt", {"model": live})
    assert str(refused.value).endswith(
        "shardsafe never casts as it loads; to load weights saved in another dtype, cast them "
        'once as you convert: shardsafe.convert(path, new_path, dtype="float32")'
    )
    shardsafe.convert(tmp_path / "hf", tmp_path / "cast", dtype="float32")
    shardsafe.load(tmp_path / "cast", {"model": live})
    cast = model.to(torch.float32)  # the bfloat16 weights, widened
    for (name, got), (_, want) in zip(live.named_parameters(), cast.named_parameters()):
        assert got.dtype == torch.float32 and torch.equal(got, want), name
