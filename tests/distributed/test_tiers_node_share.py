"""The ranks of one node write their shared data-parallel tensors once between them, on
real ranks: 4 ranks as 2 nodes of 2, each node with its own local directory.

From the first local save on (its split agreed in the space check's exchange), each
rank of a node stages and writes one part of the large replicated tensors (``part-<i>-of-2``)
and links its node-mate's part into its own rank checkpoint, which stays whole: a local
restore and a lost node's restore from replicas are bitwise. A node-mate whose write
fails leaves the step committed on neither rank of the node; tensors only some ranks of
a node hold are written by each of them."""

from __future__ import annotations

import datetime
import errno
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.tiers_setup import local_dir
from tests.harness import free_port, run_ranks

ROOT = str(Path(__file__).resolve().parents[2])

pytestmark = pytest.mark.timeout(240)

PARTS = ["part-00000-of-00002.safetensors", "part-00001-of-00002.safetensors"]


def _state(rank: int, extra: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(600, 600) for _ in range(4)])  # 1.4 MiB each
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optimizer": opt}
    if extra and rank == 1:  # large tensors only rank 1 of node 0 holds (another stage's)
        torch.manual_seed(1)
        state["stage"] = torch.nn.Linear(600, 600)
    return state


def _train(state: dict[str, Any], step: int) -> None:
    torch.manual_seed(step)  # the same on every rank: data parallel
    model, opt = state["model"], state["optimizer"]
    model(torch.randn(4, 600)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _live(state: dict[str, Any]) -> list[torch.Tensor]:
    found = list(state["model"].state_dict().values())
    if "stage" in state:
        found.extend(state["stage"].state_dict().values())
    for per_param in state["optimizer"].state.values():
        found.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return found


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    return [t.clone() for t in _live(state)]


def _session(
    rank: int,
    world: int,
    base: str,
    extra: bool,
    fail_rank1_at: int | None,
    restore: bool,
    no_links_on_node0: bool = False,
    fetch_fault: str | None = None,
) -> Any:
    from shardsafe import TieredCheckpointManager
    from shardsafe.tiers import rank_checkpoint

    os.environ["SHARDSAFE_NODE"] = str(rank // 2)
    _arm_fetch_fault(rank, fetch_fault)
    if no_links_on_node0 and rank // 2 == 0:  # a filesystem without hard links

        def refused(*args: Any, **kwargs: Any) -> None:
            raise OSError(errno.EPERM, "Operation not permitted (simulated)")

        os.link = refused
    if fail_rank1_at is not None and rank == 1:
        write = rank_checkpoint.write_uncommitted

        def failing(storage: Any, items: Any, **options: Any) -> Any:
            if options["step"] == fail_rank1_at:
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")
            written = write(storage, items, **options)
            if options["step"] == fail_rank1_at - 1:  # its own part gone once written
                os.unlink(PARTS[1], dir_fd=storage.fd)
            return written

        rank_checkpoint.write_uncommitted = failing
    state = _state(rank, extra)
    manager = TieredCheckpointManager(
        os.path.join(base, "persistent"),
        local_dir(base, rank // 2),
        persist_every=None,
        keep_local=4,
    )
    try:
        if restore:
            _train(state, 0)  # the optimizer's state exists, to be overwritten
            with torch.no_grad():
                for t in _live(state):
                    t.zero_()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                manager.load_latest(state)
            assert manager.restored is not None
            said = [str(w.message) for w in caught]
            return manager.restored.step, manager.restored.tiers, _tensors(state), said
        saved, staged = {}, []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in (1, 2, 3, 4):
                _train(state, step)
                saved[step] = _tensors(state)
                manager.async_save(step, state)
                manager._replicator.wait_written()
                staged.append(manager._stager.nbytes)
            errors = []
            try:
                manager.wait()
            except Exception as e:
                errors.append(str(e))
        full = sum(t.numel() * t.element_size() for t in _live(state))
        return saved, staged, [str(w.message) for w in caught], errors, full, manager.budget
    finally:
        manager.close()


def _arm_fetch_fault(rank: int, fault: str | None) -> None:
    """In a restore of node 1's ranks from replicas, once: ``"full"``, rank 3 cannot
    create the first part file it receives (its disk full), and a warning names what of
    that receipt is still on the disk when it receives the next step; ``"swapped"``, rank 3's
    received part file is replaced by a copy (another inode) just before rank 2 links it,
    and rank 3 links its own part from rank 2 only a moment later (rank 2 refused by then)."""
    from shardsafe.checkpoint.storage.local import LocalStorage
    from shardsafe.tiers.node_dir import NodeDir

    armed = [True]
    if fault == "full" and rank == 3:
        create = LocalStorage.create

        def full(self: LocalStorage, name: str, size_hint: int = 0) -> Any:
            if armed[0] and name.startswith("part-"):
                armed[0] = False
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")
            failed = Path(self.directory).parents[1] / "step-000000004" / "rank-00003"
            if not armed[0] and "step-000000004" not in self.directory and failed.exists():
                left = os.listdir(failed)
                warnings.warn(f"{left} left of step 4 take the room of step 3", stacklevel=2)
            return create(self, name, size_hint)

        LocalStorage.create = full  # type: ignore[method-assign]
    elif fault == "swapped" and rank == 2:
        link = NodeDir.link_reported

        def swapped(self: NodeDir, step: int, mate: int, name: str, *rest: Any, **kw: Any) -> Any:
            if armed[0]:
                armed[0] = False
                with self.rank_storage(step, mate, create=False) as theirs:
                    path = Path(theirs.where(name))
                shutil.copyfile(path, f"{path}.copy")
                os.replace(f"{path}.copy", path)
            return link(self, step, mate, name, *rest, **kw)

        NodeDir.link_reported = swapped  # type: ignore[method-assign]
    elif fault == "swapped" and rank == 3:
        late = NodeDir.link_reported

        def slow(self: NodeDir, *args: Any, **kw: Any) -> Any:
            if armed[0]:
                armed[0] = False
                time.sleep(0.5)
            return late(self, *args, **kw)

        NodeDir.link_reported = slow  # type: ignore[method-assign]


def _rank_dir(base: str, node: int, rank: int, step: int) -> Path:
    return Path(local_dir(base, node)) / f"step-{step:09d}" / f"rank-{rank:05d}"


def _restored_bitwise(restored: list[Any], saved: list[Any], step: int) -> None:
    for rank, (got_step, _, tensors, _) in enumerate(restored):
        assert got_step == step
        expected = saved[rank][0][step]
        assert len(tensors) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(tensors, expected))


def test_a_node_writes_its_shared_tensors_once_and_every_rank_restores_bitwise(
    tmp_path: Path,
) -> None:
    base = str(tmp_path)
    saved = run_ranks(_session, 4, base, False, None, False, timeout=200)
    staged, full = saved[0][1], saved[0][4]
    assert max(staged) < 0.6 * full  # from the first save on, half the large tensors staged
    # The space check counted each node's shared tensors once: about one rank's state.
    assert all(full <= n < 1.1 * full for n in saved[0][5].own_bytes), saved[0][5]
    for node in (0, 1):
        for step in (1, 4):  # the first save too: its split agreed before it staged
            files = sorted(os.listdir(_rank_dir(base, node, 2 * node, step)))
            assert set(PARTS) <= set(files)
            for part in PARTS:  # one inode, in both ranks' checkpoints (and the replicas)
                found = {os.stat(_rank_dir(base, node, r, step) / part).st_ino for r in range(4)}
                assert len(found) == 1
    assert all(not r[3] for r in saved), [r[3] for r in saved]
    restored = run_ranks(_session, 4, base, False, None, True, timeout=200)
    assert [r[1] for r in restored] == [["local"] * 4] * 4
    _restored_bitwise(restored, saved, 4)
    shutil.rmtree(local_dir(base, 1))  # node 1 lost: its ranks restore from replicas
    restored = run_ranks(_session, 4, base, False, None, True, timeout=200)
    assert restored[0][1] == ["local", "local", "peer", "peer"]
    _restored_bitwise(restored, saved, 4)
    # Each part was received once, by one of node 1's ranks, and linked by the other.
    for part in PARTS:
        inodes = {os.stat(_rank_dir(base, 1, rank, 4) / part).st_ino for rank in (2, 3)}
        assert len(inodes) == 1
    received = {(_rank_dir(base, 1, rank, 4) / p).stat().st_nlink for rank in (2, 3) for p in PARTS}
    assert received == {2}


@pytest.mark.parametrize("fault", ["full", "swapped"])
def test_a_lost_node_whose_shared_receipt_fails_restores_the_step_before_bitwise(
    tmp_path: Path, fault: str
) -> None:
    """Node 1 lost; its ranks receive each part once between them. ``full``: rank 3
    cannot store the part it receives for both, so neither rank's copy of step 4 is
    committed; ``swapped``: another file is in place of the part rank 3 received when
    rank 2 links it, and rank 2's copy of step 4 is refused, and only it: rank 3, which
    links its part from rank 2's copy a moment later, still finds it (rank 2 removed its
    copy before, and rank 3 passed over its own too). Either way step 4 is
    incomplete and step 3 is restored, every tensor bitwise, its parts again received
    once; nothing of step 4 (or of a later step) is left on node 1."""
    base = str(tmp_path)
    saved = run_ranks(_session, 4, base, False, None, False, timeout=200)
    shutil.rmtree(local_dir(base, 1))
    # What a restore before left of a step whose copies both ranks of the node removed
    # after they failed (their links refused): its empty directory.
    (Path(local_dir(base, 1)) / "step-000000005").mkdir(parents=True)
    restored = run_ranks(_session, 4, base, False, None, True, False, fault, timeout=200)
    assert restored[0][1] == ["local", "local", "peer", "peer"]
    _restored_bitwise(restored, saved, 3)
    for part in PARTS:
        inodes = {os.stat(_rank_dir(base, 1, rank, 3) / part).st_ino for rank in (2, 3)}
        assert len(inodes) == 1
    assert sorted(os.listdir(local_dir(base, 1))) == ["step-000000003"]
    said = [w for r in restored for w in r[3]]
    if fault == "swapped":  # rank 2 names the part it was to link from rank 3
        assert said in (
            [
                f"shardsafe: restoring step 4: {_rank_dir(base, 1, 3, 4) / part} is not the file "
                "rank 3 received for step 4 (another file, or a link, is in its place)"
            ]
            for part in PARTS
        )
    else:  # rank 3 says why its copy (and so rank 2's) of step 4 was passed over
        assert said == [
            "shardsafe: restoring step 4: rank 3's copy from rank 1 could not be written: "
            "[Errno 28] No space left on device (simulated)"
        ]


def test_a_node_mates_failed_write_leaves_the_step_on_neither_rank_of_the_node(
    tmp_path: Path,
) -> None:
    """Rank 1's write fails at step 3; at step 2 its own part file is gone once written.
    Each time the step is committed on neither rank of node 0, and step 4 is shared again:
    before, rank 1 then skipped step 2's exchange, rank 0 took its step 3 message for
    step 2's, and every later step failed on node 0 ("the ranks saved different steps");
    and the failed writes' files stayed on the node's disk until retention."""
    base = str(tmp_path)
    saved = run_ranks(_session, 4, base, False, 3, False, timeout=200)
    for step in (2, 3):  # nothing left of the failed writes (not even their own parts)
        assert sorted(os.listdir(Path(local_dir(base, 0)) / f"step-{step:09d}")) == [
            "rank-00002",  # the replica of node 1's rank 2
            "rank-00003",
        ]
    for rank in (0, 1):
        assert {"manifest.json", *PARTS} <= set(os.listdir(_rank_dir(base, 0, rank, 4)))
    assert not [w for r in saved for w in r[2] if "different steps" in w]
    said = [w for w in saved[0][2] if "could not write" in w]
    # Step 3's failure is step 2's again: said once (Replicator._warn), raised by wait().
    assert said == [
        "shardsafe: rank 0 could not write its local checkpoint of step 2: rank 1, on this "
        "node, has no part 1 of the node's shared tensors of step 2 (its write failed, or "
        "it held other tensors)"
    ]
    restored = run_ranks(_session, 4, base, False, None, True, timeout=200)
    _restored_bitwise(restored, saved, 4)


def test_tensors_only_some_ranks_of_a_node_hold_are_written_by_each_of_them(
    tmp_path: Path,
) -> None:
    base = str(tmp_path)
    saved = run_ranks(_session, 4, base, True, None, False, timeout=200)
    assert all(not r[3] for r in saved), [r[3] for r in saved]
    for rank in (0, 1):
        assert set(PARTS) <= set(os.listdir(_rank_dir(base, 0, rank, 4)))
    restored = run_ranks(_session, 4, base, True, None, True, timeout=200)
    _restored_bitwise(restored, saved, 4)


def test_a_node_whose_directory_cannot_hard_link_writes_everything_on_every_rank(
    tmp_path: Path,
) -> None:
    """Node 0's directory refuses hard links (probed at the first local save): its ranks
    never share and every step is committed there, whole; node 1's ranks share. Before
    the probe, every shared step failed on node 0, where the ranks cannot link. Lost and
    replaced by a node that cannot link either, node 0's ranks each receive their whole
    copy: planned to link each other's files, they failed every step, and restored
    nothing."""
    base = str(tmp_path)
    saved = run_ranks(_session, 4, base, False, None, False, True, timeout=200)
    assert all(not r[3] for r in saved) and not any(r[2] for r in saved), saved[0][2:]
    for step in (1, 2, 3, 4):
        for rank in (0, 1):
            files = os.listdir(_rank_dir(base, 0, rank, step))
            assert "manifest.json" in files and not set(PARTS) & set(files)
    assert set(PARTS) <= set(os.listdir(_rank_dir(base, 1, 2, 4)))
    assert not [n for n in os.listdir(local_dir(base, 0)) if n.startswith(".link-probe")]
    restored = run_ranks(_session, 4, base, False, None, True, timeout=200)
    _restored_bitwise(restored, saved, 4)
    # Node 0 lost, replaced by one that cannot hard-link either: its ranks receive their
    # copies whole, each file on each rank (none left for the other to link).
    shutil.rmtree(local_dir(base, 0))
    restored = run_ranks(_session, 4, base, False, None, True, True, timeout=200)
    assert restored[0][1] == ["peer", "peer", "local", "local"]
    _restored_bitwise(restored, saved, 4)
    for rank in (0, 1):
        files = list(_rank_dir(base, 0, rank, 4).iterdir())
        assert len(files) > 1 and all(f.stat().st_nlink == 1 for f in files)


def die_target() -> None:
    """``python -c '...; die_target()' RANK BASE PORT POINT``: 4 ranks as 2 nodes of 2 save
    steps 1, 2, 3, ... (each replicated before the next) until rank 1 SIGKILLs all four
    (their process group) in its write of step 3: ``part``, half-way through its part
    file; ``settled``, after its node's exchange (rank 0 may have linked its part and
    committed), before its own commit."""
    import torch.distributed as dist

    from shardsafe import TieredCheckpointManager
    from shardsafe.checkpoint.storage.files import LocalFileSink
    from shardsafe.tiers import node_share

    rank, base, port, point = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    os.environ["SHARDSAFE_NODE"] = str(rank // 2)
    if rank == 1 and point == "part":
        write = LocalFileSink.write
        mine = f"step-000000003{os.sep}rank-00001{os.sep}part-"

        def dying_write(self: LocalFileSink, data: memoryview) -> None:
            if mine in self.path and self.written >= 1 << 20:
                os.killpg(0, signal.SIGKILL)
            write(self, data)

        LocalFileSink.write = dying_write  # type: ignore[method-assign]
    elif rank == 1:
        settle = node_share.NodeShare.settle

        def dying_settle(self: Any, group: Any, step: int, *rest: Any) -> Any:
            linked = settle(self, group, step, *rest)
            if step == 3:
                os.killpg(0, signal.SIGKILL)
            return linked

        node_share.NodeShare.settle = dying_settle  # type: ignore[method-assign]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=4,
        timeout=datetime.timedelta(seconds=60),
    )
    state = _state(rank, False)
    manager = TieredCheckpointManager(
        os.path.join(base, "persistent"), local_dir(base, rank // 2), persist_every=None
    )
    for step in range(1, 10):
        _train(state, step)
        manager.async_save(step, state)
        manager.wait()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", ["part", "settled"])
def test_a_rank_killed_in_its_shared_write_leaves_the_previous_step_restorable_bitwise(
    tmp_path: Path, point: str
) -> None:
    """Every rank SIGKILLed while rank 1 writes its part of step 3 (or has exchanged it,
    its node-mate perhaps committed with a link to it): step 3 is complete on no node-0
    rank pair, so the restart restores step 2, every tensor bitwise."""
    base = str(tmp_path)
    code = "from tests.distributed.test_tiers_node_share import die_target; die_target()"
    command = [shlex.quote(sys.executable), "-c", shlex.quote(code)]
    port = free_port()

    def rank(r: int) -> str:
        args = " ".join(shlex.quote(a) for a in [str(r), base, str(port), point])
        return f"{' '.join(command)} {args} 2>{base}/rank{r}.err"

    script = " & ".join(rank(r) for r in (1, 2, 3)) + f" & exec {rank(0)}"
    proc = subprocess.Popen(["sh", "-c", script], cwd=ROOT, start_new_session=True)
    try:
        assert proc.wait(timeout=90) == -signal.SIGKILL, Path(f"{base}/rank1.err").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rank1 = _rank_dir(base, 0, 1, 3)
    assert rank1.is_dir() and not (rank1 / "manifest.json").exists()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks trained: a matmul's bits depend on its threads
    try:
        expected = _state(0, False)
        for step in (1, 2):
            _train(expected, step)
    finally:
        torch.set_num_threads(threads)
    restored = run_ranks(_session, 4, base, False, None, True, timeout=100)
    for got_step, _, tensors, _ in restored:
        assert got_step == 2
        assert all(torch.equal(a, b) for a, b in zip(tensors, _tensors(expected), strict=True))
