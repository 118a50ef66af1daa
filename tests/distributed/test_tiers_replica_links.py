"""Data-parallel replicas are linked, not sent, on real ranks: 2 ranks as 2 nodes of 1.

Each rank's checkpoint goes to the other node, whose rank holds the same large tensors
(data parallel): the replica's large-tensor file is a hard link to that rank's own file,
and only the manifest and the small file (here each rank's own RNG states) cross the
network. A lost node then restores from the linked replica bitwise. Ranks whose large
tensors differ get a received copy, never the other rank's bytes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from tests.distributed.tiers_setup import local_dir
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)

BULK, SMALL = "shard-00000-of-00001.safetensors", "small-00000-of-00001.safetensors"


def _state(rank: int, same: bool) -> dict[str, Any]:
    import shardsafe

    torch.manual_seed(0 if same else rank)
    model = torch.nn.Linear(600, 600)  # a 1.4 MiB weight: the large-tensor file
    torch.manual_seed(100 + rank)  # each rank's own RNG state (the small file)
    return {"model": model, "rng": shardsafe.RNGState()}


def _save_or_restore(rank: int, world: int, base: str, same: bool, restore: bool) -> Any:
    from shardsafe import TieredCheckpointManager

    os.environ["SHARDSAFE_NODE"] = str(rank)
    state = _state(rank, same)
    manager = TieredCheckpointManager(
        os.path.join(base, "persistent"), local_dir(base, rank), persist_every=None
    )
    try:
        if not restore:
            saved = [t.clone() for t in state["model"].state_dict().values()]
            rng = torch.get_rng_state()
            manager.save(1, state)
            manager.wait()
            return saved, rng, manager._replicator.record.received
        with torch.no_grad():
            for t in state["model"].state_dict().values():
                t.zero_()
        torch.manual_seed(12345)
        manager.load_latest(state)
        assert manager.restored is not None
        tensors = list(state["model"].state_dict().values())
        return tensors, torch.get_rng_state(), manager.restored.tiers
    finally:
        manager.close()


def _inode(base: str, node: int, rank: int, name: str) -> tuple[int, int]:
    found = os.stat(Path(local_dir(base, node)) / "step-000000001" / f"rank-{rank:05d}" / name)
    return found.st_ino, found.st_nlink


@pytest.mark.parametrize("same", [True, False], ids=["data-parallel", "rank-own-weights"])
def test_replicas_link_the_files_their_node_holds_and_a_lost_node_restores_bitwise(
    tmp_path: Path, same: bool
) -> None:
    base = str(tmp_path)
    saved = run_ranks(_save_or_restore, 2, base, same, False)
    for rank in range(2):
        assert saved[rank][2] == {1 - rank: [1]}  # each kept the other's replica
        node = 1 - rank  # rank's replica lives on the other node, beside that node's own
        replica, own = _inode(base, node, rank, BULK), _inode(base, node, node, BULK)
        if same:
            assert replica == own and own[1] == 2
        else:
            assert replica[0] != own[0] and replica[1] == own[1] == 1
        assert _inode(base, node, rank, SMALL)[0] != _inode(base, node, node, SMALL)[0]

    shutil.rmtree(local_dir(base, 0))  # node 0 lost: rank 0's checkpoint is its replica
    restored = run_ranks(_save_or_restore, 2, base, same, True)
    assert restored[0][2] == ["peer", "local"]
    for rank in range(2):
        tensors, rng, _ = restored[rank]
        assert all(torch.equal(a, b) for a, b in zip(tensors, saved[rank][0], strict=True))
        assert torch.equal(rng, saved[rank][1])  # its own RNG, not the other rank's


# ------------------------------------------------ the receiver's own file is not trusted


def _flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:  # in place, as bit rot (or a stray writer) would
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))


def _replicate_once(rank: int, world: int, base: str, case: str, trust: bool = False) -> Any:
    """Rank 0 sends its checkpoint of step 1; rank 1 receives it beside its own (damaged
    before the transfer, or swapped for another file right after it was compared).
    ``trust``: rank 1 names its own file's identity as it wrote it (``trusted``)."""
    import torch.distributed as dist

    from shardsafe.checkpoint.storage.local import LocalStorage
    from shardsafe.tiers import transfer

    root = Path(base)
    if rank == 0:
        if case == "unreadable":  # a link in its place: the sender sends zeros instead
            os.rename(root / "theirs" / BULK, root / "moved")
            os.symlink(root / "moved", root / "theirs" / BULK)
        return transfer.send(dist.group.WORLD, 1, LocalStorage(str(root / "theirs")), 1)
    found = os.stat(root / "own" / BULK)
    trusted = {BULK: (found.st_dev, found.st_ino)} if trust else None
    if case == "swapped":
        compared = transfer.loadable_manifest

        def compared_then_swapped(storage: Any) -> Any:
            manifest = compared(storage)
            os.unlink(root / "own" / BULK)
            os.link(root / "forged", root / "own" / BULK)  # same header, other data
            return manifest

        transfer.loadable_manifest = compared_then_swapped  # type: ignore[assignment]

    def target() -> LocalStorage:
        (root / "replica").mkdir()
        return LocalStorage(str(root / "replica"))

    why = transfer.receive(
        dist.group.WORLD,
        0,
        rank=0,
        step=1,
        target=target,
        held=None if case == "unreadable" else lambda: LocalStorage(str(root / "own")),
        trusted=trusted,
    )
    return why is None  # committed (else why not)


@pytest.mark.parametrize("case", ["damaged", "swapped", "unreadable", "intact"])
@pytest.mark.parametrize("trust", [False, True], ids=["", "trusted"])
def test_a_linked_file_is_checked_like_a_received_one_before_the_replica_commits(
    tmp_path: Path, case: str, trust: bool
) -> None:
    """``unreadable``: nothing linked, and the sender cannot read its file, so it sends
    zeros in its place; the receiver refuses them (it once looped forever on their
    zero-length header) and both return. ``trusted``: the receiver's own file is the
    inode it wrote (as the replicator records at each local write), so a link to it is
    not read again; a file swapped in is still refused. A byte flipped in place in that
    very inode then reaches the replica, which its checksums refuse at any load (as they
    do the damaged own checkpoint itself: the same inode)."""
    from shardsafe.checkpoint.plan.collecting import collect
    from shardsafe.checkpoint.storage.local import LocalStorage
    from shardsafe.tiers import rank_checkpoint

    for name, rank in (("theirs", 0), ("own", 1)):
        (tmp_path / name).mkdir()
        with LocalStorage(str(tmp_path / name)) as storage:
            items = collect(_state(0, same=True), 0, 1)
            rank_checkpoint.write(storage, items, rank=rank, world_size=2, step=1)
    if case == "damaged":
        _flip_last_byte(tmp_path / "own" / BULK)
    elif case == "swapped":
        shutil.copyfile(tmp_path / "own" / BULK, tmp_path / "forged")
        _flip_last_byte(tmp_path / "forged")
    sent, received = run_ranks(_replicate_once, 2, str(tmp_path), case, trust)
    committed = (tmp_path / "replica" / "manifest.json").exists()
    if case == "damaged" and trust:
        assert [sent, received, committed] == [True] * 3
        assert not shardsafe.verify(tmp_path / "replica").ok
        return
    assert [sent, received, committed] == [case == "intact"] * 3
    if case == "intact":
        assert _stat(tmp_path / "replica" / BULK) == _stat(tmp_path / "own" / BULK)
        replica = (tmp_path / "replica" / BULK).read_bytes()
        assert replica == (tmp_path / "theirs" / BULK).read_bytes()


def _stat(path: Path) -> tuple[int, int]:
    found = os.stat(path)
    return found.st_ino, found.st_nlink


def test_a_flipped_byte_in_a_shared_file_is_refused_and_the_other_nodes_copy_used(
    tmp_path: Path,
) -> None:
    """On node 1, rank 1's own large-tensor file is also rank 0's replica (one inode). One
    flipped byte in it: rank 1's load refuses its own copy and is sent its replica from
    node 0 (a link to rank 0's own file there, intact); rank 0 restores from its own node.
    Both come back bitwise, each with its own RNG state."""
    base = str(tmp_path)
    saved = run_ranks(_save_or_restore, 2, base, True, False)
    shared = Path(local_dir(base, 1)) / "step-000000001" / "rank-00001" / BULK
    assert shared.stat().st_nlink == 2
    with open(shared, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))
    restored = run_ranks(_save_or_restore, 2, base, True, True)
    assert restored[0][2] == ["local", "peer"]
    for rank in range(2):
        tensors, rng, _ = restored[rank]
        assert all(torch.equal(a, b) for a, b in zip(tensors, saved[rank][0], strict=True))
        assert torch.equal(rng, saved[rank][1])
