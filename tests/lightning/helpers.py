"""Running ``lightning_script.py`` as Lightning scripts run, and reading what they left.

Every run is real processes, one per rank, started as a cluster launcher (torchrun, SLURM)
starts them: ``LOCAL_RANK``, ``WORLD_SIZE`` and ``MASTER_*`` set, so Lightning joins
instead of launching. Each is forked from a server that has imported Lightning already
(``tests/forked_scripts.py``): about 5 s of CPU saved per process. ``launched=True`` runs
the script the plain way instead (``python lightning_script.py``), Lightning starting the
other rank itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from tests.forked_scripts import start_script
from tests.harness import free_port

SCRIPT = Path(__file__).with_name("lightning_script.py")
RUN_TIMEOUT_S = 120.0
ROOT = Path(__file__).resolve().parents[2]


def script_environment() -> dict[str, str]:
    """This environment, with this checkout's ``src`` first (the shardsafe under test, not
    an installed one: an editable install of another checkout won otherwise) and the
    repository importable (the scripts use ``tests.*``)."""
    paths = [str(ROOT / "src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def command(root: Path, *args: str | Path) -> list[str]:
    return [sys.executable, str(SCRIPT), "--root", str(root), *map(str, args)]


class Run:
    """The processes of one run (every rank, or Lightning's launcher alone), each in a
    session of its own so that a kill reaches everything it started."""

    def __init__(self, root: Path, *args: str | Path, devices: int = 2, launched: bool = False):
        self.logs: list[IO[bytes]] = []
        argv = command(root, *args, "--devices", str(devices))
        if launched:
            self.procs = [self._start(argv, script_environment(), fork=False)]
            return
        port = str(free_port())
        base = {**script_environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        base.update(WORLD_SIZE=str(devices), NODE_RANK="0")
        self.procs = [self._start(argv, {**base, "LOCAL_RANK": str(r)}) for r in range(devices)]

    def _start(self, argv: list[str], env: dict[str, str], fork: bool = True) -> Any:
        """A process running ``argv`` (``python script args...``), forked from the server
        that has imported Lightning already (``tests/forked_scripts.py``), or with
        ``fork=False`` a fresh interpreter (Lightning then starts the other ranks the
        same way, as a user's ``python script.py`` does)."""
        log = tempfile.NamedTemporaryFile()  # noqa: SIM115 - read and closed by output()
        self.logs.append(log)
        if fork:
            return start_script(argv[1:], env, log.name)
        return subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> list[int]:
        """Every process's exit code (all killed if one is still running at ``timeout``)."""
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(max(0.1, deadline - time.monotonic())) for p in self.procs]
        finally:
            self.kill()

    def running(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def output(self) -> str:
        text = []
        for rank, log in enumerate(self.logs):
            log.seek(0)
            text.append(f"--- process {rank}\n{log.read().decode(errors='replace')[-5000:]}")
            log.close()
        return "\n".join(text)


def run(root: Path, *args: str | Path, devices: int = 2, launched: bool = False) -> None:
    """A run that must succeed on every rank."""
    started = Run(root, *args, devices=devices, launched=launched)
    codes = started.wait()
    output = started.output()
    assert codes == [0] * len(codes), f"exit codes {codes}\n{output}"


def losses(root: Path, name: str = "losses.jsonl") -> dict[int, float]:
    """Step -> loss as rank 0 logged them; fails on a step logged twice."""
    path = root / name
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records}


def logged_steps(root: Path) -> int:
    """Whole lines in ``losses.jsonl`` so far (a line being written is not counted)."""
    try:
        text = (root / "losses.jsonl").read_text()
    except FileNotFoundError:
        return 0
    return text.count("\n")


def kill_after_step(root: Path, *args: str | Path, step: int) -> None:
    """Start a run; SIGKILL every process of it once ``step`` is logged, as a preemption or
    a pulled plug would: nothing gets to clean up."""
    started = Run(root, *args)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while logged_steps(root) < step:
            if not started.running():
                started.kill()
                raise AssertionError(f"the run ended before step {step}:\n{started.output()}")
            assert time.monotonic() < deadline, f"step {step} not logged within {RUN_TIMEOUT_S}s"
            time.sleep(0.02)
    finally:
        started.kill()


def outcomes(root: Path, world_size: int) -> list[dict[str, Any]]:
    """How ``fit`` ended on each rank: ``{"pid": ..., "error": "Type: message" or None}``."""
    return [json.loads((root / f"outcome-{r}.json").read_text()) for r in range(world_size)]


class Net(nn.Module):
    """The script's network under the same names (``net.0.weight``...), without Lightning."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def assert_same_optimizer_state(saved: dict[str, Any], live: dict[str, Any]) -> None:
    """torch-format optimizer states: the same parameters, state tensors bit for bit (dtype
    too), the same hyperparameters."""
    assert sorted(saved["state"]) == sorted(live["state"])
    for index, state in saved["state"].items():
        assert sorted(state) == sorted(live["state"][index]), index
        for name, tensor in state.items():
            other = live["state"][index][name]
            assert tensor.dtype == other.dtype and torch.equal(tensor, other), (index, name)
    assert saved["param_groups"] == live["param_groups"]
