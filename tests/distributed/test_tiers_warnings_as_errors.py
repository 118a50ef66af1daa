"""Replication under a warnings filter that makes every warning an error (``-W error``,
pytest's ``filterwarnings = error``), on real ranks, each a node of its own.

The replicator's threads warn as they pass a copy over (a replica that could not be
written, an old one that could not be cleared). Under such a filter each of those
warnings was raised in the thread instead: between two messages of a transfer (its peer
then waited for the rest until the timeout), or in the handling of a transfer's outcome
(this rank then stopped replicating for good, and its peer, left alone in the next
step's transfer, stopped too). Now the raised warning is recorded, ``wait()`` raises it,
and the next steps replicate as before; a replica that could not be cleared is never
left committed beside the new save of its step."""

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
from tests.distributed.tiers_setup import local_dir
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
        with contextlib.closing(
            TieredCheckpointManager(
                os.path.join(base, "persistent"),
                local_dir(base, rank),
                persist_every=None,
                timeout=TIMEOUT,
            )
        ) as manager:
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
            f"directory could not be made: shardsafe: left {left} in place: it holds "
            "['notes.txt'], which shardsafe did not write; delete it yourself if it is no "
            "longer needed",
        ],
    ]
    # The first save's replica of step 2 is no longer committed (its manifest went): it
    # is never restored beside the second save's copies of the step.
    assert sorted(os.listdir(left)) == ["notes.txt", "shard-00000-of-00001.safetensors"]
    # Step 3 replicated both ways, as if nothing had happened.
    for node, owner in ((0, 1), (1, 0)):
        assert (_replica(base, node, 3, owner) / "manifest.json").is_file()
