"""Two torchrun agents on this machine play two nodes (``--nnodes 2``, one process each),
each started in its own working directory, so a relative checkpoint path names a
different, private directory on each "node": nothing is shared but the S3 server.

A save to the node-local path must fail on every rank with the error that names the
problem and the fix, and leave nothing that looks committed; a save to an s3:// URL works
and resumes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.agents import node_env, two_agents
from tests.s3server import S3Server

pytestmark = pytest.mark.timeout(240)
WORKER = Path(__file__).with_name("multinode_save.py")


def two_nodes(tmp_path: Path, env: dict[str, str], *args: str) -> list[tuple[int, str]]:
    """Run the worker on two agents; each agent's (exit status, output)."""
    return two_agents(tmp_path, env, str(WORKER), *args)


def test_a_node_local_path_fails_on_every_rank_and_commits_nothing(tmp_path: Path) -> None:
    results = two_nodes(tmp_path, node_env(), "ckpt")
    for code, out in results:
        assert code != 0, out
        assert "ERROR" in out and "rank 1 cannot see the checkpoint directory" in out, out
        assert "not shared between the nodes" in out and "object-store URL" in out, out
    for node in (0, 1):
        assert not list((tmp_path / f"node{node}").rglob("manifest.json"))


def test_an_s3_url_saves_and_resumes_across_two_nodes(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    env = node_env(s3_server.env)
    url = f"s3://{s3_bucket}/multi"
    for code, out in two_nodes(tmp_path, env, url, "--step", "1"):
        assert code == 0 and "SAVED" in out, out
    for code, out in two_nodes(tmp_path, env, url, "--step", "2", "--resume-from", "1"):
        assert code == 0 and "RESUMED step 1" in out and "SAVED" in out, out
    keys = s3_server.keys(s3_bucket)
    assert "multi/step-1/manifest.json" in keys and "multi/step-2/manifest.json" in keys
    for node in (0, 1):
        assert not any((tmp_path / f"node{node}").iterdir())  # nothing written locally
