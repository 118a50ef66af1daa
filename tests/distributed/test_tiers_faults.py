"""``TieredCheckpointManager`` against damage and kills, on real ranks: 4 processes as 2
simulated nodes of 2 (``tiers_setup.py``), or 2 as 2 nodes of 1.

Each fault is made on disk between a run of 3 steps and its resumption: a flipped byte
in a rank's own copy or in a replica that must be sent, a step missing on one rank, a
world size that changed. The resumed run must restore exactly the step and tiers said,
bitwise the uninterrupted run's state of that step, and go on exactly as it did."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointError
from shardsafe.tiers import TieredCheckpointManager, rank_checkpoint
from tests.distributed import test_fsdp, zero_setup
from tests.distributed.tiers_setup import (
    DIE_AT,
    KILL_OPTIONS,
    build,
    kill_check,
    local_dir,
    rank_dirs,
    train,
)
from tests.e2e.kills import kill_during_a_save, seeded_moment
from tests.harness import free_port, run_ranks

pytestmark = pytest.mark.timeout(120)
STEPS = 5
ROOT = Path(__file__).resolve().parents[2]
ALL_RANKS = ["rank-00000", "rank-00001", "rank-00002", "rank-00003"]


def assert_kept(base: str, newest: int) -> None:
    """Each node keeps every rank's copy of the 2 newest steps (keep_local=2), and at most
    the step before them besides: the newest step every rank has replicated, which a rank
    may not have seen counted yet when it applied retention the last time."""
    for node in (0, 1):
        dirs = rank_dirs(base, node)
        newer = {f"step-{newest - 1:09d}", f"step-{newest:09d}"}
        assert {name: dirs.get(name) for name in newer} == dict.fromkeys(newer, ALL_RANKS)
        assert set(dirs) - newer <= {f"step-{newest - 2:09d}"}, dirs


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(train, 4, str(tmp_path_factory.mktemp("full")), STEPS, timeout=100)


def _same_run(resumed: list[dict], full: list[dict], start: int) -> None:
    """Each rank restored the uninterrupted run's state of ``start`` bitwise, and went on
    with the same losses and state, bitwise."""
    for r in range(len(full)):
        assert resumed[r]["start"] == start
        restored, saved = resumed[r]["at"][start], full[r]["at"][start]
        assert len(restored) == len(saved)
        assert all(torch.equal(a, b) for a, b in zip(restored, saved)), f"rank {r}"
        assert resumed[r]["losses"] == full[r]["losses"][start:]
        last = max(full[r]["at"])
        assert all(torch.equal(a, b) for a, b in zip(resumed[r]["at"][last], full[r]["at"][last]))


def rank_ckpt(base: str, node: int, step: int, rank: int) -> Path:
    return Path(local_dir(base, node)) / f"step-{step:09d}" / f"rank-{rank:05d}"


def flip_a_byte(ckpt: Path, where: str) -> None:
    """Flip one bit of the data file: of its last byte (tensor data), or of a byte of its
    JSON header (which the manifest's header checksum covers)."""
    (data,) = ckpt.glob("*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[-1 if where == "tensor data" else 12] ^= 0x01
    data.write_bytes(bytes(raw))


def three_steps(base: str) -> None:
    """Steps 1-3: local steps 2 and 3 on both nodes (own and replicas), persistent 2."""
    run_ranks(train, 4, base, 3, timeout=100)
    assert_kept(base, 3)


@pytest.mark.parametrize("where", ["tensor data", "file header"])
def test_a_flipped_byte_in_a_ranks_own_copy_is_refused_and_the_peers_replica_used(
    uninterrupted: list[dict], tmp_path: Path, where: str
) -> None:
    """Damaged tensor data is refused by its checksums when the load reads it (and the
    load tried again with node 1's replica); a damaged header is refused by the survey's
    cheap checks, before anything is read."""
    base = str(tmp_path)
    three_steps(base)
    flip_a_byte(rank_ckpt(base, 0, 3, 1), where)
    resumed = run_ranks(train, 4, base, STEPS, timeout=100)
    assert [r["tiers"] for r in resumed] == [["local", "peer", "local", "local"]] * 4
    _same_run(resumed, uninterrupted, 3)
    damaged = [w for w in resumed[0]["warnings"] if "was damaged" in w]
    if where == "file header":
        assert damaged == []
    else:
        assert len(damaged) == 1, resumed[0]["warnings"]
        assert damaged[0].startswith("shardsafe: a local checkpoint of step 3 was damaged (")
        assert "rank-00001" in damaged[0] and damaged[0].endswith("); trying the next copy")
    assert_kept(base, 5)


@pytest.mark.parametrize("older", ["local", "persistent"])
def test_a_flipped_byte_in_a_replica_to_be_sent_is_refused_on_receipt(
    uninterrupted: list[dict], tmp_path: Path, older: str
) -> None:
    """Rank 3's own copy of step 3 is gone and node 0's replica of it is damaged: the
    receipt fails its checksums, so step 3 is incomplete and step 2 is restored, from
    the local tier, or (its local copies gone too) from the persistent tier."""
    base = str(tmp_path)
    three_steps(base)
    shutil.rmtree(rank_ckpt(base, 1, 3, 3))
    flip_a_byte(rank_ckpt(base, 0, 3, 3), "tensor data")
    if older == "persistent":
        for node in (0, 1):
            shutil.rmtree(Path(local_dir(base, node)) / "step-000000002")
    resumed = run_ranks(train, 4, base, STEPS, timeout=100)
    assert [r["tiers"] for r in resumed] == [[older] * 4] * 4
    # refused on receipt, by the receiver's checksums: no load ever read it
    assert not any("was damaged" in w for r in resumed for w in r["warnings"])
    # and said so, naming what failed: step 3 was passed over for a reason the user sees
    assert [w for w in resumed[3]["warnings"] if "arrived damaged" in w] == [
        "shardsafe: restoring step 3: rank 3's copy from rank 0 arrived damaged: checksum "
        "mismatch in shard-00000-of-00001.safetensors, tensor 'rng/rank-00003/torch' (chunk "
        "at offsets [0], block 0): the data file is damaged"
    ]
    _same_run(resumed, uninterrupted, 2)
    assert_kept(base, 5)  # the run went on (step 3 written again, if still there)


def test_the_newest_step_missing_on_one_rank_everywhere_restores_the_one_before(
    uninterrupted: list[dict], tmp_path: Path
) -> None:
    base = str(tmp_path)
    three_steps(base)
    for node in (0, 1):
        shutil.rmtree(rank_ckpt(base, node, 3, 1))
    resumed = run_ranks(train, 4, base, STEPS, timeout=100)
    assert [r["tiers"] for r in resumed] == [["local"] * 4] * 4
    _same_run(resumed, uninterrupted, 2)


@pytest.mark.parametrize("damage", ["cut short", "ranks swapped"])
def test_a_newest_step_every_copy_of_which_is_refused_is_passed_over_saying_so(
    uninterrupted: list[dict], tmp_path: Path, damage: str
) -> None:
    """Every copy of step 3 refused by the survey (a data file cut short; rank 1's and
    rank 0's directories swapped, manifests intact): step 2 was restored, and step 3's
    copies deleted, without a word. Every rank now says which copies were passed over."""
    base = str(tmp_path)
    three_steps(base)
    for node in (0, 1):
        if damage == "cut short":
            data = next(rank_ckpt(base, node, 3, 1).glob("shard-*"))
            os.truncate(data, data.stat().st_size - 1)
        else:
            first, second = rank_ckpt(base, node, 3, 0), rank_ckpt(base, node, 3, 1)
            if first.exists() and second.exists():
                first.rename(first.with_name("swapping"))
                second.rename(first)
                first.with_name("swapping").rename(second)
    resumed = run_ranks(train, 4, base, STEPS, timeout=100)
    for r in resumed:
        said = [w for w in r["warnings"] if "passing over local checkpoints of later" in w]
        assert len(said) == 1 and said[0].startswith(
            "shardsafe: restored step 2, passing over local checkpoints of later steps that "
            "would not load (step 3 of rank "
        ), r["warnings"]
    _same_run(resumed, uninterrupted, 2)


def test_another_world_size_at_load_uses_the_persistent_tier(
    uninterrupted: list[dict], tmp_path: Path
) -> None:
    base = str(tmp_path)
    three_steps(base)
    resumed = run_ranks(train, 2, base, 3, None, 1, timeout=100)  # 2 nodes of 1 rank
    for r in range(2):
        assert resumed[r]["start"] == 2
        assert resumed[r]["tiers"] == ["persistent"] * 2
        # DDP: every rank holds the same model and optimizer state
        assert all(
            torch.equal(a, b) for a, b in zip(resumed[r]["at"][2], uninterrupted[0]["at"][2])
        )


def _local_only(rank: int, world: int, base: str, steps: int) -> Any:
    """Each rank a node of its own, no persistent tier: save ``steps`` steps (if any),
    then ``load_latest`` in a new manager; what it returned, or raised."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    warnings.simplefilter("ignore")
    options: dict[str, Any] = {"persist_every": None, "timeout": 20}
    state = {"model": torch.nn.Linear(4, 4)}
    with contextlib.closing(
        TieredCheckpointManager(os.path.join(base, "persistent"), local_dir(base, rank), **options)
    ) as manager:
        for step in range(1, steps + 1):
            manager.save(step, state)
        manager.wait()
    with contextlib.closing(
        TieredCheckpointManager(os.path.join(base, "persistent"), local_dir(base, rank), **options)
    ) as manager:
        try:
            return ("returned", manager.load_latest(state))
        except Exception as e:  # what each rank raised, compared by the test
            return (type(e).__name__, str(e))


@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (1, 2)])
def test_local_checkpoints_of_another_world_size_and_no_persistent_one_are_never_abandoned(
    tmp_path: Path, saved: int, resumed: int
) -> None:
    """Before, ``load_latest`` returned ``None`` (nothing saved) and the run started afresh
    over them, silently."""
    base = str(tmp_path)
    run_ranks(_local_only, saved, base, 3, timeout=100)
    outcomes = run_ranks(_local_only, resumed, base, 0, timeout=100)
    said = (
        f"the local tier holds checkpoints of step 3 saved at world size {saved}, but this "
        f"run's world size is {resumed}: local checkpoints load only at the world size that "
        "saved them, and the persistent tier holds no checkpoint to reshard from. Relaunch "
        f"with {saved} ranks to resume from them, or give this run a local directory of its "
        "own to start afresh"
    )
    assert outcomes == [("CheckpointMismatchError", said)] * resumed
    # Nothing was deleted: relaunched at the world size that saved them, they restore.
    assert run_ranks(_local_only, saved, base, 0, timeout=100) == [("returned", {})] * saved


def _fresh_start(rank: int, world: int, base: str) -> tuple[Any, list[str]]:
    """``load_latest`` in a new manager (each rank a node of its own, no persistent
    tier): what it returned, and shardsafe's warnings."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    options: dict[str, Any] = {"persist_every": None, "timeout": 20}
    with (
        contextlib.closing(
            TieredCheckpointManager(
                os.path.join(base, "persistent"), local_dir(base, rank), **options
            )
        ) as manager,
        warnings.catch_warnings(record=True) as said,
    ):
        warnings.simplefilter("always")
        got = manager.load_latest({"model": torch.nn.Linear(4, 4)})
    return got, [str(w.message) for w in said if str(w.message).startswith("shardsafe")]


def test_copies_that_complete_no_step_start_the_run_afresh_saying_so(tmp_path: Path) -> None:
    """Found in review: every copy of rank 1 lost (its node's directory and its replicas),
    rank 0's committed copies of steps 1-3 there, no persistent tier: ``load_latest``
    returned ``None`` on every rank in silence, and the run started afresh."""
    base = str(tmp_path)
    run_ranks(_local_only, 2, base, 3, timeout=100)
    shutil.rmtree(local_dir(base, 1))
    for replica in Path(local_dir(base, 0)).glob("step-*/rank-00001"):
        shutil.rmtree(replica)
    said = (
        "shardsafe: nothing was restored, and the run starts afresh: the newest local "
        "checkpoints, of step 3, are complete for some ranks only (no node holds a copy of "
        "rank(s) 1: a job stopped in its first local save, or a node lost with every replica "
        "of its ranks), and the persistent tier holds no checkpoint. To go on from earlier "
        "work instead, stop this run and load a checkpoint you kept elsewhere"
    )
    assert run_ranks(_fresh_start, 2, base, timeout=100) == [(None, [said])] * 2


def _relayout(rank: int, world: int, base: str, run: str) -> Any:
    """Run ``A``: 2 nodes of 2 save steps 1-3 (every tensor ``1000 + 10 x step + rank``).
    Runs ``B`` and ``C``: 4 nodes of 1 (nodes 0 and 1 keep their directories) restore;
    ``B`` then saves step 3 anew (``2030 + rank``). Each restore's step, this rank's tier
    and restored value."""
    warnings.simplefilter("ignore")
    node = rank // 2 if run == "A" else rank
    os.environ["SHARDSAFE_NODE"] = str(node)
    model = torch.nn.Linear(2, 2)
    state = {"model": model}
    with contextlib.closing(
        TieredCheckpointManager(
            os.path.join(base, "persistent"), local_dir(base, node), persist_every=None, timeout=30
        )
    ) as manager:
        if run == "A":
            for step in (1, 2, 3):
                torch.nn.init.constant_(model.weight, 1000 + 10 * step + rank)
                manager.save(step, state)
            manager.wait()
            return None
        manager.load_latest(state)
        assert manager.restored is not None
        restored = (manager.restored.step, manager.restored.tier, model.weight[0, 0].item())
        if run == "B":
            torch.nn.init.constant_(model.weight, 2030 + rank)
            manager.save(3, state)
            manager.wait()
        return restored


def test_a_later_step_of_an_abandoned_run_left_by_another_node_layout_is_never_restored(
    tmp_path: Path,
) -> None:
    """A restore to step 2 (rank 0's step 3 never committed) on a new node layout left
    step 3's copies that no rank of node 0 owns any more (rank 1's, rank 2's); before,
    once node 1 was lost, node 0 sent rank 1 that copy of the abandoned run (1031), not
    the new run's step 3 (2031) replicated on node 2."""
    base = str(tmp_path)
    run_ranks(_relayout, 4, base, "A", timeout=100)
    for node in (0, 1):
        shutil.rmtree(rank_ckpt(base, node, 3, 0))
    resumed = run_ranks(_relayout, 4, base, "B", timeout=100)
    assert [r[:2] for r in resumed] == [(2, "local")] * 2 + [(2, "peer")] * 2
    assert rank_dirs(base, 0)["step-000000003"] == ["rank-00000", "rank-00003"]  # its own
    shutil.rmtree(local_dir(base, 1))  # node 1 lost
    again = run_ranks(_relayout, 4, base, "C", timeout=100)
    assert again == [(3, "local", 2030.0), (3, "peer", 2031.0)] + [
        (3, "local", 2030.0 + r) for r in (2, 3)
    ]


def restore_run(rank: int, world: int, base: str, stale: bool = False) -> dict[str, Any]:
    """Only ``load_latest`` (2 nodes of 1 rank, a short timeout): what it restored.
    ``stale``: rank 1 may not delete what its directory of step 2 holds (permission
    denied), which it does before it receives a copy of step 2 there."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    if stale and rank == 1:
        from shardsafe.tiers.node_dir import NodeDir

        remove = NodeDir.remove

        def refused(self: NodeDir, step: int, owner: int, **kwargs: Any) -> None:
            if (step, owner) == (2, 1):
                raise PermissionError(errno.EACCES, "Permission denied (simulated)")
            remove(self, step, owner, **kwargs)

        NodeDir.remove = refused  # type: ignore[method-assign]
    model, opt = build()
    manager = TieredCheckpointManager(
        os.path.join(base, "persistent"), local_dir(base, rank), persist_every=2, timeout=20
    )
    try:
        manager.load_latest({"model": model, "optimizer": opt, "rng": shardsafe.RNGState()})
        assert manager.restored is not None
        return {"step": manager.restored.step, "tiers": manager.restored.tiers}
    finally:
        manager.close()


def restore_refused(rank: int, world: int, base: str) -> str:
    """:func:`restore_run`, which must raise: the error's text."""
    with pytest.raises(CheckpointError) as raised:
        restore_run(rank, world, base)
    return str(raised.value)


def test_a_receiver_that_cannot_make_its_directory_refuses_the_copy_without_a_hang(
    tmp_path: Path,
) -> None:
    """Rank 1's own copy of step 3 is gone, and a link (never followed) stands where node
    1's copy of it would be received: the receipt is refused before any data is sent, and
    step 2 is restored, instead of the sender waiting for a receiver that gave up; so
    too where it may not delete what its directory of step 2 holds. Then the same for
    step 2, with no persistent checkpoint: nothing can be restored, but node
    0 holds step 2, which a fresh start (``None``) would silently abandon: an error on
    every rank instead."""
    base = str(tmp_path)
    saved = run_ranks(train, 2, base, 3, None, 1, timeout=100)
    assert saved[1]["written"][-2:] == [2, 3]
    copy = rank_ckpt(base, 1, 3, 1)
    shutil.rmtree(copy)
    (tmp_path / "elsewhere").mkdir()
    copy.symlink_to(tmp_path / "elsewhere")
    restored = run_ranks(restore_run, 2, base, timeout=60)
    assert restored == [{"step": 2, "tiers": ["local", "local"]}] * 2
    assert os.listdir(tmp_path / "elsewhere") == []
    assert copy.is_symlink()
    # Rank 1's step 2 gone too, and what its directory holds may not be deleted: refused
    # at once (the persistent step 2 restored), not with rank 0 waiting for its answer
    # until the timeout (then "rank(s) 1 never arrived" on rank 0).
    shutil.rmtree(rank_ckpt(base, 1, 2, 1))
    restored = run_ranks(restore_run, 2, base, True, timeout=60)
    assert restored == [{"step": 2, "tiers": ["persistent", "persistent"]}] * 2
    rank_ckpt(base, 1, 2, 1).symlink_to(tmp_path / "elsewhere")
    shutil.rmtree(os.path.join(base, "persistent"))
    assert (
        run_ranks(restore_refused, 2, base, timeout=60)
        == [
            "nothing was restored, but the local tiers hold step 2: rank(s) 1 could not receive "
            "their copy of it from another node (their local directory full or not writable, or "
            "the copy sent damaged), and no older step or persistent checkpoint was left to "
            "restore. Returning nothing would start the run afresh and abandon it: make room in "
            "(or repair) those ranks' local directory and restart"
        ]
        * 2
    )
    assert (Path(local_dir(base, 0)) / "step-000000002" / "rank-00001" / "manifest.json").exists()


def test_a_replica_that_cannot_be_received_is_refused_and_training_goes_on(
    tmp_path: Path,
) -> None:
    """A link stands where node 1 would keep rank 0's replica of step 4: that one replica
    is refused before any data is sent (and never written through the link); rank 0's
    step 4 is not counted as replicated, and every other step replicates as before."""
    base = str(tmp_path)
    run_ranks(train, 2, base, 3, None, 1, timeout=100)
    (tmp_path / "elsewhere").mkdir()
    link = rank_ckpt(base, 1, 4, 0)
    link.parent.mkdir()
    link.symlink_to(tmp_path / "elsewhere")
    resumed = run_ranks(train, 2, base, 5, None, 1, timeout=100)
    assert [r["start"] for r in resumed] == [3, 3]
    assert [r["written"] for r in resumed] == [[4, 5], [4, 5]]
    assert [r["replicated"] for r in resumed] == [[5], [4, 5]]
    assert [r["received"] for r in resumed] == [{1: [4, 5]}, {0: [5]}]
    assert os.listdir(tmp_path / "elsewhere") == []
    assert rank_dirs(base, 1)["step-000000004"] == ["rank-00000", "rank-00001"]
    assert link.is_symlink()


def _receipt_fails(rank: int, world: int, base: str) -> tuple[str, str]:
    """Each rank a node of its own; rank 1's receipt of every replica raises at once (rank
    0's send of step 1 then times out): what each rank's ``wait()`` raised."""
    from shardsafe.tiers import transfer

    os.environ["SHARDSAFE_NODE"] = str(rank)
    warnings.simplefilter("ignore")
    if rank == 1:

        def receive(*args: Any, **kwargs: Any) -> bool:
            raise OSError(errno.EIO, "Input/output error")

        transfer.receive = receive
    with contextlib.closing(
        TieredCheckpointManager(
            os.path.join(base, "persistent"), local_dir(base, rank), persist_every=None, timeout=5
        )
    ) as manager:
        manager.save(1, {"model": torch.nn.Linear(2, 2)})
        try:
            manager.wait()
        except CheckpointError as e:
            return (type(e).__name__, str(e))
        return ("ok", "")


def test_a_failed_replication_is_raised_by_wait_as_one_not_as_a_failed_local_checkpoint(
    tmp_path: Path,
) -> None:
    """Before, wait() raised 'a local checkpoint failed: [Errno 5] Input/output error' (or
    gloo's timeout), though every local checkpoint was whole."""
    outcomes = run_ranks(_receipt_fails, 2, str(tmp_path), timeout=100)
    assert outcomes[1] == (
        "CheckpointError",
        "rank 1 stopped replicating its local checkpoints: the receive of step 1 with rank 0 "
        "failed: OSError: [Errno 5] Input/output error. Its local checkpoints are whole; from "
        "that step on they are not copied to other nodes",
    )
    assert outcomes[0][1].startswith(
        "rank 0 stopped replicating its local checkpoints: the send of step 1 with rank 1 failed: "
    )
    for node in (0, 1):  # each rank's own checkpoint of step 1 is committed
        assert (rank_ckpt(str(tmp_path), node, 1, node) / "manifest.json").is_file()


def _refused_at_a_persistent_step(rank: int, world: int, base: str, verb: str) -> list[str]:
    """Each rank a node of its own: steps 1 to 3, step 2 due in both tiers; at step 2 rank
    1's state holds a value shardsafe refuses. What each call raised (``wait`` last)."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    warnings.simplefilter("ignore")
    said = []
    with contextlib.closing(
        TieredCheckpointManager(
            os.path.join(base, "persistent"), local_dir(base, rank), persist_every=2, timeout=30
        )
    ) as manager:
        for step in (1, 2, 3):
            state: dict[str, Any] = {"model": torch.nn.Linear(2, 2)}
            if step == 2 and rank == 1:
                state["sampler"] = object()
            try:
                getattr(manager, verb)(step, state)
            except CheckpointError as e:
                said.append(f"{verb}({step}): {e}")
        for _ in range(2):
            try:
                manager.wait()
            except CheckpointError as e:
                said.append(f"wait: {e}")
    return said


@pytest.mark.parametrize("verb", ["save", "async_save"])
def test_a_state_one_rank_cannot_stage_at_a_persistent_step_is_one_agreed_error(
    tmp_path: Path, verb: str
) -> None:
    """Before, rank 1 raised its refusal at once, alone, and rank 0 waited in the
    persistent save of step 2 for the whole entry timeout (60 s), then raised 'rank(s) 1
    never arrived'; the replication of step 3 then timed out too."""
    zero, one = run_ranks(_refused_at_a_persistent_step, 2, str(tmp_path), verb, timeout=100)
    refused = "save failed on rank 1: state['sampler'] is a object, which shardsafe does not know"
    where = "" if verb == "save" else f"the background save of step 2 to {tmp_path}"
    assert len(zero) == 1 and zero[0].startswith(f"{'save(2)' if verb == 'save' else 'wait'}: ")
    assert refused in zero[0] and where in zero[0]
    assert one[0] == zero[0]
    # Rank 1's own: no local checkpoint of step 2, warned and raised by wait().
    failed = "wait: rank 1 could not write its local checkpoint of step 2: "
    assert len(one) == 2 and one[1].startswith(failed + refused.split(": ", 1)[1])
    dirs = rank_dirs(str(tmp_path), 1)  # replication went on in step
    assert "rank-00001" not in dirs.get("step-000000002", [])
    assert dirs["step-000000003"] == ["rank-00000", "rank-00001"]


def _saved_again_refused(rank: int, world: int, base: str) -> int | None:
    """Each rank a node of its own: steps 0 and 1 saved, then step 1 saved again with a
    state rank 1 cannot stage. The step ``latest`` would restore then."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    warnings.simplefilter("ignore")
    with contextlib.closing(
        TieredCheckpointManager(
            os.path.join(base, "persistent"), local_dir(base, rank), persist_every=None
        )
    ) as manager:
        state: dict[str, Any] = {"model": torch.nn.Linear(2, 2)}
        for save, step in enumerate((0, 1, 1)):
            if save == 2 and rank == 1:  # refused: this rank has nothing of this save
                state["sampler"] = object()
            manager.save(step, state)
        with contextlib.suppress(CheckpointError):
            manager.wait()
        return manager.latest()


def test_a_step_saved_again_that_one_rank_cannot_stage_is_not_restored_from_both_saves(
    tmp_path: Path,
) -> None:
    """Rank 1 kept its checkpoint of step 1's first save, committed, beside rank 0's of the
    second: ``load_latest`` restored step 1 from two different saves, silently."""
    assert run_ranks(_saved_again_refused, 2, str(tmp_path), timeout=100) == [0, 0]
    dirs = rank_dirs(str(tmp_path), 1)
    assert "rank-00001" not in dirs.get("step-000000001", [])


def _saved_again_without_rank_1(rank: int, world: int, base: str) -> float | None:
    """Each rank a node of its own: steps 1, 2 and 3 saved and replicated; then rank 0
    saves step 3 again while rank 1 is gone (as if killed before it could): its
    replication times out. Then, in a restarted job, the value ``load_latest`` restores."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    warnings.simplefilter("ignore")
    done = os.path.join(base, "rank0-done")
    with contextlib.closing(
        TieredCheckpointManager(
            os.path.join(base, "persistent"), local_dir(base, rank), persist_every=None, timeout=3
        )
    ) as manager:
        for step in (1, 2, 3):
            manager.save(step, valued(step))
        manager.wait()
        torch.distributed.barrier()
        if rank == 0:
            manager.save(3, valued(999))
            with contextlib.suppress(CheckpointError):  # rank 1 never took its copy
                manager.wait()
            open(done, "w").close()
        else:
            while not os.path.exists(done):
                time.sleep(0.05)
    return None


def _restored_value(rank: int, world: int, base: str) -> tuple[int | None, bool, list[str]]:
    os.environ["SHARDSAFE_NODE"] = str(rank)
    warnings.simplefilter("ignore")
    state = valued(-1)
    with contextlib.closing(
        TieredCheckpointManager(
            os.path.join(base, "persistent"), local_dir(base, rank), persist_every=None
        )
    ) as manager:
        manager.load_latest(state)
        restored = manager.restored
    assert restored is not None
    return restored.step, holds(state, restored.step), restored.tiers


@pytest.mark.timeout(150)
def test_a_step_saved_again_while_a_rank_was_gone_is_never_restored_from_both_saves(
    tmp_path: Path,
) -> None:
    """Rank 1's copy of step 3 is of its first save, rank 0's of its second: before, both
    ranks restored "step 3", rank 0 the second save's values and rank 1 the first's, each
    reporting a clean local restore. Now only the copies of one save complete a step
    (their token names the save): the first save of step 3 is, rank 0's copy of it being
    its replica on rank 1's node."""
    run_ranks(_saved_again_without_rank_1, 2, str(tmp_path), timeout=100)
    restored = run_ranks(_restored_value, 2, str(tmp_path), timeout=100)
    assert restored == [(3, True, ["peer", "local"])] * 2


# ------------------------------------------------------------- FSDP2 and ZeRO


def save_or_restore(
    base: str, rank: int, state: dict[str, Any], save: bool, train: Callable[[], object]
) -> list[str] | None:
    """Train 3 steps and save them to the local tier (``save``), or restore them; the
    tiers restored from."""
    manager = TieredCheckpointManager(
        os.path.join(base, "persistent"), local_dir(base, rank), persist_every=None
    )
    try:
        if save:
            train()
            manager.save(3, state)
            return None
        manager.load_latest(state)
        assert manager.restored is not None
        return manager.restored.tiers
    finally:
        manager.close()


def fsdp_run(rank: int, world: int, base: str, save: bool) -> Any:
    """Train 3 steps and save them locally, or restore them; the full state and the
    next two losses."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    model = test_fsdp.fsdp(0 if save else 1)
    opt = test_fsdp.adamw(model)
    state = {"model": model, "optimizer": opt}
    tiers = save_or_restore(
        base, rank, state, save, lambda: test_fsdp.train(model, opt, 0, 3, rank)
    )
    msd, osd = test_fsdp.full_state(model, opt)
    return msd, osd, test_fsdp.train(model, opt, 3, 2, rank), tiers


@pytest.mark.parametrize("lost", [None, 1])
def test_fsdp2_state_restores_bitwise_from_the_local_tier(tmp_path: Path, lost: int | None) -> None:
    base = str(tmp_path)
    saved = run_ranks(fsdp_run, 2, base, True)
    if lost is not None:  # rank 1's node lost: its DTensor shards come from rank 0's node
        shutil.rmtree(local_dir(base, lost))
    resumed = run_ranks(fsdp_run, 2, base, False)
    tiers = ["local", "local"] if lost is None else ["local", "peer"]
    assert [r[3] for r in resumed] == [tiers, tiers]
    assert [r[2] for r in resumed] == [s[2] for s in saved]  # next losses bitwise, per rank
    msd, osd, _, _ = saved[0]  # torch's gathered view, on rank 0
    got_msd, got_osd, _, _ = resumed[0]
    assert osd["state"], "the setup must have optimizer state to compare"
    test_fsdp.assert_same_model(got_msd, msd)
    zero_setup.assert_same_optimizer_state(
        test_fsdp.fqn_optimizer_state(got_osd), test_fsdp.fqn_optimizer_state(osd)
    )
    if lost is None:  # a copy of a shard, opened by path: the message says what it holds
        copy = os.path.join(local_dir(base, 1), "step-000000003", "rank-00001")
        with pytest.raises(shardsafe.CheckpointMismatchError) as refused:
            shardsafe.load(copy, {"model": test_fsdp.net(1)})
        assert (
            "This is rank 1's local copy of a TieredCheckpointManager: it holds what that "
            "rank held (a sharded model's pieces at their own shapes)"
        ) in str(refused.value), refused.value


def zero_run(rank: int, world: int, base: str, save: bool) -> Any:
    os.environ["SHARDSAFE_NODE"] = str(rank)
    _, wrapped, opt = zero_setup.build("zero", seed=0 if save else 1)
    state = {"model": wrapped, "optimizer": opt}
    tiers = save_or_restore(
        base, rank, state, save, lambda: zero_setup.train(wrapped, opt, 0, 3, rank)
    )
    weights = {k: v.clone() for k, v in wrapped.module.state_dict().items()}
    reference = zero_setup.torch_consolidated(opt, rank)
    return weights, reference, zero_setup.train(wrapped, opt, 3, 2, rank), tiers


def test_zero_state_restores_bitwise_from_the_local_tier(tmp_path: Path) -> None:
    base = str(tmp_path)
    saved = run_ranks(zero_run, 2, base, True)
    assert saved[0][1]["state"], "the setup must have optimizer state to compare"
    resumed = run_ranks(zero_run, 2, base, False)
    for r in range(2):
        weights, _, losses, _ = saved[r]
        got_weights, _, got_losses, tiers = resumed[r]
        assert tiers == ["local", "local"]
        test_fsdp.assert_same_model(got_weights, weights)
        assert got_losses == losses
    zero_setup.assert_same_optimizer_state(resumed[0][1], saved[0][1])


def zero_save_run(rank: int, world: int, base: str) -> list[float]:
    """Train ZeRO 3 steps, save step 3 to both tiers, then the next two losses."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    _, wrapped, opt = zero_setup.build("zero", seed=0)
    zero_setup.train(wrapped, opt, 0, 3, rank)
    manager = TieredCheckpointManager(
        os.path.join(base, "persistent"), local_dir(base, rank), persist_every=3
    )
    try:
        manager.save(3, {"model": wrapped, "optimizer": opt})
    finally:
        manager.close()
    return zero_setup.train(wrapped, opt, 3, 2, rank)


def zero_resumed_as_run(rank: int, world: int, base: str, kind: str) -> Any:
    """Resume the ZeRO save with ``kind``'s optimizer: the tiers and the next two
    losses, or the refusal."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    _, wrapped, opt = zero_setup.build(kind, seed=1)
    manager = TieredCheckpointManager(os.path.join(base, "persistent"), local_dir(base, rank))
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            manager.load_latest({"model": wrapped, "optimizer": opt})
    except shardsafe.CheckpointMismatchError as e:
        return str(e)
    finally:
        manager.close()
    assert manager.restored is not None
    warned = [str(w.message) for w in said if "do not fit this run" in str(w.message)]
    return manager.restored.tiers, warned, zero_setup.train(wrapped, opt, 3, 2, rank)


def test_a_zero_ranks_local_copy_is_never_restored_into_another_sharding(
    tmp_path: Path,
) -> None:
    """A ZeRO rank's copy holds its own partition's optimizer state only. Resumed as
    plain DDP + AdamW, each rank took the parameters its copy names without state for
    stateless ones and trained on with fresh moments for the other rank's half (review:
    losses off from the second step, no word). Now refused, and restored from the
    persistent tier: the losses go on bitwise; without one, refused on every rank."""
    base = str(tmp_path)
    losses = run_ranks(zero_save_run, 2, base)
    resumed = run_ranks(zero_resumed_as_run, 2, base, "plain")
    said = (
        "rank {r}'s local copy holds state['optimizer'] as its ZeroAdapter partition: the "
        "optimizer state of the parameters this rank owned, the others' being in the other "
        "ranks' copies; this load restores it into a AdamW (OptimizerAdapter), which needs "
        "every parameter's state. A local copy restores only into the optimizer sharding "
        "that saved it; the persistent tier restores into any other"
    )
    assert [r[0] for r in resumed] == [["persistent", "persistent"]] * 2, resumed
    warned = resumed[0][1]  # rank 0 warns, with the first rank's refusal
    assert len(warned) == 1 and any(said.format(r=r) in warned[0] for r in range(2)), warned
    assert [r[2] for r in resumed] == losses
    shutil.rmtree(os.path.join(base, "persistent"))
    refused = run_ranks(zero_resumed_as_run, 2, base, "plain")
    assert all(isinstance(text, str) and "ZeroAdapter partition" in text for text in refused)
    assert any(said.format(r=r) in refused[0] for r in range(2)), refused[0]


# ------------------------------------------------------------------ budget


def budget_run(rank: int, world: int, base: str) -> str:
    os.environ["SHARDSAFE_NODE"] = str(rank // 2)
    model = torch.nn.Linear(8, 4)
    manager = TieredCheckpointManager(
        os.path.join(base, "persistent"), local_dir(base, rank // 2), keep_local=10**9
    )
    try:
        manager.save(1, {"model": model})
    except shardsafe.CheckpointError as e:
        assert type(e) is shardsafe.CheckpointError
        assert manager.budget is None
        return str(e)
    finally:
        manager.close()
    return "saved"


def test_a_budget_no_node_meets_is_the_same_error_on_every_rank_and_writes_nothing(
    tmp_path: Path,
) -> None:
    base = str(tmp_path)
    errors = run_ranks(budget_run, 4, base)
    assert len(set(errors)) == 1, errors
    # a Linear(8, 4) is 144 bytes; node 0 keeps its 2 ranks' and node 1's 2 ranks' copies
    assert re.fullmatch(
        re.escape(
            f"the local tier needs 536.44 GiB on the node of ranks [0, 1] ({local_dir(base, 0)}): "
            "576 bytes per step (its ranks' checkpoints and the replicas it keeps) x "
            "(keep_local=1000000000 + 1 being written + the newest step every rank has "
            "replicated), plus 288 bytes (its ranks' previous step, until it is replicated), "
            "but only "
        )
        + r"[0-9.]+ [GM]iB"
        + re.escape(
            " is free there. Lower keep_local (or replicas, where you set them), save locally "
            "less state, or give the local path more room (a larger /dev/shm: docker "
            "--shm-size, or an NVMe path)"
        ),
        errors[0],
    ), errors[0]
    assert sorted(os.listdir(tmp_path)) == ["local-node0", "local-node1"]
    for node in (0, 1):
        assert os.listdir(local_dir(base, node)) == []


# ------------------------------------------------------------------- kills

KILL_SEEDS = (0, 1, 2, 3)


def _start(base: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    """Both ranks in a session of their own: rank 1 in the background of a shell that then
    becomes rank 0 (its stdout the pipe the kill is aimed by), so one ``killpg`` of rank
    0's group reaches both ranks and nothing else."""
    code = "from tests.distributed.tiers_setup import kill_target; kill_target()"
    rank = [shlex.quote(sys.executable), "-c", shlex.quote(code)]
    tail = " ".join(shlex.quote(a) for a in ["2", str(base), str(port), *extra])
    script = (
        f"{' '.join(rank)} 1 {tail} >{base}/rank1.out 2>{base}/rank1.err & "
        f"exec {' '.join(rank)} 0 {tail} 2>{base}/rank0.err"
    )
    return subprocess.Popen(
        ["sh", "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True
    )


def _last(kind: str, text: str) -> int:
    steps = [int(line.split()[1]) for line in text.splitlines() if line.startswith(f"{kind} ")]
    return steps[-1] if steps else 0


def _where(base: Path) -> str:
    """What the kill interrupted, read from the disk: the rank checkpoints (own or
    replicas) without a manifest."""
    partial = []
    for node in (0, 1):
        for rank_dir in sorted(Path(local_dir(str(base), node)).glob("step-*/rank-*")):
            if not (rank_dir / "manifest.json").exists():
                kind = "own write" if rank_dir.name == f"rank-{node:05d}" else "replica receipt"
                partial.append(f"{kind} {rank_dir.parent.name[-3:]}/{rank_dir.name[-1]}")
    return ", ".join(partial) or "between writes"


def _after_the_kill(base: Path, saved: int, saving: int, seed: Any) -> tuple[int, list[str]]:
    """Restore after the kill: a step no older than the newest one every rank had saved
    (rank 0's ``saved`` and rank 1's) and no newer than any had begun (``saving``),
    holding exactly its state; the step and tiers."""
    rank1_out = (base / "rank1.out").read_text()
    at_least = min(saved, _last("saved", rank1_out))
    at_most = max(saving, _last("saving", rank1_out))
    result = run_ranks(kill_check, 2, str(base), timeout=60)
    step = result[0]["step"]
    assert [r["step"] for r in result] == [step, step]
    assert all(r["exact"] for r in result), f"{seed}: step {step} is not its state"
    assert at_least <= step <= at_most, (seed, at_least, step, at_most)
    return step, result[0]["tiers"]


@pytest.mark.timeout(150)
def test_seeded_kills_during_local_writes_and_replication_never_lose_a_restorable_step(
    tmp_path: Path,
) -> None:
    """Both ranks SIGKILLed at seeded moments of their saves (the local write and, after
    it, the replication that goes on beside the next step): ``load_latest`` restores a
    step holding exactly its state, no older than the last step every rank had saved."""
    assert KILL_OPTIONS["replicas"] == 1
    seen = []
    for seed in KILL_SEEDS:
        base = tmp_path / f"seed-{seed}"
        base.mkdir()
        victim_step, fraction = seeded_moment(seed)
        port = free_port()
        rank0 = _start(base, port)
        try:
            died = kill_during_a_save(rank0, victim_step, fraction + 0.5 * (seed % 2))
            assert rank0.wait(timeout=10) == -signal.SIGKILL
        finally:
            if rank0.poll() is None:
                os.killpg(rank0.pid, signal.SIGKILL)
            rank0.communicate()
        where = _where(base)
        # kill_during_a_save read rank 0's lines: "in save N" ends with "saving N"
        last = int(died.split()[-1])
        step, tiers = _after_the_kill(base, last - died.startswith("in"), last, seed)
        seen.append(f"seed {seed}: killed {died} ({where}); restored {step} {tiers}")
    print("\n".join(seen))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", DIE_AT)
def test_a_kill_in_each_narrow_window_of_a_local_write_or_a_replication(
    tmp_path: Path, point: str
) -> None:
    """Both ranks killed at an exact point (``tiers_setup.DIE_AT``) of a seeded step."""
    die_step = random.Random(point).randint(3, 5)
    proc = _start(tmp_path, free_port(), f"{point}:{die_step}")
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "rank0.err").read_text()[-2000:]
    where = _where(tmp_path)
    if point == "write":
        assert f"own write {die_step:03d}/0" in where
    elif point == "receive":
        assert f"replica receipt {die_step:03d}/0" in where
    step, tiers = _after_the_kill(tmp_path, _last("saved", out), _last("saving", out), point)
    if point == "write":  # rank 0 never finished its own checkpoint of the step
        assert step == die_step - 1
    else:  # the replication of a step runs beside the next step's local write
        assert step in (die_step, die_step + 1)
    assert tiers == ["local", "local"]
    print(f"{point} of step {die_step}: {where}; restored {step} {tiers}")


# ------------------------------------------------ restarts, retention and fallbacks


def valued(step: float) -> dict[str, Any]:
    """A small model holding its seeded weights plus ``step``: a checkpoint of a step
    holds exactly these values."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(step)
    return {"model": model}


def holds(state: dict[str, Any], step: int) -> bool:
    expected = valued(step)["model"].state_dict()
    return all(torch.equal(v, expected[k]) for k, v in state["model"].state_dict().items())


def _fail_own_write_of(failing_step: int) -> None:
    """This process's local write of ``failing_step`` fails as on a full disk."""
    write = rank_checkpoint.write_uncommitted

    def failing(storage: Any, items: Any, **options: Any) -> Any:
        if options["step"] == failing_step:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return write(storage, items, **options)

    rank_checkpoint.write_uncommitted = failing


def session(
    rank: int,
    world: int,
    base: str,
    saves: list[tuple[int, float]],
    options: dict[str, Any],
    fail: dict[int, int] | None = None,
    wait_each: bool = False,
) -> dict[str, Any]:
    """One run of 2 ranks as 2 nodes of 1: restore (what, from where, whether exactly
    its values), then save ``(step, value)``s locally (rank ``r``'s own write of step
    ``fail[r]`` fails; ``wait_each``: each save replicated before the next); the steps
    whose replication count is still in the job's store; every warning's text."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    if fail and rank in fail:
        _fail_own_write_of(fail[rank])
    kwargs = {"local_every": 1, "persist_every": None, "replicas": 1, "timeout": 30.0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = TieredCheckpointManager(
            os.path.join(base, "persistent"), local_dir(base, rank), **{**kwargs, **options}
        )
        try:
            state = valued(-1.0)
            manager.load_latest(state)
            restored = manager.restored
            step = restored.step if restored else None
            out = {
                "step": step,
                "tiers": restored.tiers if restored else None,
                "exact": step is not None and holds(state, step),
            }
            for at, value in saves:
                manager.save(at, valued(value))
                if wait_each:
                    with contextlib.suppress(shardsafe.CheckpointError):  # a local write's
                        manager.wait()
            with contextlib.suppress(shardsafe.CheckpointError):  # a local write's
                manager.wait()
            tally = manager._replicator.tally
            out["counted"] = [
                at
                for save, (at, _) in enumerate(saves, 1)
                for kind in ("", "w/")  # replicated, written
                if tally is not None and tally._store.check([f"{tally._prefix}/{kind}{at}/{save}"])
            ]
            # Rank 0 hosts the store: it must not exit before rank 1 has read it (a broken
            # pipe on rank 1, seen once on a loaded machine).
            torch.distributed.barrier()
        finally:
            manager.close()
    return {**out, "warnings": [str(w.message) for w in caught]}


def committed(base: str, node: int) -> dict[str, list[str]]:
    """``step-...: [rank-...]`` of the rank checkpoints with a manifest on a node."""
    root = Path(local_dir(base, node))
    return {
        s.name: found
        for s in sorted(root.iterdir())
        if (found := sorted(r.name for r in s.iterdir() if (r / "manifest.json").is_file()))
    }


def test_after_a_restart_retention_keeps_the_restored_step_until_a_newer_one_is_complete(
    tmp_path: Path,
) -> None:
    """keep_local=1. Run 1 saves steps 1-3; run 2 restores step 3 and saves step 4, but
    rank 1's write of it fails: step 4 is complete nowhere, so step 3 (restored by run 2,
    counted by no store of run 2's) must stay on both nodes, and run 3 restore it."""
    base, keep = str(tmp_path), {"keep_local": 1}
    run_ranks(session, 2, base, [(1, 1.0), (2, 2.0), (3, 3.0)], keep, timeout=60)
    second = run_ranks(session, 2, base, [(4, 4.0)], keep, {1: 4}, timeout=60)
    assert [(r["step"], r["exact"]) for r in second] == [(3, True)] * 2
    both = ["rank-00000", "rank-00001"]
    assert committed(base, 0) == {"step-000000003": both, "step-000000004": ["rank-00000"]}
    assert committed(base, 1) == {"step-000000003": both, "step-000000004": ["rank-00000"]}
    third = run_ranks(session, 2, base, [], keep, timeout=60)
    assert [(r["step"], r["tiers"], r["exact"]) for r in third] == [(3, ["local"] * 2, True)] * 2


def test_after_a_restart_retention_still_bounds_the_older_steps_found_on_disk(
    tmp_path: Path,
) -> None:
    """keep_local=2: run 2 restores step 3 of steps 2-3 and saves step 4; retention
    counts the steps it found, so step 2 goes as soon as step 4 is kept."""
    base, keep = str(tmp_path), {"keep_local": 2}
    run_ranks(session, 2, base, [(1, 1.0), (2, 2.0), (3, 3.0)], keep, timeout=60)
    both = ["rank-00000", "rank-00001"]
    assert committed(base, 0) == {"step-000000002": both, "step-000000003": both}
    second = run_ranks(session, 2, base, [(4, 4.0)], keep, timeout=60)
    assert [(r["step"], r["exact"]) for r in second] == [(3, True)] * 2
    for node in (0, 1):
        assert committed(base, node) == {"step-000000003": both, "step-000000004": both}


def test_a_step_saved_twice_counts_each_ranks_replication_once(tmp_path: Path) -> None:
    """keep_local=1: steps 1-2, then step 3 twice, rank 1's writes of step 3 failing. Rank 0
    replicates step 3 twice; counted twice it was taken for complete everywhere, and rank
    0 deleted its step 2 on node 0: losing node 1 then left no complete step. Step 2 is
    the newest complete one and must stay on both nodes."""
    base, keep = str(tmp_path), {"keep_local": 1}
    saves = [(1, 1.0), (2, 2.0), (3, 3.0), (3, 3.0)]
    run_ranks(session, 2, base, saves, keep, {1: 3}, True, timeout=60)
    both = ["rank-00000", "rank-00001"]
    for node in (0, 1):
        assert committed(base, node) == {"step-000000002": both, "step-000000003": ["rank-00000"]}


def _steps_differ(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank r saves step 3 + r first (refused), then step 1, then step 3 + r again."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    local = local_dir(base, rank)
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager = TieredCheckpointManager(
            os.path.join(base, "persistent"), local, persist_every=None, timeout=30.0
        )
        try:
            with pytest.raises(CheckpointError) as first:
                manager.save(3 + rank, valued(3))
            out["first"] = str(first.value)
            out["written"] = sorted(os.listdir(local)) if os.path.exists(local) else []
            manager.save(1, valued(1))
            manager.save(3 + rank, valued(3))
            with pytest.raises(CheckpointError) as later:
                manager.wait()
            out["later"] = str(later.value)
        finally:
            manager.close()
    return out


def test_ranks_saving_different_steps_are_refused_on_every_rank_naming_both(
    tmp_path: Path,
) -> None:
    """Rank 0 saves step 3 where rank 1 saves step 4. Before, replication failed without
    a word (each refused the other's manifest) and neither step was ever complete. The
    first local save is refused before anything is written; a later one, by replication
    (its transfers compare the steps), raised by wait() on both ranks."""
    base = str(tmp_path)
    first, second = run_ranks(_steps_differ, 2, base, timeout=60)
    refused = (
        "the ranks saved different steps: step 3 on rank 0 but step 4 on rank 1. "
        "TieredCheckpointManager.save/async_save is collective: pass the same step on every "
        "rank"
    )
    assert first["first"] == second["first"] == refused
    assert first["written"] == second["written"] == []
    for out, (rank, step, peer, theirs) in ((first, (0, 3, 1, 4)), (second, (1, 4, 0, 3))):
        assert out["later"] == (
            f"the ranks saved different steps: step {step} on rank {rank} but step {theirs} on "
            f"rank {peer} (at the same local save). TieredCheckpointManager.save/async_save "
            "is collective: pass the same step on every rank. Neither step is complete, and "
            f"from here on rank {rank} does not replicate its local checkpoints"
        )
    both = ["rank-00000", "rank-00001"]
    assert committed(base, 0) == {"step-000000001": both, "step-000000003": ["rank-00000"]}
    assert committed(base, 1) == {"step-000000001": both, "step-000000004": ["rank-00001"]}


def test_the_job_store_holds_the_replication_counts_of_the_kept_steps_only(
    tmp_path: Path,
) -> None:
    """keep_local=1, steps 1-6. Before, each step left its count in the job's store (the
    torchrun agent's) for the rest of the job: one key per step saved. Those of the
    steps retention deleted are deleted too."""
    saves = [(step, float(step)) for step in range(1, 7)]
    for out in run_ranks(session, 2, str(tmp_path), saves, {"keep_local": 1}, timeout=60):
        assert set(out["counted"]) <= {5, 6}


FALLBACKS = {
    # steps saved (local every 40th, persistent every 50th; then persistent 100, damaged),
    # the local step damaged on rank 1, what is restored
    "a complete local step": ([80], None, (80, "local")),
    "a damaged local step": ([50, 80], 80, (50, "persistent")),
    "a damaged and an older local step": ([40, 50, 80], 80, (50, "persistent")),
}


def fallback_setup(rank: int, world: int, base: str, steps: list[int]) -> None:
    """Local steps ``steps`` (and persistent 50, if among them), then persistent 100."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    manager = TieredCheckpointManager(
        os.path.join(base, "persistent"),
        local_dir(base, rank),
        local_every=40,
        persist_every=50,
        replicas=0,
        keep_local=len(steps),
        timeout=30.0,
    )
    try:
        for step in steps:
            manager.save(step, valued(step))
        manager.persistent.save(100, valued(100))
        manager.wait()
    finally:
        manager.close()


def flip_first_data_file(directory: Path) -> None:
    data = sorted(directory.glob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("case", FALLBACKS)
def test_a_damaged_newest_persistent_step_falls_back_to_the_newest_complete_one(
    tmp_path: Path, case: str
) -> None:
    """The persistent tier's newest step (100, newer than every local one) is damaged:
    ``load_latest`` restores the newest step that does load, in either tier, exactly;
    never raising, never an older local step below a persistent step that loaded."""
    saved, damaged_local, (step, tier) = FALLBACKS[case]
    base = str(tmp_path)
    run_ranks(fallback_setup, 2, base, saved, timeout=60)
    flip_first_data_file(tmp_path / "persistent" / "step-000000100")
    if damaged_local is not None:
        flip_first_data_file(rank_ckpt(base, 1, damaged_local, 1))
    restored = run_ranks(session, 2, base, [], {"replicas": 0, "persist_every": 50}, timeout=60)
    assert [(r["step"], r["tiers"], r["exact"]) for r in restored] == [(step, [tier] * 2, True)] * 2
    assert any("step-000000100" in w for w in restored[0]["warnings"])
    for node in (0, 1):  # later local steps (of a run that no longer exists) are gone
        kept = [s for s in saved if s % 40 == 0 and s <= step]
        assert sorted(committed(base, node)) == [f"step-{s:09d}" for s in kept]
    assert (tmp_path / "persistent" / "step-000000100").is_dir()  # left for the user


def test_a_stale_copy_that_cannot_be_deleted_is_never_restored(tmp_path: Path) -> None:
    """Run 1 saves steps 1-5; step 5 is incomplete (rank 0's copies gone, as after a
    kill), and rank 1's own copy of it holds a file of the user's, so it cannot be
    deleted. Run 2 restores step 4 and saves a new step 5: the old copy must lose its
    manifest (the user's file kept), so that run 3 never mixes the two runs' step 5."""
    base, keep = str(tmp_path), {"keep_local": 2}
    run_ranks(session, 2, base, [(s, float(s)) for s in range(1, 6)], keep, timeout=60)
    for node in (0, 1):
        shutil.rmtree(rank_ckpt(base, node, 5, 0))
    stale = rank_ckpt(base, 1, 5, 1)
    (stale / "notes.txt").write_text("mine")
    second = run_ranks(session, 2, base, [(5, 500.0)], keep, timeout=60)
    assert [(r["step"], r["exact"]) for r in second] == [(4, True)] * 2
    assert any(
        w.startswith(f"shardsafe: removed the manifest of {stale} ") for w in second[1]["warnings"]
    ), second[1]["warnings"]
    assert not (stale / "manifest.json").exists()
    assert (stale / "notes.txt").read_text() == "mine"
    third = run_ranks(session, 2, base, [], keep, timeout=60)
    assert [(r["step"], r["tiers"], r["exact"]) for r in third] == [(4, ["local"] * 2, True)] * 2


def _one_node_fails(rank: int, world: int, base: str, case: str) -> tuple[str, str]:
    """Each rank a node of its own; node 1's local path is a file, or rank 1's first
    local save holds a value shardsafe refuses (a plain object)."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    warnings.simplefilter("ignore")
    manager = TieredCheckpointManager(
        os.path.join(base, "persistent"), local_dir(base, rank), replicas=1, timeout=30
    )
    model, opt = build()
    state: dict[str, Any] = {"model": model, "optimizer": opt}
    if case == "staging" and rank == 1:
        state["sampler"] = object()
    try:
        if case == "restore":
            manager.load_latest(state)
        else:
            manager.save(1, state)
        outcome = ("ok", "")
    except Exception as e:  # what each rank raised, compared by the test
        outcome = (type(e).__name__, str(e))
    finally:
        manager.close()
    return outcome


@pytest.mark.parametrize("case", ["restore", "save", "staging"])
def test_one_nodes_local_failure_is_the_same_error_on_every_rank_at_once(
    tmp_path: Path, case: str
) -> None:
    """Before, the failing rank raised alone (a raw FileExistsError for the path) and the
    other waited in the next exchange for the whole timeout, then blamed it for never
    arriving."""
    base = str(tmp_path)
    if case != "staging":
        Path(local_dir(base, 1)).parent.mkdir(parents=True, exist_ok=True)
        Path(local_dir(base, 1)).write_text("not a directory")
    (kind0, said0), (kind1, said1) = run_ranks(_one_node_fails, 2, base, case, timeout=100)
    assert "never arrived" not in said0  # the other rank's old error, after the timeout
    assert kind0 == kind1 == "CheckpointError", (said0, said1)
    assert said0 == said1
    if case == "staging":
        assert said0.startswith(
            "tiers failed on rank 1: state['sampler'] is a object, which shardsafe does not know"
        )
    else:
        assert said0.startswith(
            f"tiers failed on rank 1: the local tier's directory {local_dir(base, 1)} cannot "
            f"be made or opened: {local_dir(base, 1)} is a regular file, not a directory. "
            "Give each node a local path it can write"
        )


def _settings_differ(rank: int, world: int, base: str, differ: dict[str, Any]) -> tuple[str, str]:
    """Each rank a node of its own; rank 1 passes ``differ`` on top of rank 0's settings,
    then both save 3 steps."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    warnings.simplefilter("ignore")
    options: dict[str, Any] = {"local_every": 1, "persist_every": None, "timeout": 15}
    try:
        manager = TieredCheckpointManager(
            os.path.join(base, "persistent"),
            local_dir(base, rank),
            **{**options, **(differ if rank == 1 else {})},
        )
        try:
            state = {"model": torch.nn.Linear(4, 4)}
            for step in (1, 2, 3):
                manager.save(step, state)
            manager.wait()
        finally:
            manager.close()
        return ("ok", "")
    except Exception as e:  # what each rank raised, compared by the test
        return (type(e).__name__, str(e))


@pytest.mark.parametrize(
    ("field", "value"), [("local_every", 2), ("persist_every", 2), ("keep_local", 3)]
)
def test_settings_that_differ_between_ranks_are_refused_on_every_rank(
    tmp_path: Path, field: str, value: int
) -> None:
    """Before, local_every=2 on rank 1 only paired rank 0's replication of step 1 with rank
    1's of step 2: rank 1 returned as if all was well, and rank 0 raised a gloo 'Connection
    reset by peer' from wait()."""
    first = {"local_every": 1, "persist_every": None, "keep_local": 2}[field]
    outcomes = run_ranks(_settings_differ, 2, str(tmp_path), {field: value}, timeout=100)
    said = (
        f"TieredCheckpointManager's settings differ between ranks: {field}={first!r} on "
        f"rank 0 but {field}={value!r} on rank 1; pass the same {field} on every rank"
    )
    assert outcomes == [("CheckpointError", said)] * 2
    assert not any(Path(local_dir(str(tmp_path), node)).exists() for node in (0, 1))


@pytest.mark.parametrize(
    ("field", "said"),
    [
        (
            "keep_local",
            (
                "CheckpointError",
                "TieredCheckpointManager's settings differ between ranks: keep_local=2 on rank "
                "0 but keep_local=0 on rank 1; pass the same keep_local on every rank",
            ),
        ),
        (
            "keep_last",
            (
                "ValueError",
                "rank 1: keep_last=0 must be an int, at least 1 (or None to keep all); pass valid "
                "settings on every rank",
            ),
        ),
        (
            "keep_last=True",  # an int to isinstance: refused by CheckpointManager alone
            (
                "ValueError",
                "rank 1: keep_last=True must be an int, at least 1 (or None to keep all); pass "
                "valid settings on every rank",
            ),
        ),
    ],
)
def test_a_setting_invalid_on_one_rank_only_is_refused_on_every_rank_at_once(
    tmp_path: Path, field: str, said: tuple[str, str]
) -> None:
    """Before, rank 1 raised its ValueError alone, before the ranks' first exchange, and
    rank 0 waited for it there until the timeout, then said that rank 1 never called."""
    name, _, value = field.partition("=")
    given = {name: True if value == "True" else 0}
    outcomes = run_ranks(_settings_differ, 2, str(tmp_path), given, timeout=100)
    assert outcomes == [said] * 2
    assert not any(Path(local_dir(str(tmp_path), node)).exists() for node in (0, 1))


def _arguments_differ(rank: int, world: int, base: str, case: str) -> tuple[str, str]:
    """Each rank a node of its own; rank 1 passes an argument that only it refuses."""
    os.environ["SHARDSAFE_NODE"] = str(rank)
    warnings.simplefilter("ignore")
    persistent, local = os.path.join(base, "persistent"), local_dir(base, rank)
    options: dict[str, Any] = {"persist_every": None, "timeout": 15}
    if rank == 1:
        if case == "local":
            local = None  # type: ignore[assignment]
        elif case == "collapsed":
            local = "s3:/bucket/local"
        elif case == "timeout":
            options["timeout"] = -1
        else:
            options["storage_options"] = {"anon": True}
    try:
        TieredCheckpointManager(persistent, local, **options).close()
        return ("ok", "")
    except Exception as e:  # what each rank raised, compared by the test
        return (type(e).__name__, str(e))


@pytest.mark.parametrize(
    ("case", "refused"),
    [
        ("timeout", "timeout=-1 must be a positive number of seconds"),
        ("local", "local=None must be a path (a str or os.PathLike)"),
        (
            "collapsed",
            "local='s3:/bucket/local': 's3:/bucket/local' looks like a s3:// URL whose '//' "
            "became '/', which pathlib.Path does to a URL (str(Path('s3://bucket/run')) is "
            "'s3:/bucket/run'); pass the URL as a str (a local directory of that name: "
            "write ./s3:/bucket/local)",
        ),
        (
            "storage_options",
            "storage_options were given for '{base}/persistent', which is a local path; they "
            "apply to object-store URLs (s3://..., gs://...) only",
        ),
    ],
)
def test_an_argument_refused_on_one_rank_only_is_refused_on_every_rank_at_once(
    tmp_path: Path, case: str, refused: str
) -> None:
    """Before, rank 1 raised alone, before the ranks' first exchange, and rank 0 waited
    for it there until the timeout, then said that rank 1 never arrived."""
    outcomes = run_ranks(_arguments_differ, 2, str(tmp_path), case, timeout=100)
    said = f"rank 1: {refused.format(base=tmp_path)}; pass valid settings on every rank"
    assert outcomes == [("ValueError", said)] * 2
    assert not any(Path(local_dir(str(tmp_path), node)).exists() for node in (0, 1))


def _mates_apart(rank: int, world: int, base: str) -> tuple[str, str]:
    """4 ranks as 2 nodes of 2, each rank given a local directory of its own."""
    os.environ["SHARDSAFE_NODE"] = f"node{rank // 2}"
    warnings.simplefilter("ignore")
    try:
        TieredCheckpointManager(
            os.path.join(base, "persistent"), os.path.join(base, f"local-rank{rank}"), timeout=15
        ).close()
        return ("ok", "")
    except Exception as e:
        return (type(e).__name__, str(e))


def test_ranks_of_one_node_given_different_local_directories_are_refused(tmp_path: Path) -> None:
    """Each rank looks for its node-mates' files under its own directory: given one each,
    their saves failed at every step (a part file 'gone since it reported it'), or a lost
    node's replicas, intact on the other node, were never found."""
    outcomes = run_ranks(_mates_apart, 4, str(tmp_path), timeout=100)
    said = (
        f"ranks 0 and 1 run on the same node (node:node0) but were given different local "
        f"directories ({tmp_path}/local-rank0 and {tmp_path}/local-rank1); the ranks of a "
        "node share one (each writes its own rank-<r> directory in it): give them the same path"
    )
    assert outcomes == [("ValueError", said)] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _nodes_together(rank: int, world: int, base: str, spelling: str) -> tuple[str, str]:
    """2 ranks as 2 nodes given one local directory: node 1 spells it as node 0 does, or
    through a symlink to ``base``."""
    os.environ["SHARDSAFE_NODE"] = f"node{rank}"
    warnings.simplefilter("ignore")
    through = base if rank == 0 or spelling == "same path" else os.path.join(base, "link")
    try:
        TieredCheckpointManager(
            os.path.join(base, "persistent"), os.path.join(through, "local"), timeout=15
        ).close()
        return ("ok", "")
    except Exception as e:
        return (type(e).__name__, str(e))


@pytest.mark.parametrize("spelling", ["same path", "through a symlink"])
def test_two_nodes_given_one_local_directory_are_refused(tmp_path: Path, spelling: str) -> None:
    """Two torchrun agents on one host given the same ``local=``: each node's ranks took
    the other's checkpoints for replicas they had received and deleted them, and the
    tier was empty after every save, with nothing said but that a replica "arrived
    damaged" (found in review). Refused when the manager is made, on every rank."""
    (tmp_path / "link").symlink_to(tmp_path)
    outcomes = run_ranks(_nodes_together, 2, str(tmp_path), spelling, timeout=100)
    said = (
        f"ranks 0 and 1 run on different nodes (node:node0 and node:node1) but were given "
        f"the same local directory ({tmp_path}/local): each node's local tier must be its "
        "own (node-local storage: a tmpfs or a local disk), or the nodes delete each "
        "other's checkpoints; give each node another path"
    )
    assert outcomes == [("ValueError", said)] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


MANY = 12
"""Steps saved by :func:`_many_damaged_replicas_then_restore`: more damaged copies (10)
than the 3 x world size + 3 passes that ``load_latest`` used to try before giving up."""


def _many_damaged_replicas_then_restore(rank: int, world: int, base: str) -> dict[str, Any]:
    """2 ranks as 2 nodes save steps 0..11 (all kept locally; step 0 persisted). Node 0
    is then lost, and node 1's replicas of rank 0's steps 2..11 each have a flipped
    byte. What a fresh manager's ``load_latest`` restores."""
    os.environ["SHARDSAFE_NODE"] = str(rank)

    def manager() -> TieredCheckpointManager:
        return TieredCheckpointManager(
            os.path.join(base, "persistent"),
            local_dir(base, rank),
            persist_every=1000,
            keep_local=MANY,
            timeout=30,
        )

    model = torch.nn.Linear(4, 4)
    with contextlib.closing(manager()) as saving:
        for step in range(MANY):
            with torch.no_grad():  # each rank's own from step 1 on; step 0 is persisted,
                model.weight.fill_(100 * step + rank if step else 0)  # where copies agree
            saving.save(step, {"model": model})
            saving.wait()
    torch.distributed.barrier()
    if rank == 1:
        shutil.rmtree(local_dir(base, 0))
        for step in range(2, MANY):
            flip_a_byte(Path(local_dir(base, 1)) / f"step-{step:09d}" / "rank-00000", "tensor data")
    torch.distributed.barrier()
    with torch.no_grad():
        model.weight.zero_()
    with warnings.catch_warnings(record=True), contextlib.closing(manager()) as resumed:
        resumed.load_latest({"model": model})
        restored = resumed.restored
    assert restored is not None
    return {
        "step": restored.step,
        "tiers": restored.tiers,
        "weight": model.weight.unique().tolist(),
    }


def test_every_damaged_copy_is_passed_over_however_many_before_an_older_complete_step(
    tmp_path: Path,
) -> None:
    """``load_latest`` tried at most 3 x world size + 3 sources (9 here), then raised "the
    local tiers kept failing; load from the persistent tier" on every rank, with step 1
    complete (rank 0's replica on node 1 intact) and step 0 in the persistent tier."""
    got = run_ranks(_many_damaged_replicas_then_restore, 2, str(tmp_path), timeout=100)
    assert got == [
        {"step": 1, "tiers": ["peer", "local"], "weight": [100.0]},
        {"step": 1, "tiers": ["peer", "local"], "weight": [101.0]},
    ]


def _spelled_per_node(rank: int, world: int, base: str, phase: str) -> str:
    """The Lightning local tier's manager (its persistent root under the local directory,
    agreed under a name of its own), on 2 nodes whose local directories differ."""
    from shardsafe.lightning.local_tier import NO_PERSISTENT

    os.environ["SHARDSAFE_NODE"] = str(rank)
    warnings.simplefilter("ignore")
    local = os.path.join(base, f"node{rank}-disk", "run")
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(4, 4)}
    manager = TieredCheckpointManager(
        os.path.join(local, NO_PERSISTENT), local, persist_every=None,
        name="lightning-local-tier", timeout=20,
    )  # fmt: skip
    try:
        if phase == "save":
            manager.save(1, state)
            manager.save(2, state)
            manager.wait()
            return "saved"
        manager.load_latest(state)
        return repr(
            None if manager.restored is None else (manager.restored.step, manager.restored.tiers)
        )
    finally:
        manager.close()


def test_nodes_that_spell_the_run_differently_resume_as_one_run(tmp_path: Path) -> None:
    """Each copy recorded its writer's persistent root: a replica from the other node
    carried that node's spelling, and the resume was refused as another run's."""
    assert run_ranks(_spelled_per_node, 2, str(tmp_path), "save", timeout=100) == ["saved"] * 2
    restored = run_ranks(_spelled_per_node, 2, str(tmp_path), "load", timeout=100)
    assert restored == ["(2, ['local', 'local'])"] * 2
