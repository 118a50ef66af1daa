"""Large manifests: costs linear in the manifest's size, parsing memory proportional to
it (how long they take is measured in ``benchmarks/validation_scale.py``)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from shardsafe import CheckpointCorruptError
from shardsafe.checkpoint.format.manifest import parse
from tests import forge
from tests.unit.attacks.common import SHARD, run_cli, strict_json

pytestmark = pytest.mark.timeout(60)


# ======================================================================================
# Costs are linear in the manifest's size


def test_sixteen_thousand_chunks_along_dim_1_and_in_a_2d_grid_parse() -> None:
    """How long they take is measured in ``benchmarks/validation_scale.py``."""
    raw = forge.manifest_bytes(forge.grid_doc(1, 16_000))
    assert len(parse(raw).tensors["model/w"].chunks) == 16_000
    raw = forge.manifest_bytes(forge.grid_doc(125, 128))  # 2-d grid of 16,000 cells
    assert len(parse(raw).tensors["model/w"].chunks) == 16_000


def test_inspect_of_ten_thousand_values_and_tensors(tmp_path: Path) -> None:
    n = 10_000
    doc = forge.wide_doc(n, SHARD)
    ckpt = tmp_path / "wide"
    ckpt.mkdir()
    forge.write_manifest(ckpt, doc)
    for args in (("inspect",), ("inspect", "--json")):  # timed in validation_scale.py
        rc, out, err = run_cli(*args, str(ckpt))
        assert (rc, err) == (0, "")
    assert strict_json(out)["totals"]["tensors"] == n


def _brick(pairs: int) -> dict[str, Any]:
    """A [2, 2*pairs] tensor tiled exactly by 2*pairs+1 chunks that do not form a grid:
    row 0 cut every 2 columns, row 1 offset by one column."""
    width = 2 * pairs
    doc = forge.grid_doc(1, 1)
    chunks = [
        {"file": SHARD, "name": f"a{i}", "offsets": [0, 2 * i], "shape": [1, 2], "crc32": [0]}
        for i in range(pairs)
    ]
    cuts = [(0, 1), *[(1 + 2 * i, 2) for i in range(pairs - 1)], (width - 1, 1)]
    chunks += [
        {"file": SHARD, "name": f"b{i}", "offsets": [1, o], "shape": [1, n], "crc32": [0]}
        for i, (o, n) in enumerate(cuts)
    ]
    doc["files"] = {SHARD: {"bytes": 4096, "header_crc32": 0}}
    doc["tensors"] = {"model/w": {"dtype": "float32", "shape": [2, width], "chunks": chunks}}
    return doc


def test_more_than_64_chunks_that_do_not_form_a_grid_are_refused() -> None:
    assert len(parse(forge.manifest_bytes(_brick(31))).tensors["model/w"].chunks) == 63
    with pytest.raises(CheckpointCorruptError, match="do not form a grid, and 65 chunks"):
        parse(forge.manifest_bytes(_brick(32)))
    overlapping = _brick(31)
    overlapping["tensors"]["model/w"]["chunks"][1]["offsets"] = [0, 1]  # overlaps a0
    with pytest.raises(CheckpointCorruptError, match="overlap or leave holes"):
        parse(forge.manifest_bytes(overlapping))


# ======================================================================================
# Parsing memory is proportional to the manifest


def test_parsing_a_ten_megabyte_manifest_peaks_under_eight_times_its_size() -> None:
    tensors, per_tensor = 4, 17_000
    doc = forge.grid_doc(1, 1, block_bytes=16 << 20)
    doc["files"] = {SHARD: {"bytes": 1 << 40, "header_crc32": 0}}
    doc["tensors"] = {
        f"model/layers.{t}.weight": {
            "dtype": "float32",
            "shape": [4, per_tensor],
            "chunks": [
                {
                    "file": SHARD,
                    "name": f"model/layers.{t}.weight@0,{i}",
                    "offsets": [0, i],
                    "shape": [4, 1],
                    "crc32": [(t * per_tensor + i) * 2654435761 & 0xFFFFFFFF],
                }
                for i in range(per_tensor)
            ],
        }
        for t in range(tensors)
    }
    doc["values"] = {
        "model": {
            "kind": "module",
            "meta": {"tensors": [f"layers.{t}.weight" for t in range(tensors)], "extra": {}},
        }
    }
    raw = forge.manifest_bytes(doc)
    assert 8 << 20 < len(raw) < 14 << 20, len(raw)
    tracemalloc.start()
    try:
        manifest = parse(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(len(r.chunks) for r in manifest.tensors.values()) == tensors * per_tensor
    assert peak < 8 * len(raw), f"peak {peak / len(raw):.1f}x the manifest's {len(raw)} bytes"
