"""Tiered checkpoints across two torchrun agents playing two nodes (``--nnodes 2``, one
worker each): each node its own local directory, the persistent tier on a real S3 server
on loopback. The failure table of the README, one row per test: losses after recovery
must continue bitwise as in an uninterrupted run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.agents import node_env, two_agents
from tests.s3server import S3Server

pytestmark = pytest.mark.timeout(300)
WORKER = Path(__file__).with_name("tiered_worker.py")
STEPS = 6


def run_nodes(
    tmp_path: Path, env: dict[str, str], *args: str, restarts: int = 0
) -> list[tuple[int, str]]:
    """Both agents' (exit status, output)."""
    return two_agents(tmp_path, env, str(WORKER), *args, restarts=restarts, timeout=240)


def losses(out: str) -> dict[int, str]:
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "loss":
            found[int(parts[1])] = parts[2]  # the last attempt's value wins
    return found


def restored(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("restored ")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> list[dict]:
    """Each node's losses in an uninterrupted run."""
    tmp = tmp_path_factory.mktemp("reference")
    url = f"s3://{s3_server.new_bucket()}/run"
    results = run_nodes(tmp, node_env(s3_server.env), url, str(tmp / "local"))
    for code, out in results:
        assert code == 0 and "done" in out, out
    return [losses(out) for _, out in results]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> tuple[Path, str, str]:
    """A run whose workers were all SIGKILLed once step 4 was saved locally and
    replicated: its local directories, its bucket and a pristine copy of the bucket
    (``killed_run`` copies the directories and puts the bucket back)."""
    tmp = tmp_path_factory.mktemp("killed")
    bucket = s3_server.new_bucket()
    args = (f"s3://{bucket}/run", str(tmp / "local"), "--kill-at", "4")
    for code, out in run_nodes(tmp, node_env(s3_server.env), *args):
        assert code != 0, out
        assert "loss 4 " in out and "loss 5 " not in out, out
    return tmp / "local", bucket, s3_server.copy_bucket(bucket)


def killed_run(
    tmp_path: Path, s3_server: S3Server, killed: tuple[Path, str, str]
) -> tuple[str, dict[str, str]]:
    """The killed run, for one test: a copy of its local directories (hard links kept, as
    the node's shared tensors have them), and its own bucket put back as the kill left it
    (the local copies record the run's URL: a copy under another name is another run's)."""
    local, bucket, pristine = killed
    subprocess.run(["cp", "-a", str(local), str(tmp_path / "local")], check=True)
    s3_server.restore_bucket(bucket, pristine)
    return f"s3://{bucket}/run", node_env(s3_server.env)


def resume(tmp_path: Path, url: str, env: dict[str, str], reference: list[dict]) -> list[str]:
    """Restart both nodes; the tier each restored from, after checking the losses."""
    tiers = []
    for node, (code, out) in enumerate(run_nodes(tmp_path, env, url, str(tmp_path / "local"))):
        assert code == 0 and "done" in out, out
        step_losses = losses(out)
        assert step_losses == {s: reference[node][s] for s in step_losses}, out
        (line,) = restored(out)
        tiers.append(line)
    return tiers


def test_whole_job_killed_restores_from_the_local_tiers(
    tmp_path: Path, s3_server: S3Server, reference: list[dict], killed: tuple[Path, str, str]
) -> None:
    url, env = killed_run(tmp_path, s3_server, killed)
    assert resume(tmp_path, url, env, reference) == ["restored 4 local"] * 2


def test_a_lost_node_restores_from_its_replica_on_the_other(
    tmp_path: Path, s3_server: S3Server, reference: list[dict], killed: tuple[Path, str, str]
) -> None:
    url, env = killed_run(tmp_path, s3_server, killed)
    shutil.rmtree(tmp_path / "local" / "node1")  # the node was replaced
    assert resume(tmp_path, url, env, reference) == ["restored 4 local", "restored 4 peer"]


def test_both_nodes_lost_restore_from_the_persistent_tier_on_s3(
    tmp_path: Path, s3_server: S3Server, reference: list[dict], killed: tuple[Path, str, str]
) -> None:
    url, env = killed_run(tmp_path, s3_server, killed)
    shutil.rmtree(tmp_path / "local")
    assert resume(tmp_path, url, env, reference) == ["restored 4 persistent"] * 2


def test_a_killed_worker_recovers_by_itself_under_max_restarts(
    tmp_path: Path, s3_server: S3Server, reference: list[dict]
) -> None:
    # torchrun's restarted workers otherwise read the previous attempt's gloo addresses
    # from the store they share with the agent (pytorch/pytorch#135712).
    env = {**node_env(s3_server.env), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    url = f"s3://{s3_server.new_bucket()}/run"
    args = (url, str(tmp_path / "local"), "--kill-at", "3", "--kill-rank", "1")
    for node, (code, out) in enumerate(run_nodes(tmp_path, env, *args, restarts=1)):
        assert code == 0 and "done" in out, out
        assert restored(out) == ["restored 0 none", "restored 3 local"], out
        assert losses(out) == reference[node], out
