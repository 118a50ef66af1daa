"""Two runs, two processes, one checkpoint root: one of them gets it, the other a clear error.

Each run is a separate Python process with its own CheckpointManager on the same root.
Both are released at the same instant (they wait for a "go" file) and save five steps
each; their step numbers do not overlap, so interleaving would show on disk. Exactly one
run saves all its steps; the other fails at its first save with a CheckpointError naming
the winner's pid and host, and writes nothing. Once the winner has exited (its lock
released at exit), a run can save there again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardsafe.checkpoint.manager import step_dir_name
from shardsafe.checkpoint.storage.lock import LOCK_NAME

RUN = r"""
import json, os, sys, time
import torch, shardsafe
root, first, go, release = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
manager = shardsafe.CheckpointManager(root, keep_last=3)
state = {"w": torch.full((256, 1024), float(first)), "first": first}
print(json.dumps({"pid": os.getpid()}), flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
saved = []
try:
    for step in range(first, first + 5):
        manager.save(step, state)
        saved.append(step)
except shardsafe.CheckpointError as e:
    print(json.dumps({"saved": saved, "error": str(e)}), flush=True)
    sys.exit(3)
print(json.dumps({"saved": saved, "error": None}), flush=True)
while release and not os.path.exists(release[0]):  # stay alive, between saves, holding
    time.sleep(0.01)
"""


def launch(root: Path, first: int, go: Path, *release: Path) -> Any:
    return subprocess.Popen(
        [sys.executable, "-c", RUN, str(root), str(first), str(go), *map(str, release)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(90)
def test_two_runs_on_one_root_one_wins_the_other_is_told_who(tmp_path: Path) -> None:
    root, go = tmp_path / "run", tmp_path / "go"
    runs = {first: launch(root, first, go) for first in (1, 101)}
    pids = {first: json.loads(p.stdout.readline())["pid"] for first, p in runs.items()}
    go.touch()  # both are ready: release them together
    results = {}
    for first, p in runs.items():
        out, err = p.communicate(timeout=60)
        results[first] = (p.returncode, json.loads(out.strip().splitlines()[-1]), err)

    winners = [f for f, (rc, _, _) in results.items() if rc == 0]
    assert len(winners) == 1, results
    (winner,) = winners
    loser = 101 if winner == 1 else 1
    rc, report, err = results[loser]
    assert rc == 3, err
    assert report["saved"] == []  # refused at its first save
    assert (
        f"{root} is being written by another run (pid {pids[winner]} on this host"
        in (report["error"])
    )
    assert f"delete {root / LOCK_NAME}" in report["error"]
    assert results[winner][1]["saved"] == list(range(winner, winner + 5))

    # Nothing of the loser's is on disk: the winner's last three steps, its pointer, and
    # no lock (released when the winner exited).
    kept = [step_dir_name(s) for s in range(winner + 2, winner + 5)]
    assert sorted(os.listdir(root)) == ["latest", *kept]
    for name in kept:
        manifest = json.loads((root / name / "manifest.json").read_text())
        assert manifest["values"]["first"]["meta"] == winner

    # The other run, started again now (continuing from step 201), gets the root.
    again = launch(root, 201, go)
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["saved"] == list(range(201, 206))
    assert sorted(os.listdir(root)) == ["latest", *(step_dir_name(s) for s in (203, 204, 205))]


@pytest.mark.timeout(60)
def test_a_second_run_is_refused_while_the_first_is_between_saves(tmp_path: Path) -> None:
    """The lock lasts as long as the run, not just during a save; a clean exit frees it."""
    root, go, release = tmp_path / "run", tmp_path / "go", tmp_path / "release"
    go.touch()
    holder = launch(root, 1, go, release)
    pid = json.loads(holder.stdout.readline())["pid"]
    assert json.loads(holder.stdout.readline())["saved"] == [1, 2, 3, 4, 5]
    second = launch(root, 101, go)
    out, err = second.communicate(timeout=50)
    assert second.returncode == 3, err
    assert f"(pid {pid} on this host" in json.loads(out.strip().splitlines()[-1])["error"]
    assert json.loads((root / LOCK_NAME).read_text())["pid"] == pid
    release.touch()
    assert holder.wait(timeout=30) == 0
    assert not (root / LOCK_NAME).exists()
    holder.communicate()
