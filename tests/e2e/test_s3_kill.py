"""Seeded SIGKILLs of runs saving to S3 (moto on loopback), mid-upload, of the whole run
and of one rank of two: ``latest`` always names a complete checkpoint that verifies and
holds exactly its step's bytes, a surviving rank exits by itself naming the dead one, and
the next save cleans what the killed one left (objects and unfinished multipart uploads).
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.checkpoint.verifying import find_problems
from tests.e2e.kills import (
    SURVIVOR_EXIT_S,
    KillTarget,
    kill_during_a_save,
    seeded_moment,
    survivor_error,
)
from tests.e2e.s3_kill_target import state_of
from tests.harness import free_port
from tests.s3server import S3Server

TARGET = Path(__file__).with_name("s3_kill_target.py")
ROOT_DIR = str(Path(__file__).resolve().parents[2])


def start(root: str, *args: str, output: str | None = None, errors: str | None = None) -> Any:
    """The target on ``root``, in a session of its own (``KillTarget``: its output
    followed unless ``output`` names a file)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path, ROOT_DIR])}
    return KillTarget([str(TARGET), root, *args], env, output=output, errors=errors)


def check_latest_then_save_again(s3_server: S3Server, bucket: str, root: str) -> int:
    """``latest`` verifies and holds exactly its step; one more save (a fresh process
    taking over the dead run's lock) leaves only committed step prefixes and no
    unfinished multipart upload. Returns the step of ``latest``."""
    manager = shardsafe.CheckpointManager(root, warn_if_not_empty=False)
    latest = manager.latest()
    assert latest is not None
    assert find_problems(latest, shardsafe.read_manifest(latest)) == []
    step = int(latest.rsplit("-", 1)[1])
    got = {"big": torch.zeros(3 << 20), "other": torch.zeros(3 << 20)}
    assert shardsafe.load(latest, got)["step"] == step
    want = state_of(step)
    assert torch.equal(got["big"], want["big"]) and torch.equal(got["other"], want["other"])  # type: ignore[arg-type]
    newest = manager.complete_steps()[-1]
    manager.close()
    next_manager = shardsafe.CheckpointManager(root, warn_if_not_empty=False)
    next_manager.save(newest + 1, state_of(newest + 1))
    prefixes = {k.split("/")[1] for k in s3_server.keys(bucket, "run/step-")}
    committed = {f"step-{s:09d}" for s in next_manager.complete_steps()}
    assert prefixes == committed, (prefixes, committed)
    uploads = s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert uploads == [], uploads
    next_manager.close()
    return step


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigkill_mid_upload_leaves_latest_complete_and_the_next_save_cleans_up(
    s3_server: S3Server, s3_bucket: str, seed: int
) -> None:
    root = f"s3://{s3_bucket}/run"
    proc = start(root)
    try:
        died = kill_during_a_save(proc, *seeded_moment(seed))
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    step = check_latest_then_save_again(s3_server, s3_bucket, root)
    print(f"seed {seed}: killed {died}; latest was step {step}")


def one_rank_of_two(s3_server: S3Server, tmp_path: Path, seed: int, victim: int) -> str:
    """Kill rank ``victim`` of a two-rank run saving to a bucket of its own at a seeded
    moment of an upload; check the survivor and the bucket. What happened, in words."""
    bucket = s3_server.new_bucket()
    root = f"s3://{bucket}/run"
    port = str(free_port())
    tmp_path.mkdir()

    def err(rank: int) -> Path:
        return tmp_path / f"rank{rank}.err"

    procs = []
    for rank in range(2):
        args = ("--rank", str(rank), "--world-size", "2", "--port", port)
        out = None if rank == victim else str(tmp_path / "survivor.out")
        procs.append(start(root, *args, output=out, errors=str(err(rank))))
    survivor = procs[1 - victim]
    try:
        died = kill_during_a_save(procs[victim], *seeded_moment(100 + seed))
        killed_at = time.monotonic()
        procs[victim].wait(timeout=30)
        code = survivor.wait(timeout=SURVIVOR_EXIT_S + 10)
        took = time.monotonic() - killed_at
    finally:
        for p in procs:
            p.kill()
        procs[victim].communicate()
        survivor.wait()
    assert code != 0, f"seed {seed}: the survivor exited 0"
    assert took < SURVIVOR_EXIT_S, f"seed {seed}: the survivor took {took:.1f}s to exit"
    stderr = err(1 - victim).read_text()
    why = survivor_error(victim, stderr, (tmp_path / "survivor.out").read_text())
    step = check_latest_then_save_again(s3_server, bucket, root)
    return (
        f"seed {seed}: rank {victim} killed {died}; survivor exited {code} after "
        f"{took:.1f}s: {why}; latest was step {step}"
    )


@pytest.mark.timeout(240)
def test_sigkill_of_one_rank_mid_upload_the_survivor_reports_it_and_latest_stays_complete(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Three trials (rank 1 killed at two seeded moments, rank 0 at a third), each in a
    bucket of its own, at once: rank 0 surviving rank 1 waits out the heartbeat's 15 s,
    and the trials share that wait."""
    trials = [(0, 1), (1, 1), (2, 0)]
    with concurrent.futures.ThreadPoolExecutor(len(trials)) as pool:
        futures = [
            pool.submit(one_rank_of_two, s3_server, tmp_path / f"trial-{seed}", seed, victim)
            for seed, victim in trials
        ]
        for future in futures:
            print(future.result())
