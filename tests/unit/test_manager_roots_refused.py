"""Roots no checkpoint could be saved in are refused before anything happens, naming them.

A bucket that does not exist is no "fresh start": ``load_latest``, ``latest`` and
``complete_steps`` raise the save's missing-bucket error (agreed on every rank by
``load_latest``), while a missing prefix in an existing bucket is still a fresh start. A
local root this process cannot create files in (or, when absent, cannot make) is refused
by ``require_writable_root`` (the Trainer asks before its first step) and by the first
save, naming the directory.

The tests run as root, which ignores file permissions: the child processes that must be
refused drop the DAC capabilities with ``setpriv`` first (skipped where it is missing).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shardsafe import CheckpointManager
from shardsafe.errors import CheckpointNotFoundError
from tests.harness import run_ranks
from tests.s3server import S3Server, with_env

NO_DAC = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--ambient-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
]
"""A command prefix under which permissions apply to root too (see the module's doc)."""


def missing_bucket_message(bucket: str, root: str) -> str:
    return (
        f"the bucket {bucket!r} of {root} does not exist (or these credentials cannot see "
        "it); shardsafe never creates a bucket: check the URL and the endpoint, or create "
        "the bucket first"
    )


def test_a_missing_bucket_is_refused_by_every_look_for_checkpoints(
    s3_server: S3Server, s3_bucket: str
) -> None:
    bucket = f"{s3_bucket}-typo"
    root = f"s3://{bucket}/run"
    message = missing_bucket_message(bucket, root)
    state = {"w": torch.zeros(2)}
    for look in (
        lambda m: m.load_latest(state),
        lambda m: m.latest(),
        lambda m: m.complete_steps(),
    ):
        with pytest.raises(CheckpointNotFoundError) as caught:
            look(CheckpointManager(root))
        assert str(caught.value) == message
    assert torch.equal(state["w"], torch.zeros(2))
    buckets = {b["Name"] for b in s3_server.client().list_buckets()["Buckets"]}
    assert bucket not in buckets  # asked about, never created


def test_a_missing_prefix_in_an_existing_bucket_is_a_fresh_start(
    s3_server: S3Server, s3_bucket: str
) -> None:
    manager = CheckpointManager(f"s3://{s3_bucket}/never-saved")
    assert manager.load_latest({"w": torch.zeros(2)}) is None
    assert manager.latest() is None
    assert manager.complete_steps() == []
    assert s3_server.keys(s3_bucket) == []  # looking wrote nothing


def load_latest_error(rank: int, world: int, root: str) -> tuple[str, str]:
    try:
        CheckpointManager(root).load_latest({"w": torch.zeros(2)})
    except Exception as e:
        return type(e).__name__, str(e)
    return "returned", ""


def test_load_latest_agrees_on_a_missing_bucket_on_every_rank(
    s3_server: S3Server, s3_bucket: str
) -> None:
    bucket = f"{s3_bucket}-typo"
    root = f"s3://{bucket}/run"
    got = run_ranks(with_env, 2, s3_server.env, load_latest_error, root)
    said = f"load failed on rank 0: {missing_bucket_message(bucket, root)}"
    assert got == [("CheckpointNotFoundError", said)] * 2


def without_dac(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (with ``sys.argv[1:]`` = ``args``) in a Python child under which
    permissions apply (see the module's doc)."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: file permissions would not apply")
    prefix = NO_DAC if os.geteuid() == 0 else []
    command = [*prefix, sys.executable, "-c", textwrap.dedent(code), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


REFUSED = """
    import sys, torch
    from shardsafe import CheckpointManager, CheckpointError
    manager = CheckpointManager(sys.argv[1], warn_if_not_empty=False)
    if len(sys.argv) > 2:  # the permissions changed after the probe: the lock is refused
        manager.require_writable_root = lambda: None
    for call in (manager.require_writable_root, lambda: manager.save(2, {"w": torch.ones(2)})):
        try:
            call()
        except CheckpointError as e:
            print(e)
        else:
            print("not refused")
"""


def read_only(directory: Path) -> None:
    directory.chmod(0o555)


def test_a_read_only_root_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    CheckpointManager(root).save(1, {"w": torch.zeros(2)})
    before = sorted(os.listdir(root))
    read_only(root)
    try:
        proc = without_dac(REFUSED, str(root))
    finally:
        root.chmod(0o755)
    message = (
        f"cannot create files in {root} (Permission denied), where the checkpoints belong: "
        f"make {root} writable (chmod u+w {root}, or run as its owner), or save into another "
        "root (run_dir); nothing was written"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [message, message]
    assert sorted(os.listdir(root)) == before  # no probe left, no lock, no step


def test_the_locks_refusal_names_the_root(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    CheckpointManager(root).save(1, {"w": torch.zeros(2)})
    before = sorted(os.listdir(root))
    read_only(root)
    try:
        proc = without_dac(REFUSED, str(root), "skip the probe")
    finally:
        root.chmod(0o755)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1] == (
        f"cannot create files in {root} (Permission denied), where the checkpoints belong: "
        f"make {root} writable (chmod u+w {root}, or run as its owner), or save into another "
        "root (run_dir); nothing was written"
    ), proc.stdout
    assert sorted(os.listdir(root)) == before


def test_an_absent_root_under_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "run"
    parent.mkdir()
    root = parent / "more" / "ck"
    read_only(parent)
    try:
        proc = without_dac(REFUSED, str(root))
    finally:
        parent.chmod(0o755)
    message = (
        f"{root} does not exist, and this process cannot create it in {parent} (not "
        f"writable by it), where the checkpoints belong: make {parent} writable (chmod u+w "
        f"{parent}, or run as its owner), or save into another root (run_dir); nothing was "
        "written"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [message, message]
    assert os.listdir(parent) == []


def test_a_writable_root_passes_and_keeps_nothing_of_the_probe(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    manager = CheckpointManager(root)
    manager.require_writable_root()  # absent, in a writable directory
    assert not root.exists()
    manager.save(1, {"w": torch.zeros(2)})
    before = sorted(os.listdir(root))
    manager.require_writable_root()
    assert sorted(os.listdir(root)) == before


def test_a_probe_left_by_a_killed_process_is_removed_by_the_next_save(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    manager = CheckpointManager(root)
    manager.save(1, {"w": torch.zeros(2)})
    left = root / f".shardsafe.probe-{'0' * 32}"
    left.write_bytes(b"")
    mine = root / ".shardsafe.probe-mine"  # not a probe's name: the user's, kept
    mine.write_bytes(b"")
    manager.save(2, {"w": torch.zeros(2)})
    assert not left.exists()
    assert mine.exists()
