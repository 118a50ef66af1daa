"""What ``inspect`` and ``verify`` print about a hostile checkpoint: whole output while
manifest.json is swapped (read exactly once), a clean error or valid, strict output on
huge recorded numbers, and no terminal escape from the checkpoint."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from tests import forge
from tests.opens import recorded_opens
from tests.unit.attacks.common import (
    LAYOUTS,
    RACE_SECONDS,
    SHARD,
    Swapper,
    assert_clean_failure,
    fast_switching,
    fifo_reader_probe,
    flip_bit,
    linker,
    manifest_doc,
    opens_with_flags,
    outside_but_private,
    run_cli,
    staged_fifo,
    strict_json,
    symlinker,
)

pytestmark = pytest.mark.timeout(60)


# ======================================================================================
# inspect reads manifest.json exactly once, while it is being swapped


def test_inspect_output_is_whole_while_the_manifest_is_swapped(
    copy_of: Any, tmp_path: Path
) -> None:
    ckpt = copy_of("sharded")
    target = ckpt / "manifest.json"
    stage = tmp_path / "stage"
    stage.mkdir()
    a = stage / "a.json"
    shutil.copyfile(target, a)
    doc = manifest_doc(ckpt)
    doc["values"]["cfg"]["meta"]["step"] = 6
    doc["info"]["shardsafe_version"] = "9.9.9"
    b = stage / "b.json"
    b.write_bytes(forge.manifest_bytes(doc))
    garbage = stage / "garbage.json"
    garbage.write_bytes(a.read_bytes()[:5000])
    invalid = stage / "invalid.json"
    invalid.write_bytes(b"\xff" + a.read_bytes()[1:])
    decoy = tmp_path / "decoy.json"
    shutil.copyfile(b, decoy)
    modes = [("inspect",), ("inspect", "--json"), ("verify",)]
    expected: dict[tuple[str, ...], set[str]] = {mode: set() for mode in modes}
    for master in (a, b):
        os.link(master, stage / "tmp")
        os.replace(stage / "tmp", target)
        for mode in modes:
            rc, out, err = run_cli(*mode, str(ckpt))
            assert (rc, err) == (0, ""), (mode, out, err)
            expected[mode].add(out)
    assert len(expected[("inspect",)]) == len(expected[("inspect", "--json")]) == 2
    fifo = staged_fifo(stage)
    makers = [
        linker(a),
        linker(b),
        linker(garbage),
        linker(fifo),
        linker(invalid),
        symlinker(decoy),
    ]
    counts = {"complete": 0, "refused": 0}
    deadline = time.monotonic() + RACE_SECONDS
    with (
        recorded_opens() as opened,
        fast_switching(),
        fifo_reader_probe(fifo) as probe,
        Swapper(target, stage, makers),
    ):
        while time.monotonic() < deadline or not (counts["complete"] and counts["refused"]):
            assert time.monotonic() < deadline + 20, counts
            for mode in modes:
                rc, out, err = run_cli(*mode, str(ckpt))
                if rc == 0:
                    assert out in expected[mode] and err == "", (mode, out, err)
                    if mode[-1] == "--json":
                        strict_json(out)
                    counts["complete"] += 1
                else:
                    assert out == "", (mode, out)
                    assert_clean_failure(rc, out, err)
                    counts["refused"] += 1
    assert probe["readers_seen"] == 0, probe
    assert outside_but_private(opened, ckpt) == []


def test_inspect_opens_manifest_json_once_and_no_data_file(copy_of: Any) -> None:
    ckpt = copy_of("consolidated")
    for args in (("inspect",), ("inspect", "--json")):
        with opens_with_flags() as flagged:
            rc, _, err = run_cli(*args, str(ckpt))
        assert (rc, err) == (0, "")
        names = [os.path.basename(p) for p, _ in flagged]
        assert names.count("manifest.json") == 1, names
        assert not [n for n in names if n.endswith(".safetensors")], names


# ======================================================================================
# inspect on huge recorded numbers: a clean error or valid, strict output


def _numbers_case(name: str) -> Callable[[Path], None]:
    def edit(ckpt: Path) -> None:
        doc = manifest_doc(ckpt)
        if name == "file bytes 10**30":
            doc["files"][SHARD]["bytes"] = 10**30
        elif name == "file bytes 2**62":
            doc["files"][SHARD]["bytes"] = 2**62
        elif name.startswith("created_unix"):
            doc["info"]["created_unix"] = {
                "created_unix 1e300": 1e300,
                "created_unix -1e300": -1e300,
                "created_unix string": "yesterday",
                "created_unix true": True,
                "created_unix 10**30": 10**30,
                "created_unix 10**400": 10**400,  # beyond a float: OverflowError
            }[name]
        elif name == "world_size 10**30":
            doc["world_size"] = 10**30
        elif name == "block_bytes 2**62":
            doc["checksum"]["block_bytes"] = 2**62
        elif name == "value 10**30":
            doc["values"]["cfg"]["meta"]["step"] = -(10**30)
        elif name == "version not a string":
            doc["info"]["shardsafe_version"] = 10**30
        elif name in ("value 1e999", "value of 5000 digits", "value NaN", "value -Infinity"):
            literal = {
                "value 1e999": "1e999",
                "value of 5000 digits": "9" * 5000,
                "value NaN": "NaN",
                "value -Infinity": "-Infinity",
            }[name]
            doc.pop(forge.CRC_KEY)
            text = json.dumps(forge.pack(doc), indent=1).replace('"step": 5', f'"step": {literal}')
            (ckpt / "manifest.json").write_bytes(forge.sign(text))
            return
        else:
            raise AssertionError(name)
        forge.write_manifest(ckpt, doc)

    return edit


HUGE = {
    "file bytes 10**30": (1, "has no valid 'bytes'"),
    "file bytes 2**62": (0, None),
    "created_unix 1e300": (0, None),
    "created_unix -1e300": (0, None),
    "created_unix 10**30": (0, None),
    "created_unix 10**400": (0, None),
    "created_unix string": (0, None),
    "created_unix true": (0, None),
    "world_size 10**30": (0, None),
    "block_bytes 2**62": (0, None),
    "value 10**30": (0, None),
    "version not a string": (0, None),
    "value 1e999": (1, "is out of range"),
    "value of 5000 digits": (1, "is not valid JSON"),
    "value NaN": (1, "non-standard constant NaN"),
    "value -Infinity": (1, "non-standard constant -Infinity"),
}


@pytest.mark.parametrize("case", sorted(HUGE))
def test_inspect_on_huge_numbers_is_clean(copy_of: Any, case: str) -> None:
    ckpt = copy_of("sharded")
    _numbers_case(case)(ckpt)
    expected_rc, fragment = HUGE[case]
    rc, text, err = run_cli("inspect", str(ckpt))
    rc_json, raw, err_json = run_cli("inspect", "--json", str(ckpt))
    assert rc == rc_json == expected_rc, (text, err, raw, err_json)
    if expected_rc == 1:
        for r, o, e in ((rc, text, err), (rc_json, raw, err_json)):
            assert_clean_failure(r, o, e)
            assert o == "" and fragment in e, e
        return
    assert err == err_json == ""
    assert text.splitlines()[-1].startswith("total: ")
    doc = strict_json(raw)
    info = manifest_doc(ckpt)
    if case.startswith("created_unix"):
        value = info["info"]["created_unix"]
        finite = isinstance(value, (int, float)) and not isinstance(value, bool)
        finite = finite and case != "created_unix 10**400"
        assert doc["created_unix"] == (float(value) if finite else None)
        assert doc["created"] is None
        assert "created     ? by shardsafe" in text
    if case == "file bytes 2**62":
        assert doc["totals"]["bytes"] == 2**62 + doc["totals"]["manifest_bytes"]
        assert doc["files"][0]["bytes"] == 2**62
    if case == "world_size 10**30":
        assert doc["world_size"] == 10**30 and f"{10**30} at save" in text
    if case == "value 10**30":
        cfg = next(v for v in doc["values"] if v["name"] == "cfg")
        assert cfg["value"]["step"] == -(10**30)
    if case == "version not a string":
        assert doc["shardsafe_version"] is None


def test_non_finite_floats_round_trip_and_inspect_stays_strict_json(tmp_path: Path) -> None:
    values = [math.inf, -math.inf, math.nan, -0.0, 5e-324, 1.7976931348623157e308]
    ckpt = tmp_path / "floats"
    shardsafe.save(ckpt, {"v": math.inf, "w": values, "t": (math.nan,)})
    out = shardsafe.load(ckpt, {})
    assert out["v"] == math.inf
    assert [struct.pack("<d", v) for v in out["w"]] == [struct.pack("<d", v) for v in values]
    assert isinstance(out["t"], tuple) and math.isnan(out["t"][0])
    rc, raw, err = run_cli("inspect", "--json", str(ckpt))
    assert (rc, err) == (0, "")
    doc = strict_json(raw)
    v = next(v for v in doc["values"] if v["name"] == "v")
    assert v["value"] == {"__float__": "inf"}
    rc, text, err = run_cli("inspect", str(ckpt))
    assert (rc, err) == (0, "") and '{"__float__": "inf"}' in text


# ======================================================================================
# Terminal escapes from a checkpoint never reach the terminal

ESCAPES = {
    "clear": "\x1b[2J",
    "title": "\x1b]0;title\x07",
    "clipboard": "\x1b]52;c;aGVsbG8=\x07",
    "return": "\r",
    "bidi": "\u202e",
}
EVIL = "".join(ESCAPES.values())


def _escape_checkpoint(root: Path, layout: str) -> Path:
    module = nn.Module()
    module.register_parameter("w" + ESCAPES["title"], nn.Parameter(torch.ones(2)))
    module.register_parameter(ESCAPES["bidi"] + "x", nn.Parameter(torch.zeros(3)))
    state = {
        "model": module,
        "name" + ESCAPES["clear"]: {"s": ESCAPES["clipboard"], ESCAPES["return"]: EVIL},
        "t" + ESCAPES["return"]: torch.arange(4.0),
        "cfg": [EVIL, {"k" + ESCAPES["bidi"]: torch.ones(1)}],
    }
    ckpt = root / f"escapes-{layout}"
    shardsafe.save(ckpt, state, layout=layout)
    doc = manifest_doc(ckpt)
    doc["info"]["shardsafe_version"] = ESCAPES["clear"] + "0.1" + ESCAPES["title"]
    doc["info"]["torch_version"] = ESCAPES["bidi"] + "2.13"
    doc["values"]["odd" + ESCAPES["clipboard"]] = {"kind": ESCAPES["clear"] + "module", "meta": {}}
    forge.write_manifest(ckpt, doc)
    return ckpt


def _assert_terminal_safe(*outputs: str) -> None:
    for text in outputs:
        bad = sorted({repr(ch) for ch in text if not (ch.isprintable() or ch == "\n")})
        assert not bad, (bad, text[:300])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_and_verify_escape_everything_from_the_checkpoint(
    tmp_path: Path, layout: str
) -> None:
    ckpt = _escape_checkpoint(tmp_path, layout)
    rc, text, err = run_cli("inspect", str(ckpt))
    assert (rc, err) == (0, "")
    _assert_terminal_safe(text)
    assert "\\x1b[2J0.1\\x1b]0;title\\x07" in text and "\\x1b[2Jmodule" in text
    assert "w\\x1b]0;title\\x07" in text and "\\u202ex" in text
    rc, raw, err = run_cli("inspect", "--json", str(ckpt))
    assert (rc, err) == (0, "")
    _assert_terminal_safe(raw)
    doc = strict_json(raw)
    assert doc["shardsafe_version"] == ESCAPES["clear"] + "0.1" + ESCAPES["title"]
    assert "odd" + ESCAPES["clipboard"] in {v["name"] for v in doc["values"]}
    rc, text, err = run_cli("verify", str(ckpt))
    assert (rc, err) == (0, "")
    _assert_terminal_safe(text)
    # Damaged: every problem line names the escaped keys.
    for path in ckpt.glob("*.safetensors"):
        flip_bit(path, path.stat().st_size - 1, 0)
    first = sorted(ckpt.glob("*.safetensors"))[0]
    first.unlink()
    rc, text, err = run_cli("verify", str(ckpt))
    assert rc == 1 and err == ""
    _assert_terminal_safe(text)
    assert f"data file {first.name} is missing" in text
    if layout == "consolidated":
        assert "checksum mismatch" in text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (("layout",), EVIL),
        (("format",), EVIL),
        (("values",), {"a/" + EVIL: {"kind": "value", "meta": 1}}),
        (("tensors", "t\r", "dtype"), EVIL),
        (("files",), {EVIL + ".safetensors": {"bytes": 10, "header_crc32": 0}}),
    ],
    ids=["layout", "format", "value name", "dtype", "file name"],
)
def test_refusals_of_fields_holding_escapes_are_escaped(
    tmp_path: Path, field: tuple[str, ...], value: Any
) -> None:
    ckpt = _escape_checkpoint(tmp_path, "sharded")
    doc = manifest_doc(ckpt)
    node = doc
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = value
    forge.write_manifest(ckpt, doc)
    for args in (("inspect",), ("inspect", "--json"), ("verify",)):
        rc, out, err = run_cli(*args, str(ckpt))
        assert_clean_failure(rc, out, err)
        _assert_terminal_safe(out, err)


def test_verify_escapes_the_path_in_its_failed_line(tmp_path: Path) -> None:
    ckpt = tmp_path / ("ckpt" + ESCAPES["title"])
    shardsafe.save(ckpt, {"t": torch.ones(4)})
    path = ckpt / SHARD
    flip_bit(path, path.stat().st_size - 1, 0)
    rc, out, err = run_cli("verify", str(ckpt))
    assert rc == 1
    _assert_terminal_safe(out, err)


@pytest.mark.parametrize("tensors", [5, None, True, 1.5])
def test_verify_reports_module_metadata_that_no_load_accepts(copy_of: Any, tensors: Any) -> None:
    """A module entry whose 'tensors' is not a list: verify ended in a raw TypeError
    ("verify failed unexpectedly ... a bug in shardsafe"), while load refused it."""
    ckpt = copy_of("sharded")
    doc = manifest_doc(ckpt)
    doc["values"]["model"]["meta"]["tensors"] = tensors
    forge.write_manifest(ckpt, doc)
    rc, out, err = run_cli("verify", str(ckpt))
    assert (rc, err) == (1, ""), (out, err)
    assert (
        "state entry 'model': the manifest entry for 'model' is not valid module metadata: "
        "'tensors' is not a list of names"
    ) in out
    report = shardsafe.verify(ckpt)
    assert not report.ok and "'tensors' is not a list of names" in report.problems[0]
