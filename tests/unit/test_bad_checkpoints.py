"""Damaged and hostile checkpoints: each gives its own error class and a message naming the
file, key and problem; nothing is restored; nothing outside the checkpoint directory is opened.

Every file open in this process is recorded through a ``sys.addaudithook`` hook (the
"open" audit event fires for ``open()``, ``io.open_code`` and ``os.open`` alike), so
"nothing outside the directory is read" is checked, not assumed.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from tests import forge
from tests.opens import outside, recorded_opens


@pytest.fixture
def opened() -> Iterator[list[str]]:
    """Real paths of every file opened (tests clear it right before ``load``)."""
    with recorded_opens() as record:
        yield record


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One good checkpoint per layout, plus the state they hold."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    root = tmp_path_factory.mktemp("good")
    for layout in ("sharded", "consolidated"):
        shardsafe.save(root / layout, {"model": model, "optimizer": opt}, layout=layout)
    return {"root": root, "model": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.fixture
def copy_of(saved: dict[str, Any], tmp_path: Path) -> Callable[[str], Path]:
    def make(layout: str) -> Path:
        dest = tmp_path / "run" / f"ckpt-{layout}"
        shutil.copytree(saved["root"] / layout, dest)
        return dest

    return make


def data_file(ckpt: Path, layout: str, which: str = "model") -> Path:
    return ckpt / (
        "shard-00000-of-00001.safetensors" if layout == "sharded" else f"{which}.safetensors"
    )


def tensor_offset(path: Path, name: str) -> tuple[int, int]:
    """Absolute byte range of tensor ``name`` in a safetensors file (read independently)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def fresh_state() -> dict[str, Any]:
    torch.manual_seed(42)
    model = make_model()
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), weight_decay=0.1)}


def load_fails(ckpt: Path, opened: list[str]) -> CheckpointError:
    state = fresh_state()
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    opened.clear()  # record only what load itself opens
    with pytest.raises(CheckpointError) as info:
        shardsafe.load(ckpt, state)
    # Nothing was restored ...
    for k, v in state["model"].state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not state["optimizer"].state
    # ... and nothing outside the checkpoint directory was opened.
    assert outside(opened, ckpt) == []
    assert os.path.join(os.path.abspath(ckpt), "manifest.json") in opened or isinstance(
        info.value, CheckpointNotFoundError
    )
    return info.value


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_a_good_copy_loads(
    copy_of: Any, saved: dict[str, Any], layout: str, opened: list[str]
) -> None:
    ckpt = copy_of(layout)
    state = fresh_state()
    opened.clear()
    shardsafe.load(ckpt, state)
    for k, v in state["model"].state_dict().items():
        assert torch.equal(v, saved["model"][k])
    assert outside(opened, ckpt) == []
    assert any(p.endswith(".safetensors") for p in opened)  # the spy does see data files


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
@pytest.mark.parametrize("cut", [1, 100])
def test_a_truncated_data_file(copy_of: Any, layout: str, cut: int, opened: list[str]) -> None:
    ckpt = copy_of(layout)
    path = data_file(ckpt, layout)
    size = path.stat().st_size
    os.truncate(path, size - cut)
    err = load_fails(ckpt, opened)
    assert type(err) is CheckpointCorruptError
    msg = str(err)
    assert f"data file {path.name} is {size - cut} bytes but the manifest recorded {size}" in msg
    assert "truncated" in msg


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
@pytest.mark.parametrize("tensor", ["model/0.weight", "model/2.bias"])
def test_a_flipped_byte_in_tensor_data(
    copy_of: Any, layout: str, tensor: str, opened: list[str]
) -> None:
    ckpt = copy_of(layout)
    path = data_file(ckpt, layout)
    name = tensor if layout == "sharded" else tensor.removeprefix("model/")
    begin, end = tensor_offset(path, name)
    raw = bytearray(path.read_bytes())
    raw[(begin + end) // 2] ^= 0x10
    path.write_bytes(raw)
    err = load_fails(ckpt, opened)
    assert type(err) is CheckpointCorruptError
    msg = str(err)
    assert f"checksum mismatch in {path.name}, tensor {tensor!r}" in msg
    assert "damaged" in msg


def test_a_changed_safetensors_header(copy_of: Any, opened: list[str]) -> None:
    ckpt = copy_of("consolidated")
    path = data_file(ckpt, "consolidated")
    raw = path.read_bytes()
    assert raw.count(b'"F32"') > 1
    path.write_bytes(raw.replace(b'"F32"', b'"I32"', 1))  # same length, header still valid JSON
    err = load_fails(ckpt, opened)
    assert type(err) is CheckpointCorruptError
    assert str(err) == (
        "model.safetensors has a damaged safetensors header: its CRC32 does not match the one "
        "in the manifest (the file was modified or corrupted after the save)"
    )


def test_a_forged_safetensors_header(copy_of: Any, opened: list[str]) -> None:
    """The same edit by someone who also fixes the header's checksum in the manifest: the
    header is still checked against the manifest, which records float32."""
    ckpt = copy_of("consolidated")
    path = data_file(ckpt, "consolidated")
    path.write_bytes(path.read_bytes().replace(b'"F32"', b'"I32"', 1))
    forge.resign_file(ckpt, path)
    err = load_fails(ckpt, opened)
    assert type(err) is CheckpointCorruptError
    assert "model.safetensors: tensor" in str(err)
    assert "int32" in str(err) and "in the safetensors header but float32" in str(err)


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_a_missing_manifest(copy_of: Any, layout: str, opened: list[str]) -> None:
    ckpt = copy_of(layout)
    (ckpt / "manifest.json").unlink()
    err = load_fails(ckpt, opened)
    assert type(err) is CheckpointNotFoundError
    assert str(ckpt) in str(err) and "has no manifest.json" in str(err)
    assert "not a committed checkpoint" in str(err)


def test_a_directory_that_does_not_exist(tmp_path: Path, opened: list[str]) -> None:
    err = load_fails(tmp_path / "nope", opened)
    assert type(err) is CheckpointNotFoundError and "does not exist" in str(err)


@pytest.mark.parametrize(
    ("layout", "victim"), [("consolidated", "optimizer"), ("sharded", "model")]
)
def test_a_missing_data_file(copy_of: Any, layout: str, victim: str, opened: list[str]) -> None:
    ckpt = copy_of(layout)
    path = data_file(ckpt, layout, victim)
    path.unlink()
    err = load_fails(ckpt, opened)
    assert type(err) is CheckpointCorruptError
    assert f"data file {path.name} is missing" in str(err)


def test_a_newer_format_version(copy_of: Any, opened: list[str]) -> None:
    ckpt = copy_of("consolidated")
    doc = json.loads((ckpt / "manifest.json").read_text())
    doc["version"] = 3
    forge.write_manifest(ckpt, doc)
    err = load_fails(ckpt, opened)
    assert type(err) is CheckpointVersionError
    msg = str(err)
    assert "manifest.json declares format version 3" in msg
    assert "Upgrade shardsafe" in msg
    assert not any(p.endswith(".safetensors") for p in opened)


def _point_at(ckpt: Path, layout: str, target: str) -> None:
    """Make the manifest name ``target`` instead of the model's data file."""
    doc = forge.read_manifest(ckpt)
    old = data_file(ckpt, layout).name
    doc["files"][target] = doc["files"].pop(old)
    for rec in doc["tensors"].values():
        for c in rec["chunks"]:
            if c["file"] == old:
                c["file"] = target
    forge.write_manifest(ckpt, doc)


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
@pytest.mark.parametrize("form", ["relative", "absolute"])
def test_a_manifest_naming_a_file_outside_the_directory(
    copy_of: Any, layout: str, form: str, opened: list[str]
) -> None:
    ckpt = copy_of(layout)
    # A perfectly valid data file sits at the target, outside the checkpoint directory.
    decoy = ckpt.parent / "x.safetensors"
    shutil.copyfile(data_file(ckpt, layout), decoy)
    target = "../x.safetensors" if form == "relative" else str(decoy)
    _point_at(ckpt, layout, target)
    err = load_fails(ckpt, opened)
    assert type(err) is CheckpointCorruptError
    msg = str(err)
    # Refused while parsing the manifest, before any data file is opened.
    assert f"{ckpt}/manifest.json is malformed: data file name {target!r}" in msg
    assert "paths, '..' and absolute names are refused" in msg
    assert os.path.abspath(decoy) not in opened
    assert [p for p in opened if p.endswith(".safetensors")] == []


def test_a_data_file_replaced_by_a_symlink_out_of_the_directory(
    copy_of: Any, opened: list[str]
) -> None:
    ckpt = copy_of("consolidated")
    path = data_file(ckpt, "consolidated")
    decoy = ckpt.parent / "x.safetensors"
    shutil.move(path, decoy)
    path.symlink_to(decoy)
    err = load_fails(ckpt, opened)
    assert type(err) is CheckpointCorruptError
    assert "model.safetensors is a symbolic link" in str(err)
    assert os.path.abspath(decoy) not in opened
