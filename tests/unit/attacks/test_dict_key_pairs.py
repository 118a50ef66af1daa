"""A forged manifest's dict with non-string keys (the ``__dict__`` tag's pairs): a key
twice, or keys crafted to share one hash, are refused as damage, in linear time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.errors import CheckpointCorruptError
from tests import forge

pytestmark = pytest.mark.timeout(60)


def forged(tmp_path: Path, pairs: list[list[Any]]) -> Path:
    ckpt = tmp_path / "c"
    shardsafe.save(ckpt, {"cfg": {1: "a"}, "t": torch.ones(1)})  # forge wants a tensor
    doc = forge.read_manifest(ckpt)
    assert doc["values"]["cfg"]["meta"] == {"__dict__": [[1, "a"]]}
    doc["values"]["cfg"]["meta"] = {"__dict__": pairs}
    forge.write_manifest(ckpt, doc)
    return ckpt


@pytest.mark.parametrize("twin", [1, True, 1.0])
def test_a_key_given_twice_is_refused_not_overwritten(tmp_path: Path, twin: Any) -> None:
    """``[[1, "a"], [True, "b"]]`` loaded as ``{1: "b"}``: one pair silently dropped,
    where strict JSON refuses a duplicate key of a plain dict."""
    ckpt = forged(tmp_path, [[1, "a"], [twin, "b"]])
    with pytest.raises(CheckpointCorruptError) as caught:
        shardsafe.load(ckpt, {})
    assert "malformed __dict__ value in the manifest: the key " in str(caught.value)
    assert "appears twice" in str(caught.value)


def test_keys_crafted_to_share_one_hash_are_refused_in_linear_time(tmp_path: Path) -> None:
    """An int's hash is its value modulo 2**61 - 1: 40,000 keys sharing one (a megabyte of
    manifest) took about 6 s to decode, quadratic in their number."""
    modulus = 2**61 - 1
    ckpt = forged(tmp_path, [[1 + i * modulus, i] for i in range(40_000)])
    with pytest.raises(CheckpointCorruptError) as caught:  # the load ran, slowly, before
        shardsafe.load(ckpt, {})
    assert "more than 16 of its keys share one hash value" in str(caught.value)
    keys = [1 + i * modulus for i in range(16)] + [2, -1, -2]  # hash(-1) == hash(-2)
    ckpt = forged(tmp_path / "ok", [[k, str(k)] for k in keys])
    assert shardsafe.load(ckpt, {})["cfg"] == {k: str(k) for k in keys}
