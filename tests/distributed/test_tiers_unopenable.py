"""A copy that one end of a transfer cannot open is refused at once, on real ranks.

Each rank is a node of its own (2 ranks), with a transfer timeout of 30 s: before these
fixes, a sender that could not open the copy it was to send (its directory removed from
under it: a tmpfs cleaned by another job) raised before saying anything, and its
receiver waited for it until the timeout; so did a sender whose receiver could not clear
the place its replica goes. Now the other end is told at once, in both directions, the
failure is raised by ``wait()`` (replication) or passed over (a restore), and the next
steps replicate as before."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointError
from shardsafe.tiers import TieredCheckpointManager
from tests.distributed.tiers_setup import build, local_dir, train
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 30


def _rank_dir(base: str, node: int, step: int, rank: int) -> Path:
    return Path(local_dir(base, node)) / f"step-{step:09d}" / f"rank-{rank:05d}"


def _three_steps(rank: int, world: int, base: str) -> dict[str, Any]:
    """Steps 1-3 saved and waited for, one at a time; at step 2, between rank 0's write
    and its replication, its node's local directory is replaced by a file (so it can
    neither open the copy it sends nor clear the place of the one it receives), and rank
    0 goes on only once rank 1's ``wait()`` of step 2 has returned (or after longer than
    the transfers' timeout), as a rank that keeps training would. At step 1, between
    rank 1's write and its replication, its manifest is cut short (damaged on disk); and
    rank 1's node has no room for the data files of rank 0's replicas (ENOSPC on their
    writes). What each
    ``wait()`` raised, and the warnings."""
    from shardsafe.checkpoint.storage import files
    from shardsafe.tiers import replication

    os.environ["SHARDSAFE_NODE"] = str(rank)
    signal = Path(base) / "rank-1-waited-for-step-2"
    if rank == 1:
        replicate_1 = replication.Replicator._replicate

        def damaged_first(self: Any, step: int) -> bool:
            if step == 1:
                manifest = _rank_dir(base, 1, 1, 1) / "manifest.json"
                manifest.write_bytes(manifest.read_bytes()[:-10])
            return replicate_1(self, step)

        replication.Replicator._replicate = damaged_first  # type: ignore[method-assign]
        write = files.LocalFileSink.write

        def full(self: Any, data: Any) -> None:
            if "rank-00000" in self.path and self.path.endswith(".safetensors"):
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")
            write(self, data)

        files.LocalFileSink.write = full  # type: ignore[method-assign]
    if rank == 0:
        replicate = replication.Replicator._replicate

        def unusable_first(self: Any, step: int) -> bool:
            if step == 2:
                root = local_dir(base, 0)
                os.rename(root, root + "-gone")
                Path(root).write_text("not a directory")
            return replicate(self, step)

        replication.Replicator._replicate = unusable_first  # type: ignore[method-assign]
    raised: dict[int, str] = {}
    model = torch.nn.Linear(4, 4)
    with (
        warnings.catch_warnings(record=True) as caught,
        contextlib.closing(
            TieredCheckpointManager(
                os.path.join(base, "persistent"),
                local_dir(base, rank),
                persist_every=None,
                timeout=TIMEOUT,
            )
        ) as manager,
    ):
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            manager.save(step, {"model": model})
            try:
                manager.wait()
            except CheckpointError as e:
                raised[step] = str(e)
            if step == 2 and rank == 1:
                signal.touch()
            # Alive past the transfers' timeout: a rank 1 left waiting for rank 0 times
            # out and stops replicating ("stopped replicating", asserted absent below).
            deadline = time.monotonic() + TIMEOUT + 15
            while step == 2 and rank == 0 and not signal.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    said = [str(w.message) for w in caught if "shardsafe:" in str(w.message)]
    return {"raised": raised, "warnings": said}


def test_a_node_whose_local_directory_became_unusable_tells_its_peer_at_once(
    tmp_path: Path,
) -> None:
    """Before, rank 1's ``wait()`` of step 2 returned only when rank 0 closed its
    manager (or after the 30 s timeout), and both stopped replicating for good."""
    base = str(tmp_path)
    got = run_ranks(_three_steps, 2, base, timeout=100)
    unusable = (
        f"the local tier's directory {local_dir(base, 0)} cannot be made or opened: "
        f"{local_dir(base, 0)} is a regular file, not a directory. Give each node a local path "
        "it can write (a directory, or nothing yet, on a tmpfs or NVMe disk)"
    )
    unsent = (
        "rank 0 could not open its local checkpoint of step 2 to send it to rank 1, which "
        f"has no replica of it: {unusable}"
    )
    assert got[0]["raised"] == {
        2: unsent,
        3: f"rank 0 could not write its local checkpoint of step 3: {unusable}",
    }
    # A manifest that no longer parses was sent as none in silence before: the step was
    # not replicated, and neither wait() nor a warning said so.
    damaged = got[1]["raised"][1]
    assert damaged.startswith(
        "rank 1 could not open its local checkpoint of step 1 to send it to rank 0, which "
        f"has no replica of it: {_rank_dir(base, 1, 1, 1) / 'manifest.json'} is not valid "
        "JSON: "
    ), damaged
    assert got[1]["raised"] == {1: damaged}
    assert f"shardsafe: {damaged}" in got[1]["warnings"]
    assert os.listdir(Path(local_dir(base, 0) + "-gone") / "step-000000001") == ["rank-00000"]
    # A replica that could not be written leaves nothing behind: its files that arrived
    # were kept before (one directory per step for the whole run, taking the room).
    assert (
        "shardsafe: rank 1 does not keep rank 0's replica of step 1: it could not be "
        "written: [Errno 28] No space left on device (simulated)"
    ) in got[1]["warnings"]
    assert not Path(local_dir(base, 1), "step-000000001", "rank-00000").exists()
    # Rank 0 tells rank 1 it has none, and refuses rank 1's, at steps 2 and 3: the
    # refusal of step 3 is step 2's again, not repeated (Replicator._warn).
    refused = [w for w in got[0]["warnings"] if "does not keep" in w]
    assert refused == [
        "shardsafe: rank 0 does not keep rank 1's replica of step 2: it was refused: its "
        f"directory could not be made: {unusable}"
    ]
    assert f"shardsafe: {unsent}" in got[0]["warnings"]
    assert not [w for w in got[1]["warnings"] if "stopped replicating" in w]
    assert Path(local_dir(base, 0)).read_text() == "not a directory"
    # Step 1 (rank 1's own copy, beyond keep_local=2, and no replica) is gone.
    assert sorted(os.listdir(local_dir(base, 1))) == ["step-000000002", "step-000000003"]
    assert sorted(os.listdir(Path(local_dir(base, 1)) / "step-000000002")) == ["rank-00001"]


def _restored(rank: int, base: str) -> dict[str, Any]:
    """``load_latest`` on this rank (each rank a node of its own): the step and tiers
    restored, this rank's warnings, and the files they were attributed to."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    model, opt = build()
    with (
        warnings.catch_warnings(record=True) as caught,
        contextlib.closing(
            TieredCheckpointManager(
                os.path.join(base, "persistent"), local_dir(base, rank), timeout=TIMEOUT
            )
        ) as manager,
    ):
        warnings.simplefilter("always")
        manager.load_latest({"model": model, "optimizer": opt, "rng": shardsafe.RNGState()})
        assert manager.restored is not None
        restored = manager.restored
    return {
        "step": restored.step,
        "tiers": restored.tiers,
        "warnings": [str(w.message) for w in caught if "shardsafe:" in str(w.message)],
        "warned in": sorted({Path(w.filename).name for w in caught if "delete" in str(w.message)}),
    }


def _restore_where_rank_0_cannot_delete(rank: int, world: int, base: str) -> dict[str, Any]:
    """:func:`_restored`, with every deletion in rank 0's local directory failing (an I/O
    error)."""
    from shardsafe.checkpoint.storage import removal

    if rank == 0:

        def failing(*args: Any, **kwargs: Any) -> None:
            raise OSError(errno.EIO, "Input/output error (simulated)")

        removal.record = failing  # the first write of a deletion
    return _restored(rank, base)


def test_copies_a_restore_cannot_delete_are_warned_about_and_passed_over(
    tmp_path: Path,
) -> None:
    """Rank 0's own copy of step 3 is damaged, and nothing in its node's directory can be
    deleted. Before, its failed deletion of that copy was raised on rank 0 alone, inside
    the restore, while rank 1 waited for it until the timeout (the message, "the new
    checkpoint is committed, but deleting the old checkpoint ... failed", was retention's).
    Now each failed deletion is a warning naming the copy: the damaged one, the place the
    replica from node 1 would be received into (so step 3 cannot be completed), and
    step 3's copies after step 2 is restored."""
    base = str(tmp_path)
    run_ranks(train, 2, base, 3, None, 1, timeout=100)
    (data,) = _rank_dir(base, 0, 3, 0).glob("*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))
    got = run_ranks(_restore_where_rank_0_cannot_delete, 2, base, timeout=100)
    assert [(g["step"], g["tiers"]) for g in got] == [(2, ["local", "local"])] * 2
    failed = "failed: [Errno 5] Input/output error (simulated)"
    own, replica = _rank_dir(base, 0, 3, 0), _rank_dir(base, 0, 3, 1)
    said = [w for w in got[0]["warnings"] if "delete" in w or "refused" in w]
    assert said == [
        f"shardsafe: restoring: rank 0 could not delete its damaged copy of step 3 "
        f"(deleting the checkpoint {own} {failed}); delete it yourself",
        "shardsafe: restoring step 3: rank 0's copy from rank 1 was refused: its directory "
        f"could not be made: deleting the checkpoint {own} {failed}",
        "shardsafe: restoring: rank 0 could not delete rank 0's copy of step 3, a later "
        f"step (deleting the checkpoint {own} {failed}); delete it yourself",
        "shardsafe: restoring: rank 0 could not delete rank 1's copy of step 3, a later "
        f"step (deleting the checkpoint {replica} {failed}); delete it yourself",
    ]
    assert not any("delete" in w for w in got[1]["warnings"])
    assert got[0]["warned in"] == [Path(__file__).name]  # load_latest's caller, not shardsafe
    assert not Path(local_dir(base, 1), "step-000000003").exists()
    # Not deleted, but no longer committed: left so, rank 0's copy of step 3 was restored
    # after a restart beside rank 1's of the resumed run's step 3 (rank 0's own write of
    # it failed, its deletion failing again): a mix of two runs, loaded in silence.
    for copy in (own, replica):
        assert copy.is_dir() and not (copy / "manifest.json").exists(), sorted(copy.iterdir())


def _restore_where_rank_1_cannot_commit(rank: int, world: int, base: str) -> dict[str, Any]:
    """:func:`_restored`, where rank 1's commit of its copy of step 3 fails (ENOSPC, as a
    full disk refuses the manifest)."""
    from shardsafe.checkpoint.storage.local import LocalStorage

    if rank == 1:
        commit = LocalStorage.commit

        def full(self: LocalStorage, name: str, data: bytes) -> None:
            if name == "manifest.json" and "step-000000003" in self.directory:
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")
            commit(self, name, data)

        LocalStorage.commit = full  # type: ignore[method-assign]
    return _restored(rank, base)


def test_a_fetched_copy_that_cannot_commit_says_why_it_was_passed_over(tmp_path: Path) -> None:
    """Node 1 lost: rank 1 receives its copy of step 3 from rank 0, whole, but cannot
    commit it. Before, the restore went back to step 2 and no rank said why (a copy that
    failed its commit, or its last check, was passed over in silence)."""
    base = str(tmp_path)
    run_ranks(train, 2, base, 3, None, 1, timeout=100)
    shutil.rmtree(local_dir(base, 1))
    got = run_ranks(_restore_where_rank_1_cannot_commit, 2, base, timeout=100)
    assert [(g["step"], g["tiers"]) for g in got] == [(2, ["local", "peer"])] * 2
    assert got[1]["warnings"] == [
        "shardsafe: restoring step 3: rank 1's copy from rank 0 could not be committed: "
        "[Errno 28] No space left on device (simulated)"
    ]
    assert got[0]["warnings"] == []
    assert not Path(local_dir(base, 1), "step-000000003").exists()


def _mixed_runs(rank: int, world: int, base: str, phase: str) -> dict[str, Any]:
    """``train``: steps 1-3, each rank's weights ``step + 100 * rank``. ``resume``: rank 0
    can delete nothing of step 3, not even a manifest; restore, then save step 3 again
    (weights ``30 + 100 * rank``). ``restart``: restore. What was restored, and its
    weight."""
    from shardsafe.checkpoint.storage import removal
    from shardsafe.tiers.node_dir import NodeDir

    os.environ["SHARDSAFE_NODE"] = str(rank)
    if rank == 0 and phase == "resume":
        record = removal.record

        def failing(storage: Any, names: Any, **kwargs: Any) -> None:
            if "step-000000003" in storage.where("x"):
                raise OSError(errno.EIO, "Input/output error (simulated)")
            record(storage, names, **kwargs)

        def kept(self: Any, step_dir: Any, rank: int) -> None:
            raise OSError(errno.EIO, "Input/output error (simulated)")

        removal.record = failing
        NodeDir._uncommitted = kept  # type: ignore[method-assign]
    model = torch.nn.Linear(2, 2)
    out: dict[str, Any] = {}
    with (
        warnings.catch_warnings(),
        contextlib.closing(
            TieredCheckpointManager(
                os.path.join(base, "persistent"),
                local_dir(base, rank),
                persist_every=None,
                keep_local=3,
                timeout=TIMEOUT,
            )
        ) as manager,
    ):
        warnings.simplefilter("ignore")
        if phase == "train":
            for step in (1, 2, 3):
                with torch.no_grad():
                    model.weight.fill_(step + 100 * rank)
                manager.save(step, {"model": model})
                manager.wait()
            return out
        manager.load_latest({"model": model})
        assert manager.restored is not None
        out["restored"] = (manager.restored.step, float(model.weight[0, 0]))
        if phase == "resume":
            with torch.no_grad():
                model.weight.fill_(30 + 100 * rank)
            manager.save(3, {"model": model})
            with contextlib.suppress(CheckpointError):  # rank 0's write of step 3 fails
                manager.wait()
    return out


def test_copies_of_one_step_from_two_runs_are_never_restored_together(tmp_path: Path) -> None:
    """Rank 1's copies of step 3 are damaged, so a restore goes back to step 2; rank 0 can
    delete nothing of step 3 (not even its manifest), so its copy of the abandoned run's
    step 3 stays committed; the resumed run saves step 3 again, rank 0's write failing.
    After a restart, step 3 was restored from rank 0's old copy (weight 3) beside rank
    1's new one (weight 130): two runs mixed, in silence. Each local checkpoint now
    records its run's token, and one step is restored only from the copies of one run."""
    base = str(tmp_path)
    run_ranks(_mixed_runs, 2, base, "train", timeout=100)
    for node in (0, 1):
        (data,) = _rank_dir(base, node, 3, 1).glob("*.safetensors")
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0x01
        data.write_bytes(bytes(raw))
    resumed = run_ranks(_mixed_runs, 2, base, "resume", timeout=100)
    assert [r["restored"] for r in resumed] == [(2, 2.0), (2, 102.0)]
    assert (_rank_dir(base, 0, 3, 0) / "manifest.json").is_file()  # the old run's, kept
    assert (_rank_dir(base, 1, 3, 1) / "manifest.json").is_file()  # the new run's
    restarted = run_ranks(_mixed_runs, 2, base, "restart", timeout=100)
    assert [r["restored"] for r in restarted] == [(2, 2.0), (2, 102.0)]
