"""Format version 2: the chunk table (``manifest_table.py``) is hostile input like the rest.

Each defect of ``test_manifest.CASES`` is applied again to the same manifest written as
version 2 (its chunk table packed by ``tests/forge.py``, independently of the writer), and
must be refused again; then attacks on the table itself: malformed columns, wrong
lengths, out-of-range indices, huge numbers, duplicate names, and tilings that only the
vectorised grid check sees. A property test checks that versions 1 and 2 accept and
refuse exactly the same chunk arrangements.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardsafe
from shardsafe.checkpoint.format.manifest import (
    ChunkRecord,
    Manifest,
    TensorRecord,
    crc_block_count,
    parse,
)
from shardsafe.checkpoint.loading import read_manifest
from shardsafe.checkpoint.verifying import find_problems
from shardsafe.errors import CheckpointCorruptError
from shardsafe.protocol import SavedValue
from tests import forge
from tests.unit.test_manifest import CASES, S0, valid_doc

WHERE = "ckpt/manifest.json"


def v2_doc() -> dict[str, Any]:
    """``valid_doc()`` as version 2 (expanded: chunks still objects; packed on writing)."""
    doc = valid_doc()
    doc["version"] = 2
    doc["checksum"]["covers"] = ["data", "manifest"]
    return doc


def packed() -> dict[str, Any]:
    return forge.pack(v2_doc())


def refused(raw: bytes) -> str:
    with pytest.raises(CheckpointCorruptError) as info:
        parse(raw, WHERE)
    assert type(info.value) is CheckpointCorruptError
    msg = str(info.value)
    assert msg.startswith(f"{WHERE} is malformed: ") or msg.startswith(f"{WHERE} is damaged"), msg
    return msg


def test_the_version_2_doc_parses_like_version_1() -> None:
    assert parse(forge.manifest_bytes(v2_doc())) == parse(json.dumps(valid_doc()).encode())
    m = parse(forge.manifest_bytes(v2_doc()))
    assert m.version == 2 and m.covers == frozenset({"data", "manifest"})


# ------------------------------------------------- version 1's defects, in version 2

V2_FRAGMENTS = {
    "no checksum": "'manifest_crc32' and 'checksum.covers' disagree",
    "no chunks": "'model/w' has no valid chunk count",
    "chunk rank differs": "'chunks.offsets' holds 6 values, not the 7",
    "negative offset": "a chunk of 'model/w' lies outside the tensor's shape",
    "chunk in unlisted file": "index out of range",
    "chunk without name": "'chunks.names' is not a list of valid stored tensor names",
    "too few crcs": "'chunks.crc32' holds",
    "too many crcs": "'chunks.crc32' holds",
    "no crc for empty": "'chunks.crc32' holds",
    "crc over 32 bits": "'chunks.crc32' is not one of ['u32']",
    "crc negative": "'chunks.crc32' is not one of ['u32']",
}
"""Where version 2 words the same refusal differently (a column, not a record)."""
V1_ONLY = {
    "dim beyond int64": "a chunk's shape of 2**64 does not fit an i64 column",
    "crc not a list": "a column holds numbers, not lists",
}
"""Defects of chunk records that version 2's columns cannot express at all."""


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_defect_is_refused_in_version_2(case: str) -> None:
    mutate, fragment = CASES[case]
    doc = v2_doc()
    mutate(doc)
    try:
        raw = forge.manifest_bytes(doc)
    except forge.Unpackable:
        assert case in V1_ONLY
        return
    assert case not in V1_ONLY
    msg = refused(raw)
    assert V2_FRAGMENTS.get(case, fragment) in msg, msg


# ----------------------------------------------------------- attacks on the table


def _table(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    return lambda doc: edit(doc["chunks"])


def _column(name: str, values: list[int], kind: str = "u32") -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["chunks"][name] = forge.pack_column(values, kind)

    return edit


def _raw_column(name: str, text: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["chunks"][name] = text

    return edit


def _u32(values: list[int]) -> str:
    return "u32:" + base64.b64encode(struct.pack(f"<{len(values)}I", *values)).decode()


# The packed valid doc's columns, in tensor order model/w (2 chunks), model/n (0-d),
# opt/e ([0, 3]), opt/big ([40]):
FILES = [0, 1, 0, 1, 1]
NAMES = [0, 1, 2, 3, 4]
OFFSETS = [0, 0, 2, 0, 0, 0, 0]
SHAPES = [2, 6, 2, 6, 0, 3, 40]
CRCS = [1, 2, 3, 0, 4, 5, 6]

TABLE_CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "no table": (lambda d: d.pop("chunks"), "'chunks' is not an object"),
    "table a list": (lambda d: d.__setitem__("chunks", []), "'chunks' is not an object"),
    "table key missing": (_table(lambda t: t.pop("crc32")), "'chunks' has keys"),
    "table key unknown": (_table(lambda t: t.__setitem__("extra", 1)), "'chunks' has keys"),
    "rows wrong": (_table(lambda t: t.__setitem__("rows", 4)), "'chunks.rows' is 4"),
    "rows bool": (_table(lambda t: t.__setitem__("rows", True)), "'chunks.rows' is True"),
    "rows string": (_table(lambda t: t.__setitem__("rows", "5")), "'chunks.rows' is '5'"),
    "names not a list": (_table(lambda t: t.__setitem__("names", "x")), "'chunks.names' is not"),
    "name not a string": (
        _table(lambda t: t["names"].__setitem__(0, 7)),
        "'chunks.names' is not",
    ),
    "name too long": (
        _table(lambda t: t["names"].__setitem__(0, "n" * 4097)),
        "'chunks.names' is not",
    ),
    "duplicate names": (
        _table(lambda t: t["names"].__setitem__(1, t["names"][0])),
        "'chunks.names' lists 'model/w@0,0' twice",
    ),
    "column not a string": (_raw_column("file", [0, 1]), "'chunks.file' is not one of"),
    "column without type": (
        _raw_column("file", base64.b64encode(bytes(20)).decode()),
        "'chunks.file' is not one of",
    ),
    "column of unknown type": (
        _raw_column("file", "u64:" + base64.b64encode(bytes(40)).decode()),
        "'chunks.file' is not one of ['u32']",
    ),
    "index column as i64": (_column("name", NAMES, "i64"), "'chunks.name' is not one of ['u32']"),
    "not base64": (_raw_column("file", "u32:AAAA*AAA"), "'chunks.file' is not one of"),
    "base64 with a newline": (
        _raw_column("file", "u32:" + base64.encodebytes(bytes(20)).decode()),
        "'chunks.file' is not one of",
    ),
    "base64 badly padded": (_raw_column("file", "u32:AAAAAA"), "'chunks.file' is not one of"),
    "non-ascii column": (_raw_column("file", "u32:AAAA\u00e9AAA"), "'chunks.file' is not one of"),
    "partial value": (
        _raw_column("file", "u32:" + base64.b64encode(bytes(19)).decode()),
        "'chunks.file' is not one of",
    ),
    "file column short": (_column("file", FILES[:4]), "'chunks.file' holds 4 values, not the 5"),
    "name column long": (_column("name", [*NAMES, 0]), "'chunks.name' holds 6 values, not the 5"),
    "offsets short": (_column("offsets", OFFSETS[:6]), "'chunks.offsets' holds 6 values"),
    "shape long": (_column("shape", [*SHAPES, 1]), "'chunks.shape' holds 8 values"),
    "file index out of range": (_column("file", [0, 2, 0, 1, 1]), "index out of range"),
    "file index 2**32-1": (_column("file", [0, 2**32 - 1, 0, 1, 1]), "index out of range"),
    "name index out of range": (_column("name", [0, 1, 2, 3, 5]), "index out of range"),
    "offset 2**63-1": (
        _column("offsets", [0, 0, 2**63 - 1, 0, 0, 0, 0], "i64"),
        "a chunk of 'model/w' lies outside",
    ),
    "offset plus shape overflows": (
        _column("offsets", [0, 0, 2**63 - 2, 0, 0, 0, 0], "i64"),
        "a chunk of 'model/w' lies outside",
    ),
    "shape 2**63-1": (
        _column("shape", [2, 6, 2**63 - 1, 6, 0, 3, 40], "i64"),
        "a chunk of 'model/w' lies outside",
    ),
    "negative shape": (
        _column("shape", [2, 6, 2, 6, 0, 3, -40], "i64"),
        "a chunk of 'opt/big' lies outside",
    ),
    "crc column short": (_column("crc32", CRCS[:6]), "'chunks.crc32' holds 6 values"),
    "crc column long": (_column("crc32", [*CRCS, 0]), "'chunks.crc32' holds 8 values"),
    "chunk count zero": (lambda d: d["tensors"]["model/w"].update(chunks=0), "chunk count"),
    "chunk count bool": (lambda d: d["tensors"]["model/n"].update(chunks=True), "chunk count"),
    "chunk count a list": (lambda d: d["tensors"]["model/w"].update(chunks=[]), "chunk count"),
    "chunk count 65537": (lambda d: d["tensors"]["model/w"].update(chunks=65537), "chunk count"),
    "chunk count 10**30": (lambda d: d["tensors"]["model/w"].update(chunks=10**30), "chunk count"),
    "counts shifted between tensors": (
        lambda d: (
            d["tensors"]["model/w"].update(chunks=1),
            d["tensors"]["opt/e"].update(chunks=2),
        ),
        "a chunk of 'opt/e' lies outside",
    ),
    "aliased stored tensor": (_column("name", [0, 1, 2, 3, 3]), "which another chunk names too"),
    "version 2 without its own checksum": (
        lambda d: d["checksum"].update(covers=["data"]),
        "'manifest_crc32' and 'checksum.covers' disagree",
    ),
}


@pytest.mark.parametrize("case", sorted(TABLE_CASES))
def test_each_defect_of_the_table_is_refused(case: str) -> None:
    edit, fragment = TABLE_CASES[case]
    doc = packed()
    assert (doc["chunks"]["file"], doc["chunks"]["name"]) == (_u32(FILES), _u32(NAMES))
    assert doc["chunks"]["offsets"] == _u32(OFFSETS) and doc["chunks"]["crc32"] == _u32(CRCS)
    edit(doc)
    msg = refused(forge.manifest_bytes(doc))
    assert fragment in msg, msg


def test_version_2_without_the_manifest_covered_is_refused_even_without_a_trailer() -> None:
    doc = packed()
    doc["checksum"]["covers"] = ["data"]
    assert "'checksum.covers' lacks 'manifest'" in refused(json.dumps(doc).encode())


# ------------------------------------------------------------- sizes and overflow


def _one_tensor(
    shape: list[int], boxes: list[tuple[list[int], list[int]]], *, dtype: str = "float32"
) -> dict[str, Any]:
    """A packed version 2 manifest of one tensor ``t`` whose chunks are ``boxes``, each a
    stored tensor of its own in one large file."""
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    chunks = []
    for i, (off, size) in enumerate(boxes):
        n = itemsize
        for s in size:
            n *= s
        chunks.append(
            {"file": S0, "name": f"c{i}", "offsets": off, "shape": size,
             "crc32": [0] * crc_block_count(n, 64)}
        )  # fmt: skip
    doc = {
        "format": "shardsafe",
        "version": 2,
        "layout": "sharded",
        "world_size": 1,
        "checksum": {"algorithm": "crc32", "block_bytes": 64, "covers": ["data", "manifest"]},
        "info": {},
        "files": {S0: {"bytes": 1 << 40}},
        "values": {"t": {"kind": "value", "meta": {"__tensor__": "t"}}},
        "tensors": {"t": {"dtype": dtype, "shape": shape, "chunks": chunks}},
    }
    return forge.pack(doc)


def test_a_chunk_whose_byte_count_overflows_int64_is_larger_than_its_file() -> None:
    doc = _one_tensor([1], [([0], [1])], dtype="float64")
    doc["tensors"]["t"]["shape"] = [2**62]
    doc["chunks"]["shape"] = forge.pack_column([2**62], "i64")
    doc["files"][S0]["bytes"] = 2**62
    assert "a chunk of 't' is larger than file" in refused(forge.manifest_bytes(doc))


def test_crc_counts_that_would_overflow_their_sum_are_refused_without_allocating() -> None:
    """Sixteen chunks of 2**59 blocks each sum to 2**63: the count of each is checked
    against the column's length before anything is summed or allocated."""
    doc = _one_tensor([16], [([i], [1]) for i in range(16)], dtype="uint8")
    doc["tensors"]["t"]["shape"] = [2**62]
    doc["files"][S0]["bytes"] = 2**62
    doc["checksum"]["block_bytes"] = 8
    doc["chunks"]["offsets"] = forge.pack_column([0] * 16, "i64")
    doc["chunks"]["shape"] = forge.pack_column([2**62] * 16, "i64")
    msg = refused(forge.manifest_bytes(doc))
    assert "'chunks.crc32' holds 16 values, not one per checksum block" in msg


# ------------------------------------------------------------------------ tiling


def _grid(rows: int, cols: int, height: int = 2, width: int = 3) -> list[Any]:
    return [([r * height, c * width], [height, width]) for r in range(rows) for c in range(cols)]


@pytest.mark.parametrize(
    ("boxes", "shape"),
    [
        (_grid(8, 8), [16, 24]),  # 64 chunks, a 2-d grid: the vectorised check
        (_grid(40, 1), [80, 3]),
        ([([i], [1]) for i in range(100)], [100]),
        ([([0], [37]), *[([37 + i], [1]) for i in range(40)]], [77]),  # uneven intervals
        ([*(([i, 0], [1, 5]) for i in range(40)), ([0, 0], [0, 5])], [40, 5]),  # an empty one
        ([([0, 0], [0, 5])] * 40, [0, 5]),
    ],
    ids=["8x8", "40x1", "100 on dim 0", "uneven", "with an empty chunk", "empty tensor"],
)
def test_grids_are_accepted(boxes: list[Any], shape: list[int]) -> None:
    m = parse(forge.manifest_bytes(_one_tensor(shape, boxes)))
    assert [(list(c.offsets), list(c.shape)) for c in m.tensors["t"].chunks] == [
        (list(o), list(s)) for o, s in boxes
    ]


@pytest.mark.parametrize(
    ("boxes", "shape", "fragment"),
    [
        # 64 cells, but one of them twice and one missing: only the cell check sees it.
        (
            [*_grid(8, 8)[:-1], _grid(8, 8)[0]],
            [16, 24],
            "overlap or leave holes",
        ),
        # 40 chunks on dim 0, one shifted into its neighbour.
        (
            [*(([i], [1]) for i in range(39)), ([38], [1])],
            [40],
            "overlap or leave holes",
        ),
        # 101 chunks that cover the tensor exactly once but not in a grid: more than the
        # pairwise check accepts.
        (
            [([0, 0], [1, 100]), *(([1, i], [1, 1]) for i in range(100))],
            [2, 100],
            "do not form a grid, and 101 chunks",
        ),
        # 40 chunks that cover the tensor but one interval is longer than its start gap.
        (
            [*(([i], [1]) for i in range(38)), ([38], [3]), ([39], [1])],
            [41],
            "overlap or leave holes",
        ),
        # A single chunk that is only part of the tensor.
        ([([0, 0], [2, 3])], [4, 3], "overlap or leave holes"),
    ],
    ids=["a cell twice", "shifted", "not a grid, 100", "overlong interval", "single partial"],
)
def test_tilings_that_are_not_exact_are_refused(
    boxes: list[Any], shape: list[int], fragment: str
) -> None:
    msg = refused(forge.manifest_bytes(_one_tensor(shape, boxes)))
    assert f"the chunks of 't' {fragment}" in msg, msg


@st.composite
def _arrangements(draw: st.DrawFn) -> tuple[list[int], list[Any]]:
    """A grid over a random shape (random cuts in each dim, up to ~100 cells, so that
    both checks of version 2 are reached), shuffled, then perhaps damaged: a cell
    dropped, doubled, shifted, resized, emptied, or an empty chunk added."""
    ndim = draw(st.integers(1, 3))
    shape, intervals = [], []
    for _ in range(ndim):
        extent = draw(st.integers(1, 60))
        cuts = sorted(set(draw(st.lists(st.integers(1, extent), max_size=12))) - {extent})
        bounds = [0, *cuts, extent]
        shape.append(extent)
        intervals.append([(a, b - a) for a, b in itertools.pairwise(bounds)])
    boxes: list[Any] = [([], [])]
    for dim_intervals in intervals:
        boxes = [([*o, s], [*n, ln]) for o, n in boxes for s, ln in dim_intervals][:150]
    boxes = draw(st.permutations(boxes))
    damage = draw(st.sampled_from(["none", "drop", "double", "shift", "resize", "empty", "add"]))
    i = draw(st.integers(0, len(boxes) - 1))
    dim = draw(st.integers(0, ndim - 1))
    off, size = list(boxes[i][0]), list(boxes[i][1])
    if damage == "drop" and len(boxes) > 1:
        del boxes[i]
    elif damage == "double":
        boxes.append((off, size))
    elif damage in ("shift", "resize"):
        which = off if damage == "shift" else size
        which[dim] = max(0, which[dim] + draw(st.sampled_from([-1, 1])))
        boxes[i] = (off, size)
    elif damage == "empty":
        size[dim] = 0
        boxes[i] = (off, size)
    elif damage == "add":
        size[dim] = 0
        boxes.append((off, size))
    return shape, boxes


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_arrangements())
def test_versions_1_and_2_accept_and_refuse_the_same_arrangements(
    drawn: tuple[list[int], list[Any]],
) -> None:
    """Grids, and grids with one defect (overlaps, holes, chunks outside the tensor, empty
    ones), with 1 to ~150 chunks: version 2's column checks (and its vectorised grid
    check, from ``table_tiling.GRID_VECTOR_MIN`` chunks) decide exactly as version 1's
    per-record checks."""
    shape, boxes = drawn
    v2 = _one_tensor(shape, boxes)
    v1 = copy.deepcopy(forge.expanded(v2))
    v1["version"] = 1
    outcomes: list[Any] = []
    for doc in (v1, v2):
        try:
            outcomes.append(parse(forge.manifest_bytes(doc)).tensors["t"].chunks)
        except CheckpointCorruptError:
            outcomes.append(CheckpointCorruptError)
    assert (outcomes[0] is CheckpointCorruptError) == (outcomes[1] is CheckpointCorruptError)
    assert outcomes[0] == outcomes[1]


# ------------------------------------------------------------- fuzzing the table


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["file", "name", "offsets", "shape", "crc32"]),
    st.sampled_from(["u32", "i64", "x"]),
    st.binary(max_size=64),
)
def test_any_column_content_parses_or_is_refused_as_corruption(
    column: str, kind: str, data: bytes
) -> None:
    doc = packed()
    doc["chunks"][column] = f"{kind}:" + base64.b64encode(data).decode()
    try:
        m = parse(forge.manifest_bytes(doc))
    except CheckpointCorruptError:
        return
    for rec in m.tensors.values():  # what parse promises, checked record by record
        for c in rec.chunks:
            assert c.file in m.files and len(c.offsets) == len(c.shape) == len(rec.shape)
            assert all(o >= 0 and o + n <= s for o, n, s in zip(c.offsets, c.shape, rec.shape))


# ------------------------------------------------------------------- the writer


def fsdp_like(ranks: int, params: int) -> Manifest:
    files = {f"shard-{r:05d}-of-{ranks:05d}.safetensors": 1 << 30 for r in range(ranks)}
    names = list(files)
    tensors = {
        f"model/p{p}": TensorRecord(
            torch.float32,
            (2 * ranks, 8),
            tuple(
                ChunkRecord(names[r], f"model/p{p}", (2 * r, 0), (2, 8), (r * params + p,))
                for r in range(ranks)
            ),
        )
        for p in range(params)
    }
    values = {"model": SavedValue("model", "module", {})}
    return Manifest("sharded", ranks, 16 << 20, values, tensors, files, {}, dict.fromkeys(files, 7))


def test_a_large_manifest_round_trips_and_builds_records_only_when_asked() -> None:
    m = fsdp_like(64, 50)
    raw = m.to_json()
    back = parse(raw)
    assert back == m
    assert len(raw) < len(m.to_json(version=1)) / 2
    doc = json.loads(raw)
    assert doc["chunks"]["offsets"].startswith("u32:")


def test_100_thousand_chunks_parse_into_every_record() -> None:
    """How long it takes is measured in ``benchmarks/validation_scale.py``."""
    m = parse(fsdp_like(100, 1000).to_json())
    assert len(m.tensors) == 1000 and len(m.tensors["model/p7"].chunks) == 100
    assert m.tensors["model/p7"].chunks[99].offsets == (198, 0)


# ------------------------------------------------ checkpoints written as version 1


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_a_version_1_checkpoint_still_loads_inspects_and_verifies(
    tmp_path: Path, layout: str
) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    shardsafe.save(
        tmp_path / "c", {"model": model, "optimizer": opt, "x": torch.arange(5)}, layout=layout
    )
    path = tmp_path / "c" / "manifest.json"
    assert json.loads(path.read_bytes())["version"] == 2
    path.write_bytes(parse(path.read_bytes()).to_json(version=1))  # as an older shardsafe
    assert json.loads(path.read_bytes())["version"] == 1
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    out = shardsafe.load(tmp_path / "c", {"model": fresh, "optimizer": fresh_opt})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(out["x"], torch.arange(5))
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].equal(
        opt.state_dict()["state"][0]["exp_avg"]
    )
    assert shardsafe.inspect(tmp_path / "c").format_version == 1
    assert shardsafe.verify(tmp_path / "c").ok
    assert find_problems(str(tmp_path / "c"), read_manifest(tmp_path / "c")) == []
