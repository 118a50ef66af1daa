"""Dtype names come from a fixed table: nothing is imported for a hostile name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import shardsafe
from tests import forge
from tests.unit.attacks.common import manifest_doc

pytestmark = pytest.mark.timeout(60)


DTYPE_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import shardsafe
    watched = ["torch._inductor", "torch._dynamo", "torch.onnx", "torch.testing"]
    before = [m for m in watched if m in sys.modules]
    results = {}
    for name, path in json.loads(sys.argv[1]).items():
        start = time.perf_counter()
        try:
            shardsafe.load(path, {})
            results[name] = ["loaded", "", 0.0]
        except shardsafe.CheckpointCorruptError as e:
            results[name] = ["refused", str(e), time.perf_counter() - start]
        except BaseException as e:
            results[name] = ["other", repr(e), 0.0]
    after = [m for m in watched if m in sys.modules]
    print(json.dumps({"before": before, "after": after, "results": results}))
    """
)
HOSTILE_DTYPES = [
    "_inductor",
    "_dynamo",
    "onnx",
    "testing",
    "nn",
    "Tensor",
    "__builtins__",
    "__class__",
    "FloatTensor",
    "float",
    "torch.float32",
    "float32 ",
    "",
]


def test_a_hostile_dtype_name_is_refused_without_importing_anything(tmp_path: Path) -> None:
    base = tmp_path / "base"
    shardsafe.save(base, {"amp": {"amp_dtype": torch.bfloat16}, "t": torch.ones(2)})
    paths = {}
    for i, name in enumerate([*HOSTILE_DTYPES, 5, ["float32"], None]):
        ckpt = tmp_path / f"c{i}"
        shutil.copytree(base, ckpt)
        doc = manifest_doc(ckpt)
        doc["values"]["amp"]["meta"]["amp_dtype"] = {"__dtype__": name}
        forge.write_manifest(ckpt, doc)
        paths[repr(name)] = str(ckpt)
    bad_tensor = tmp_path / "tensor-dtype"
    shutil.copytree(base, bad_tensor)
    doc = manifest_doc(bad_tensor)
    doc["tensors"]["t"]["dtype"] = "_inductor"
    forge.write_manifest(bad_tensor, doc)
    paths["tensor record"] = str(bad_tensor)
    proc = subprocess.run(
        [sys.executable, "-c", DTYPE_SCRIPT, json.dumps(paths)],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert "torch._inductor" not in report["before"]
    assert report["after"] == report["before"], report["after"]
    for name, (outcome, message, _) in report["results"].items():
        assert outcome == "refused", (name, outcome, message)
        non_strings = ("5", "['float32']", "None")
        expected = "malformed __dtype__ value" if name in non_strings else "unknown dtype"
        assert expected in message, (name, message)


def test_real_dtypes_round_trip_as_the_same_objects(tmp_path: Path) -> None:
    value = {
        "amp_dtype": torch.bfloat16,
        "all": [torch.float16, torch.int8, torch.complex128, torch.bool, torch.float8_e4m3fn],
        "nested": ({"d": torch.uint8},),
    }
    shardsafe.save(tmp_path / "c", {"cfg": value})
    out = shardsafe.load(tmp_path / "c", {})
    assert out["cfg"] == value
    assert out["cfg"]["amp_dtype"] is torch.bfloat16
    assert all(a is b for a, b in zip(out["cfg"]["all"], value["all"]))
