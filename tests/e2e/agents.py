"""Two torchrun agents on this machine playing two nodes (``--nnodes 2``, one worker
each, c10d rendezvous on loopback), each started in its own working directory
``tmp_path/node<N>``: shared by the multi-node tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.trainer_helpers import TORCHRUN
from tests.harness import free_port


def node_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The agents' environment: one thread, gloo on loopback, this checkout importable."""
    root = str(Path(__file__).resolve().parents[2])
    return {
        **os.environ,
        **(extra or {}),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join([*sys.path, root]),
    }


def two_agents(
    tmp_path: Path,
    env: dict[str, str],
    *worker: str,
    restarts: int = 0,
    timeout: float = 180,
) -> list[tuple[int, str]]:
    """Run ``worker`` (a script and its arguments) under both agents; each agent's (exit
    status, output)."""
    if not TORCHRUN.exists():
        pytest.skip(f"torchrun is not installed at {TORCHRUN}")
    port = free_port()
    procs = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir(exist_ok=True)
        command = [
            str(TORCHRUN),
            *("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node)),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
            *("--local-addr", "127.0.0.1", "--max-restarts", str(restarts)),
            *("--monitor-interval", "0.5"),
            *worker,
        ]
        procs.append(
            subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    return [(proc.returncode, out) for proc, out in zip(procs, outputs)]
