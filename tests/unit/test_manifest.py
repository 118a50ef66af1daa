"""``manifest.parse``: the manifest is hostile input, and every defect is a CheckpointCorruptError.

``valid_doc()`` is a small manifest written out by hand (so the format is pinned here, not
just whatever the writer happens to emit); each test breaks one thing in it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardsafe.checkpoint.format import geometry
from shardsafe.checkpoint.format.manifest import (
    ChunkRecord,
    Manifest,
    TensorRecord,
    crc_block_count,
    parse,
)
from shardsafe.errors import CheckpointCorruptError, CheckpointVersionError
from tests import forge

S0 = "shard-00000-of-00002.safetensors"
S1 = "shard-00001-of-00002.safetensors"


def chunk(file: str, name: str, offsets: list[int], shape: list[int], crc: list[int]) -> dict:
    return {"file": file, "name": name, "offsets": offsets, "shape": shape, "crc32": crc}


def valid_doc() -> dict[str, Any]:
    return {
        "format": "shardsafe",
        "version": 1,
        "layout": "sharded",
        "world_size": 2,
        "checksum": {"algorithm": "crc32", "block_bytes": 64},
        "info": {"shardsafe_version": "0.1.0"},
        "files": {S0: {"bytes": 1000}, S1: {"bytes": 1000}},
        "values": {
            "model": {"kind": "module", "meta": {"tensors": ["w", "n"], "extra": {}}},
            "step": {"kind": "value", "meta": 7},
        },
        "tensors": {
            # 4x6 float32 split on dim 0 across two files: 48 bytes each, one CRC block.
            "model/w": {
                "dtype": "float32",
                "shape": [4, 6],
                "chunks": [
                    chunk(S0, "model/w@0,0", [0, 0], [2, 6], [1]),
                    chunk(S1, "model/w@2,0", [2, 0], [2, 6], [2]),
                ],
            },
            # 0-d tensor: empty offsets and shape.
            "model/n": {
                "dtype": "int64",
                "shape": [],
                "chunks": [chunk(S0, "model/n", [], [], [3])],
            },
            # empty tensor: zero bytes, still one CRC.
            "opt/e": {
                "dtype": "bfloat16",
                "shape": [0, 3],
                "chunks": [chunk(S1, "opt/e", [0, 0], [0, 3], [0])],
            },
            # 160 bytes at block_bytes=64: three CRC blocks.
            "opt/big": {
                "dtype": "float32",
                "shape": [40],
                "chunks": [chunk(S1, "opt/big", [0], [40], [4, 5, 6])],
            },
        },
    }


def raw(doc: Any) -> bytes:
    return json.dumps(doc).encode("utf-8")


def test_the_valid_doc_parses_into_typed_records() -> None:
    m = parse(raw(valid_doc()))
    assert (m.layout, m.world_size, m.block_bytes) == ("sharded", 2, 64)
    assert m.files == {S0: 1000, S1: 1000}
    w = m.tensors["model/w"]
    assert w.dtype == torch.float32 and w.shape == (4, 6) and w.nbytes == 96
    assert [(c.file, c.offsets, c.shape, c.crc32) for c in w.chunks] == [
        (S0, (0, 0), (2, 6), (1,)),
        (S1, (2, 0), (2, 6), (2,)),
    ]
    assert m.tensors["model/n"].shape == () and m.tensors["opt/e"].dtype == torch.bfloat16
    assert m.values["step"].kind == "value" and m.values["step"].meta == 7


def test_to_json_and_parse_round_trip() -> None:
    m = parse(raw(valid_doc()))
    assert isinstance(m, Manifest)
    assert parse(m.to_json()) == m
    assert parse(m.to_json(version=1)) == m
    assert json.loads(m.to_json(version=1))["tensors"] == valid_doc()["tensors"]


def test_the_writer_writes_version_2_as_the_forge_reads_it() -> None:
    """The writer's chunk table, decoded by the tests' own reader of the format."""
    m = parse(raw(valid_doc()))
    doc = json.loads(m.to_json())
    assert doc["version"] == 2 and set(doc["chunks"]) == {
        "rows", "names", "file", "name", "offsets", "shape", "crc32"
    }  # fmt: skip
    assert doc["tensors"]["model/w"] == {"dtype": "float32", "shape": [4, 6], "chunks": 2}
    expanded = forge.expanded(doc)
    assert expanded["tensors"] == dict(sorted(valid_doc()["tensors"].items()))
    assert parse(forge.manifest_bytes(expanded)) == m


def test_an_empty_tensor_with_a_huge_dim_is_still_a_tensor() -> None:
    # torch.empty((2**62, 0)) exists, so a manifest may describe it.
    doc = valid_doc()
    doc["tensors"]["opt/e"]["shape"] = [2**62, 0]
    doc["tensors"]["opt/e"]["chunks"] = [chunk(S1, "opt/e", [0, 0], [2**62, 0], [0])]
    m = parse(raw(doc))
    assert m.tensors["opt/e"].nbytes == 0
    assert torch.empty(m.tensors["opt/e"].shape).numel() == 0


def test_crc_block_count() -> None:
    assert [crc_block_count(n, 64) for n in (0, 1, 64, 65, 128, 129)] == [1, 1, 1, 2, 2, 3]


Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    def apply(doc: dict[str, Any]) -> None:
        *parents, last = path.split(":")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return apply


def _del(path: str) -> Mutation:
    def apply(doc: dict[str, Any]) -> None:
        *parents, last = path.split(":")
        node: Any = doc
        for p in parents:
            node = node[p]
        del node[last]

    return apply


def _rename_file(new: str) -> Mutation:
    def apply(doc: dict[str, Any]) -> None:
        doc["files"][new] = doc["files"].pop(S0)
        for rec in doc["tensors"].values():
            for c in rec["chunks"]:
                if c["file"] == S0:
                    c["file"] = new

    return apply


W0 = "tensors:model/w:chunks:0"
W1 = "tensors:model/w:chunks:1"

CASES: dict[str, tuple[Mutation, str]] = {
    "wrong format": (_set("format", "pytorch"), "'format' is 'pytorch'"),
    "version missing": (_del("version"), "'version' is None"),
    "version zero": (_set("version", 0), "'version' is 0"),
    "version bool": (_set("version", True), "'version' is True"),
    "version string": (_set("version", "1"), "'version' is '1'"),
    "unknown layout": (_set("layout", "zip"), "'layout' is 'zip'"),
    "world size 0": (_set("world_size", 0), "'world_size'"),
    "no checksum": (_del("checksum"), "'checksum'"),
    "md5 checksum": (_set("checksum:algorithm", "md5"), "'checksum'"),
    "block not multiple of 8": (_set("checksum:block_bytes", 60), "block_bytes"),
    "files not an object": (_set("files", []), "'files' is not an object"),
    "file size missing": (_set(f"files:{S0}", {}), f"file '{S0}' has no valid 'bytes'"),
    "file size negative": (_set(f"files:{S0}", {"bytes": -1}), "no valid 'bytes'"),
    "tensors not an object": (_set("tensors", [1]), "'tensors' is not an object"),
    "values not an object": (_set("values", None), "'values' is not an object"),
    "value without kind": (_set("values:step", {"meta": 1}), "value 'step' lacks 'kind'"),
    "info not an object": (_set("info", "x"), "'info' is not an object"),
    "unknown dtype": (_set("tensors:model/w:dtype", "float128"), "unknown dtype 'float128'"),
    "dtype not a string": (_set("tensors:model/w:dtype", ["float32"]), "unknown dtype"),
    "negative dim": (_set("tensors:model/w:shape", [-4, 6]), "the shape of 'model/w' is not"),
    "float dim": (_set("tensors:model/w:shape", [4.0, 6]), "the shape of 'model/w' is not"),
    "bool dim": (_set("tensors:model/w:shape", [True, 6]), "the shape of 'model/w' is not"),
    "65 dims": (_set("tensors:model/n:shape", [1] * 65), "the shape of 'model/n' is not"),
    "huge shape": (
        _set("tensors:model/w:shape", [4, 2**40]),
        "chunks of 'model/w' overlap or leave holes",
    ),
    "shape over 2**63 elements": (
        _set("tensors:model/w:shape", [4, 2**62]),
        "the shape of 'model/w' is too large",
    ),
    "huge chunk": (
        _set(
            "tensors:opt/big",
            {
                "dtype": "float32",
                "shape": [2**40],
                "chunks": [chunk(S1, "opt/big", [0], [2**40], [0])],
            },
        ),
        "a chunk of 'opt/big' is larger than file",
    ),
    "huge empty shape": (
        _set(
            "tensors:opt/e",
            {
                "dtype": "bfloat16",
                "shape": [2**40, 2**40, 0],
                "chunks": [chunk(S1, "opt/e", [0, 0, 0], [2**40, 2**40, 0], [0])],
            },
        ),
        "the shape of 'opt/e' is too large",
    ),
    "dim beyond int64": (
        _set(
            "tensors:opt/e",
            {
                "dtype": "bfloat16",
                "shape": [2**64, 0],
                "chunks": [chunk(S1, "opt/e", [0, 0], [2**64, 0], [0])],
            },
        ),
        "the shape of 'opt/e' is too large",
    ),
    "no chunks": (_set("tensors:model/w:chunks", []), "no valid 'chunks' list"),
    "overlapping chunks": (_set(f"{W1}:offsets", [1, 0]), "overlap or leave holes"),
    "hole between chunks": (
        _set(W1, chunk(S1, "model/w@2,0", [2, 0], [1, 6], [2])),
        "overlap or leave holes",
    ),
    "duplicated chunk": (_set(W1, chunk(S0, "model/w@0,0", [0, 0], [2, 6], [1])), "overlap"),
    "chunk outside tensor": (_set(f"{W1}:offsets", [3, 0]), "lies outside the tensor's shape"),
    "chunk rank differs": (_set(f"{W1}:offsets", [2]), "lies outside the tensor's shape"),
    "negative offset": (_set(f"{W1}:offsets", [-2, 0]), "offsets of a chunk of 'model/w'"),
    "chunk in unlisted file": (
        _set(f"{W0}:file", "other.safetensors"),
        "which 'files' does not list",
    ),
    "chunk without name": (_set(f"{W0}:name", ""), "no valid 'name'"),
    "too few crcs": (
        _set("tensors:opt/big:chunks:0:crc32", [4, 5]),
        "'opt/big' has no valid 'crc32'",
    ),
    "too many crcs": (_set(f"{W0}:crc32", [1, 1]), "'model/w' has no valid 'crc32'"),
    "no crc for empty": (_set("tensors:opt/e:chunks:0:crc32", []), "'opt/e' has no valid 'crc32'"),
    "crc over 32 bits": (_set(f"{W0}:crc32", [2**32]), "no valid 'crc32'"),
    "crc negative": (_set(f"{W0}:crc32", [-1]), "no valid 'crc32'"),
    "crc not a list": (_set(f"{W0}:crc32", 1), "no valid 'crc32'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_defect_is_reported_as_corruption(case: str) -> None:
    mutate, fragment = CASES[case]
    doc = valid_doc()
    mutate(doc)
    with pytest.raises(CheckpointCorruptError) as info:
        parse(raw(doc), "ckpt/manifest.json")
    assert type(info.value) is CheckpointCorruptError
    msg = str(info.value)
    assert msg.startswith("ckpt/manifest.json is malformed: "), msg
    assert fragment in msg, msg


@pytest.mark.parametrize(
    "name",
    [
        "../x.safetensors",
        "/tmp/x.safetensors",
        "sub/x.safetensors",
        "..safetensors",
        "a..b.safetensors",
        ".hidden.safetensors",
        "x.safetensors/",
        "x.bin",
        "x.safetensors\n",
        "C:\\x.safetensors",
        "x" * 300 + ".safetensors",
    ],
)
def test_file_names_that_are_not_plain_names_in_the_directory_are_refused(name: str) -> None:
    doc = valid_doc()
    _rename_file(name)(doc)
    with pytest.raises(
        CheckpointCorruptError, match=re.escape("is not a plain '*.safetensors' name")
    ) as info:
        parse(raw(doc))
    assert repr(name) in str(info.value)


def test_a_newer_version_asks_to_upgrade() -> None:
    doc = valid_doc()
    doc["version"] = 3
    with pytest.raises(CheckpointVersionError) as info:
        parse(raw(doc), "ckpt/manifest.json")
    msg = str(info.value)
    assert "ckpt/manifest.json declares format version 3" in msg
    assert "reads versions up to 2" in msg and "Upgrade shardsafe" in msg


def test_a_newer_version_is_reported_before_fields_it_may_have_changed() -> None:
    doc = {"format": "shardsafe", "version": 99, "something": "new"}
    with pytest.raises(CheckpointVersionError, match="version 99"):
        parse(raw(doc))


def test_duplicate_json_keys_are_refused() -> None:
    text = raw(valid_doc()).decode()
    dup = text.replace('"layout": "sharded"', '"layout": "sharded", "layout": "consolidated"')
    assert dup != text
    with pytest.raises(CheckpointCorruptError, match="not valid JSON: duplicate key 'layout'"):
        parse(dup.encode())


def test_duplicate_keys_deep_inside_are_refused() -> None:
    text = raw(valid_doc()).decode()
    dup = text.replace('"crc32": [1]', '"crc32": [1], "crc32": [1]', 1)
    assert dup != text
    with pytest.raises(CheckpointCorruptError, match="duplicate key 'crc32'"):
        parse(dup.encode())


def test_non_utf8_is_refused() -> None:
    data = raw(valid_doc()).replace(b'"0.1.0"', b'"0.1.0\xff"')
    with pytest.raises(CheckpointCorruptError, match="is not valid UTF-8"):
        parse(data)


@pytest.mark.parametrize("depth", [10_000, 200_000])
def test_absurd_nesting_is_refused(depth: int) -> None:
    doc = valid_doc()
    doc["info"] = "NEST"
    data = raw(doc).replace(b'"NEST"', b"[" * depth + b"]" * depth)
    with pytest.raises(CheckpointCorruptError, match="nested too deeply"):
        parse(data)


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_standard_json_constants_are_refused(constant: bytes) -> None:
    data = raw(valid_doc()).replace(b'"0.1.0"', constant)
    with pytest.raises(CheckpointCorruptError, match="non-standard constant"):
        parse(data)


@pytest.mark.parametrize("data", [b"", b"[]", b"null", b"{", b"\xef\xbb\xbf{}", b'"x"'])
def test_garbage_is_corruption(data: bytes) -> None:
    with pytest.raises(CheckpointCorruptError):
        parse(data)


# ------------------------------------------------------------------ property tests

_json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, 7, 8, 64, 2**31, 2**63, -1])
    | st.floats(allow_nan=False)
    | st.text(max_size=6)
    | st.sampled_from(["../x.safetensors", "/etc/passwd", S0, S1, "float32", "bfloat16", "sharded"])
)
_json = st.recursive(
    _json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _check_trustworthy(m: Manifest) -> None:
    """What downstream code relies on when parse succeeds."""
    for name in m.files:
        assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\.safetensors", name) and ".." not in name
    for rec in m.tensors.values():
        assert isinstance(rec, TensorRecord) and all(isinstance(c, ChunkRecord) for c in rec.chunks)
        assert geometry.tiles(rec.shape, [(c.offsets, c.shape) for c in rec.chunks])
        for c in rec.chunks:
            assert c.file in m.files and len(c.offsets) == len(c.shape) == len(rec.shape)


def _parse_or_corrupt(data: bytes) -> None:
    try:
        m = parse(data)
    except CheckpointCorruptError:
        return
    _check_trustworthy(m)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_manifests_parse_or_raise_corrupt(data: st.DataObject) -> None:
    doc = valid_doc()
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        paths = _paths(doc)
        path = data.draw(st.sampled_from(paths), label="path")
        if not path:
            doc = data.draw(_json, label="document")
            continue
        parent: Any = doc
        for p in path[:-1]:
            parent = parent[p]
        action = data.draw(st.sampled_from(["replace", "delete", "insert"]), label="action")
        if action == "replace":
            parent[path[-1]] = data.draw(_json, label="value")
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=6), label="key")] = data.draw(_json, label="value")
        else:
            parent.insert(path[-1], data.draw(_json, label="value"))
    _parse_or_corrupt(json.dumps(doc).encode("utf-8"))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_byte_mutated_manifests_parse_or_raise_corrupt(data: st.DataObject) -> None:
    buf = bytearray(raw(valid_doc()))
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        pos = data.draw(st.integers(0, len(buf) - 1), label="pos")
        kind = data.draw(st.sampled_from(["flip", "delete", "insert", "truncate"]), label="kind")
        if kind == "flip":
            buf[pos] ^= data.draw(st.integers(1, 255), label="mask")
        elif kind == "delete":
            del buf[pos]
        elif kind == "insert":
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=4), label="bytes")
        else:
            del buf[pos:]
        if not buf:
            buf = bytearray(b" ")
    _parse_or_corrupt(bytes(buf))


@settings(max_examples=200, deadline=None)
@given(_json)
def test_arbitrary_json_parses_or_raises_corrupt(doc: Any) -> None:
    _parse_or_corrupt(json.dumps(doc).encode("utf-8"))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_parse_or_raise_corrupt(data: bytes) -> None:
    _parse_or_corrupt(data)


def test_the_garbage_collector_is_paused_while_parsing_and_left_as_it_was() -> None:
    """Manifests are parsed with the collector paused (its traversals made large manifests
    superlinear, ``gc_pause``); afterwards it is as the program left it, after a
    refusal too, and a program that disabled it finds it still disabled."""
    import gc

    from shardsafe.checkpoint.format import gc_pause

    assert gc.isenabled()
    with pytest.raises(ValueError, match="inside"), gc_pause.paused():
        assert not gc.isenabled()
        raise ValueError("inside")
    assert gc.isenabled()
    with pytest.raises(CheckpointCorruptError):
        parse(b"{not json")
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(CheckpointCorruptError):
            parse(b"{not json")
        assert not gc.isenabled()
    finally:
        gc.enable()
