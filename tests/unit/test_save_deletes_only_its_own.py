"""A save never deletes what it did not write.

What a save may delete (``leftovers.py``): only the regular files an interrupted shardsafe
save (or retention) recorded in its ``.shardsafe-incomplete`` marker (or, for an empty or
damaged marker, only the names no one but shardsafe gives: probes, temporary files). These
tests plant real files, symlinks, FIFOs and directories beside a marker, on disk and on a
real S3 API server (moto on loopback), and check byte for byte what is left; and they
interrupt real saves (SIGKILL mid-write) and a real retention, and check that the next save
into the same path clears exactly their leftovers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.checkpoint.storage import leftovers
from shardsafe.checkpoint.storage.files import LocalFileSink
from shardsafe.checkpoint.storage.local import LocalStorage
from shardsafe.checkpoint.storage.object_storage import FsspecFileSink, FsspecStorage
from shardsafe.checkpoint.storage.target_directory import INCOMPLETE_MARKER
from shardsafe.converters import convert
from shardsafe.errors import CheckpointError
from tests.isolated import run_isolated
from tests.s3server import S3Server
from tests.unit.disk_helpers import record, snapshot, state

with contextlib.suppress(ImportError):  # loaded here, so that a child's case imports nothing
    import fsspec.implementations.chained  # noqa: F401 - what url_to_fs imports on first use
    import s3fs  # noqa: F401

pytestmark = pytest.mark.timeout(180)

SHARD = "shard-00000-of-00001.safetensors"
PROBE = ".shardsafe-probe-" + "0" * 32
NOTES = b"my notes: not a checkpoint\n"
MEMORY = 512 << 20
DEEP = "[" * 100_000 + "]" * 100_000
DIGITS = "7" * 5000


def loads_back(path: Path | str, seed: int = 0) -> None:
    live = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    assert shardsafe.load(path, live)["step"] == seed
    expected = state(seed)
    assert torch.equal(live["w"], expected["w"]) and torch.equal(live["b"], expected["b"])


def plant(directory: Path, marker: bytes | None, **files: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if marker is not None:
        (directory / INCOMPLETE_MARKER).write_bytes(marker)
    for name, data in files.items():
        (directory / name).write_bytes(data)


def refused_save(path: Path) -> str:
    """Save into ``path``, which must be refused with nothing on disk changed."""
    before = snapshot(path)
    with pytest.raises(CheckpointError) as info:
        shardsafe.save(path, state())
    assert type(info.value) is CheckpointError
    assert snapshot(path) == before
    return str(info.value)


# ------------------------------------------------ item 7: what a save may delete


@pytest.mark.parametrize(
    "marker", [b"", record(PROBE, SHARD)], ids=["empty marker (older shardsafe)", "record"]
)
def test_a_stray_marker_does_not_let_a_save_delete_a_users_file(
    tmp_path: Path, marker: bytes
) -> None:
    target = tmp_path / "ckpt"
    plant(target, marker, **{"my_notes.txt": NOTES, SHARD: b"half written"})
    msg = refused_save(target)
    assert f"{target} holds an interrupted shardsafe save's leftovers, but also" in msg
    assert "'my_notes.txt' (a regular file)" in msg
    assert "nothing was deleted" in msg and "save to another path" in msg


def test_convert_to_shardsafe_does_not_delete_a_users_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    source = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(2, 2)}, source)
    target = tmp_path / "out"
    plant(target, b"", **{"my_notes.txt": NOTES})
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=r"'my_notes\.txt' \(a regular file\)"):
        convert(source, target, to="shardsafe")
    assert snapshot(target) == before
    rc, err = run_cli("convert", str(source), str(target), "--to", "shardsafe")
    assert rc == 1 and "'my_notes.txt' (a regular file)" in err, err
    assert snapshot(target) == before
    (target / "my_notes.txt").unlink()  # what the message says to do
    convert(source, target, to="shardsafe")
    assert sorted(os.listdir(target)) == ["manifest.json", SHARD]


def run_cli(*args: str) -> tuple[int, str]:
    import io

    from shardsafe import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(list(args))
    return rc, err.getvalue()


def _symlink_to_file(entry: Path, outside: Path) -> str:
    (outside / "precious.bin").write_bytes(b"precious")
    entry.symlink_to(outside / "precious.bin")
    return "a symbolic link"


def _symlink_to_directory(entry: Path, outside: Path) -> str:
    (outside / "inside.txt").write_bytes(b"precious")
    entry.symlink_to(outside)
    return "a symbolic link"


def _directory(entry: Path, outside: Path) -> str:
    entry.mkdir()
    (entry / "inside.txt").write_bytes(b"precious")
    return "a directory"


def _fifo(entry: Path, outside: Path) -> str:
    os.mkfifo(entry)
    return "a named pipe (FIFO)"


NOT_REGULAR: dict[str, Callable[[Path, Path], str]] = {
    "symlink to a file": _symlink_to_file,
    "symlink to a directory": _symlink_to_directory,
    "directory": _directory,
    "fifo": _fifo,
}


@pytest.mark.parametrize("kind", sorted(NOT_REGULAR))
@pytest.mark.parametrize("marker", [b"", None], ids=["empty marker", "recorded"])
def test_a_recorded_name_that_is_not_a_regular_file_is_never_cleared(
    tmp_path: Path, kind: str, marker: bytes | None
) -> None:
    """Even under a name the marker lists (or shardsafe's pattern covers): never followed,
    never deleted, and the save refused."""
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "ckpt"
    name = "shard-00001-of-00002.safetensors"
    plant(target, record(PROBE, name) if marker is None else marker)
    what = NOT_REGULAR[kind](target / name, outside)
    outside_before = snapshot(outside)
    msg = refused_save(target)
    assert f"'{name}' ({what})" in msg, msg
    assert snapshot(outside) == outside_before


def test_a_forged_record_cannot_name_a_users_file(tmp_path: Path) -> None:
    """A record may list anything; a save clears only shardsafe's own names of it."""
    target = tmp_path / "ckpt"
    forged = record("my_notes.txt", "../outside.txt", "model.safetensors", SHARD)
    plant(target, forged, **{"my_notes.txt": NOTES, SHARD: b"half written"})
    (tmp_path / "outside.txt").write_bytes(b"outside")
    msg = refused_save(target)
    assert "'my_notes.txt' (a regular file)" in msg and SHARD not in msg
    assert (tmp_path / "outside.txt").read_bytes() == b"outside"


def test_a_shardsafe_name_the_record_does_not_list_is_refused(tmp_path: Path) -> None:
    """An interrupted save recorded its probe only (it died before planning); a Hugging
    Face ``model.safetensors`` copied in since is not its writing."""
    target = tmp_path / "ckpt"
    plant(target, record(PROBE), **{PROBE: b"", "model.safetensors": b"someone's weights"})
    msg = refused_save(target)
    assert "'model.safetensors' (a regular file)" in msg and PROBE not in msg


def test_a_refusal_lists_a_bounded_number_of_entries(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    plant(target, b"", **{f"notes-{i:03d}.txt": b"x" for i in range(40)})
    msg = refused_save(target)
    assert "'notes-004.txt' (a regular file) and 35 more" in msg
    assert "notes-005.txt" not in msg


def test_a_directory_without_the_marker_is_refused_with_a_listing(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    plant(target, None, **{SHARD: b"x", "model.safetensors": b"y"})
    msg = refused_save(target)
    assert "is not empty (it holds 'model.safetensors' (a regular file), " in msg
    assert "not left over from an interrupted shardsafe save" in msg


def test_a_marker_that_is_not_a_regular_file_makes_the_directory_not_ours(
    tmp_path: Path,
) -> None:
    target = tmp_path / "ckpt"
    plant(target, None, **{SHARD: b"x"})
    (tmp_path / "elsewhere").write_bytes(b"")
    (target / INCOMPLETE_MARKER).symlink_to(tmp_path / "elsewhere")
    msg = refused_save(target)
    assert f"'{INCOMPLETE_MARKER}' (a symbolic link)" in msg


INTERNAL_ONLY = {
    ".manifest.json.tmp-1234": b"{",
    "..shardsafe-incomplete.tmp-99": b"{",
    PROBE: b"",
}
DATA_FILES = {
    "shard-00003-of-00004.safetensors": b"from an older, larger run",
    "model.safetensors": b"half written, or a user's",
}
OURS_ONLY = {**INTERNAL_ONLY, **DATA_FILES}


def _sparse(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(leftovers.MAX_MARKER_BYTES + 1)


DAMAGED_MARKERS: dict[str, Callable[[Path], object]] = {
    "empty (older shardsafe)": lambda p: p.write_bytes(b""),
    "not json": lambda p: p.write_bytes(b"{names: all"),
    "not utf-8": lambda p: p.write_bytes(b"\xff\xfe\x00"),
    "nested 100,000 deep": lambda p: p.write_text(DEEP),
    "a 5000-digit number": lambda p: p.write_text(f'{{"version": {DIGITS}}}'),
    "another format": lambda p: p.write_text('{"format": "x", "version": 1, "names": []}'),
    "names not strings": lambda p: p.write_text(
        '{"format": "shardsafe-incomplete", "version": 1, "names": [{"a": 1}]}'
    ),
    "over the size limit": _sparse,
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_MARKERS))
def test_an_empty_or_damaged_marker_clears_only_shardsafe_internal_names(
    tmp_path: Path, damage: str
) -> None:
    """No record to go by: only names no one but shardsafe gives (probes, commits'
    temporary files) are cleared; a data file, which may be a user's, and a user's own
    file refuse the save, listed; once they are moved the save commits."""
    target = tmp_path / "ckpt"
    plant(target, None, **OURS_ONLY, **{"my_notes.txt": NOTES})
    DAMAGED_MARKERS[damage](target / INCOMPLETE_MARKER)
    msg = refused_save(target)
    assert (
        "but also 'model.safetensors' (a regular file), 'my_notes.txt' (a regular file), "
        "'shard-00003-of-00004.safetensors' (a regular file), which that save did not record"
    ) in msg
    assert (target / "model.safetensors").read_bytes() == DATA_FILES["model.safetensors"]
    for name in (*DATA_FILES, "my_notes.txt"):
        (target / name).unlink()  # what the message says to do
    shardsafe.save(target, state())
    assert sorted(os.listdir(target)) == ["manifest.json", SHARD]
    loads_back(target)


class _Crash(BaseException):
    """Stands for the process dying: nothing catches it on the way out."""


class _RemovesOnce(LocalStorage):
    """A step directory whose deletion dies after its manifest and one data file."""

    def remove(self, name: str) -> None:
        super().remove(name)
        if name.endswith(".safetensors"):
            raise _Crash


class _RootOfDyingSteps(LocalStorage):
    def child(self, name: str) -> LocalStorage:
        return _RemovesOnce(os.path.join(self.directory, name))


def test_a_retention_killed_half_way_leaves_what_the_next_save_clears(tmp_path: Path) -> None:
    """Retention marks a step with a record of its files before deleting any: a crash in
    between leaves a directory the next save into that name recognises and clears."""
    step = tmp_path / "step-000000001"
    shardsafe.save(step, {**state(), "more": torch.ones(3)}, layout="consolidated")
    files = sorted(os.listdir(step))
    from shardsafe.checkpoint.storage.removal import delete_checkpoint

    with pytest.raises(_Crash), _RootOfDyingSteps(str(tmp_path)) as root:
        delete_checkpoint(root, step.name)
    left = sorted(os.listdir(step))
    assert "manifest.json" not in left and INCOMPLETE_MARKER in left
    assert len(left) == len(files) - 1  # one data file gone, the marker in the manifest's place
    assert leftovers.recorded_names(LocalStorage(str(step))) >= set(files) - {"manifest.json"}
    shardsafe.save(step, state(7))
    assert sorted(os.listdir(step)) == ["manifest.json", SHARD]
    loads_back(step, 7)


class _DyingSink(LocalFileSink):
    """Writes a little of a data file, then the process is killed (a real SIGKILL)."""

    def write(self, data: memoryview) -> None:
        super().write(data[:16])
        os.kill(os.getpid(), signal.SIGKILL)


class _DyingStorage(LocalStorage):
    def create(self, name: str, size_hint: int = 0) -> LocalFileSink:
        sink = super().create(name, size_hint)
        assert isinstance(sink, LocalFileSink)
        sink.__class__ = _DyingSink
        return sink


def killed_mid_write(path: str, layout: str) -> None:
    """A save killed while it writes its first data file (run in a child)."""
    shardsafe.save(path, state(1), layout=layout, storage=_DyingStorage)


def test_retention_leaves_a_step_directory_that_holds_files_without_the_marker(
    tmp_path: Path,
) -> None:
    """A step's name holding a user's files, with neither a manifest nor the marker every
    shardsafe save and deletion writes first: the save of that step refused it, and the
    next save's retention then deleted it in silence (found in review)."""
    root = tmp_path / "ck"
    users = root / "step-000000001"
    users.mkdir(parents=True)
    (users / "model.safetensors").write_bytes(b"user's exported weights")
    (root / "step-000000002").mkdir()  # empty: nothing to lose, removed
    manager = shardsafe.CheckpointManager(root, keep_last=1, warn_if_not_empty=False)
    with pytest.raises(shardsafe.CheckpointError, match="is not left over from an interrupted"):
        manager.save(1, {"w": torch.ones(2)})
    with pytest.warns(UserWarning) as warned:
        manager.save(3, {"w": torch.ones(2)})
    messages = [str(w.message) for w in warned if "retention left" in str(w.message)]
    assert messages == [
        f"shardsafe: retention left {users} in place: it holds no manifest.json and no "
        ".shardsafe-incomplete, so shardsafe did not write it; delete it yourself if it is "
        "no longer needed"
    ]
    assert (users / "model.safetensors").read_bytes() == b"user's exported weights"
    assert sorted(os.listdir(root)) == [
        ".shardsafe.lock",
        "latest",
        "step-000000001",
        "step-000000003",
    ]


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_a_killed_saves_leftovers_are_cleared_by_the_next_save(tmp_path: Path, layout: str) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()  # it existed: a failed save leaves its leftovers, a killed one anyway
    outcome = run_isolated(killed_mid_write, str(target), layout, memory_bytes=MEMORY)
    assert outcome.exitcode == -signal.SIGKILL, outcome.describe()
    data = SHARD if layout == "sharded" else "b.safetensors"
    names = sorted(os.listdir(target))
    assert INCOMPLETE_MARKER in names and data in names and "manifest.json" not in names
    marker = json.loads((target / INCOMPLETE_MARKER).read_bytes())
    assert marker["format"] == "shardsafe-incomplete" and data in marker["names"]
    assert set(names) - {INCOMPLETE_MARKER} <= set(marker["names"])
    assert (target / data).stat().st_size == 16  # the kill came mid-file
    shardsafe.save(target, state(), layout=layout)
    expected = [SHARD] if layout == "sharded" else ["b.safetensors", "w.safetensors"]
    assert sorted(os.listdir(target)) == sorted(["manifest.json", *expected])
    loads_back(target)


class _FailingStorage(LocalStorage):
    """Every data file fails to be created; before that, someone else writes a file of
    theirs into the directory."""

    def create(self, name: str, size_hint: int = 0) -> LocalFileSink:
        (Path(self.directory) / "theirs.txt").write_bytes(b"theirs")
        raise OSError(28, "No space left on device")


def test_a_failed_save_keeps_a_file_someone_else_wrote_meanwhile(tmp_path: Path) -> None:
    """The save created the directory, so on failure it removes it: its own files only,
    and the directory only if nothing else is left in it."""
    target = tmp_path / "new"
    with pytest.raises(CheckpointError, match="No space left"):
        shardsafe.save(target, state(), storage=_FailingStorage)
    assert snapshot(target) == {"theirs.txt": ("file", b"theirs")}
    msg = refused_save(target)  # the next save does not delete it either
    assert "is not empty (it holds 'theirs.txt' (a regular file))" in msg
    (target / "theirs.txt").unlink()
    shardsafe.save(target, state())
    assert sorted(os.listdir(target)) == ["manifest.json", SHARD]


def test_a_failed_save_into_an_existing_directory_leaves_what_the_next_save_clears(
    tmp_path: Path,
) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()

    class Failing(LocalStorage):
        def create(self, name: str, size_hint: int = 0) -> LocalFileSink:
            raise OSError(5, "Input/output error")

    with pytest.raises(CheckpointError, match="Input/output error"):
        shardsafe.save(target, state(), storage=Failing)
    names = sorted(os.listdir(target))
    assert names[0] == ".shardsafe-incomplete" and names[1].startswith(".shardsafe-probe-")
    assert len(names) == 2
    shardsafe.save(target, state())
    assert sorted(os.listdir(target)) == ["manifest.json", SHARD]
    loads_back(target)


# ---------------------------------------------------------------- on an object store


def test_on_s3_a_stray_marker_does_not_let_a_save_delete_a_users_object(
    s3_server: S3Server, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/ckpt"
    s3_server.put(s3_bucket, f"ckpt/{INCOMPLETE_MARKER}", b"")
    s3_server.put(s3_bucket, "ckpt/my_notes.txt", NOTES)
    s3_server.put(s3_bucket, f"ckpt/{SHARD}", b"half written")
    s3_server.put(s3_bucket, "ckpt/shard-00001-of-00002.safetensors/inside", b"a prefix")
    client = s3_server.client()
    client.create_multipart_upload(Bucket=s3_bucket, Key="ckpt/their_upload.bin")
    before = {k: s3_server.get(s3_bucket, k) for k in s3_server.keys(s3_bucket)}
    with pytest.raises(CheckpointError) as info:
        shardsafe.save(url, state())
    uploads = client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["Key"] for u in uploads] == ["ckpt/their_upload.bin"]  # not aborted either
    msg = str(info.value)
    assert type(info.value) is CheckpointError
    assert "'my_notes.txt' (an object)" in msg and "nothing was deleted" in msg
    assert "'shard-00001-of-00002.safetensors' (a prefix)" in msg
    assert {k: s3_server.get(s3_bucket, k) for k in s3_server.keys(s3_bucket)} == before


def test_on_s3_an_empty_marker_with_only_shardsafe_internal_objects_is_cleared(
    s3_server: S3Server, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/ckpt"
    s3_server.put(s3_bucket, f"ckpt/{INCOMPLETE_MARKER}", b"")
    for name, data in INTERNAL_ONLY.items():
        s3_server.put(s3_bucket, f"ckpt/{name}", data)
    shardsafe.save(url, state())
    assert s3_server.keys(s3_bucket) == ["ckpt/manifest.json", f"ckpt/{SHARD}"]
    loads_back(url)


class _DyingS3Sink(FsspecFileSink):
    def finish(self) -> int:
        written = super().finish()  # the whole object is uploaded, then the process dies
        os.kill(os.getpid(), signal.SIGKILL)
        return written


class _DyingS3Storage(FsspecStorage):
    def create(self, name: str, size_hint: int = 0) -> FsspecFileSink:
        sink = super().create(name, size_hint)
        sink.__class__ = _DyingS3Sink
        return sink


def killed_after_an_upload(url: str, env: dict[str, str]) -> None:
    """A save to S3 killed once its data object is uploaded (run in a child)."""
    os.environ.update(env)
    shardsafe.save(url, state(1), storage=_DyingS3Storage)  # type: ignore[arg-type]


def test_on_s3_a_killed_saves_leftovers_are_cleared_by_the_next_save(
    s3_server: S3Server, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/ckpt"
    outcome = run_isolated(killed_after_an_upload, url, s3_server.env, memory_bytes=1 << 30)
    assert outcome.exitcode == -signal.SIGKILL, outcome.describe()
    keys = s3_server.keys(s3_bucket)
    assert f"ckpt/{SHARD}" in keys and f"ckpt/{INCOMPLETE_MARKER}" in keys, keys
    assert "ckpt/manifest.json" not in keys
    marker = json.loads(s3_server.get(s3_bucket, f"ckpt/{INCOMPLETE_MARKER}"))
    assert {k.removeprefix("ckpt/") for k in keys} - {INCOMPLETE_MARKER} <= set(marker["names"])
    shardsafe.save(url, state())
    assert s3_server.keys(s3_bucket) == ["ckpt/manifest.json", f"ckpt/{SHARD}"]
    loads_back(url)


class _WaitsBeforeItsManifest(LocalStorage):
    """Local storage whose save stops before its manifest until ``flags + ".go"`` exists
    (having made ``flags + ".ready"``): another save runs in the meantime."""

    flags = ""

    def commit(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        if name == "manifest.json":
            Path(self.flags + ".ready").touch()
            for _ in range(1200):
                if os.path.exists(self.flags + ".go"):
                    break
                time.sleep(0.05)
        super().commit(name, data, exclusive=exclusive)


def _first_save(path: str, flags: str, told: Any) -> None:
    _WaitsBeforeItsManifest.flags = flags
    try:
        shardsafe.save(path, {"w": torch.full((64, 64), 1.0)}, storage=_WaitsBeforeItsManifest)
        told.put("committed")
    except CheckpointError as e:
        told.put(str(e))


def test_two_saves_to_one_path_at_once_never_both_commit(tmp_path: Path) -> None:
    """A job launched twice: save A has written its data, save B to the same path takes
    A's files for an interrupted save's, clears them and commits. Before, A's manifest
    then replaced B's, naming data it did not describe, and both saves returned; a load
    found a checksum mismatch. Now A's commit is refused by name and B's checkpoint is
    left as B wrote it."""
    import multiprocessing

    path, flags = tmp_path / "ckpt", str(tmp_path / "flag")
    ctx = multiprocessing.get_context("fork")
    told = ctx.Queue()
    first = ctx.Process(target=_first_save, args=(str(path), flags, told))
    first.start()
    try:
        for _ in range(1200):
            if os.path.exists(flags + ".ready"):
                break
            time.sleep(0.05)
        shardsafe.save(path, {"w": torch.full((64, 64), 2.0)})
        Path(flags + ".go").touch()
        said = told.get(timeout=60)
    finally:
        first.join(timeout=60)
        if first.is_alive():
            first.kill()
    assert said == (
        f"another save committed a checkpoint at {path} while this one was writing there, "
        "so this save did not commit (that checkpoint is kept as it is): two saves to one "
        "path at once replace each other's files. Save each run to a path of its own, or "
        "through a CheckpointManager, whose lock keeps a second run off its root"
    )
    out = {"w": torch.zeros(64, 64)}
    shardsafe.load(path, out)
    assert torch.equal(out["w"], torch.full((64, 64), 2.0))
    assert sorted(os.listdir(path)) == ["manifest.json", "shard-00000-of-00001.safetensors"]


def test_on_s3_a_manifest_is_committed_only_where_none_is(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """The object store's commit of a save's manifest is a conditional create (moto
    honours ``If-None-Match``): a second one is refused, the first left as it was."""
    from tests.s3server import with_env

    def commit_twice(rank: int, world: int) -> None:
        storage = FsspecStorage(f"s3://{s3_bucket}/ckpt")
        storage.commit("manifest.json", b"first", exclusive=True)
        with pytest.raises(FileExistsError):
            storage.commit("manifest.json", b"second", exclusive=True)
        storage.commit("latest", b"a", exclusive=False)
        storage.commit("latest", b"b", exclusive=False)  # a plain commit replaces

    with_env(0, 1, s3_server.env, commit_twice)
    assert s3_server.get(s3_bucket, "ckpt/manifest.json") == b"first"
    assert s3_server.get(s3_bucket, "ckpt/latest") == b"b"
