"""Saving under a name that already holds a checkpoint on an object store (Lightning's
``last.ckpt`` under an ``s3://`` dirpath), against a real S3 API server (moto on
loopback): the exact objects left, the replacement's crash window, and what is refused."""

from __future__ import annotations

import io
import time
import zipfile
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.checkpoint import SaveOptions
from shardsafe.checkpoint.replacing import save_replacing
from shardsafe.checkpoint.storage import object_placement
from shardsafe.checkpoint.storage.object_placement import ObjectPlacement, committed_copy
from shardsafe.checkpoint.storage.object_storage import FsspecStorage
from tests.harness import free_port
from tests.s3server import S3Server

pytestmark = pytest.mark.timeout(120)


def save(url: str, value: float) -> None:
    save_replacing(url, {"w": torch.full((3,), value)}, SaveOptions())


def loaded(url: str) -> float:
    return float(shardsafe.load(url, {})["w"][0])


def names(server: S3Server, bucket: str) -> list[str]:
    return server.keys(bucket, "ckpts/")


def test_a_new_name_is_saved_into_directly(s3_server: S3Server, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/ckpts/epoch=0-step=5.ckpt"
    assert ObjectPlacement.of(url).staging == "epoch=0-step=5.ckpt"
    save(url, 1.0)
    assert loaded(url) == 1.0
    keys = names(s3_server, s3_bucket)
    assert "ckpts/epoch=0-step=5.ckpt/manifest.json" in keys
    assert all(k.startswith("ckpts/epoch=0-step=5.ckpt/") for k in keys)


def test_saving_again_replaces_the_checkpoint_and_leaves_no_staged_copy(
    s3_server: S3Server, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"
    save(url, 1.0)
    first = names(s3_server, s3_bucket)
    assert ObjectPlacement.of(url).staging == ".last.ckpt.shardsafe-partial"
    save(url, 2.0)
    assert loaded(url) == 2.0
    assert names(s3_server, s3_bucket) == first  # the same objects, the new bytes
    save(url, 3.0)
    assert loaded(url) == 3.0
    assert names(s3_server, s3_bucket) == first


def test_a_folder_marker_under_the_name_does_not_stop_its_replacement(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """A zero-byte ``last.ckpt/`` object (the S3 console's "Create folder", S3A, gcsfuse)
    made each replacement delete the old checkpoint and then fail, saying foreign objects
    had appeared ("it holds []"), with nothing left to load (found in review)."""
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"
    save(url, 1.0)
    s3_server.put(s3_bucket, "ckpts/last.ckpt/", b"")
    save(url, 2.0)
    assert loaded(url) == 2.0
    save(url, 3.0)
    assert loaded(url) == 3.0
    keys = names(s3_server, s3_bucket)
    assert "ckpts/last.ckpt/" in keys  # the marker, left as it was
    assert not any("shardsafe-partial" in k for k in keys)
    assert shardsafe.verify(url).ok


def test_a_crash_while_publishing_leaves_a_committed_copy_that_is_found_then_cleared(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"
    save(url, 1.0)
    real = object_placement._copy_checkpoint

    def crash_after_the_old_one_is_gone(*args: object) -> None:
        raise OSError("killed while copying")

    monkeypatch.setattr(object_placement, "_copy_checkpoint", crash_after_the_old_one_is_gone)
    with pytest.raises(shardsafe.CheckpointError):
        save(url, 2.0)
    monkeypatch.setattr(object_placement, "_copy_checkpoint", real)
    assert not any(k.startswith("ckpts/last.ckpt/") for k in names(s3_server, s3_bucket))
    staged = f"s3://{s3_bucket}/ckpts/.last.ckpt.shardsafe-partial"
    assert committed_copy(url) == staged
    assert loaded(staged) == 2.0  # the newest checkpoint survived the crash
    save(url, 3.0)  # the name is free again: saved into directly, the copy deleted after
    assert loaded(url) == 3.0
    assert committed_copy(url) is None
    assert not any(".shardsafe-partial" in k for k in names(s3_server, s3_bucket))


def test_a_foreign_object_under_the_name_is_refused_and_kept(
    s3_server: S3Server, s3_bucket: str
) -> None:
    s3_server.put(s3_bucket, "ckpts/last.ckpt/notes.txt", b"mine")
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"
    with pytest.raises(shardsafe.CheckpointError) as info:
        save(url, 1.0)
    assert str(info.value) == (
        f"{url} holds ['notes.txt'], which shardsafe did not write, so shardsafe will not "
        "replace it with the new checkpoint (it only ever replaces a checkpoint it wrote). "
        "Move it away, or save under another name."
    )
    assert names(s3_server, s3_bucket) == ["ckpts/last.ckpt/notes.txt"]


def test_a_lightning_ckpt_object_under_the_name_is_replaced(
    s3_server: S3Server, s3_bucket: str
) -> None:
    ckpt = io.BytesIO()
    with zipfile.ZipFile(ckpt, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    s3_server.put(s3_bucket, "ckpts/last.ckpt", ckpt.getvalue())
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"
    save(url, 1.0)
    assert loaded(url) == 1.0
    keys = names(s3_server, s3_bucket)
    assert "ckpts/last.ckpt" not in keys
    assert "ckpts/last.ckpt/manifest.json" in keys


def test_a_failed_save_under_a_free_name_leaves_nothing_and_the_next_one_saves(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"

    def killed_before_the_manifest(self: FsspecStorage, name: str, data: bytes) -> None:
        raise OSError("killed before the commit")

    with monkeypatch.context() as patched:
        patched.setattr(FsspecStorage, "commit", killed_before_the_manifest)
        with pytest.raises(shardsafe.CheckpointError):
            save(url, 1.0)
    assert names(s3_server, s3_bucket) == []  # the failed save removed what it wrote
    assert ObjectPlacement.of(url).staging == "last.ckpt"
    save(url, 2.0)
    assert loaded(url) == 2.0
    assert "ckpts/last.ckpt/manifest.json" in names(s3_server, s3_bucket)


def test_a_crash_in_the_middle_of_the_copy_leaves_leftovers_the_next_save_clears(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the data objects were copied, before the manifest: the name holds our
    marked leftovers (not a checkpoint, not foreign), the staged copy is found, and the
    next save of the name writes over the leftovers."""
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"
    save(url, 1.0)
    real = object_placement._copy_one

    def killed_at_the_manifest(staged: Any, named: Any, name: str) -> None:
        if name == "manifest.json":
            raise OSError("killed before the manifest was copied")
        real(staged, named, name)

    with monkeypatch.context() as patched:
        patched.setattr(object_placement, "_copy_one", killed_at_the_manifest)
        with pytest.raises(shardsafe.CheckpointError) as info:
            save(url, 2.0)
    staged = f"s3://{s3_bucket}/ckpts/.last.ckpt.shardsafe-partial"
    assert str(info.value).startswith(
        f"the new checkpoint is committed under {staged}, but giving it the name {url} failed"
    )
    left = [k for k in names(s3_server, s3_bucket) if k.startswith("ckpts/last.ckpt/")]
    assert "ckpts/last.ckpt/.shardsafe-incomplete" in left
    assert any(k.endswith(".safetensors") for k in left)  # the data did get copied
    assert "ckpts/last.ckpt/manifest.json" not in left
    assert committed_copy(url) == staged
    save(url, 3.0)
    assert loaded(url) == 3.0
    assert not any(
        "shardsafe-partial" in k or "incomplete" in k for k in names(s3_server, s3_bucket)
    )


def test_names_with_pattern_characters_are_copied_as_they_are(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """``*``, ``?`` and ``[`` in the directory: copied object to object, never expanded."""
    url = f"s3://{s3_bucket}/run*x[1]?/last.ckpt"
    save(url, 1.0)
    save(url, 2.0)
    assert loaded(url) == 2.0
    keys = s3_server.keys(s3_bucket, "run*x[1]?/")
    assert "run*x[1]?/last.ckpt/manifest.json" in keys
    assert not any("shardsafe-partial" in k or k.count("manifest.json") > 1 for k in keys)


@pytest.mark.parametrize("newest_first", [False, True])
def test_of_several_staged_copies_the_newest_is_found(
    s3_server: S3Server, s3_bucket: str, newest_first: bool
) -> None:
    """Crashes can leave committed copies under more than one staging name; the one whose
    manifest was written last is the newest, whichever name it has."""
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"
    first, second = ".last.ckpt.shardsafe-partial", ".last.ckpt.shardsafe-partial-1"
    older, newer = (second, first) if newest_first else (first, second)
    shardsafe.save(f"s3://{s3_bucket}/ckpts/{older}", {"w": torch.full((3,), 1.0)})
    time.sleep(1.1)  # the store's clock counts whole seconds
    shardsafe.save(f"s3://{s3_bucket}/ckpts/{newer}", {"w": torch.full((3,), 2.0)})
    assert committed_copy(url) == f"s3://{s3_bucket}/ckpts/{newer}"


def test_a_copy_that_lost_an_object_is_not_published_and_the_staged_copy_stays(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target's listing is checked against the manifest before the manifest is
    copied: a data object the store did not copy stops the publish, and the staged
    checkpoint (the only complete one) is kept and found."""
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"
    save(url, 1.0)
    real = object_placement._copy_one

    def loses_data(staged: Any, named: Any, name: str) -> None:
        if name.endswith(".safetensors"):
            return  # the store said it copied, but nothing arrived
        real(staged, named, name)

    with monkeypatch.context() as patched:
        patched.setattr(object_placement, "_copy_one", loses_data)
        with pytest.raises(shardsafe.CheckpointError) as info:
            save(url, 2.0)
    assert "does not hold the files its manifest names after it was copied" in str(info.value)
    assert "manifest.json" not in " ".join(
        k for k in names(s3_server, s3_bucket) if k.startswith("ckpts/last.ckpt/")
    )
    staged = f"s3://{s3_bucket}/ckpts/.last.ckpt.shardsafe-partial"
    assert committed_copy(url) == staged
    assert loaded(staged) == 2.0
    save(url, 3.0)
    assert loaded(url) == 3.0


def test_a_url_the_store_would_read_as_other_keys_is_refused() -> None:
    """``a//b`` and ``a/./b`` are other keys than ``a/b`` in a bucket: a save and the lookups
    of its name would miss each other, so the URL is refused, naming the fix."""
    for url in ("s3://b/ckpts//last.ckpt", "s3://b/ckpts/./last.ckpt", "s3://b/x/../last.ckpt"):
        with pytest.raises(shardsafe.CheckpointError) as info:
            object_placement.split(url)
        assert str(info.value) == (
            f"{url!r} has an empty, '.' or '..' segment in its path; an object store keeps "
            "'a//b', 'a/./b' and 'a/b' as different keys: write the URL with single slashes "
            "and no dot segments"
        )
    for url in ("s3://bucket", "s3://bucket/", "ckpts/last.ckpt", "hdfs:///last.ckpt"):
        with pytest.raises(shardsafe.CheckpointError) as info:
            object_placement.split(url)
        assert str(info.value) == (
            f"{url!r} does not name a checkpoint under a bucket (scheme://bucket/.../name)"
        )
    assert object_placement.split("s3://b/ckpts/last.ckpt/") == ("s3://b/ckpts", "last.ckpt")
    # An empty authority is not a doubled slash.
    assert object_placement.split("hdfs:///user/x/last.ckpt") == ("hdfs:///user/x", "last.ckpt")


@pytest.fixture
def unreachable(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Storage options for an S3 endpoint nothing listens on (loopback, a closed port)."""
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask for credentials
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {
            "endpoint_url": f"http://127.0.0.1:{free_port()}",
            "region_name": "us-east-1",
        },
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
    }


def test_a_store_that_cannot_be_reached_is_a_checkpoint_error_naming_the_url(
    unreachable: dict[str, Any],
) -> None:
    """botocore's connection errors are not ``OSError``s; they come out as the
    ``CheckpointError`` that the ranks agree on (or a single process reads)."""
    url = "s3://bucket/ckpts/last.ckpt"
    for call in (ObjectPlacement.of, committed_copy):
        with pytest.raises(shardsafe.CheckpointError) as info:
            call(url, unreachable)
        assert str(info.value).startswith(
            f"the object store failed at {url}: EndpointConnectionError: Could not connect"
        )


def test_a_failure_to_clear_staged_copies_after_publishing_only_warns(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"
    save(url, 1.0)

    def throttled(*args: object) -> None:
        raise OSError("SlowDown: please reduce your request rate")

    monkeypatch.setattr(object_placement, "_delete_staged_leftovers", throttled)
    with pytest.warns(UserWarning) as warned:
        save(url, 2.0)  # succeeds: the new checkpoint has its name
    assert loaded(url) == 2.0
    assert [str(w.message) for w in warned] == [
        f"shardsafe: the checkpoint is published under {url}; older staged copies beside it "
        "could not be listed or deleted (OSError: SlowDown: please reduce your request "
        "rate): the next save of the name deletes them"
    ]


def test_what_is_left_under_the_name_after_deleting_the_old_checkpoint_stops_the_copy(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object that appears under the name after the check makes the deletion leave the
    old checkpoint in place (it is not all shardsafe's): nothing is copied beside it, the old
    checkpoint still loads, and the new one stays committed under its staging prefix."""
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"
    save(url, 1.0)
    real = object_placement._delete_replaced

    def then_someone_writes(root: FsspecStorage, name: str, kind: str) -> None:
        s3_server.put(s3_bucket, "ckpts/last.ckpt/notes.txt", b"mine")
        with pytest.warns(UserWarning):  # the deletion leaves what is not shardsafe's
            real(root, name, kind)

    monkeypatch.setattr(object_placement, "_delete_replaced", then_someone_writes)
    with pytest.raises(shardsafe.CheckpointError) as info:
        save(url, 2.0)
    staged = f"s3://{s3_bucket}/ckpts/.last.ckpt.shardsafe-partial"
    assert str(info.value) == (
        f"the new checkpoint is committed under {staged} only: objects shardsafe did not "
        f"write appeared under {url} while it was being replaced (it holds ['manifest.json', "
        "'notes.txt', 'shard-00000-of-00001.safetensors']), so nothing there was deleted "
        "past them and nothing was copied; the name holds the older checkpoint, whole, which "
        f"the name's lookups still find. Load the new checkpoint by passing {staged} itself, "
        "and move the foreign objects away before the next save of the name (which refuses "
        "them)."
    )
    assert loaded(url) == 1.0  # the deletion kept it whole, beside the foreign object
    assert loaded(staged) == 2.0
