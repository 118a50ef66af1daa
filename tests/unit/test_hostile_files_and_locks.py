"""Every hostile file ends in an error that names it: a Hugging Face index, a safetensors
header, a manifest, the trainer's metrics file, and a root lock (local or on an object
store), each damaged or forged.

Every parsing attack runs in a child process (``tests/isolated.py``) under a memory and
time bound: it must end in the named error class, with a message naming the file, and
change nothing in the interpreter. A damaged lock ends in a plain ``CheckpointError`` that
names it and says what to do, and is never taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointManager
from shardsafe.checkpoint.storage.lock import LOCK_NAME
from shardsafe.checkpoint.storage.object_storage import FsspecStorage
from shardsafe.converters import convert
from shardsafe.errors import CheckpointCorruptError
from shardsafe.trainer.metrics import MetricsLog
from tests import forge
from tests.isolated import Outcome, run_isolated
from tests.s3server import S3Server
from tests.unit.disk_helpers import snapshot, state

with contextlib.suppress(ImportError):  # loaded here, so that a child's case imports nothing
    import fsspec.implementations.chained  # noqa: F401 - what url_to_fs imports on first use
    import s3fs  # noqa: F401

pytestmark = pytest.mark.timeout(180)

CORRUPT = "shardsafe.errors.CheckpointCorruptError"
PLAIN = "shardsafe.errors.CheckpointError"
MEMORY = 512 << 20
DEEP = "[" * 100_000 + "]" * 100_000
DEEP_LOCK = "[" * 30_000 + "]" * 30_000
"""Under a lock's 64 KiB limit, far deeper than the parser recurses."""
DIGITS = "7" * 5000


# ------------------------------------- item 8: hostile files end in a named error


def _safetensors(header: str | bytes, data: bytes = b"") -> bytes:
    raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(raw)) + raw + data


def _entry(shape: str, end: int = 0) -> str:
    return f'{{"w": {{"dtype": "F32", "shape": {shape}, "data_offsets": [0, {end}]}}}}'


def hf_index(directory: Path, text: str) -> Path:
    from safetensors.torch import save_file

    directory.mkdir()
    save_file({"w": torch.ones(2)}, directory / "model-00001-of-00001.safetensors")
    index = directory / "model.safetensors.index.json"
    index.write_text(text)
    return index


def hf_file(directory: Path, raw: bytes) -> Path:
    directory.mkdir()
    path = directory / "model.safetensors"
    path.write_bytes(raw)
    return path


def forged_manifest(directory: Path, edit: Callable[[dict[str, Any]], str | None]) -> Path:
    """A checkpoint whose manifest is edited (and re-signed, as a forger would)."""
    shardsafe.save(directory, state())
    doc = forge.read_manifest(directory)
    doc["version"] = 1  # what version 2's columns cannot hold, version 1 can
    text = edit(doc)
    if text is None:
        forge.write_manifest(directory, doc)
    else:
        (directory / "manifest.json").write_bytes(forge.sign(text))
    return directory / "manifest.json"


def _shape(shape: list[int]) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"]["w"]["shape"] = shape
        doc["tensors"]["w"]["chunks"][0]["shape"] = shape
        doc["tensors"]["w"]["chunks"][0]["offsets"] = [0] * len(shape)

    return edit


def _step_value(literal: str) -> Callable[[dict[str, Any]], str]:
    """The saved ``step`` (a plain value) replaced by ``literal`` in the manifest's text."""

    def edit(doc: dict[str, Any]) -> str:
        doc.pop(forge.CRC_KEY, None)
        text = json.dumps(doc, indent=1)
        assert text.count('"meta": 0') == 1
        return text.replace('"meta": 0', f'"meta": {literal}')

    return edit


def metrics_file(directory: Path, line: str) -> Path:
    directory.mkdir()
    path = directory / "metrics.jsonl"
    path.write_text(f'{{"step": 1, "loss": NaN}}\n{line}\n{{"step": 2, "lo')
    return path


def converting(path: str) -> None:
    convert(path, path + ".out", to="shardsafe")


def loading(path: str) -> None:
    shardsafe.load(path, {"w": torch.zeros(4, 3), "b": torch.zeros(3)})


def opening_metrics(path: str) -> None:
    MetricsLog(path, after_step=0).close()


def without_int_limit(case: Callable[[str], None], path: str) -> None:
    """``case`` with the interpreter's digit limit off (as some programs set it)."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        case(path)
    finally:
        sys.set_int_max_str_digits(before)


HOSTILE: dict[str, tuple[Callable[[Path], Path], Callable[[str], None], str]] = {
    # name: (make the file, run the case on it, a fragment of the message)
    "hf index nested 100,000 deep": (
        lambda d: hf_index(d, f'{{"weight_map": {DEEP}}}'),
        converting,
        "nested too deeply",
    ),
    "hf index with a 5000-digit number": (
        lambda d: hf_index(d, f'{{"metadata": {{"total_size": {DIGITS}}}, "weight_map": {{}}}}'),
        converting,
        "a number of 5000 digits",
    ),
    "safetensors shape [2**62, 2**62, 0]": (
        lambda d: hf_file(d, _safetensors(_entry(f"[{2**62}, {2**62}, 0]"))),
        converting,
        "has a shape too large for any tensor",
    ),
    "safetensors shape [2**64, 0]": (
        lambda d: hf_file(d, _safetensors(_entry(f"[{2**64}, 0]"))),
        converting,
        "has a shape too large for any tensor",
    ),
    "safetensors shape [2**62, 2**62]": (
        lambda d: hf_file(d, _safetensors(_entry(f"[{2**62}, {2**62}]", 16), b"x" * 16)),
        converting,
        "its shape and dtype need over 2**64",
    ),
    "safetensors dims of 3000 digits": (
        lambda d: hf_file(d, _safetensors(_entry(f"[{'9' * 3000}, {'9' * 3000}]", 4), b"x" * 4)),
        converting,
        "its shape and dtype need over 2**64",
    ),
    "safetensors header with a 5000-digit number": (
        lambda d: hf_file(d, _safetensors(_entry(f"[{DIGITS}]"))),
        converting,
        "damaged safetensors header (a number of 5000 digits",
    ),
    "safetensors header nested 100,000 deep": (
        lambda d: hf_file(d, _safetensors(f'{{"w": {DEEP}}}')),
        converting,
        "damaged safetensors header (nested too deeply)",
    ),
    "manifest with a 5000-digit number": (
        lambda d: forged_manifest(d, _step_value(DIGITS)).parent,
        loading,
        "is not valid JSON: a number of 5000 digits",
    ),
    "manifest nested 100,000 deep": (
        lambda d: forged_manifest(d, _step_value(DEEP)).parent,
        loading,
        "nested too deeply",
    ),
    "manifest shape [2**62, 2**62]": (
        lambda d: forged_manifest(d, _shape([2**62, 2**62])).parent,
        loading,
        "is too large for any tensor",
    ),
    "manifest shape [2**62, 2**62, 0]": (
        lambda d: forged_manifest(d, _shape([2**62, 2**62, 0])).parent,
        loading,
        "is too large for any tensor",
    ),
    "metrics line with a 5000-digit number": (
        lambda d: metrics_file(d, f'{{"step": {DIGITS}, "loss": 1.0}}'),
        opening_metrics,
        "line 2 is not a metrics record (a number of 5000 digits",
    ),
    "metrics line nested 100,000 deep": (
        lambda d: metrics_file(d, DEEP),
        opening_metrics,
        "line 2 is not a metrics record (nested too deeply)",
    ),
}


@pytest.mark.parametrize("limit", ["default int limit", "no int limit"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_file_ends_in_a_corrupt_error_naming_it(
    tmp_path: Path, case: str, limit: str
) -> None:
    make, run, fragment = HOSTILE[case]
    path = make(tmp_path / "input")
    if limit == "default int limit":
        outcome = run_isolated(run, str(path), memory_bytes=MEMORY, seconds=60)
    else:
        outcome = run_isolated(without_int_limit, run, str(path), memory_bytes=MEMORY, seconds=60)
    assert outcome.exitcode == 0 and outcome.error == CORRUPT, outcome.describe()
    named = path if path.is_file() else path / "manifest.json"
    shown = str(named) if case.startswith(("hf index", "manifest", "metrics")) else named.name
    assert shown in outcome.message and fragment in outcome.message, outcome.describe()
    assert outcome.changed == [], outcome.describe()


# ----------------------------------------------------------------- damaged locks

HOST = socket.gethostname()


def _owner(**fields: Any) -> dict[str, Any]:
    return {"pid": 1, "host": "elsewhere", "started": "1", "token": "t", "since": 1.0e9, **fields}


def _json(**fields: Any) -> bytes:
    return json.dumps(_owner(**fields)).encode()


DAMAGED_LOCKS: dict[str, tuple[bytes, str]] = {
    # name: (the lock's bytes, a fragment of what is wrong)
    "nested 30,000 deep": (DEEP_LOCK.encode(), "it is nested too deeply"),
    "a 5000-digit number": (_json().replace(b'"pid": 1', f'"pid": {DIGITS}'.encode()), "digits"),
    "pid 2**70": (_json(pid=2**70), "its 'pid' is a number of about 22 digits"),
    "pid -1": (_json(pid=-1), "its 'pid' is -1, not a process id"),
    "pid 0": (_json(pid=0), "its 'pid' is 0"),
    "pid true": (_json(pid=True), "its 'pid' is True"),
    "pid a string": (_json(pid="123"), "its 'pid' is '123'"),
    "pid missing": (json.dumps({"host": "h", "since": 1.0}).encode(), "its 'pid' is None"),
    "since a string": (_json(since="yesterday"), "its 'since' is 'yesterday'"),
    "since 1e300": (_json(since=1e300), "its 'since' is 1e+300"),
    "since negative": (_json(since=-5), "its 'since' is -5"),
    "since 10**30": (_json(since=10**30), "its 'since' is a number of about 31 digits"),
    "host a number": (_json(host=42), "its 'host' is 42"),
    "host a list": (_json(host=["a"]), "its 'host' is a JSON array"),
    "host empty": (_json(host=""), "its 'host' is ''"),
    "host 300 characters": (_json(host="h" * 300), "not a host name of 1 to 255 characters"),
    "token an object": (_json(token={"a": 1}), "its 'token' is a JSON object"),
    "started 500 characters": (_json(started="9" * 500), "its 'started' is '999"),
    "not utf-8": (b'{"pid": "\xff"}', "it is not valid UTF-8"),
    "not json": (b"{pid: 1", "it is not valid JSON"),
    "NaN": (_json().replace(b"1000000000.0", b"NaN"), "non-standard constant NaN"),
    "an array": (b"[1, 2]", "it holds a JSON list, not an object"),
    "over 64 KiB": (_json(host="h") + b" " * (1 << 16), "over the 65536 limit"),
}


def _link_to_valid_lock(lock: Path, tmp: Path) -> str:
    (tmp / "valid.lock").write_bytes(_json(pid=os.getpid(), host=HOST))
    lock.symlink_to(tmp / "valid.lock")
    return "is a symbolic link"


def _fifo_lock(lock: Path, tmp: Path) -> str:
    os.mkfifo(lock)  # opening it to read would wait for a writer forever
    return "a named pipe (FIFO)"


def _directory_lock(lock: Path, tmp: Path) -> str:
    lock.mkdir()
    return "a directory"


LOCAL_ONLY: dict[str, Callable[[Path, Path], str]] = {
    "a symlink to a valid lock": _link_to_valid_lock,
    "a fifo": _fifo_lock,
    "a directory": _directory_lock,
}


def saving_under_a_lock(root: str) -> None:
    """A manager's first save into ``root`` (run in a child)."""
    manager = CheckpointManager(root, keep_last=2)
    try:
        manager.save(1, state())
    finally:
        manager.close()


def assert_damaged_lock(outcome: Outcome, where: str, fragment: str) -> None:
    assert outcome.exitcode == 0 and outcome.error == PLAIN, outcome.describe()
    assert f"the lock {where} is damaged: " in outcome.message, outcome.describe()
    assert fragment in outcome.message, outcome.describe()
    assert f"then delete {where} and save again" in outcome.message, outcome.describe()
    assert "no other run is saving into this root" in outcome.message
    assert outcome.changed == [], outcome.describe()


@pytest.mark.parametrize("case", sorted(DAMAGED_LOCKS) + sorted(LOCAL_ONLY))
def test_a_damaged_local_lock_is_named_and_never_taken_over(tmp_path: Path, case: str) -> None:
    root = tmp_path / "run"
    root.mkdir()
    lock = root / LOCK_NAME
    if case in DAMAGED_LOCKS:
        raw, fragment = DAMAGED_LOCKS[case]
        lock.write_bytes(raw)
    else:
        fragment = LOCAL_ONLY[case](lock, tmp_path)
    old = time.time() - 3600  # old enough for an empty lock to be taken over
    os.utime(lock, (old, old), follow_symlinks=False)
    before = snapshot(root)
    outcome = run_isolated(saving_under_a_lock, str(root), memory_bytes=MEMORY, seconds=60)
    assert_damaged_lock(outcome, str(lock), fragment)
    assert snapshot(root) == before  # nothing written, the lock untouched
    if lock.is_dir():
        lock.rmdir()
    else:
        lock.unlink()  # what the message says to do
    saving_under_a_lock(str(root))
    assert sorted(os.listdir(root)) == ["latest", "step-000000001"]


def saving_under_an_s3_lock(root: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    saving_under_a_lock(root)


S3_ONLY: dict[str, tuple[Callable[[S3Server, str], None], str]] = {
    # One PUT writes it, so an empty lock object is damaged (locally: an older writer's).
    "an empty object": (lambda s3, b: s3.put(b, f"run/{LOCK_NAME}", b""), "it is empty"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED_LOCKS) + sorted(S3_ONLY))
def test_a_damaged_object_store_lock_is_named_and_never_taken_over(
    s3_server: S3Server, s3_bucket: str, case: str
) -> None:
    root = f"s3://{s3_bucket}/run"
    if case in DAMAGED_LOCKS:
        raw, fragment = DAMAGED_LOCKS[case]
        s3_server.put(s3_bucket, f"run/{LOCK_NAME}", raw)
    else:
        put, fragment = S3_ONLY[case]
        put(s3_server, s3_bucket)
    before = {k: s3_server.get(s3_bucket, k) for k in s3_server.keys(s3_bucket)}
    outcome = run_isolated(
        saving_under_an_s3_lock, root, s3_server.env, memory_bytes=1 << 30, seconds=90
    )
    assert_damaged_lock(outcome, f"{root}/{LOCK_NAME}", fragment)
    assert {k: s3_server.get(s3_bucket, k) for k in s3_server.keys(s3_bucket)} == before


def a_held_lock_replaced_by_a_damaged_one(root: str, env: dict[str, str], raw: bytes) -> None:
    """A manager saves, someone replaces its lock with ``raw``, and it saves again."""
    os.environ.update(env)
    manager = CheckpointManager(root, keep_last=2)
    try:
        manager.save(1, state())
        with FsspecStorage(root) as storage:
            storage.commit(LOCK_NAME, raw)
        manager.save(2, state())
    finally:
        manager.close()  # leaves the damaged lock alone, without raising


def test_an_object_store_lock_damaged_while_held_stops_the_next_save(
    s3_server: S3Server, s3_bucket: str
) -> None:
    root = f"s3://{s3_bucket}/run"
    raw = _json(pid=2**70)
    outcome = run_isolated(
        a_held_lock_replaced_by_a_damaged_one, root, s3_server.env, raw, memory_bytes=1 << 30
    )
    assert_damaged_lock(outcome, f"{root}/{LOCK_NAME}", "its 'pid' is a number of about 22")
    assert s3_server.get(s3_bucket, f"run/{LOCK_NAME}") == raw
    assert "run/step-000000002/manifest.json" not in s3_server.keys(s3_bucket)


def test_damaged_lock_errors_are_not_corrupt_checkpoint_errors() -> None:
    """A damaged lock is not a damaged checkpoint: ``load_latest``'s fallback to an older
    checkpoint (which catches CheckpointCorruptError) must never swallow it."""
    from shardsafe.checkpoint.storage.lock_owner import damaged_lock

    assert not isinstance(damaged_lock("x", "y"), CheckpointCorruptError)
