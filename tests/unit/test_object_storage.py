"""The object-store backend in one process, against a real S3 API server (moto on
loopback): URLs are never local paths, inspect/verify on s3://, hostile names, aborted
uploads, bounded memory while streaming."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import cli
from shardsafe.checkpoint import loading
from shardsafe.checkpoint.options import LoadOptions, SaveHooks, SaveOptions
from shardsafe.checkpoint.replacing import async_save_replacing, save_replacing
from shardsafe.checkpoint.saving import save as saving_save
from shardsafe.checkpoint.storage import target_directory
from shardsafe.checkpoint.storage.locations import open_storage
from shardsafe.checkpoint.storage.object_storage import (
    MAX_PARTS,
    FsspecStorage,
    check_object_name,
)
from shardsafe.errors import CheckpointCorruptError, CheckpointError
from tests import forge
from tests.harness import free_port, run_ranks
from tests.s3server import S3Server, with_env

pytestmark = pytest.mark.timeout(120)


def small_state(seed: int = 0) -> dict[str, object]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "step": 7}


def test_a_url_without_the_extra_is_a_clear_error_and_never_a_local_directory(
    tmp_path: Path,
) -> None:
    code = (
        "import sys; sys.modules['fsspec'] = None\n"
        "import torch, shardsafe\n"
        "try:\n"
        "    shardsafe.save('s3://bucket/run/x', {'w': torch.ones(2)})\n"
        "except shardsafe.CheckpointError as e:\n"
        "    print('ERROR', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "ERROR s3://bucket/run/x is an object-store URL" in out.stdout, out.stderr
    assert 'pip install "shardsafe[s3]"' in out.stdout
    assert list(tmp_path.iterdir()) == []  # no "s3:" directory


def test_an_unknown_scheme_is_refused_and_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="nosuchscheme"):
        shardsafe.save("nosuchscheme://bucket/x", {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="nosuchscheme"):
        shardsafe.load("nosuchscheme://bucket/x", {"w": torch.ones(2)})
    assert list(tmp_path.iterdir()) == []


def test_storage_options_for_a_local_path_are_refused(tmp_path: Path) -> None:
    """A usage error, raised as a ValueError where it is made (before the ranks meet, so
    never an agreed CheckpointError), by save, load and a manager's constructor."""
    said = (
        f"storage_options were given for {str(tmp_path / 'x')!r}, which is a local path; "
        "they apply to object-store URLs (s3://..., gs://...) only"
    )
    with pytest.raises(ValueError) as refused:
        shardsafe.save(tmp_path / "x", {"w": torch.ones(2)}, storage_options={"anon": True})
    assert str(refused.value) == said
    shardsafe.save(tmp_path / "x", {"w": torch.ones(2)})
    with pytest.raises(ValueError) as refused:
        shardsafe.load(tmp_path / "x", {"w": torch.ones(2)}, storage_options={"anon": True})
    assert str(refused.value) == said
    with pytest.raises(ValueError) as refused:
        shardsafe.CheckpointManager(tmp_path / "x", storage_options={"anon": True})
    assert str(refused.value) == said
    # Saves that replace a name (Lightning's last.ckpt, the transformers integration).
    for replacing in (save_replacing, async_save_replacing):
        with pytest.raises(ValueError) as refused:
            replacing(
                str(tmp_path / "x"),
                {"w": torch.ones(2)},
                SaveOptions.of(storage_options={"anon": True}),
            )
        assert str(refused.value) == said


def test_file_urls_are_local_directories(tmp_path: Path) -> None:
    shardsafe.save(f"file://{tmp_path}/x", {"w": torch.arange(4.0)})
    assert (tmp_path / "x" / "manifest.json").is_file()
    w = torch.zeros(4)
    shardsafe.load(f"file://{tmp_path}/x", {"w": w})
    assert torch.equal(w, torch.arange(4.0))
    # inspect named it "<cwd>/file:/<path>"
    assert shardsafe.inspect(f"file://{tmp_path}/x").path == str(tmp_path / "x")


def test_memory_url_round_trip() -> None:
    url = f"memory://shardsafe-test-{os.getpid()}/x"
    shardsafe.save(url, small_state(0))
    state = small_state(1)
    assert shardsafe.load(url, state) == {"step": 7}
    assert torch.equal(state["model"].weight, small_state(0)["model"].weight)  # type: ignore[attr-defined]


def test_s3_round_trip_writes_only_under_the_prefix(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"s3://{s3_bucket}/run/step-7"
    shardsafe.save(url, small_state(0))
    assert list(tmp_path.iterdir()) == []
    keys = s3_server.keys(s3_bucket)
    assert keys == ["run/step-7/manifest.json", "run/step-7/shard-00000-of-00001.safetensors"]
    state = small_state(1)
    assert shardsafe.load(url, state) == {"step": 7}
    with pytest.raises(CheckpointError, match="already holds a committed checkpoint"):
        shardsafe.save(url, small_state(0))
    assert shardsafe.read_manifest(url).world_size == 1


def test_inspect_and_verify_on_s3_name_the_damaged_object_and_key(
    s3_server: S3Server, s3_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{s3_bucket}/ck"
    shardsafe.save(url, {"model": torch.nn.Linear(64, 64)})
    assert cli.main(["verify", url]) == 0
    assert "OK:" in capsys.readouterr().out
    assert cli.main(["inspect", url]) == 0
    assert "model/weight" in capsys.readouterr().out

    manifest = shardsafe.read_manifest(url)
    (chunk,) = manifest.tensors["model/weight"].chunks
    name = chunk.file
    key = f"ck/{name}"
    data = bytearray(s3_server.get(s3_bucket, key))
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + 10] ^= 0x01  # a byte inside the first tensor's data
    s3_server.put(s3_bucket, key, bytes(data))
    assert cli.main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and name in out
    bad = [line for line in out.splitlines() if "checksum mismatch" in line]
    assert bad and name in bad[0] and "model/" in bad[0], out


def test_a_hostile_manifest_cannot_name_an_object_outside_the_prefix(
    s3_server: S3Server, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/ck"
    shardsafe.save(url, {"w": torch.arange(8.0)})
    s3_server.put(
        s3_bucket,
        "secret.safetensors",
        s3_server.get(s3_bucket, "ck/shard-00000-of-00001.safetensors"),
    )
    doc = json.loads(s3_server.get(s3_bucket, "ck/manifest.json"))
    old = "shard-00000-of-00001.safetensors"
    for evil in ("../secret.safetensors", "/secret.safetensors", "..%2fsecret.safetensors"):
        text = json.dumps(doc).replace(old, evil)
        s3_server.put(
            s3_bucket,
            "ck/manifest.json",
            forge.sign(
                json.dumps({k: v for k, v in json.loads(text).items() if k != forge.CRC_KEY})
            ),
        )
        with pytest.raises(CheckpointCorruptError):
            shardsafe.load(url, {"w": torch.zeros(8)})


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "", "a?versionId=1", "a#b", "*", "a\\b"])
def test_object_names_that_could_leave_the_prefix_are_refused(
    s3_server: S3Server, s3_bucket: str, name: str
) -> None:
    with pytest.raises(CheckpointCorruptError):
        check_object_name(name)
    storage = FsspecStorage(f"s3://{s3_bucket}/ck")
    with pytest.raises(CheckpointCorruptError):
        storage.open_reader(name)
    with pytest.raises(CheckpointCorruptError):
        storage.create(name)


def test_an_aborted_upload_leaves_no_object_and_no_pending_multipart(
    s3_server: S3Server, s3_bucket: str
) -> None:
    storage = open_storage(f"s3://{s3_bucket}/ck", storage_options={"default_block_size": 5 << 20})
    sink = storage.create("shard-00000-of-00001.safetensors")
    sink.write(memoryview(bytes(12 << 20)))  # two parts uploaded
    sink.abort()
    assert s3_server.keys(s3_bucket) == []
    uploads = s3_server.client().list_multipart_uploads(Bucket=s3_bucket)
    assert not uploads.get("Uploads"), uploads


def test_removing_a_failed_save_aborts_a_killed_ranks_unfinished_upload(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """Rank 1 killed mid-upload, rank 0 removing the failed save: the dead rank's
    multipart upload (invisible in listings, billed) went with it, not only when a later
    save came to the same prefix."""
    storage = open_storage(f"s3://{s3_bucket}/ck")
    target_directory.prepare(storage)  # the marker: the prefix is a save's
    s3_server.client().create_multipart_upload(
        Bucket=s3_bucket, Key="ck/shard-00001-of-00002.safetensors"
    )
    s3_server.client().create_multipart_upload(Bucket=s3_bucket, Key="other/x")
    target_directory.remove_uncommitted(storage)
    assert s3_server.keys(s3_bucket) == []
    uploads = s3_server.client().list_multipart_uploads(Bucket=s3_bucket)["Uploads"]
    assert [u["Key"] for u in uploads] == ["other/x"]  # another prefix's: untouched


def test_a_failed_save_whose_cleanup_fails_too_raises_the_saves_error(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store gone mid-save: rank 0's clean-up of the failed save failed too, with the
    client's own exception (botocore's are not OSError), which replaced the agreed error
    on rank 0 alone, so a loop catching CheckpointError crashed there (found in review)."""
    from botocore.exceptions import EndpointConnectionError

    def store_gone() -> None:
        def unreachable(self: FsspecStorage) -> bool:
            raise EndpointConnectionError(endpoint_url=s3_server.endpoint)

        monkeypatch.setattr(FsspecStorage, "is_directory", unreachable)
        raise CheckpointError("the store went away")

    options = SaveOptions(hooks=SaveHooks(before_write=store_gone))
    with pytest.raises(CheckpointError, match="the store went away"):
        saving_save(f"s3://{s3_bucket}/ck", small_state(), options)


def test_parts_grow_only_for_objects_too_large_for_ten_thousand_of_them() -> None:
    storage = FsspecStorage("memory://parts")
    assert storage.part_bytes(0) == 8 << 20
    assert storage.part_bytes(70 << 30) == 8 << 20  # 70 GiB fits 10,000 parts of 8 MiB
    huge = 200 << 30
    part = storage.part_bytes(huge)
    mib = 1 << 20
    assert part % mib == 0 and part * MAX_PARTS >= huge * 1.01 > (part - mib) * MAX_PARTS
    sized = FsspecStorage("memory://parts", storage_options={"default_block_size": 32 << 20})
    assert sized.part_bytes(1 << 30) == 32 << 20


def stream_big(rank: int, world: int, url: str, part: int) -> tuple[int, bool]:
    big = torch.randn(16 << 20)  # 64 MiB: far more than a few parts
    options = {"default_block_size": part}
    tracemalloc.start()
    try:
        # botocore's service models (~15 MiB of dicts, loaded once) are not buffers.
        shardsafe.save(url + "-warm", {"w": torch.ones(4)}, storage_options=options)
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        shardsafe.save(url, {"w": big}, storage_options=options)
        _, peak = tracemalloc.get_traced_memory()
        peak -= base
    finally:
        tracemalloc.stop()
    out = torch.zeros_like(big)
    shardsafe.load(url, {"w": out})
    return peak, torch.equal(out, big)


def test_streaming_a_large_tensor_holds_about_two_parts(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """Python-side buffers (the upload's, botocore's) measured in a process of its own, away
    from the in-process S3 server's own memory; torch's tensor memory is not traced."""
    part = 5 << 20
    url = f"s3://{s3_bucket}/big"
    peak, same = run_ranks(
        with_env, 1, s3_server.env, stream_big, url, part, init_process_group=False
    )[0]
    assert same
    assert peak < 4 * part, f"peak Python-side buffers {peak / 2**20:.1f} MiB"


def test_manager_on_s3_latest_retention_lock_and_cleanup(
    s3_server: S3Server, s3_bucket: str
) -> None:
    root = f"s3://{s3_bucket}/run"
    manager = shardsafe.CheckpointManager(root, keep_last=2)
    assert manager.latest() is None and manager.load_latest(small_state(1)) is None
    for step in (1, 2, 3):
        state = small_state(step)
        state["step"] = step
        assert manager.save(step, state) == f"{root}/step-{step:09d}"
    assert manager.latest() == f"{root}/step-000000003"
    assert s3_server.get(s3_bucket, "run/latest") == b"step-000000003\n"
    keys = s3_server.keys(s3_bucket)
    assert not any(k.startswith("run/step-000000001/") for k in keys), keys
    assert "run/.shardsafe.lock" in keys
    assert manager._lock.conditional is True  # moto honours If-None-Match: *

    other = shardsafe.CheckpointManager(root, keep_last=2, warn_if_not_empty=False)
    other._lock.me["host"] = "elsewhere"  # a run on another host: refused
    with pytest.raises(CheckpointError, match="being written by another run"):
        other.save(4, small_state(4))
    assert manager.latest() == f"{root}/step-000000003"

    # An interrupted save: data objects, the marker and an unfinished multipart upload,
    # no manifest. latest() passes over it; the next save's retention removes it.
    s3_server.put(s3_bucket, "run/step-000000004/.shardsafe-incomplete", b"")
    s3_server.put(s3_bucket, "run/step-000000004/shard-00000-of-00001.safetensors", b"x" * 9)
    s3_server.client().create_multipart_upload(
        Bucket=s3_bucket, Key="run/step-000000005/shard-00000-of-00001.safetensors"
    )
    s3_server.put(s3_bucket, "run/step-000000005/.shardsafe-incomplete", b"")
    assert manager.latest() == f"{root}/step-000000003"
    state = small_state(0)
    assert manager.load_latest(state) == {"step": 3}
    manager.save(5, small_state(5))
    keys = s3_server.keys(s3_bucket)
    assert not any(k.startswith("run/step-000000004/") for k in keys), keys
    assert not s3_server.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads")
    assert manager.latest() == f"{root}/step-000000005"
    manager.close()
    assert "run/.shardsafe.lock" not in s3_server.keys(s3_bucket)


def test_async_save_to_s3_commits_the_state_of_the_call(
    s3_server: S3Server, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/async"
    w = torch.arange(1 << 20, dtype=torch.float32)
    handle = shardsafe.async_save(url, {"w": w})
    w.zero_()  # after staging: what is written is the state at the call
    handle.wait()
    out = torch.empty(1 << 20)
    shardsafe.load(url, {"w": out})
    assert torch.equal(out, torch.arange(1 << 20, dtype=torch.float32))


def test_a_missing_s3_checkpoint_is_not_found(s3_server: S3Server, s3_bucket: str) -> None:
    with pytest.raises(shardsafe.CheckpointNotFoundError):
        shardsafe.load(f"s3://{s3_bucket}/nothing-here", {"w": torch.zeros(2)})


def test_a_save_to_a_bucket_that_does_not_exist_is_refused_and_creates_no_bucket(
    s3_server: S3Server, s3_bucket: str
) -> None:
    missing = f"{s3_bucket}-typo"
    with pytest.raises(shardsafe.CheckpointNotFoundError) as caught:
        shardsafe.save(f"s3://{missing}/run/step-1", {"w": torch.zeros(2)})
    assert str(caught.value) == (
        f"the bucket {missing!r} of s3://{missing}/run/step-1 does not exist (or these "
        "credentials cannot see it); shardsafe never creates a bucket: check the URL and "
        "the endpoint, or create the bucket first"
    )
    with pytest.raises(CheckpointError) as caught:
        shardsafe.CheckpointManager(f"s3://{missing}/run").save(1, {"w": torch.zeros(2)})
    assert str(caught.value).startswith(  # named before the manager's lock is written
        f"the bucket {missing!r} of s3://{missing}/run does not exist"
    )
    with pytest.raises(shardsafe.CheckpointNotFoundError) as caught:
        shardsafe.save(f"s3://{missing}", {"w": torch.zeros(2)})  # the bucket's root
    assert str(caught.value).startswith(f"the bucket {missing!r} of s3://{missing} does not")
    buckets = [b["Name"] for b in s3_server.client().list_buckets()["Buckets"]]
    assert missing not in buckets and s3_bucket in buckets


class GetSpy:
    """Records each ranged GET an fsspec filesystem makes (the real call goes through):
    which object, and which thread asked (the read-ahead thread, or the caller)."""

    def __init__(self, fs: Any) -> None:
        self.calls: list[tuple[str, str]] = []
        self.bytes = 0
        cat_file, cat_ranges = fs.cat_file, fs.cat_ranges

        def spied_cat_file(path: str, *args: Any, **kwargs: Any) -> Any:
            self.calls.append((path.rsplit("/", 1)[-1], threading.current_thread().name))
            data = cat_file(path, *args, **kwargs)
            self.bytes += len(data)
            return data

        def spied_cat_ranges(paths: list[str], *args: Any, **kwargs: Any) -> Any:
            out = cat_ranges(paths, *args, **kwargs)
            self.calls += [(p.rsplit("/", 1)[-1], threading.current_thread().name) for p in paths]
            self.bytes += sum(len(d) for d in out if isinstance(d, bytes))
            return out

        fs.cat_file, fs.cat_ranges = spied_cat_file, spied_cat_ranges


def written(storage: Any, name: str, nbytes: int, seed: int) -> bytes:
    rng = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=rng)
    raw = data.numpy().tobytes()
    sink = storage.create(name, size_hint=len(raw))
    sink.write(memoryview(raw))
    sink.finish()
    return raw


def read(reader: Any, offset: int, n: int) -> bytes:
    out = bytearray(n)
    reader.read_into(offset, memoryview(out))
    return bytes(out)


def test_ranged_reads_in_order_across_blocks_and_at_random_return_the_object_bytes(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """The reader's read-ahead (one block cached, the next fetched in the background once
    reads go through blocks in order) never changes what a read returns, and an object
    walked in order costs one GET per block, the third fetched ahead by the read-ahead
    thread."""
    storage = FsspecStorage(f"s3://{s3_bucket}/ck", storage_options={"default_block_size": 5 << 20})
    name = "shard-00000-of-00001.safetensors"
    raw = written(storage, name, 64 << 20, 0)
    spy = GetSpy(storage.fs)
    with storage.open_reader(name) as reader:
        at, pieces = 0, []
        while at < len(raw):  # 5 MiB pieces: some straddle two 24 MiB blocks
            n = min(5 << 20, len(raw) - at)
            pieces.append(read(reader, at, n))
            at += n
        assert b"".join(pieces) == raw
        assert len(spy.calls) == 3, spy.calls  # blocks at 0, 24 and 48 MiB
        assert [thread.startswith("shardsafe-read-ahead") for _, thread in spy.calls] == [
            False,
            False,
            True,
        ]
        rng = torch.Generator().manual_seed(1)
        for _ in range(40):
            offset = int(torch.randint(0, len(raw) - 1, (1,), generator=rng))
            n = min(len(raw) - offset, int(torch.randint(1, 30 << 20, (1,), generator=rng)))
            assert read(reader, offset, n) == raw[offset : offset + n], (offset, n)
        with pytest.raises(CheckpointCorruptError, match="truncated"):
            read(reader, len(raw) - 4, 8)


def test_only_the_two_readers_used_last_hold_read_ahead_blocks(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """A load with many objects open (a new world size reads parts of every shard file)
    keeps the blocks of the two objects read last, not of every open one: reading a third
    drops those of the one read longest ago, so going back to it costs a GET again."""
    storage = FsspecStorage(f"s3://{s3_bucket}/ck", storage_options={"default_block_size": 5 << 20})
    names = ("a.safetensors", "b.safetensors", "c.safetensors")
    raws = {n: written(storage, n, 1 << 20, i) for i, n in enumerate(names)}
    spy = GetSpy(storage.fs)
    readers = {n: storage.open_reader(n) for n in names}
    try:
        a, b, c = (readers[n] for n in names)
        assert read(a, 0, 1024) == raws["a.safetensors"][:1024]
        assert read(b, 0, 1024) == raws["b.safetensors"][:1024]
        assert read(a, 4096, 1024) == raws["a.safetensors"][4096:5120]  # two hold blocks
        assert read(b, 4096, 1024) == raws["b.safetensors"][4096:5120]
        assert read(c, 0, 1024) == raws["c.safetensors"][:1024]  # a's block is dropped
        assert read(a, 0, 1024) == raws["a.safetensors"][:1024]
    finally:
        for r in readers.values():
            r.close()
    assert [obj[0] for obj, _ in spy.calls] == ["a", "b", "c", "a"]


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 64 MiB: more than the reader's two read-ahead blocks, so a second pass needs GETs
    return torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(4)))


def saved_for_counting(url: str) -> torch.nn.Module:
    saved = model(0)
    shardsafe.save(url, {"model": saved, "step": 3})
    return saved


def bytes_fetched_by_a_load(url: str, saved: torch.nn.Module, verify: str) -> tuple[int, int, bool]:
    """(bytes the load fetched, bytes the data objects hold, restored bitwise); the
    model's tensors are live ones, restored in place (read twice with verify="first")."""
    got = model(1)
    with FsspecStorage(url) as storage:
        spy = GetSpy(storage.fs)
        manifest = shardsafe.read_manifest(url)
        values = loading.load(storage, {"model": got}, LoadOptions(verify=verify, strict=False))
        want, have = saved.state_dict(), got.state_dict()
        same = all(torch.equal(have[k], want[k]) for k in want) and values["step"] == 3
        return spy.bytes, sum(manifest.files.values()), same


@pytest.mark.parametrize("verify", ["first", "inline"])
def test_a_load_from_an_object_store_downloads_each_byte_once_in_either_verify_mode(
    s3_server: S3Server, s3_bucket: str, verify: str
) -> None:
    """With verify="first" the check pass keeps what it downloads in a local spool file,
    and the second read (into the live tensors, checked again) comes from there."""
    url = f"s3://{s3_bucket}/ck"
    fetched, total, same = bytes_fetched_by_a_load(url, saved_for_counting(url), verify)
    assert same
    assert total <= fetched < total * 1.1, (fetched, total)


def test_a_spool_that_cannot_be_written_warns_and_the_load_downloads_again(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """A spool whose disk fills up mid-load (here: a file-size limit, EFBIG after 1 MiB)
    stops growing with a warning; the load still restores every byte, downloading what
    the spool could not keep again."""
    url = f"s3://{s3_bucket}/ck"
    saved = saved_for_counting(url)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limits[1]))
    try:
        with pytest.warns(RuntimeWarning, match="could not keep downloaded bytes"):
            fetched, total, same = bytes_fetched_by_a_load(url, saved, "first")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, ignored)
    assert same
    assert fetched > total * 1.9, (fetched, total)


def test_no_spool_in_a_temporary_directory_in_memory(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spool on tmpfs would hold the rank's state in RAM: the load downloads twice."""
    from shardsafe.checkpoint.storage.spool import _filesystem_type

    if _filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("needs /dev/shm on tmpfs")
    url = f"s3://{s3_bucket}/ck"
    saved = saved_for_counting(url)
    monkeypatch.setattr(tempfile, "tempdir", "/dev/shm")  # not for moto's save
    with pytest.warns(RuntimeWarning, match=r"twice in this load: /dev/shm is a tmpfs"):
        fetched, total, same = bytes_fetched_by_a_load(url, saved, "first")
    assert same
    assert fetched > total * 1.9, (fetched, total)


def test_a_gs_url_without_gcsfs_names_the_package_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gs:// goes through gcsfs, which the s3 extra does not bring: what a user without
    it sees. The test environment has gcsfs (for the gs:// tests), so it is made
    unimportable here, and forgotten by fsspec's registry if an earlier test loaded it."""
    import importlib
    import sys

    registry = importlib.import_module(
        "fsspec.registry"
    )._registry  # the module, not fsspec.registry

    monkeypatch.setitem(sys.modules, "gcsfs", None)
    monkeypatch.delitem(registry, "gs", raising=False)
    monkeypatch.delitem(registry, "gcs", raising=False)
    monkeypatch.chdir(tmp_path)
    wanted = r'gs://b/x is an object-store URL.*: pip install "shardsafe\[gcs\]"'
    with pytest.raises(CheckpointError, match=wanted):
        shardsafe.save("gs://b/x", {"w": torch.ones(2)})
    assert list(tmp_path.iterdir()) == []  # no local directory "gs:"


@pytest.mark.parametrize("path", ["run//step-1", "run/./step-1", "run/../step-1", "run/step-1/."])
def test_a_url_with_an_empty_or_dot_segment_is_refused_before_anything_is_written(
    s3_server: S3Server, s3_bucket: str, path: str
) -> None:
    """Such a URL was saved to keys like 'run//step-1/manifest.json', where a load of the
    same place spelled 'run/step-1' (or any other tool) finds nothing."""
    url = f"s3://{s3_bucket}/{path}"
    message = (
        f"{url!r} has an empty, '.' or '..' segment in its path; an object store keeps "
        "'a//b', 'a/./b' and 'a/b' as different keys: write the URL with single slashes "
        "and no dot segments"
    )
    with pytest.raises(CheckpointError) as caught:
        shardsafe.save(url, {"w": torch.ones(2)})
    assert str(caught.value) == message
    with pytest.raises(CheckpointError) as caught:
        shardsafe.load(url, {"w": torch.ones(2)})
    assert str(caught.value) == message
    root = f"s3://{s3_bucket}/{path}/ckpts"
    with pytest.raises(CheckpointError, match=r"has an empty, '\.' or '\.\.' segment"):
        shardsafe.CheckpointManager(root).save(1, {"w": torch.ones(2)})
    assert s3_server.keys(s3_bucket) == []


def test_inspect_and_verify_of_an_s3_root_or_run_directory_name_the_newest_checkpoint(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """As for a local path (docs/saving-and-loading.md): the hint was given for local
    directories only, so on S3 the error said only that a save may have been interrupted."""
    run = f"s3://{s3_bucket}/exp"
    manager = shardsafe.CheckpointManager(f"{run}/checkpoints")
    manager.save(3, {"w": torch.ones(2)})
    manager.close()
    missing = (
        "has no manifest.json, so it is not a committed checkpoint (a save into it may have "
        "been interrupted)"
    )
    for call in (shardsafe.inspect, shardsafe.verify):
        with pytest.raises(shardsafe.CheckpointNotFoundError) as caught:
            call(f"{run}/checkpoints")
        assert str(caught.value) == (
            f"{run}/checkpoints {missing}. It looks like a checkpoint root; the newest "
            f"committed checkpoint in it is {run}/checkpoints/step-000000003"
        )
        with pytest.raises(shardsafe.CheckpointNotFoundError) as caught:
            call(run)
        assert str(caught.value) == (
            f"{run} {missing}. It looks like a Trainer run directory: its checkpoints are "
            f"under {run}/checkpoints; the newest is {run}/checkpoints/step-000000003"
        )
        with pytest.raises(shardsafe.CheckpointNotFoundError) as caught:
            call(f"s3://{s3_bucket}/elsewhere")
        assert str(caught.value) == f"s3://{s3_bucket}/elsewhere does not exist"


def test_a_url_naming_an_object_is_called_an_object_not_missing(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """``s3://b/run/latest`` (the manager's pointer) was reported as not existing."""
    root = f"s3://{s3_bucket}/run"
    manager = shardsafe.CheckpointManager(root)
    manager.save(1, {"w": torch.ones(2)})
    manager.close()
    message = (
        f"{root}/latest is an object, not a prefix; pass the checkpoint's prefix (the one "
        "holding manifest.json)"
    )
    for call in (shardsafe.inspect, shardsafe.verify, shardsafe.read_manifest):
        with pytest.raises(shardsafe.CheckpointNotFoundError) as caught:
            call(f"{root}/latest")
        assert str(caught.value) == message
    with pytest.raises(shardsafe.CheckpointNotFoundError) as caught:
        shardsafe.load(f"{root}/latest", {"w": torch.zeros(2)})
    assert str(caught.value) == message


def test_an_fsspec_chained_url_is_refused_and_never_a_local_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """'simplecache::s3://bucket/x' had no scheme by the URL pattern, so it was a local
    path: the save wrote ./simplecache::s3:/bucket/x and reported success."""
    monkeypatch.chdir(tmp_path)
    url = "simplecache::s3://bucket/run/x"
    message = (
        f"{url} is an fsspec chained URL, which shardsafe does not open (a caching layer "
        "would change what an upload or a ranged read means); pass the store's own URL "
        "(s3://..., gs://...): a load from it downloads each byte once"
    )
    for call in (shardsafe.save, shardsafe.load):
        with pytest.raises(CheckpointError) as caught:
            call(url, {"w": torch.ones(2)})
        assert str(caught.value) == message
    with pytest.raises(CheckpointError, match="is an fsspec chained URL"):
        shardsafe.CheckpointManager("filecache::s3://bucket/run").save(1, {"w": torch.ones(2)})
    assert list(tmp_path.iterdir()) == []


def test_a_second_manager_of_the_same_process_saves_on_s3_as_on_a_filesystem(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """Two CheckpointManager objects on one root in one process (a script's second phase):
    the second one's second save read the lock back, found the first one's token, and
    refused, blaming 'another run (pid <this pid> on host <this host>)'."""
    root = f"s3://{s3_bucket}/run"
    first = shardsafe.CheckpointManager(root, keep_last=3)
    first.save(1, {"w": torch.ones(2)})
    second = shardsafe.CheckpointManager(root, keep_last=3)
    state = {"w": torch.zeros(2)}
    second.load_latest(state)
    assert torch.equal(state["w"], torch.ones(2))
    second.save(2, {"w": torch.ones(2)})
    second.save(3, {"w": torch.full((2,), 3.0)})
    assert second.latest() == f"{root}/step-000000003"
    second.close()
    first.close()
    assert "run/.shardsafe.lock" not in s3_server.keys(s3_bucket)


def test_an_uppercase_scheme_is_named_as_written_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """'S3://b/x' was refused as "fsspec does not know the scheme 's3'", which it does."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as caught:
        shardsafe.save("S3://bucket/x", {"w": torch.ones(2)})
    assert str(caught.value) == (
        "S3://bucket/x: fsspec does not know the scheme 'S3' (Protocol not known: S3); "
        "schemes are lowercase: s3://"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_trainer_run_on_s3_looks_for_its_bucket_once(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Trainer checked the bucket before step 1 through one manager, and its first save
    checked it again through another: a round trip to the store for nothing."""
    from shardsafe.trainer.example import ExampleModule

    looked: list[str] = []
    make_directory = FsspecStorage.make_directory

    def spied(self: FsspecStorage) -> None:
        looked.append(self.directory)
        make_directory(self)

    monkeypatch.setattr(FsspecStorage, "make_directory", spied)
    monkeypatch.chdir(tmp_path)  # the run's metrics are local
    root = f"s3://{s3_bucket}/run/checkpoints"
    trainer = shardsafe.Trainer(max_steps=2, checkpoint_every=2, run_dir=f"s3://{s3_bucket}/run")
    assert trainer.fit(ExampleModule()).checkpoint == f"{root}/step-000000002"
    assert looked == [root, f"{root}/step-000000002"]  # the bucket; the step's directory


def resumed_after(bucket: str, steps: int) -> shardsafe.CheckpointManager:
    """A run that saved steps 1..``steps`` (``keep_last=2``), restarted: a new manager
    that looked for the latest step. Its first save asks the store about every step (a
    manager's later saves ask only about the names its saves have not seen)."""
    manager = shardsafe.CheckpointManager(f"s3://{bucket}/run", keep_last=2)
    for step in range(1, steps + 1):
        manager.save(step, {"w": torch.full((4,), float(step))})
    manager.close()
    manager = shardsafe.CheckpointManager(f"s3://{bucket}/run", keep_last=2)
    manager.latest()
    return manager


def test_retention_never_deletes_a_step_it_could_not_read(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request refused during retention (S3's 503 SlowDown once botocore's retries are
    spent) made the checkpoint it asked about count as incomplete, and it was deleted:
    keep_last=2 lost step 3 and kept step 2 in its place."""
    import s3fs.core
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    manager = resumed_after(s3_bucket, 3)
    call = s3fs.core.S3FileSystem._call_s3
    refused = {"armed": False, "left": 1}
    throttled = ClientError(
        {
            "Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
            "ResponseMetadata": {"HTTPStatusCode": 503},
        },
        "HeadObject",
    )

    async def once_throttled(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        asked = kwargs.get("Key") == "run/step-000000003/manifest.json"
        if refused["armed"] and method == "head_object" and asked and refused["left"]:
            refused["left"] -= 1
            raise translate_boto_error(throttled)
        return await call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", once_throttled)
    arm = SaveHooks(before_write=lambda: refused.update(armed=True))  # after the checks
    with pytest.warns(UserWarning) as said:
        manager.save(4, {"w": torch.full((4,), 4.0)}, hooks=arm)
    monkeypatch.undo()
    assert refused["left"] == 0
    messages = [str(w.message) for w in said]
    assert len(messages) == 1, messages
    assert messages[0].startswith(
        f"shardsafe: retention left s3://{s3_bucket}/run/step-000000003 in place: whether it "
        "is a complete checkpoint could not be read ("
    ), messages
    assert "reduce your request rate" in messages[0], messages
    assert manager.complete_steps() == [2, 3, 4]  # nothing kept was lost; one more kept
    manager.save(5, {"w": torch.full((4,), 5.0)})  # the next save's retention catches up
    assert manager.complete_steps() == [4, 5]
    manager.close()


def test_retention_never_deletes_a_step_a_store_said_once_has_no_manifest(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One HEAD of step 2's manifest answered "not found" during retention (what an
    eventually consistent S3-compatible store can answer): step 2 counted as an
    interrupted save and was deleted, though its listing showed the manifest, and
    keep_last=2 kept step 1 in its place. Now it is left in place, with a warning."""
    import s3fs.core

    manager = resumed_after(s3_bucket, 2)
    call = s3fs.core.S3FileSystem._call_s3
    missing = {"armed": False, "left": 1}

    async def once_missing(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        asked = kwargs.get("Key") == "run/step-000000002/manifest.json"
        if missing["armed"] and method == "head_object" and asked and missing["left"]:
            missing["left"] -= 1
            raise FileNotFoundError(kwargs["Key"])
        return await call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", once_missing)
    arm = SaveHooks(before_write=lambda: missing.update(armed=True))  # after the checks
    with pytest.warns(UserWarning) as said:
        manager.save(3, {"w": torch.full((4,), 3.0)}, hooks=arm)
    monkeypatch.undo()
    assert missing["left"] == 0
    assert [str(w.message) for w in said] == [
        f"shardsafe: retention left s3://{s3_bucket}/run/step-000000002 in place: it looked "
        "like an interrupted save (no manifest.json when asked), but its listing holds one; "
        "the next save looks again"
    ]
    assert manager.complete_steps() == [1, 2, 3]  # nothing was lost; one more kept
    manager.save(4, {"w": torch.full((4,), 4.0)})  # the next save's retention catches up
    assert manager.complete_steps() == [3, 4]
    manager.close()


def test_a_managers_unmade_client_is_an_error_not_no_checkpoint(tmp_path: Path) -> None:
    """A store's client that cannot be made (a broken gcsfs credentials file) read as "no
    checkpoint": latest() and load_latest() returned None without asking the store, and
    a run started afresh over its checkpoints."""
    pytest.importorskip("gcsfs")
    broken = tmp_path / "credentials.json"
    broken.write_text(json.dumps({"type": "authorized_user", "client_id": "x"}))
    options = {"token": str(broken), "project": "p"}
    manager = shardsafe.CheckpointManager("gs://bucket/run", storage_options=options)
    said = (
        "gs://bucket/run: the gs:// client could not be made from its storage_options and "
        "environment (KeyError: 'refresh_token')"
    )
    with pytest.raises(CheckpointError) as latest:
        manager.latest()
    assert str(latest.value).startswith(said), latest.value
    with pytest.raises(CheckpointError) as loaded:
        manager.load_latest({"w": torch.zeros(2)})
    assert str(loaded.value).startswith(said), loaded.value
    manager.close()


def test_two_managers_of_one_process_share_the_lock_however_the_scheme_is_spelled(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """``s3://`` and ``s3a://`` name one root: each manager counted the lock under its own
    spelling, and the first to close deleted the lock the other still held."""
    first = shardsafe.CheckpointManager(f"s3://{s3_bucket}/run")
    second = shardsafe.CheckpointManager(f"s3a://{s3_bucket}/run")
    first.save(1, {"w": torch.ones(2)})
    second.save(2, {"w": torch.ones(2)})
    first.close()
    assert "run/.shardsafe.lock" in s3_server.keys(s3_bucket)
    second.save(3, {"w": torch.ones(2)})
    second.close()
    assert "run/.shardsafe.lock" not in s3_server.keys(s3_bucket)


def test_an_s3_url_naming_an_object_version_is_refused_by_name(s3_bucket: str) -> None:
    """s3fs reads ``?versionId=`` as an object version: the save failed with a bare "Bad
    Request"."""
    url = f"s3://{s3_bucket}/run/ck?versionId=1"
    with pytest.raises(CheckpointError) as refused:
        shardsafe.save(url, {"w": torch.ones(2)})
    assert str(refused.value) == (
        f"{url!r} names an object version (?versionId=), which s3fs reads from an S3 URL: a "
        "checkpoint is a prefix of objects, not one version of one; remove it"
    )


def test_a_manager_whose_store_cannot_be_reached_raises_a_checkpoint_error() -> None:
    """Nothing listens at the endpoint: latest(), load_latest and complete_steps raised
    botocore's EndpointConnectionError itself (the manager lists outside any agreed
    operation), past a loop's ``except CheckpointError``; save and load said it inside
    theirs."""
    endpoint = f"http://127.0.0.1:{free_port()}"  # picked free: nothing listens there
    options = {
        "key": "k",
        "secret": "s",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    manager = shardsafe.CheckpointManager("s3://bucket/run", storage_options=options)
    said = (
        "the object store failed at s3://bucket/run: EndpointConnectionError: Could not "
        f'connect to the endpoint URL: "{endpoint}/bucket?list-type=2&prefix=run%2F&'
        'delimiter=%2F&encoding-type=url"'
    )
    for call in (
        manager.latest,
        manager.complete_steps,
        lambda: manager.load_latest({"w": torch.zeros(2)}),
    ):
        with pytest.raises(CheckpointError) as raised:
            call()
        assert str(raised.value) == said


def test_a_store_failing_after_the_listing_is_a_checkpoint_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store stops answering after the manager's listing of its root, at the first
    look into a step: botocore's exception escaped latest() and load_latest raw (found
    in review). Fault injected on memory:// (one request, raising what botocore raises
    for an unreachable endpoint)."""
    from botocore.exceptions import EndpointConnectionError

    root = "memory://failing-after-listing/run"
    manager = shardsafe.CheckpointManager(root)
    manager.save(1, {"w": torch.ones(2)})
    manager.close()
    real_kind = FsspecStorage.kind

    def kind(self: FsspecStorage, name: str) -> Any:
        if name == "manifest.json":
            raise EndpointConnectionError(endpoint_url="http://store")
        return real_kind(self, name)

    monkeypatch.setattr(FsspecStorage, "kind", kind)
    reader = shardsafe.CheckpointManager(root)
    said = (
        f"the object store failed at {root}: EndpointConnectionError: Could not connect to "
        'the endpoint URL: "http://store"'
    )
    for call in (reader.latest, lambda: reader.load_latest({"w": torch.zeros(2)})):
        with pytest.raises(CheckpointError) as raised:
            call()
        assert str(raised.value) == said
    assert reader.newest_committed_step() is None  # not known committed, as for an OSError


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["verify", "inspect", "read_manifest"])
def test_a_store_that_cannot_be_reached_is_a_checkpoint_error_naming_it(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """verify, inspect and read_manifest raised botocore's own EndpointConnectionError
    (load and the manager said "the object store failed at ...")."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    dead = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"}}
    url = "s3://bucket/run/step-000000001"
    with pytest.raises(shardsafe.CheckpointError) as e:
        getattr(shardsafe, call)(url, storage_options=dead)
    assert str(e.value).startswith(
        f"the object store failed at {url}: EndpointConnectionError: Could not connect to "
        "the endpoint URL"
    ), str(e.value)
