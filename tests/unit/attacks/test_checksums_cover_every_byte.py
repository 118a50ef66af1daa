"""Checksums cover every byte read: manifest, headers, data."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardsafe
from shardsafe import CheckpointCorruptError
from shardsafe.checkpoint.format.manifest import parse
from shardsafe.checkpoint.loading import read_manifest
from tests import forge
from tests.unit.attacks.common import (
    CFG,
    LAYOUTS,
    MASK,
    SHARD,
    X,
    assert_bitwise,
    assert_clean_failure,
    bits,
    data_file,
    flip_bit,
    header_span,
    load_refused,
    make_model,
    make_optimizer,
    manifest_doc,
    optimizer_tensors,
    run_cli,
    weights,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def victim(pristine: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A copy reused across hypothesis examples (each restores what it damaged)."""
    ckpt = tmp_path_factory.mktemp("victim") / "ckpt"
    shutil.copytree(pristine["root"] / "sharded", ckpt)
    return {
        "ckpt": ckpt,
        "manifest": (ckpt / "manifest.json").read_bytes(),
        "data": data_file(ckpt).read_bytes(),
        "header_end": header_span(data_file(ckpt)),
    }


def _refused_everywhere(ckpt: Path) -> CheckpointCorruptError:
    err = load_refused(ckpt)
    rc, out, verr = run_cli("verify", str(ckpt))
    assert rc == 1, (out, verr)
    return err


HYPOTHESIS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@HYPOTHESIS
@given(data=st.data())
def test_any_single_bit_flip_in_the_manifest_is_refused(victim: dict[str, Any], data: Any) -> None:
    raw = victim["manifest"]
    pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
    bit = data.draw(st.integers(0, 7), label="bit")
    path = victim["ckpt"] / "manifest.json"
    try:
        flip_bit(path, pos, bit)
        _refused_everywhere(victim["ckpt"])
    finally:
        path.write_bytes(raw)


def test_every_bit_of_the_manifest_checksum_line_matters(victim: dict[str, Any]) -> None:
    """Exhaustively: each bit of the trailer line (``,`` to the final newline), including
    the eight hex digits, which are also loaded."""
    raw = victim["manifest"]
    start = raw.rindex(b',\n "manifest_crc32": "')
    digits = raw.rindex(b'"', 0, len(raw) - 3) - 8
    assert re.fullmatch(rb"[0-9a-f]{8}", raw[digits : digits + 8])
    parse(raw)
    for pos in range(start, len(raw)):
        for bit in range(8):
            damaged = bytearray(raw)
            damaged[pos] ^= 1 << bit
            with pytest.raises(CheckpointCorruptError):
                parse(bytes(damaged))
    path = victim["ckpt"] / "manifest.json"
    try:
        for pos in range(digits, digits + 8):
            for bit in range(8):
                path.write_bytes(raw)
                flip_bit(path, pos, bit)
                load_refused(victim["ckpt"])
    finally:
        path.write_bytes(raw)


@HYPOTHESIS
@given(data=st.data())
def test_any_single_bit_flip_in_a_data_file_header_is_refused(
    victim: dict[str, Any], data: Any
) -> None:
    pos = data.draw(st.integers(0, victim["header_end"] - 1), label="pos")
    bit = data.draw(st.integers(0, 7), label="bit")
    path = data_file(victim["ckpt"])
    try:
        flip_bit(path, pos, bit)
        err = _refused_everywhere(victim["ckpt"])
        assert SHARD in str(err), str(err)
    finally:
        path.write_bytes(victim["data"])


def _edit_header_metadata(ckpt: Path, layout: str) -> tuple[Path, str]:
    path = data_file(ckpt, layout)
    raw = path.read_bytes()
    assert raw.count(b'"format":"pt"') == 1
    path.write_bytes(raw.replace(b'"format":"pt"', b'"format":"pu"'))
    return path, "has a damaged safetensors header: its CRC32 does not match"


def _edit_manifest(old: bytes, new: bytes) -> Callable[[Path, str], tuple[Path, str]]:
    def edit(ckpt: Path, layout: str) -> tuple[Path, str]:
        path = ckpt / "manifest.json"
        raw = path.read_bytes()
        assert old in raw
        path.write_bytes(raw.replace(old, new, 1))
        return path, "manifest.json is damaged: its content does not match its CRC32"

    return edit


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "edit",
    [
        _edit_header_metadata,
        _edit_manifest(b'"step":5', b'"step":7'),
        _edit_manifest(b'"lr":0.001', b'"lr":0.003'),
        _edit_manifest(b'"name":"run"', b'"name":"ran"'),
    ],
    ids=["header pt->pu", "step 5->7", "lr 0.001->0.003", "name run->ran"],
)
def test_a_same_length_edit_that_keeps_everything_valid_is_caught(
    copy_of: Any, layout: str, edit: Callable[[Path, str], tuple[Path, str]]
) -> None:
    ckpt = copy_of(layout)
    path, fragment = edit(ckpt, layout)
    err = _refused_everywhere(ckpt)
    assert fragment in str(err) and path.name in str(err), str(err)


def _as_old_manifest(ckpt: Path, covers: list[str] | None = None) -> None:
    """What shardsafe wrote before checksums covered the manifest and the headers (format
    version 1, as first released)."""
    doc = manifest_doc(ckpt)
    doc["version"] = 1
    doc.pop(forge.CRC_KEY)
    if covers is None:
        doc["checksum"].pop("covers")
    else:
        doc["checksum"]["covers"] = covers
    if covers is None or "headers" not in covers:
        for entry in doc["files"].values():
            entry.pop("header_crc32")
    (ckpt / "manifest.json").write_text(json.dumps(doc, indent=1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_manifest_from_before_the_new_checksums_still_loads_bitwise(
    copy_of: Any, pristine: dict[str, Any], layout: str
) -> None:
    ckpt = copy_of(layout)
    _as_old_manifest(ckpt)
    assert read_manifest(ckpt).covers == frozenset({"data"})
    model = make_model(1)
    opt = make_optimizer(model)
    out = shardsafe.load(ckpt, {"model": model, "optimizer": opt})
    assert_bitwise(weights(model), pristine["model"])
    assert_bitwise(optimizer_tensors(opt), pristine["optimizer"])
    assert bits(out["x"]) == bits(X) and bits(out["mask"]) == bits(MASK) and out["cfg"] == CFG
    rc, stdout, err = run_cli("verify", str(ckpt))
    assert (rc, err) == (0, "")
    lines = stdout.splitlines()
    assert lines[0].startswith("OK: ") and len(lines) == 2
    assert lines[1].startswith("note: not checked: the manifest's own content and the data")
    # Data blocks are still checked in an old checkpoint.
    path = data_file(ckpt, layout)
    flip_bit(path, path.stat().st_size - 1, 0)
    assert "checksum mismatch" in str(load_refused(ckpt))


def test_a_manifest_covering_headers_but_not_itself_notes_only_the_manifest(
    copy_of: Any,
) -> None:
    ckpt = copy_of("sharded")
    _as_old_manifest(ckpt, covers=["data", "headers"])
    rc, out, err = run_cli("verify", str(ckpt))
    assert (rc, err) == (0, "")
    assert out.splitlines()[1].startswith("note: not checked: the manifest's own content, which")
    _edit_header_metadata(ckpt, "sharded")  # headers are still covered
    assert "CRC32 does not match" in str(load_refused(ckpt))


def _drop_trailer(text: str) -> str:
    return text[: text.rindex(',\n "manifest_crc32"')] + "\n}\n"


def _uppercase_digits(text: str) -> str:
    return re.sub(r'"[0-9a-f]{8}"\n\}\n$', '"ABCDEF12"\n}\n', text)


def _forged_covers(covers: Any) -> Callable[[str], str]:
    """The covers list replaced, and the manifest's checksum recomputed (a forger)."""

    def edit(text: str) -> str:
        doc = json.loads(text)
        doc["checksum"]["covers"] = covers
        return forge.manifest_bytes(doc).decode()

    return edit


MISSING = "its own checksum ('manifest_crc32', the last line) is missing or malformed"


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (_drop_trailer, MISSING),
        (lambda t: json.dumps(json.loads(t), indent=2), MISSING),
        (_uppercase_digits, MISSING),
        (lambda t: t.rstrip("\n"), MISSING),
        (lambda t: t + "\n", MISSING),
        (lambda t: t.replace(' "manifest_crc32"', ' "manifest_crc32" '), MISSING),
        (_forged_covers(["data", "headers"]), "'manifest_crc32' and 'checksum.covers' disagree"),
        (_forged_covers(["data", "headers", "manifest", "all"]), "'checksum.covers' is"),
        (_forged_covers(["headers", "manifest"]), "'checksum.covers' is"),
        (_forged_covers("data,headers,manifest"), "'checksum.covers' is"),
    ],
    ids=[
        "line removed",
        "reformatted",
        "uppercase hex",
        "final newline cut",
        "newline added",
        "space in the line",
        "covers drops manifest",
        "covers unknown",
        "covers lacks data",
        "covers a string",
    ],
)
def test_a_manifest_that_claims_its_checksum_but_lacks_it_is_refused(
    copy_of: Any, damage: Callable[[str], str], fragment: str
) -> None:
    ckpt = copy_of("sharded")
    path = ckpt / "manifest.json"
    path.write_text(damage(path.read_text()))
    err = _refused_everywhere(ckpt)
    assert fragment in str(err), str(err)
    assert_clean_failure(*run_cli("inspect", str(ckpt)))


def test_a_manifest_whose_header_crc_is_dropped_is_refused(copy_of: Any) -> None:
    """A forger (checksum recomputed) cannot turn header checking off for one file while
    the manifest still declares that headers are covered."""
    ckpt = copy_of("consolidated")
    doc = manifest_doc(ckpt)
    doc["files"]["model.safetensors"].pop("header_crc32")
    forge.write_manifest(ckpt, doc)
    assert "'model.safetensors' has no valid header_crc32" in str(load_refused(ckpt))
