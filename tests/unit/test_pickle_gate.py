"""Hostile pickles against every path that unpickles: DCP's ``.metadata``, ``.pt``/``.ckpt``
files (converters, ``interop``, Lightning resume) and the ``torch.save`` items inside
``.distcp`` files.

Each bomb is built opcode by opcode (``tests/pickles.py``) and each case runs in a child
process (``tests/isolated.py``) under an address-space limit and a time bound. A case
passes only if the child ends by itself, raising exactly ``CheckpointCorruptError`` with
the expected words, and the interpreter is unchanged (no class or module attribute set,
no module imported). Before the pickle gate, the same inputs segfaulted CPython (deep
tuples hashed as keys), hung every reader (shared tuples with 2**60 leaves), replaced
``pathlib.PosixPath.__truediv__`` or imported ``torch._dynamo``.
"""

from __future__ import annotations

import collections
import contextlib
import io
import pickle
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import shardsafe
from shardsafe import interop
from shardsafe.converters.dcp_metadata import parse_metadata
from shardsafe.pickles import load_torch
from tests import pickles as P
from tests.isolated import Outcome, run_isolated
from tests.lightning.helpers import Run, outcomes

pytestmark = pytest.mark.timeout(180)

CORRUPT = "shardsafe.errors.CheckpointCorruptError"
DCP_MD = "torch.distributed.checkpoint.metadata"
MEMORY = 1 << 30
SECONDS = 30.0


# ------------------------------------------------------------------ what an attacker wrote

BOMBS: dict[str, tuple[bytes, str]] = {
    "tuple 200,000 deep as a key": (P.dict_with_key(P.deep_tuple(200_000)), "levels deep"),
    "tuple 200,000 deep as a value": (P.dict_with_value(P.deep_tuple(200_000)), "levels deep"),
    "2**60 shared leaves as a key": (P.sharing_bomb_as_key(60), "walking or hashing"),
    "2**60 shared leaves as a value": (P.sharing_bomb_as_value(60), "walking or hashing"),
    "a list containing itself": (P.self_containing_list(), "contains itself"),
    "memo index 2**32 - 16": (
        P.PROTO2 + P.i(1) + P.put(2**32 - 16) + P.STOP,
        "skips ahead",
    ),
    "an integer of 100,000 bytes": (
        P.PROTO2 + b"\x8b" + (100_000).to_bytes(4, "little") + b"\x01" * 100_000 + P.STOP,
        "an integer of 100000 bytes",
    ),
    "an extension code": (P.PROTO2 + b"\x82\x01" + P.STOP, "opcode 0x82"),
    "a length past the end": (P.PROTO2 + b"\x8d" + (2**62).to_bytes(8, "little"), "past the end"),
    "bytes after STOP": (P.pickled({"a": 1}) + b"trailing", "follow its STOP"),
    "torch._dynamo named": (P.PROTO2 + P.glob("torch", "_dynamo") + P.STOP, "torch._dynamo"),
}

BUILDS: dict[str, tuple[bytes, str]] = {
    "an attribute added to DCP's Metadata class": (
        P.build_on_global(DCP_MD, "Metadata", {"evil": P.i(1)}, slots=True),
        "the global torch.distributed.checkpoint.metadata.Metadata",
    ),
    "pathlib.PosixPath.__truediv__ replaced": (
        P.build_on_global("pathlib", "PosixPath", {"__truediv__": P.NONE}, slots=True),
        "the global pathlib.PosixPath",
    ),
    "_get_layout's cache poisoned": (
        P.build_on_global(
            "torch.serialization", "_get_layout", {"cache": P.EMPTY_DICT}, slots=False
        ),
        "the global torch.serialization._get_layout",
    ),
    "a field that a MetadataIndex does not have": (
        P.PROTO2
        + P.glob(DCP_MD, "MetadataIndex")
        + P.EMPTY_TUPLE
        + P.NEWOBJ
        + P.EMPTY_DICT
        + P.s("__class__")
        + P.glob("pathlib", "PosixPath")
        + P.SETITEM
        + P.BUILD
        + P.STOP,
        "'__class__' on a MetadataIndex",
    ),
    "a layout made by _get_layout, then filled": (
        P.PROTO2
        + P.glob("torch.serialization", "_get_layout")
        + P.s("torch.strided")
        + P.TUPLE1
        + P.REDUCE
        + P.EMPTY_DICT
        + P.BUILD
        + P.STOP,
        "BUILD",
    ),
}


COLLIDING_KEYS = P.PROTO2 + P.EMPTY_DICT + P.MARK
COLLIDING_KEYS += (
    b"".join(P.long1(k) + P.i(0) for k in P.colliding_ints(4000)) + P.SETITEMS + P.STOP
)
# What each of these was, before: a dict taking seconds to minutes to fill, 256 MiB from a
# 517-byte file, a 2 GiB tensor of uninitialized memory, a quadratic codec, an
# OrderedDict whose items() was 3.
CALLS: dict[str, tuple[bytes, str, str]] = {  # pickle, fragment for DCP, for torch
    "4000 int keys sharing one hash": (COLLIDING_KEYS, "share a hash", "share a hash"),
    # The check itself was quadratic: 40,000 keys took a minute to be refused.
    "60,000 int keys sharing one hash": (
        P.PROTO2
        + P.EMPTY_DICT
        + P.MARK
        + b"".join(P.long1(k) + P.i(0) for k in P.colliding_ints(60_000))
        + P.SETITEMS
        + P.STOP,
        "share a hash",
        "share a hash",
    ),
    "bytearray(2**30)": (
        P.PROTO2 + P.call("builtins", "bytearray", P.i(2**30)) + P.STOP,
        "the global builtins.bytearray",
        "the global builtins.bytearray",
    ),
    "_rebuild_from_type_v2 calling torch.Tensor": (
        P.PROTO2
        + P.call(
            "torch._tensor",
            "_rebuild_from_type_v2",
            P.glob("torch", "Tensor"),
            P.glob("torch", "Tensor"),
            P.i(2**29) + P.TUPLE1,
            P.EMPTY_DICT,
        )
        + P.STOP,
        "the global torch._tensor._rebuild_from_type_v2",
        "the global torch._tensor._rebuild_from_type_v2",
    ),
    "punycode through _codecs.encode": (
        P.PROTO2 + P.call("_codecs", "encode", P.s("\u00e9" * 3000), P.s("punycode")) + P.STOP,
        "the global _codecs.encode",
        "calls _codecs.encode with arguments no real pickle gives it",
    ),
    "an OrderedDict given items=3": (
        P.PROTO2
        + P.call("collections", "OrderedDict")
        + P.EMPTY_DICT
        + P.s("items")
        + P.i(3)
        + P.SETITEM
        + P.BUILD
        + P.STOP,
        "sets the state (BUILD) of a collections.OrderedDict it made",
        "sets 'items' on a OrderedDict",
    ),
    "a Counter given a list": (
        P.PROTO2 + P.call("collections", "Counter", P.EMPTY_LIST) + P.STOP,
        "the global collections.Counter",
        "calls collections.Counter with arguments no real pickle gives it (one dict only)",
    ),
    "a Counter of colliding ints": (
        P.PROTO2
        + P.call(
            "collections",
            "Counter",
            P.EMPTY_DICT
            + P.MARK
            + b"".join(P.long1(k) + P.i(1) for k in P.colliding_ints(100))
            + P.SETITEMS,
        )
        + P.STOP,
        "the global collections.Counter",
        "share a hash",
    ),
    "a set of colliding ints": (
        P.PROTO2
        + P.call(
            "builtins",
            "set",
            P.EMPTY_LIST + P.MARK + b"".join(map(P.long1, P.colliding_ints(100))) + P.APPENDS,
        )
        + P.STOP,
        "the global builtins.set",
        "share a hash",
    ),
}


def _parse_metadata(raw: bytes) -> None:
    parse_metadata(raw, "evil/.metadata")


def _load_torch_bytes(raw: bytes) -> None:
    load_torch(io.BytesIO(raw), "evil.pt")


def _convert(src: str, dst: str) -> None:
    shardsafe.convert(src, dst, progress=False)


def _read_torch_file(path: str) -> None:
    interop.read_torch_file(path)


def assert_refused(outcome: Outcome, fragment: str) -> None:
    assert outcome.exitcode == 0, outcome.describe()
    assert outcome.error == CORRUPT, outcome.describe()
    assert fragment in outcome.message, outcome.describe()
    assert outcome.changed == [], outcome.describe()


# ------------------------------------------------------------------------ DCP's .metadata


@pytest.mark.parametrize("case", [*BOMBS, *BUILDS, *CALLS])
def test_a_hostile_dcp_metadata_is_refused_cleanly(case: str) -> None:
    raw, fragment = {**BOMBS, **BUILDS, **{k: v[:2] for k, v in CALLS.items()}}[case]
    assert_refused(
        run_isolated(_parse_metadata, raw, memory_bytes=MEMORY, seconds=SECONDS), fragment
    )


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    model = nn.Linear(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it saves in one process
        dcp.save({"model": model.state_dict(), "step": 3}, checkpoint_id=str(path))
    return path


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("case", ["tuple 200,000 deep as a key", "2**60 shared leaves as a key"])
def test_convert_of_a_dcp_checkpoint_with_a_bomb_for_metadata(
    dcp_dir: Path, tmp_path: Path, case: str
) -> None:
    ckpt = _copy(dcp_dir, tmp_path / "dcp")
    (ckpt / ".metadata").write_bytes(BOMBS[case][0])
    outcome = run_isolated(_convert, str(ckpt), str(tmp_path / "out"), seconds=SECONDS)
    assert_refused(outcome, BOMBS[case][1])
    assert ".metadata" in outcome.message
    assert not (tmp_path / "out").exists()


def _with_item_replaced(ckpt: Path, payload: bytes) -> None:
    """Point the checkpoint's step item at ``payload`` in a new data file (the attacker
    writes both the data and the index)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md = pickle.loads((ckpt / ".metadata").read_bytes())  # our own file: trusted here
    (index,) = [i for i in md.storage_data if i.fqn == "step"]
    (ckpt / "evil.distcp").write_bytes(payload)
    md.storage_data[index] = _StorageInfo("evil.distcp", 0, len(payload))
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize(
    "case", ["tuple 200,000 deep as a key", "2**60 shared leaves as a value", "torch._dynamo named"]
)
def test_a_bomb_inside_a_distcp_item_is_refused(dcp_dir: Path, tmp_path: Path, case: str) -> None:
    ckpt = _copy(dcp_dir, tmp_path / "dcp")
    _with_item_replaced(ckpt, P.torch_archive(BOMBS[case][0]))
    outcome = run_isolated(_convert, str(ckpt), str(tmp_path / "out"), seconds=SECONDS)
    assert_refused(outcome, BOMBS[case][1])
    assert "evil.distcp" in outcome.message


def test_a_dcp_checkpoint_still_converts_and_loads(dcp_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shardsafe.convert(dcp_dir, out, progress=False)
    model = nn.Linear(4, 3)
    assert shardsafe.load(out, {"model": model})["step"] == 3


def test_a_planner_path_five_thousand_names_long_is_refused(dcp_dir: Path) -> None:
    md = pickle.loads((dcp_dir / ".metadata").read_bytes())
    md.planner_data["step"] = tuple(f"n{k}" for k in range(5000))
    outcome = run_isolated(_parse_metadata, pickle.dumps(md), seconds=SECONDS)
    assert_refused(outcome, "a path 5000 names long")


# ------------------------------------------------------------------- .pt and .ckpt files


TORCH_BUILDS: dict[str, tuple[bytes, str]] = {
    "OrderedDict's class filled": (
        P.build_on_global("collections", "OrderedDict", {"evil": P.i(1)}, slots=True),
        "the global collections.OrderedDict",
    ),
    "a rebuild function's __dict__ filled": (
        P.build_on_global("torch._utils", "_rebuild_tensor_v2", {"x": P.i(1)}, slots=False),
        "the global torch._utils._rebuild_tensor_v2",
    ),
    "_get_layout's cache poisoned": BUILDS["_get_layout's cache poisoned"],
    "a layout made by _get_layout, then filled": BUILDS[
        "a layout made by _get_layout, then filled"
    ],
    "DCP's Metadata named": (
        BUILDS["an attribute added to DCP's Metadata class"][0],
        "not part of what torch.load",
    ),
}


@pytest.mark.parametrize("case", [*BOMBS, *TORCH_BUILDS, *CALLS])
def test_a_hostile_torch_file_is_refused_cleanly(case: str) -> None:
    raw, fragment = {**BOMBS, **TORCH_BUILDS, **{k: (v[0], v[2]) for k, v in CALLS.items()}}[case]
    archive = P.torch_archive(raw)
    assert_refused(run_isolated(_load_torch_bytes, archive, seconds=SECONDS), fragment)


@pytest.mark.parametrize(
    "case",
    ["tuple 200,000 deep as a key", "2**60 shared leaves as a value", "memo index 2**32 - 16"],
)
def test_convert_and_import_of_a_hostile_pt_are_refused(tmp_path: Path, case: str) -> None:
    path = tmp_path / "evil.pt"
    path.write_bytes(P.torch_archive(BOMBS[case][0]))
    for outcome in (
        run_isolated(_convert, str(path), str(tmp_path / "out"), seconds=SECONDS),
        run_isolated(_read_torch_file, str(path), seconds=SECONDS),
    ):
        assert_refused(outcome, BOMBS[case][1])
        assert str(path) in outcome.message
    assert not (tmp_path / "out").exists()


def test_a_record_that_inflates_past_the_file_is_refused() -> None:
    archive = P.deflated_archive(P.pickled({"a": 1}), padding=64 << 20)
    assert len(archive) < 1 << 20
    outcome = run_isolated(_load_torch_bytes, archive, memory_bytes=256 << 20, seconds=SECONDS)
    assert_refused(outcome, "more than the whole file holds")


def test_records_that_together_inflate_past_the_file_are_refused() -> None:
    archive = P.many_deflated_records(1000, 256 << 10)
    assert len(archive) < 1 << 20  # a 256 MiB load, from a file of under 1 MiB
    outcome = run_isolated(_load_torch_bytes, archive, memory_bytes=128 << 20, seconds=SECONDS)
    assert_refused(outcome, "more than the whole file holds")


class _Storage:
    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _Tensor:
    """Pickles as torch.save's rebuild of a 1-D float tensor over ``storage``."""

    def __init__(self, storage: _Storage) -> None:
        self.storage = storage

    def __reduce__(self) -> tuple[Any, ...]:
        rebuild = torch._utils._rebuild_tensor_v2
        size = (self.storage.numel,)
        return (rebuild, (self.storage, 0, size, (1,), False, collections.OrderedDict()))


class _StoragePickler(pickle.Pickler):
    def persistent_id(self, obj: object) -> object:
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return None


def _archive_declaring(numel: int, record: bytes, tmp_path: Path) -> Path:
    """A torch.save archive whose pickle declares storage '0' as ``numel`` floats, and
    whose record ``data/0`` holds ``record``; a second tensor's record follows it."""
    out = io.BytesIO()
    _StoragePickler(out, protocol=2).dump(
        {"w": _Tensor(_Storage("0", numel)), "secret": _Tensor(_Storage("1", 1))}
    )
    storages = {"0": record, "1": torch.tensor([42.0]).numpy().tobytes()}
    path = tmp_path / "declared.pt"
    path.write_bytes(P.torch_archive(out.getvalue(), storages=storages))
    return path


def test_a_storage_declared_larger_than_its_record_is_refused(tmp_path: Path) -> None:
    """torch.load(mmap=True), which the converters use, cuts each storage out of the file
    as long as the pickle says: a 4-byte record declared as 8 bytes gave the tensor the
    next record's bytes, and 1-byte records each declared to run to the end made a 4 MB
    file convert to 9 GiB (found in review). torch.load without mmap refuses it too."""
    path = _archive_declaring(2, torch.tensor([1.0]).numpy().tobytes(), tmp_path)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.load(path, weights_only=True)
    expected = (
        f"{path}: its pickle declares the storage '0' as 8 bytes, but its record 'data/0' "
        "holds 4: the file is damaged or crafted (torch.save writes each storage's bytes as "
        "its record, and torch.load(weights_only=True) refuses it too)"
    )
    with pytest.raises(shardsafe.CheckpointCorruptError) as refused:
        shardsafe.convert(path, tmp_path / "out.pt", to="torch")
    assert str(refused.value) == expected
    assert not (tmp_path / "out.pt").exists()
    with pytest.raises(shardsafe.CheckpointCorruptError) as refused:
        interop.read_torch_file(path)
    assert str(refused.value) == expected
    smaller = _archive_declaring(1, torch.tensor([1.0, 2.0]).numpy().tobytes(), tmp_path)
    with pytest.raises(shardsafe.CheckpointCorruptError, match="as 4 bytes, but its record"):
        interop.read_torch_file(smaller)
    exact = _archive_declaring(2, torch.tensor([1.0, 2.0]).numpy().tobytes(), tmp_path)
    assert interop.read_torch_file(exact)["w"].tolist() == [1.0, 2.0]


def test_a_tensor_with_attributes_is_refused_naming_the_rebuild(tmp_path: Path) -> None:
    t = torch.ones(3)
    t.numel = 5  # type: ignore[method-assign]  # torch.save keeps instance attributes
    torch.save({"w": t}, tmp_path / "attr.pt")
    outcome = run_isolated(_convert, str(tmp_path / "attr.pt"), str(tmp_path / "out"))
    assert_refused(outcome, "the global torch._tensor._rebuild_from_type_v2")


def test_metadata_keys_crafted_to_collide_are_refused(dcp_dir: Path) -> None:
    """DCP's storage_data is keyed by MetadataIndex(fqn, offset): offsets whose numbers
    hash alike make every key collide, and filling the dict quadratic."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = pickle.loads((dcp_dir / ".metadata").read_bytes())  # our own file: trusted here
    for k in P.colliding_ints(2000):
        md.storage_data[MetadataIndex("model.weight", torch.Size([k]))] = _StorageInfo("x", 0, 0)
    outcome = run_isolated(_parse_metadata, pickle.dumps(md), seconds=SECONDS)
    assert_refused(outcome, "more than 32 distinct keys of one dict or set share a hash")


def test_metadata_of_a_dataclass_never_filled_is_corrupt() -> None:
    raw = P.PROTO2 + P.glob(DCP_MD, "Metadata") + P.EMPTY_TUPLE + P.NEWOBJ + P.STOP
    assert_refused(run_isolated(_parse_metadata, raw), "is not valid DCP metadata")


def test_the_legacy_format_is_refused_with_the_way_out(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    outcome = run_isolated(_read_torch_file, str(path), seconds=SECONDS)
    assert_refused(outcome, "torch.save(torch.load(path, weights_only=True), new_path)")


def test_a_fifo_named_as_a_torch_file_is_refused_without_opening_it(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "x.ckpt"
    os.mkfifo(fifo)
    with pytest.raises(shardsafe.CheckpointCorruptError, match="named pipe"):
        interop.read_torch_file(fifo)


def test_real_torch_files_still_load(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), betas=(0.8, 0.9))
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    saved = {
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "tied": [model[0].weight, model[0].weight],
        "extra": {"bytes": b"\x00\xff", "set": {1, 2}, "complex": 1j, "dtype": torch.bfloat16},
        # MultiStepLR's milestones are a Counter: a Lightning checkpoint with one was refused
        "lr_schedulers": [torch.optim.lr_scheduler.MultiStepLR(opt, [3, 9, 9]).state_dict()],
        "u16": torch.zeros(3, dtype=torch.uint16),
        "f8": torch.ones(2, dtype=torch.float8_e4m3fn),  # an UntypedStorage reference
        "empty": torch.zeros(0),
        "flags": torch.tensor([True, False]),
        "param": nn.Parameter(torch.ones(2)),
    }
    path = tmp_path / "real.ckpt"
    torch.save(saved, path)
    loaded = interop.read_torch_file(path)
    assert loaded["state_dict"]["0.weight"].equal(saved["state_dict"]["0.weight"])
    assert loaded["state_dict"]._metadata == saved["state_dict"]._metadata
    assert loaded["optimizer_states"][0]["param_groups"][0]["betas"] == (0.8, 0.9)
    assert loaded["extra"] == saved["extra"]
    milestones = loaded["lr_schedulers"][0]["milestones"]
    assert type(milestones) is Counter and milestones == Counter({3: 1, 9: 2})
    assert loaded["tied"][0] is loaded["tied"][1]
    assert loaded["u16"].dtype == torch.uint16 and isinstance(loaded["param"], nn.Parameter)
    for name in ("f8", "empty", "flags"):
        assert loaded[name].dtype == saved[name].dtype
        assert loaded[name].view(torch.uint8).equal(saved[name].view(torch.uint8)), name


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["2**60 shared leaves as a value", "tuple 200,000 deep as a key"])
def test_lightning_resume_from_a_hostile_ckpt_fails_cleanly(tmp_path: Path, case: str) -> None:
    bomb = tmp_path / "evil.ckpt"
    bomb.write_bytes(P.torch_archive(BOMBS[case][0]))
    codes = Run(tmp_path, "--resume", str(bomb), devices=1).wait(timeout=120)
    assert codes == [1]
    (outcome,) = outcomes(tmp_path, 1)
    assert outcome["error"].startswith("CheckpointCorruptError: "), outcome
    assert BOMBS[case][1] in outcome["error"] and str(bomb) in outcome["error"]


# ------------------------------------------------------------ opcode streams, generated

_GLOBALS = [
    (DCP_MD, "Metadata"), (DCP_MD, "MetadataIndex"), ("pathlib", "PosixPath"),
    ("torch.serialization", "_get_layout"), ("torch", "Size"), ("torch", "float32"),
    ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
    ("builtins", "eval"), ("os", "system"), ("torch", "_dynamo"), ("builtins", "getattr"),
    ("_codecs", "encode"), ("builtins", "bytearray"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "complex"), ("torch", "device"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"), (DCP_MD, "_MEM_FORMAT_ENCODING"),
]  # fmt: skip
_FIXED = [
    P.MARK, P.EMPTY_DICT, P.EMPTY_LIST, P.EMPTY_TUPLE, P.TUPLE, P.TUPLE1, P.TUPLE2,
    P.SETITEM, P.SETITEMS, P.APPEND, P.APPENDS, P.REDUCE, P.BUILD, P.NEWOBJ, P.NONE,
    b"0", b"1", b"2", b"\x94", b"\x88", b"\x8f", b"\x90", b"\x91", b"\x93", b"Q", b"d", b"l",
]  # fmt: skip
_TOKENS = st.one_of(
    st.sampled_from(_FIXED),
    st.builds(P.i, st.integers(-(2**31), 2**31 - 1)),
    st.builds(P.s, st.sampled_from(["", "a", "state", "cache", "__class__", "torch", "Size"])),
    st.builds(P.put, st.integers(0, 6)),
    st.builds(P.get, st.integers(0, 6)),
    st.builds(lambda g: P.glob(*g), st.sampled_from(_GLOBALS)),
    st.builds(P.deep_tuple, st.sampled_from([3, 150, 50_000])),
    st.builds(P.shared_tuple, st.integers(1, 64)),
    st.builds(P.long1, st.sampled_from(P.colliding_ints(8))),
    st.builds(P.s, st.sampled_from(["latin1", "punycode", "_metadata", "items"])),
    st.binary(max_size=6),
)
_STREAMS = st.lists(_TOKENS, max_size=30).map(lambda ts: P.PROTO2 + b"".join(ts) + P.STOP)


def _fuzz(reader: Callable[[bytes], Any]) -> int:
    """Run inside the child: every generated stream is read, or refused as corrupt."""
    seen = [0]

    @settings(
        max_examples=250,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(_STREAMS)
    def each(raw: bytes) -> None:
        seen[0] += 1
        with contextlib.suppress(shardsafe.CheckpointCorruptError):
            reader(raw)

    each()
    return seen[0]


def _fuzz_metadata() -> int:
    return _fuzz(lambda raw: parse_metadata(raw, "fuzz/.metadata"))


def _fuzz_torch() -> int:
    return _fuzz(lambda raw: load_torch(io.BytesIO(P.torch_archive(raw)), "fuzz.pt"))


@pytest.mark.parametrize("target", [_fuzz_metadata, _fuzz_torch], ids=["metadata", "torch"])
def test_generated_opcode_streams_end_in_a_result_or_a_corrupt_error(
    target: Callable[[], int],
) -> None:
    outcome = run_isolated(target, memory_bytes=MEMORY, seconds=150)
    assert outcome.exitcode == 0 and outcome.error is None, outcome.describe()
    assert outcome.result == 250 and outcome.changed == [], outcome.describe()


@pytest.mark.parametrize("tail", [b"\x8c", b"\x8c\x05ab"], ids=["no length", "short"])
def test_a_short_string_cut_off_at_the_end_is_corrupt(tail: bytes) -> None:
    """SHORT_BINUNICODE as the last byte (its length missing) is refused as corrupt, not an
    ``IndexError`` out of the scan's fast path."""
    with pytest.raises(shardsafe.CheckpointCorruptError, match="runs past the end"):
        parse_metadata(P.PROTO2 + P.i(3) + tail, "cut/.metadata")


# -------------------------------------------------- memory-mapping only where torch won't write


def _big_endian_copy(src: Path, dst: Path) -> None:
    """``src`` (float32 storages) as a big-endian machine's ``torch.save`` writes it."""
    import zipfile

    import numpy as np

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename:
                data = np.frombuffer(data, dtype="<f4").astype(">f4").tobytes()
            zout.writestr(info.filename, data)


def test_a_big_endian_file_with_shared_storage_converts_exactly(tmp_path: Path) -> None:
    base = torch.arange(4096, dtype=torch.float32)  # 16 KiB: whole pages to drop
    torch.save({"a": base, "tail": base[1024:]}, tmp_path / "little.pt")
    _big_endian_copy(tmp_path / "little.pt", tmp_path / "big.pt")
    shardsafe.convert(tmp_path / "big.pt", tmp_path / "out", progress=False)
    live = {"model": _Holder(base.shape, base[1024:].shape)}
    shardsafe.load(tmp_path / "out", live)
    assert torch.equal(live["model"].a, base) and torch.equal(live["model"].tail, base[1024:])


class _Holder(nn.Module):
    def __init__(self, a: torch.Size, tail: torch.Size) -> None:
        super().__init__()
        self.register_buffer("a", torch.zeros(a))
        self.register_buffer("tail", torch.zeros(tail))


def test_metadata_keys_colliding_apart_from_their_unhashed_index_are_refused(
    dcp_dir: Path,
) -> None:
    """MetadataIndex's ``index`` field takes no part in its hash (``hash=False``), but the
    scan counted it in: keys of one real hash, each with its own index, looked distinct
    in hash, and a 344 KB file took seconds (2 MB, minutes) to fill its dict."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = pickle.loads((dcp_dir / ".metadata").read_bytes())  # our own file: trusted here
    for n, k in enumerate(P.colliding_ints(2000)):
        key = MetadataIndex("model.weight", torch.Size([k]), index=n)
        md.storage_data[key] = _StorageInfo("x", 0, 0)
    outcome = run_isolated(_parse_metadata, pickle.dumps(md), seconds=SECONDS)
    assert_refused(outcome, "more than 32 distinct keys of one dict or set share a hash")


def test_complex_keys_crafted_to_collide_are_refused() -> None:
    """``hash(complex(x, y))`` is ``hash(x) + 1000003 * hash(y)``, as knowable as an
    int's, but a complex key was taken for unknowable and never counted: torch.load
    filled a dict of 60,000 such keys (2 MB) in about a minute."""
    keys = [complex(float(1000003 * k), float(-k)) for k in range(2, 2002)]
    assert len({hash(k) for k in keys}) == 1 and len(set(keys)) == 2000
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(2), "extra": dict.fromkeys(keys, 0)}, buffer)
    outcome = run_isolated(_load_torch_bytes, buffer.getvalue(), seconds=SECONDS)
    assert_refused(outcome, "more than 32 distinct keys of one dict or set share a hash")


def test_torchs_error_is_said_without_its_cpp_stack() -> None:
    """A tensor rebuilt with a size of 2**80: torch's error carried its C++ stack
    ("Exception raised from THPUtils_unpackLong ... frame #0: c10::Error::Error")."""
    storage = P.glob("torch", "FloatStorage")
    reference = (
        P.MARK + P.s("storage") + storage + P.s("0") + P.s("cpu") + P.i(4) + P.TUPLE + b"Q"
    )  # BINPERSID
    size = P.MARK + P.long1(2**80) + P.TUPLE
    rebuild = P.glob("torch._utils", "_rebuild_tensor_v2") + P.MARK + reference + P.i(0)
    rebuild += size + P.MARK + P.i(1) + P.TUPLE + b"\x89"  # NEWFALSE
    rebuild += P.glob("collections", "OrderedDict") + P.EMPTY_TUPLE + P.REDUCE
    rebuild += P.TUPLE + P.REDUCE
    pickled = P.PROTO2 + P.EMPTY_DICT + P.s("w") + rebuild + P.SETITEM + P.STOP
    archive = P.torch_archive(pickled, storages={"0": bytes(16)})
    with pytest.raises(shardsafe.CheckpointCorruptError) as refused:
        load_torch(io.BytesIO(archive), "crafted.pt")
    said = str(refused.value)
    assert said.startswith("cannot read crafted.pt with torch.load(weights_only=True): "), said
    assert "Exception raised from" not in said and "frame #" not in said, said
