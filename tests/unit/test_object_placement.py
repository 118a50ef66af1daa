"""Saving under a name that already holds a checkpoint on an object store (Lightning's
``last.ckpt`` under an ``s3://`` dirpath), against a real S3 API server (moto on
loopback): the exact objects left, the replacement's crash window, and what is refused."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

import shardsafe
from shardsafe.checkpoint import SaveOptions
from shardsafe.checkpoint.replacing import save_replacing
from shardsafe.checkpoint.storage import object_placement
from shardsafe.checkpoint.storage.object_placement import ObjectPlacement, committed_copy
from shardsafe.checkpoint.storage.object_storage import FsspecStorage
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
