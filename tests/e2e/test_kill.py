"""SIGKILL during saves: whatever the moment, the newest complete checkpoint survives.

A real run (``kill_target.py``: CheckpointManager, keep_last=3, 8 MiB of model and
tensors, a save every step) is started in its own session (forked from the tests' script
server, ``kills.KillTarget``: its own process, as ``python kill_target.py`` would be,
without its imports) and killed with a real SIGKILL at a chosen moment inside a save:
the target prints when each save starts and ends (``time.monotonic()``, one clock for
every process of the host), and the kill lands at a given fraction of a typical save's
duration after a given save starts. The moments are spread from the start of a save to
just after its end, alternating the two layouts, in saves before and after retention
starts deleting (save 4 is the first that does). Four more kills land exactly in windows
too narrow to hit by timing (``--die-at``).
With two ranks, one rank is killed and the survivor must exit by itself, non-zero,
naming the dead rank, well before any collective timeout.

After every kill:

* ``latest()`` names a complete checkpoint, ``shardsafe verify`` finds no problem in it,
  and it loads, holding exactly the state of its step (every tensor is ``base + step``);
* saving into the same root works: the dead process's lock is taken over;
* that save cleans up: the root holds exactly the lock, ``latest`` and the newest three
  complete step directories, each exactly its manifest and data files (no temp files,
  no half-written or half-deleted directories).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.checkpoint.loading import read_manifest
from shardsafe.checkpoint.manager import step_dir_name
from shardsafe.checkpoint.verifying import find_problems
from tests.e2e import kill_target as target
from tests.e2e.kills import SURVIVOR_EXIT_S, KillTarget, kill_during_a_save, survivor_error
from tests.harness import free_port

TARGET = Path(target.__file__)
LOCK = ".shardsafe.lock"
# (layout, the save killed, the fraction of a typical save's duration after it starts)
WHOLE_RUN_KILLS = (
    ("sharded", 3, 0.1),
    ("consolidated", 4, 0.3),
    ("sharded", 5, 0.5),
    ("consolidated", 3, 0.7),
    ("sharded", 4, 0.9),
    ("consolidated", 5, 1.05),
)
ASYNC_KILLS = (
    ("sharded", 3, 0.2),
    ("consolidated", 4, 0.5),
    ("sharded", 5, 0.8),
    ("consolidated", 4, 1.0),
)
# (layout, the rank killed, the save, the fraction): both layouts, either rank killed.
ONE_RANK_KILLS = (
    ("sharded", 1, 3, 0.2),
    ("consolidated", 1, 4, 0.45),
    ("sharded", 0, 5, 0.7),
    ("consolidated", 0, 4, 0.95),
)


def start(root: Path, *args: str, output: str | None = None, errors: str | None = None) -> Any:
    """The target on ``root``, in a session of its own (``KillTarget``: its output
    followed unless ``output`` names a file)."""
    return KillTarget([str(TARGET), str(root), *args], os.environ, output=output, errors=errors)


def where_it_died(root: Path) -> str:
    """Which part of a save the kill interrupted, read from the disk: the save in
    progress is the newest step directory."""
    dirs = sorted(root.glob("step-*"))
    newest = dirs[-1]
    names = os.listdir(newest)
    if "manifest.json" not in names:
        if any(n.startswith(".manifest.json.tmp") for n in names):
            return "manifest written, not yet renamed"
        return "while writing data files"
    if (root / "latest").read_text().strip() != newest.name:
        return "committed, latest not yet moved"
    if len(dirs) > target.KEEP_LAST:
        return "latest moved, retention not done"
    return "between saves"


def check_after_kill(root: Path, dead: set[int], layout: str) -> int:
    """Everything a user relies on after a crash; return the step of ``latest()``."""
    manager = shardsafe.CheckpointManager(root, keep_last=target.KEEP_LAST)
    latest = manager.latest()
    assert latest is not None, "no complete checkpoint survived"
    step = int(Path(latest).name.removeprefix("step-"))
    assert find_problems(latest, read_manifest(latest)) == []  # `shardsafe verify`

    state = target.build_state()
    base = target.base_of(state)
    returned = shardsafe.load(latest, {"model": state["model"], "extra": state["extra"]})
    assert returned["step"] == step
    for name, p in state["model"].state_dict().items():
        assert torch.equal(p, base[name] + step), f"{name} is not the state of step {step}"
    assert torch.equal(returned["extra"]["buf"], base["extra/buf"] + step)

    # Saving again into the same root: the dead process's lock is taken over.
    if (root / LOCK).exists():
        assert json.loads((root / LOCK).read_text())["pid"] in dead
    complete = manager.complete_steps()
    target.set_step(state, base, step + 1)
    manager.save(step + 1, state, layout=layout)
    assert json.loads((root / LOCK).read_text())["pid"] == os.getpid()

    # ... and cleans up everything the kill left behind.
    kept = [step_dir_name(s) for s in [*complete, step + 1][-target.KEEP_LAST :]]
    assert sorted(os.listdir(root)) == sorted([LOCK, "latest", *kept])
    assert (root / "latest").read_text() == f"{kept[-1]}\n"
    for name in kept:
        files = read_manifest(root / name).files
        assert sorted(os.listdir(root / name)) == sorted(["manifest.json", *files]), name
    manager.close()
    assert not (root / LOCK).exists()
    return step


# ----------------------------------------------------------------- the whole run


@pytest.mark.timeout(150)
def test_killing_the_whole_run_at_moments_across_saves(tmp_path: Path) -> None:
    began = time.monotonic()
    seen: dict[str, int] = {}
    inside = 0
    for trial, (layout, step, fraction) in enumerate(WHOLE_RUN_KILLS):
        root = tmp_path / f"trial-{trial}"
        proc = start(root, "--layout", layout)
        try:
            died = kill_during_a_save(proc, step, fraction)
            assert proc.wait(timeout=10) == -signal.SIGKILL
        finally:
            proc.kill()
            proc.communicate()
        where = where_it_died(root)
        seen[where] = seen.get(where, 0) + 1
        inside += died.startswith("in save")
        latest = check_after_kill(root, {proc.pid}, layout)
        print(f"trial {trial}: {layout:12} killed {died}: {where}; latest was step {latest}")
    print(f"{len(WHOLE_RUN_KILLS)} trials in {time.monotonic() - began:.1f}s: {seen}")
    assert inside >= len(WHOLE_RUN_KILLS) // 2, f"only {inside} kills landed inside a save"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", target.DIE_AT)
def test_a_kill_in_each_narrow_window(tmp_path: Path, point: str) -> None:
    expected = {
        "data-write": "while writing data files",
        "manifest-rename": "manifest written, not yet renamed",
        "latest-rename": "committed, latest not yet moved",
        "retention": "latest moved, retention not done",
    }[point]
    proc = start(tmp_path, "--die-at", point)
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == -signal.SIGKILL, err
    assert f"saving {target.DIE_AFTER_STEP} " in out
    assert where_it_died(tmp_path) == expected
    leftovers = sorted(os.listdir(tmp_path))
    latest = check_after_kill(tmp_path, {proc.pid}, "sharded")
    committed = point in ("latest-rename", "retention")
    assert latest == (target.DIE_AFTER_STEP if committed else target.DIE_AFTER_STEP - 1)
    print(f"{point}: root held {leftovers}; latest() was step {latest}")


@pytest.mark.timeout(120)
def test_killing_async_saves_at_moments_across_their_background_writes(
    tmp_path: Path,
) -> None:
    """The same, with ``async_save``: the tensors change while each background write
    runs, and the kill lands early, in the middle, late, or at the end of it."""
    inside = 0
    for trial, (layout, step, fraction) in enumerate(ASYNC_KILLS):
        root = tmp_path / f"trial-{trial}"
        proc = start(root, "--layout", layout, "--async")
        try:
            died = kill_during_a_save(proc, step, fraction)
            assert proc.wait(timeout=10) == -signal.SIGKILL
        finally:
            proc.kill()
            proc.communicate()
        inside += died.startswith("in save")
        latest = check_after_kill(root, {proc.pid}, layout)
        print(f"async trial {trial}: {layout:12} killed {died}; latest was step {latest}")
    assert inside >= len(ASYNC_KILLS) // 2, f"only {inside} kills landed inside a save"


# ------------------------------------------------------------- one rank of two


@dataclass
class TwoRankTrial:
    seed: int
    root: Path
    layout: str
    victim: int
    step: int
    fraction: float
    procs: list[Any] = field(default_factory=list)
    killed_at: float = 0.0
    died: str = ""
    survivor_rc: int | None = None
    survivor_s: float = 0.0
    error: BaseException | None = None

    def run(self) -> None:
        try:
            for attempt in range(3):
                try:
                    self._run()
                    return
                except AssertionError:
                    # The port picked for the rendezvous can be taken (by another trial's
                    # gloo connection) before rank 0 binds it: a harness race, not a
                    # finding. Start the trial again on a new port.
                    if attempt == 2 or not self._lost_the_port_race():
                        raise
                    self._stop()
                    self.procs.clear()
                    shutil.rmtree(self.root)
        except BaseException as e:  # reported by the test thread
            self.error = e
        finally:
            self._stop()

    def _stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()

    def _lost_the_port_race(self) -> bool:
        return any(
            "EADDRINUSE" in (self.root.parent / f"{self.root.name}-rank{r}.err").read_text()
            for r in range(2)
        )

    def _run(self) -> None:
        port = str(free_port())
        self.root.mkdir(parents=True)
        for rank in range(2):
            args = ["--rank", str(rank), "--world-size", "2", "--port", port]
            out = None if rank == self.victim else self._file(rank, "out")
            err = self._file(rank, "err")
            self.procs.append(
                start(self.root, "--layout", self.layout, *args, output=out, errors=err)
            )
        victim = self.procs[self.victim]
        self.died = kill_during_a_save(victim, self.step, self.fraction)
        self.killed_at = time.monotonic()
        victim.wait()
        survivor = self.procs[1 - self.victim]
        try:
            self.survivor_rc = survivor.wait(timeout=SURVIVOR_EXIT_S + 10)
        except subprocess.TimeoutExpired:
            self.survivor_rc = None
        self.survivor_s = time.monotonic() - self.killed_at

    def _file(self, rank: int, kind: str) -> str:
        path = self.root.parent / f"{self.root.name}-rank{rank}.{kind}"
        path.write_text("")
        return str(path)

    def survivor_output(self, kind: str) -> str:
        return (self.root.parent / f"{self.root.name}-rank{1 - self.victim}.{kind}").read_text()


@pytest.mark.timeout(150)
def test_killing_one_rank_of_two_during_saves(tmp_path: Path) -> None:
    began = time.monotonic()
    trials = [
        TwoRankTrial(seed, tmp_path / f"trial-{seed}", layout, victim, step, fraction)
        for seed, (layout, victim, step, fraction) in enumerate(ONE_RANK_KILLS)
    ]
    threads = [threading.Thread(target=t.run) for t in trials]
    for thread in threads:
        thread.start()
        time.sleep(0.5)  # stagger the starts a little on a small machine
    for thread in threads:
        thread.join(timeout=120)
    inside = 0
    for t in trials:
        if t.error is not None:
            raise t.error
        inside += t.died.startswith("in save")
        stderr, stdout = t.survivor_output("err"), t.survivor_output("out")
        assert t.survivor_rc is not None, f"trial {t.seed}: the survivor hung"
        assert t.survivor_rc != 0, f"trial {t.seed}: the survivor exited 0"
        why = survivor_error(t.victim, stderr, stdout)
        assert t.survivor_s < SURVIVOR_EXIT_S, (
            f"trial {t.seed}: {t.layout}, rank {t.victim} killed {t.died}; the survivor "
            f"exited {t.survivor_rc} after {t.survivor_s:.1f}s: {why}"
        )
        where = where_it_died(t.root)
        dead = {p.pid for p in t.procs}  # the survivor has exited too
        latest = check_after_kill(t.root, dead, t.layout)
        print(
            f"trial {t.seed}: {t.layout:12} rank {t.victim} killed {t.died} "
            f"(on disk: {where}); survivor exited {t.survivor_rc} after "
            f"{t.survivor_s:.1f}s: {why}; latest was step {latest}"
        )
    print(f"{len(trials)} two-rank trials in {time.monotonic() - began:.1f}s")
    assert inside >= len(trials) // 2, f"only {inside} kills landed inside a save"


RANK0_GONE = """
import os, sys, time
import torch, torch.distributed as dist
import shardsafe
rank = int(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2)
state = {"values": {"w": torch.ones(4)}}
shardsafe.save(os.path.join(sys.argv[3], "one"), state)
if rank == 0:
    os._exit(0)  # between two saves: the process hosting the store is gone
time.sleep(2)
try:
    shardsafe.save(os.path.join(sys.argv[3], "two"), state)
except shardsafe.CheckpointError as e:
    print("CheckpointError:", e)
    sys.exit(3)
"""


@pytest.mark.timeout(90)
def test_a_save_after_rank_0_died_between_saves_says_the_store_is_gone(tmp_path: Path) -> None:
    """The first store request of the next save (the entry's first heartbeat) is the one
    that finds rank 0's store gone: a clear CheckpointError, not torch's "Connection
    reset by peer" (seen once in a one-rank-of-two kill trial)."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK0_GONE, str(rank), port, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    out, err = procs[1].communicate(timeout=60)
    procs[0].wait(timeout=30)
    assert procs[1].returncode == 3, err[-2000:]
    assert "lost contact with the process group's store during the 'entry' phase" in out, out
    assert "usually rank 0 which hosts the store, has probably exited" in out
    assert not (tmp_path / "two" / "manifest.json").exists()
