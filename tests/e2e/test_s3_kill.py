"""Seeded SIGKILLs of a process saving to S3 (moto on loopback), mid-upload: ``latest``
always names a complete checkpoint that verifies and holds exactly its step's bytes, and
the next save cleans what the killed one left (objects and unfinished multipart uploads)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe.commands.verify import find_problems
from tests.s3server import S3Server

pytestmark = pytest.mark.timeout(240)
TARGET = Path(__file__).with_name("s3_kill_target.py")


def run_until_killed(root: str, env: dict[str, str], seed: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(TARGET), root], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the first save committed: kill during a later one
    assert line.startswith("SAVED"), line
    time.sleep(random.Random(seed).uniform(0.0, 1.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigkill_mid_upload_leaves_latest_complete_and_the_next_save_cleans_up(
    s3_server: S3Server, s3_bucket: str, seed: int
) -> None:
    sys.path.insert(0, str(TARGET.parent))
    from s3_kill_target import state_of

    root = f"s3://{s3_bucket}/run"
    root_dir = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path, root_dir])}
    run_until_killed(root, env, seed)

    manager = shardsafe.CheckpointManager(root, warn_if_not_empty=False)
    latest = manager.latest()
    assert latest is not None
    assert find_problems(latest, shardsafe.read_manifest(latest)) == []
    step = int(latest.rsplit("-", 1)[1])
    got = {"big": torch.zeros(6 << 20)}
    assert shardsafe.load(latest, got)["step"] == step
    assert torch.equal(got["big"], state_of(step)["big"])  # type: ignore[arg-type]

    # Run again (it continues after the newest step) and kill it after one more save:
    # the leftovers of the first kill are gone, except what the second kill left.
    newest = manager.complete_steps()[-1]
    manager.close()
    next_manager = shardsafe.CheckpointManager(root, warn_if_not_empty=False)
    next_manager.save(newest + 1, state_of(newest + 1))
    prefixes = {k.split("/")[1] for k in s3_server.keys(s3_bucket, "run/step-")}
    committed = {f"step-{s:09d}" for s in next_manager.complete_steps()}
    assert prefixes == committed, (prefixes, committed)
    uploads = s3_server.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert uploads == [], uploads
    next_manager.close()
