"""A Lightning fit whose ``ModelCheckpoint(dirpath=...)`` is an ``s3://`` URL, against a real
S3 API server (moto on loopback), on 2 ranks: the same checkpoints as on a local disk
(same tensors, same names kept by ``save_top_k``, ``last.ckpt`` replaced at every save),
resumed with the same losses, in the background too (and, after a crash while
``last.ckpt`` was being replaced, from its staged copy); ``save_last="link"`` is refused (by
Lightning itself) with nothing written."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe.checkpoint import SaveOptions
from shardsafe.checkpoint.replacing import save_replacing
from shardsafe.checkpoint.storage import object_placement
from shardsafe.lightning import cleanup, local_tier, restore
from tests.harness import free_port
from tests.lightning.helpers import (
    Net,
    Run,
    assert_same_optimizer_state,
    losses,
    outcomes,
    run,
)
from tests.s3server import S3Server

pytestmark = pytest.mark.timeout(150)

KEPT = ["epoch=1-step=10.ckpt", "epoch=2-step=15.ckpt", "last.ckpt"]


def saved(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    net = Net()
    adam = torch.optim.Adam(net.parameters(), lr=1.0)
    shardsafe.load(path, {"model": net, "optimizer": adam})
    return net.state_dict(), adam.state_dict()


def checkpoints(server: S3Server, bucket: str) -> list[str]:
    """The checkpoint names under ``ckpts/`` (each a prefix of objects)."""
    return sorted({k.split("/")[1] for k in server.keys(bucket, "ckpts/")})


def assert_same_checkpoint(url: str, local: Path) -> None:
    model, optimizer = saved(url)
    model_l, optimizer_l = saved(local)
    assert all(torch.equal(model[k], model_l[k]) for k in model_l)
    assert_same_optimizer_state(optimizer_l, optimizer)  # type: ignore[arg-type]
    assert shardsafe.verify(url).ok


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "async_save"])
def test_an_s3_dirpath_holds_what_a_local_one_holds_and_resumes_the_same(
    tmp_path: Path,
    s3_server: S3Server,
    s3_bucket: str,
    uninterrupted: Callable[[str], Path],
    background: bool,
) -> None:
    local = uninterrupted("zero")
    ckpts = f"s3://{s3_bucket}/ckpts"
    flags = ("--async-save",) if background else ()
    run(
        tmp_path, "--optimizer", "zero", "--dirpath", ckpts, "--save-last", *flags,
        "--save-at-end", f"s3://{s3_bucket}/final.ckpt",
    )  # fmt: skip
    assert losses(tmp_path) == losses(local)
    assert checkpoints(s3_server, s3_bucket) == KEPT  # no staged copy left, nothing else
    for name in KEPT:
        assert_same_checkpoint(f"{ckpts}/{name}", local / "ckpts" / name)
    assert_same_checkpoint(f"s3://{s3_bucket}/final.ckpt", local / "final.ckpt")
    assert not (tmp_path / "ckpts").exists()  # nothing on the local disk instead

    resumed = tmp_path / "resumed"
    run(resumed, "--optimizer", "zero", "--resume", f"{ckpts}/epoch=1-step=10.ckpt", *flags)
    whole = losses(local)
    assert losses(resumed) == {s: whole[s] for s in range(11, 16)}
    if not background:
        crashed_while_replacing_last(s3_server, s3_bucket)
        after_crash = tmp_path / "after-crash"
        run(after_crash, "--optimizer", "zero", "--resume", f"{ckpts}/last.ckpt")
        assert losses(after_crash) == {s: whole[s] for s in range(11, 16)}


def crashed_while_replacing_last(server: S3Server, bucket: str) -> None:
    """What a crash in the middle of replacing ``last.ckpt`` leaves: the old one gone, the
    new one (here: step 10's objects) committed only under the staging prefix."""
    client = server.client()
    for key in server.keys(bucket, "ckpts/last.ckpt/"):
        client.delete_object(Bucket=bucket, Key=key)
    for key in server.keys(bucket, "ckpts/epoch=1-step=10.ckpt/"):
        staged = key.replace("epoch=1-step=10.ckpt", ".last.ckpt.shardsafe-partial", 1)
        client.copy_object(Bucket=bucket, Key=staged, CopySource={"Bucket": bucket, "Key": key})


def test_save_last_link_under_an_s3_dirpath_is_refused_before_the_first_step(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    ckpts = f"s3://{s3_bucket}/ckpts"
    started = Run(tmp_path, "--optimizer", "plain", "--dirpath", ckpts, "--save-last", "link")
    codes = started.wait()
    assert codes == [1, 1], started.output()
    for rank in (0, 1):
        outcome = (tmp_path / f"outcome-{rank}.json").read_text()
        assert (  # Lightning's own refusal, before the strategy is set up
            "ValueError: `ModelCheckpoint(save_last='link')` is only supported for local file "
            f"paths, got `dirpath={ckpts}`."
        ) in outcome
    assert losses(tmp_path) == {}
    assert s3_server.keys(s3_bucket) == []
    assert not any(n.startswith("s3:") for n in os.listdir(tmp_path))


@pytest.mark.parametrize("mistake", ["missing bucket", "double slash"])
def test_a_dirpath_no_save_could_write_to_is_refused_before_the_first_step(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str, mistake: str
) -> None:
    """A mistyped bucket or a ``//`` in the dirpath was found at the first save, after
    the run had trained up to it (found in review)."""
    if mistake == "missing bucket":
        ckpts = f"s3://{s3_bucket}-typo/ckpts"
        why = (
            f"the bucket '{s3_bucket}-typo' of {ckpts} does not exist (or these credentials "
            "cannot see it); shardsafe never creates a bucket: check the URL and the "
            "endpoint, or create the bucket first"
        )
    else:
        ckpts = f"s3://{s3_bucket}/runs//ckpts"
        why = (
            f"{ckpts!r} has an empty, '.' or '..' segment in its path; an object store keeps "
            "'a//b', 'a/./b' and 'a/b' as different keys: write the URL with single slashes "
            "and no dot segments"
        )
    started = Run(tmp_path, "--optimizer", "plain", "--dirpath", ckpts)
    codes = started.wait()
    assert codes == [1, 1], started.output()
    said = (
        f"CheckpointError: ModelCheckpoint(dirpath={ckpts!r}) cannot hold checkpoints: "
        f"{why} (shardsafe's Lightning strategy checks this when fit starts, so that no "
        "save fails mid-run)"
    )
    assert [o["error"] for o in outcomes(tmp_path, 2)] == [said, said]
    assert losses(tmp_path) == {}  # not one step trained
    assert s3_server.keys(s3_bucket) == []


def test_the_folder_of_checkpoints_passed_as_one_is_told_so(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    """The dirpath passed where one of its checkpoints was meant: on S3 "has no
    manifest.json, so it is not a committed checkpoint (a save into it may have been
    interrupted)", which sent users looking for a crash (found in review); a local
    folder was told what it is."""
    from shardsafe.checkpoint.options import LoadOptions

    ckpts = f"s3://{s3_bucket}/ckpts"
    for step in (5, 10, 15, 20):
        shardsafe.save(f"{ckpts}/epoch=0-step={step}.ckpt", {"w": torch.ones(2)})
    s3_server.put(s3_bucket, "ckpts/epoch=0-step=25.ckpt/half-written.safetensors", b"x")
    said = (
        f"{ckpts} has no manifest.json, so it is not a committed checkpoint (a save into it "
        "may have been interrupted). It looks like a folder of Lightning checkpoints (it "
        "holds epoch=0-step=10.ckpt, epoch=0-step=15.ckpt, epoch=0-step=20.ckpt ...): pass "
        "one of them"
    )
    with pytest.raises(shardsafe.CheckpointNotFoundError) as plain:
        shardsafe.load(ckpts, {"w": torch.zeros(2)})
    assert str(plain.value) == said
    with pytest.raises(shardsafe.CheckpointError) as in_fit:
        restore.load_directory(ckpts, Net(), None, LoadOptions())
    assert str(in_fit.value) == said


def test_a_resume_after_a_crash_while_last_ckpt_was_replaced_loads_its_staged_copy(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process: the crash window of ``object_placement`` (the old ``last.ckpt`` gone, the
    new one committed only under its staging prefix), as the strategy's load resolves it."""
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"
    save_replacing(
        url, {"w": torch.full((2,), 1.0), "lightning": {"global_step": 5}}, SaveOptions()
    )
    assert local_tier._step_of(url) == 5

    def killed(*args: object) -> None:
        raise OSError("killed while copying")

    with monkeypatch.context() as patched:
        patched.setattr(object_placement, "_copy_checkpoint", killed)
        with pytest.raises(shardsafe.CheckpointError):
            state = {"w": torch.full((2,), 2.0), "lightning": {"global_step": 10}}
            save_replacing(url, state, SaveOptions())
    # The local tier compares its newest step with the committed copy's, not "unknown"
    # (which would resume from an older local step, and the next save would delete step 10).
    assert local_tier._step_of(url) == 10
    staged = f"s3://{s3_bucket}/ckpts/.last.ckpt.shardsafe-partial"
    with pytest.warns(UserWarning) as warned:
        assert restore.committed_url(url) == staged
    assert str(warned[0].message) == (
        f"shardsafe: {url} has no manifest (the save that replaced it was interrupted while "
        f"being published); loading its committed copy {staged}"
    )
    assert torch.equal(shardsafe.load(staged, {})["w"], torch.full((2,), 2.0))


def test_a_ckpt_object_on_s3_is_refused_with_the_way_out(
    s3_server: S3Server, s3_bucket: str
) -> None:
    s3_server.put(s3_bucket, "ckpts/old.ckpt", b"PK\x03\x04 a Lightning file")
    url = f"s3://{s3_bucket}/ckpts/old.ckpt"
    with pytest.raises(shardsafe.CheckpointError) as info:
        restore.committed_url(url)
    assert str(info.value) == (
        f"{url} is a single object (a Lightning .ckpt file?), not a shardsafe checkpoint; the "
        "shardsafe strategies read .ckpt files from local paths only: download it, then pass "
        "its local path"
    )


def test_an_unreachable_store_is_a_warning_where_rank_0_acts_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 removes old checkpoints and reads ``last.ckpt``'s step on its own (the others
    wait for it in a broadcast or go on training): a store's connection error, which is
    not an ``OSError``, must not escape there; each is a warning saying what was not done."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    url = "s3://bucket/ckpts/epoch=0-step=5.ckpt"
    with pytest.warns(UserWarning) as warned:
        cleanup.remove(url)
        assert local_tier._step_of(url) is None
        cleanup.remove("s3://bucket/ckpts//last.ckpt")  # refused by the URL check: warned
    # pytest.warns records every warning raised meanwhile (in CI once a third-party one,
    # or one a garbage-collected object of an earlier test gave): only shardsafe's count.
    messages = [str(w.message) for w in warned if str(w.message).startswith("shardsafe: ")]
    assert len(messages) == 3, messages
    assert messages[2] == (
        "shardsafe: could not remove the old checkpoint s3://bucket/ckpts//last.ckpt: "
        "CheckpointError: 's3://bucket/ckpts//last.ckpt' has an empty, '.' or '..' segment in "
        "its path; an object store keeps 'a//b', 'a/./b' and 'a/b' as different keys: write "
        "the URL with single slashes and no dot segments"
    )
    assert messages[0].startswith(
        f"shardsafe: could not remove the old checkpoint {url}: EndpointConnectionError: "
    )
    assert messages[1].startswith(
        f"shardsafe: could not read which step {url} holds (CheckpointError: the object "
        f"store failed at {url}: EndpointConnectionError: "
    )
    assert messages[1].endswith("resuming from the local tier's newest step")
