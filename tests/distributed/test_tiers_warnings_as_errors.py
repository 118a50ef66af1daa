"""Replication and restores under a warnings filter that makes every warning an error
(``-W error``, pytest's ``filterwarnings = error``), on real ranks, each a node of its own.

The replicator's threads warn as they pass a copy over (a replica that could not be
written, an old one that could not be cleared). Under such a filter each of those
warnings was raised in the thread instead: between two messages of a transfer (its peer
then waited for the rest until the timeout), or in the handling of a transfer's outcome
(this rank then stopped replicating for good, and its peer, left alone in the next
step's transfer, stopped too). Now the raised warning is recorded, ``wait()`` raises it,
and the next steps replicate as before; a replica that could not be cleared is never
left committed beside the new save of its step. A restore's warnings are said as
``load_latest`` returns, once every rank is done with the restore."""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from shardsafe.tiers import TieredCheckpointManager
from tests.distributed.tiers_setup import local_dir, node_manager
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 30


def _replica(base: str, node: int, step: int, rank: int) -> Path:
    return Path(local_dir(base, node)) / f"step-{step:09d}" / f"rank-{rank:05d}"


def _saves_under_an_error_filter(rank: int, world: int, base: str) -> dict[str, Any]:
    """Saves of steps 1, 2, 2 again and 3, each waited for, every warning an error. Rank
    1's node has no room for the data files of rank 0's replica of step 1 (ENOSPC on
    their writes); before the second save of step 2, a file of the user's is put in rank
    1's replica of rank 0's step 2 (which shardsafe then does not delete). What each
    ``wait()`` raised, in order."""
    from shardsafe.checkpoint.storage import files

    os.environ["SHARDSAFE_NODE"] = str(rank)
    if rank == 1:
        write = files.LocalFileSink.write

        def full(self: Any, data: Any) -> None:
            if str(_replica(base, 1, 1, 0)) in self.path and self.path.endswith(".safetensors"):
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")
            write(self, data)

        files.LocalFileSink.write = full  # type: ignore[method-assign]
    raised: list[list[Any]] = []
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with contextlib.closing(node_manager(base, rank, TIMEOUT)) as manager:
            for save, step in enumerate((1, 2, 2, 3)):
                if save == 2 and rank == 1:
                    (_replica(base, 1, 2, 0) / "notes.txt").write_text("mine")
                with torch.no_grad():
                    model.weight.fill_(100 * rank + save)
                manager.save(step, {"model": model})
                try:
                    manager.wait()
                except Exception as e:
                    raised.append([step, type(e).__name__, str(e)])
    return {"raised": raised}


def test_warnings_made_errors_are_raised_by_wait_and_replication_goes_on(tmp_path: Path) -> None:
    """Before, rank 1's warning about step 1 was raised in its replication thread: it
    stopped replicating, and rank 0 waited for it in step 2's transfer until the timeout
    (``rank 0 stopped replicating ...``)."""
    base = str(tmp_path)
    got = run_ranks(_saves_under_an_error_filter, 2, base, timeout=100)
    left = _replica(base, 1, 2, 0)
    assert got[0]["raised"] == []
    assert got[1]["raised"] == [
        [
            1,
            "UserWarning",
            "shardsafe: rank 1 does not keep rank 0's replica of step 1: it could not be "
            "written: [Errno 28] No space left on device (simulated)",
        ],
        [
            2,
            "UserWarning",
            "shardsafe: rank 1 does not keep rank 0's replica of step 2: it was refused: its "
            f"directory could not be made: {left} cannot take a new copy: it holds "
            "['notes.txt'], which shardsafe did not write; delete the directory (or move "
            "those away)",
        ],
    ]
    # The first save's replica of step 2 is no longer committed (its manifest went): it
    # is never restored beside the second save's copies of the step.
    assert sorted(os.listdir(left)) == ["notes.txt", "shard-00000-of-00001.safetensors"]
    # Step 3 replicated both ways, as if nothing had happened.
    for node, owner in ((0, 1), (1, 0)):
        assert (_replica(base, node, 3, owner) / "manifest.json").is_file()


def _restore_past_a_damaged_copy_under_an_error_filter(
    rank: int, world: int, base: str
) -> dict[str, Any]:
    """Steps 1 and 2 saved and replicated; then a byte of rank 1's own copy of step 2 is
    flipped, and a new manager restores under a filter that makes every warning an
    error. What ``load_latest`` returned or raised, the tier and the weight restored."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    model = torch.nn.Linear(4, 4)

    def manager() -> TieredCheckpointManager:
        return node_manager(base, rank, TIMEOUT)

    with contextlib.closing(manager()) as saving:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(10 * step + rank)
            saving.save(step, {"model": model})
            saving.wait()
    torch.distributed.barrier()
    if rank == 1:
        [shard] = _replica(base, 1, 2, 1).glob("*.safetensors")
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    torch.distributed.barrier()
    with torch.no_grad():
        model.weight.zero_()
    outcome: list[Any]
    with warnings.catch_warnings(), contextlib.closing(manager()) as restoring:
        warnings.simplefilter("error")
        try:
            values = restoring.load_latest({"model": model})
            outcome = ["returned", values is not None]
        except Exception as e:
            outcome = [type(e).__name__, str(e)]
        restored = restoring._restorer.restored
    tier = [restored.step, restored.tier] if restored else None
    return {"outcome": outcome, "tier": tier, "weight": model.weight.unique().tolist()}


def test_a_restores_warning_made_an_error_is_raised_once_every_rank_is_done(
    tmp_path: Path,
) -> None:
    """Rank 1's own copy of step 2 is damaged: rank 0 warns that it was, and the ranks
    restore step 2 with rank 1's replica from rank 0's node. Before, that warning was
    raised on rank 0 as it was made, between two exchanges, and rank 1 waited for it
    until the timeout (``... did not enter ...``); now it is raised as rank 0 leaves
    ``load_latest``, after the restore, and rank 1 restores as it would without the
    filter."""
    base = str(tmp_path)
    got = run_ranks(_restore_past_a_damaged_copy_under_an_error_filter, 2, base, timeout=100)
    kind, message = got[0]["outcome"]
    assert kind == "UserWarning"
    assert message.startswith(
        "shardsafe: a local checkpoint of step 2 was damaged (load failed on rank 1: "
        "checksum mismatch in shard-00000-of-00001.safetensors"
    )
    assert message.endswith(
        "Load a good checkpoint before using these objects.); trying the next copy"
    )
    assert got[1]["outcome"] == ["returned", True]
    assert [got[0]["tier"], got[1]["tier"]] == [[2, "local"], [2, "peer"]]
    assert [got[0]["weight"], got[1]["weight"]] == [[20.0], [21.0]]


def _one_node_manager(rank: int, world: int, base: str, error_filter: bool) -> dict[str, Any]:
    """Both ranks on one node, replicas=1 (the default): the constructor warns that no
    replica is possible. What it raised or warned, and what the next call gave."""
    os.environ["SHARDSAFE_NODE"] = "0"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("error" if error_filter else "always")
        try:
            manager = node_manager(base, 0, TIMEOUT)
        except Exception as e:
            return {"raised": [type(e).__name__, str(e)]}
    with contextlib.closing(manager):
        restored = manager.load_latest({"model": torch.nn.Linear(2, 2)})
    warned = [(str(w.message), os.path.basename(w.filename)) for w in seen]
    return {"warned": warned, "restored": restored, "replicas": manager.replicas}


@pytest.mark.parametrize("error_filter", [False, True], ids=["warned", "made an error"])
def test_a_single_node_jobs_missing_replicas_warning_is_raised_alike_on_every_rank(
    tmp_path: Path, error_filter: bool
) -> None:
    """Rank 0 warned after the constructor's agreement: under an error filter it raised
    alone, and rank 1, holding its manager, waited for rank 0 in ``load_latest`` until the
    timeout and then said rank 0 never called. Now rank 0 warns inside an exchange: the
    error is every rank's; without the filter rank 0 alone warns, once, at the caller."""
    got = run_ranks(_one_node_manager, 2, str(tmp_path), error_filter, timeout=100)
    said = (
        "shardsafe: replicas=1, but the job runs on 1 node(s), so a replica on another node "
        "is possible for 0; a lost node loses its local checkpoints"
    )
    if error_filter:
        assert got[0] == got[1], got
        kind, message = got[0]["raised"]
        assert kind == "CheckpointError"
        assert f"failed on rank 0: UserWarning: {said}" in message, message
        return
    caller = "tiers_setup.py"  # node_manager's call of TieredCheckpointManager(...)
    assert got[0] == {"warned": [(said, caller)], "restored": None, "replicas": 0}
    assert got[1] == {"warned": [], "restored": None, "replicas": 0}
