"""An error on one rank between a restore's exchanges is every rank's, on real ranks.

2 ranks, each a node of its own, with a timeout of 30 s. A restore of the tiered manager
is a chain of agreements (the survey, the load, the exchanges after a failed load or a
transfer); what a rank did between two of them was its own: an error there was raised on
that rank alone, and the other rank waited for it at the next agreement until the
timeout, then failed naming it as missing. Now that work runs inside the agreements: the
rank's directory is opened inside the load, a failed copy is judged inside the exchange
that follows it, and a received copy is linked and committed inside the transfer's last
exchange. Each test fails the one rank at one of those places and checks that both ranks
raise the same error, naming it."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from shardsafe.tiers import TieredCheckpointManager
from tests.distributed.tiers_setup import local_dir
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 30


def _manager(base: str, rank: int) -> TieredCheckpointManager:
    return TieredCheckpointManager(
        os.path.join(base, "persistent"),
        local_dir(base, rank),
        persist_every=None,
        timeout=TIMEOUT,
    )


def _saved(base: str, rank: int, model: torch.nn.Linear) -> None:
    """Steps 1 and 2 saved and replicated (each node keeps the other's replica)."""
    with contextlib.closing(_manager(base, rank)) as saving:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(10 * step + rank)
            saving.save(step, {"model": model})
            saving.wait()
    torch.distributed.barrier()


def _restore(base: str, rank: int, model: torch.nn.Linear) -> dict[str, Any]:
    """A new manager's ``load_latest``: what it returned or raised. (Before, the rank
    left waiting raised another error: the other rank named as missing.)"""
    with torch.no_grad():
        model.weight.zero_()
    with contextlib.closing(_manager(base, rank)) as restoring:
        try:
            restoring.load_latest({"model": model})
            outcome = ["returned"]
        except Exception as e:
            outcome = [type(e).__name__, str(e)]
    return {"outcome": outcome}


def _root_replaced_before_the_load(rank: int, world: int, base: str) -> dict[str, Any]:
    """After the survey chose step 2, and before the load, rank 1's local directory is
    replaced by a file (its disk remounted, another job's cleanup): the directory of the
    copy it chose cannot be opened."""
    from shardsafe.tiers import fetch

    os.environ["SHARDSAFE_NODE"] = str(rank)
    model = torch.nn.Linear(4, 4)
    _saved(base, rank, model)
    if rank == 1:
        chosen = fetch.Fetcher.fetch

        def then_replaced(self: Any, choice: Any, excluded: Any) -> list[int]:
            failed = chosen(self, choice, excluded)
            root = local_dir(base, 1)
            os.rename(root, root + ".moved")
            Path(root).write_text("not a directory")
            return failed

        fetch.Fetcher.fetch = then_replaced  # type: ignore[method-assign]
    return _restore(base, rank, model)


def test_a_directory_that_cannot_be_opened_for_the_load_fails_every_rank_at_once(
    tmp_path: Path,
) -> None:
    """Before, rank 1 raised as it opened its copy, before the load, and rank 0 waited for
    it at the load's entry until the timeout (``rank(s) 1 never arrived ...``)."""
    base = str(tmp_path)
    got = run_ranks(_root_replaced_before_the_load, 2, base, timeout=100)
    root = local_dir(base, 1)
    expected = [
        "CheckpointError",
        f"load failed on rank 1: the local tier's directory {root} cannot be made or opened: "
        "File exists. Give each node a local path it can write (a directory, or nothing yet, "
        "on a tmpfs or NVMe disk)",
    ]
    assert [got[0]["outcome"], got[1]["outcome"]] == [expected, expected]
    # Nothing was deleted: the moved directory still holds both steps.
    assert sorted(os.listdir(root + ".moved")) == ["step-000000001", "step-000000002"]


def _judging_fails_after_a_damaged_copy(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank 1's own copy of step 2 is damaged (a flipped byte), so the load fails on
    every rank; then, as rank 1 checks its copy again to know whether it is the bad one,
    that check raises an unexpected error (a bug, memory exhausted)."""
    from shardsafe.checkpoint.io.reader import CheckpointReader

    os.environ["SHARDSAFE_NODE"] = str(rank)
    model = torch.nn.Linear(4, 4)
    _saved(base, rank, model)
    if rank == 1:
        [shard] = (Path(local_dir(base, 1)) / "step-000000002" / "rank-00001").glob("*.safetensors")
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))

        def broken(self: Any) -> Any:
            raise RuntimeError("simulated failure while checking the copy")

        CheckpointReader.verify_all = broken  # type: ignore[method-assign,assignment]
    torch.distributed.barrier()
    return _restore(base, rank, model)


def test_an_unexpected_error_judging_a_failed_copy_fails_every_rank_at_once(
    tmp_path: Path,
) -> None:
    """Before, rank 1 raised the ``RuntimeError`` alone, and rank 0 waited for it in the
    exchange of which copies were bad until the timeout."""
    base = str(tmp_path)
    got = run_ranks(_judging_fails_after_a_damaged_copy, 2, base, timeout=100)
    for rank in (0, 1):
        kind, message = got[rank]["outcome"]
        assert kind == "CheckpointError"
        assert message.startswith(
            "tiers failed on rank 1: RuntimeError: simulated failure while checking the copy"
        ), message


def _commit_fails_after_a_transfer(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank 1's node lost its directory, so rank 1 receives its copy of step 2 from rank
    0's replica; committing the copy that arrived raises an unexpected error."""
    from shardsafe.tiers import transfer

    os.environ["SHARDSAFE_NODE"] = str(rank)
    model = torch.nn.Linear(4, 4)
    _saved(base, rank, model)
    if rank == 1:
        shutil.rmtree(local_dir(base, 1))

        def broken(self: Any, checked: Any = frozenset()) -> bool:
            raise RuntimeError("simulated failure while committing the copy")

        transfer.Arrived.commit = broken  # type: ignore[method-assign]
    torch.distributed.barrier()
    return _restore(base, rank, model)


def test_an_unexpected_error_committing_a_received_copy_fails_every_rank_at_once(
    tmp_path: Path,
) -> None:
    """Before, rank 1 raised the ``RuntimeError`` alone after the transfer, and rank 0
    waited for it in the exchange of which copies arrived until the timeout."""
    base = str(tmp_path)
    got = run_ranks(_commit_fails_after_a_transfer, 2, base, timeout=100)
    for rank in (0, 1):
        kind, message = got[rank]["outcome"]
        assert kind == "CheckpointError"
        assert message.startswith(
            "tiers failed on rank 1: RuntimeError: simulated failure while committing the copy"
        ), message
