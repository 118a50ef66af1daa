"""An error on one rank during save or load: every rank raises, quickly, the same error.

Two real gloo ranks. One rank fails in a chosen way (its ``state_dict()`` raises, its
storage raises ``OSError``, its disk fills up, its live objects do not match, its
``load_state_dict`` raises); the test checks that

* every rank raises a ``CheckpointError`` naming the failing rank and its message, of the
  same class and with the same text on every rank;
* every rank raises within 10 s of the fault (measured with ``time.monotonic()``, which is
  one clock for all processes of a host; the fault records when it fired);
* nothing becomes visible: the step directory has no ``manifest.json``, the previous
  checkpoint is still ``latest()`` and loads, and the next save of all ranks works.

And the collective rule: ``save`` called by one rank only raises on that rank after
``entry_timeout`` seconds, naming the ranks that never arrived, and writes nothing.
"""

from __future__ import annotations

import errno
import inspect
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import shardsafe
from shardsafe import CheckpointError, CheckpointManager
from shardsafe.checkpoint.io.reader import CheckpointReader
from shardsafe.checkpoint.loading import read_manifest
from shardsafe.checkpoint.options import SaveHooks, SaveOptions
from shardsafe.checkpoint.storage.files import LocalFileSink, create_new
from shardsafe.checkpoint.storage.local import LocalStorage
from tests.harness import run_ranks

AGREEMENT_S = 10.0
FAULT: dict[str, Any] = {}
"""This process's armed fault (each rank is its own process): kind, rank, when it fired."""


def fired() -> None:
    FAULT.setdefault("at", time.monotonic())


class Flaky:
    """A stateful object (say, a data loader) that raises on the armed rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.value = 0

    def state_dict(self) -> dict[str, Any]:
        if FAULT.get("kind") == "state_dict" and FAULT["rank"] == self.rank:
            fired()
            raise RuntimeError(f"the data loader on rank {self.rank} lost its shard list")
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if FAULT.get("kind") == "load_state_dict" and FAULT["rank"] == self.rank:
            fired()
            raise RuntimeError(f"the data loader on rank {self.rank} cannot seek")
        self.value = sd["value"]


class _FaultySink(LocalFileSink):
    def write(self, data: memoryview) -> None:
        if dist.get_rank() != FAULT.get("rank"):
            super().write(data)
            return
        if FAULT["kind"] == "eio":
            fired()
            raise OSError(errno.EIO, os.strerror(errno.EIO), self.path)
        # A filling disk: whatever still fits is written, then ENOSPC.
        room = max(FAULT["disk_bytes"] - FAULT.setdefault("written", 0), 0)
        view = data.cast("B") if data.format != "B" else data
        if view.nbytes > room:
            super().write(view[:room])
            FAULT["written"] += room
            fired()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        super().write(view)
        FAULT["written"] += view.nbytes


class FaultyStorage(LocalStorage):
    """The storage seam of ``save``: data files written through failing sinks."""

    def create(self, name: str, size_hint: int = 0) -> LocalFileSink:
        return _FaultySink(create_new(self.fd, name), self.where(name))


def make_state(rank: int, seed: int = 0) -> dict[str, Any]:
    """A replicated model and a ZeRO optimizer (each rank holds its own part of the
    optimizer state: 4 MiB in all, so a consolidated save moves rank 1's part to rank 0
    in several messages), plus the flaky object and a plain value."""
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(2)))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01 * (seed + 1))
    opt.step()
    return {"model": model, "optimizer": opt, "loader": Flaky(rank), "step": seed}


def weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


def outcome(call: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        call()
    except CheckpointError as e:
        error: tuple[str, str] | None = (type(e).__name__, str(e))
    else:
        error = None
    return {"error": error, "start": start, "raised": time.monotonic(), "fault": FAULT.get("at")}


# ------------------------------------------------------------------------------ save


def save_with_fault(
    rank: int, world_size: int, root: str, layout: str, fault: dict[str, Any]
) -> dict[str, Any]:
    manager = CheckpointManager(root, keep_last=3)
    state = make_state(rank, seed=1)
    manager.save(1, state, layout=layout)
    saved = weights(state)
    fds = len(os.listdir("/proc/self/fd"))
    FAULT.update(fault)
    result = outcome(
        lambda: manager.save(2, state, layout=layout, storage=FaultyStorage, buffer_bytes=1 << 20)
    )
    FAULT.clear()
    result["leaked_fds"] = len(os.listdir("/proc/self/fd")) - fds
    dist.barrier()  # every rank has cleaned up after the failure
    result["step2_exists"] = os.path.exists(manager.path_for(2))
    # What every rank sees right after: the previous checkpoint is the latest and loads.
    result["latest"] = manager.latest()
    fresh = make_state(rank, seed=7)
    shardsafe.load(manager.latest() or "", fresh)
    result["reloaded"] = all(torch.equal(v, saved[k]) for k, v in weights(fresh).items())
    # And the ranks are not left out of step: the next save of all ranks works.
    manager.save(3, state, layout=layout)
    manager.close()
    return result


def check_agreed(results: list[dict[str, Any]], failing: int, fragments: list[str]) -> float:
    """Same error on every rank, naming ``failing`` and its message; return the latency."""
    errors = [r["error"] for r in results]
    assert all(e is not None for e in errors), errors
    assert errors[0] == errors[1], errors
    cls, msg = errors[0]
    assert cls == "CheckpointError", (cls, msg)  # a plain exception becomes the base class
    assert msg.startswith(f"save failed on rank {failing}: ") or msg.startswith(
        f"load failed on rank {failing}: "
    ), msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    fault_at = results[failing]["fault"]
    assert fault_at is not None, "the fault never fired"
    latency = max(r["raised"] for r in results) - fault_at
    assert 0 <= latency < AGREEMENT_S, f"ranks raised {latency:.1f}s after the fault"
    print(f"agreement latency {latency * 1000:.0f} ms")
    return latency


def check_nothing_committed(root: Path, results: list[dict[str, Any]]) -> None:
    for r in results:
        assert not r["step2_exists"]  # the failed save removed what it had written
        assert r["leaked_fds"] == 0, "a file of the failed save was left open"
    for r in results:
        assert r["latest"] == str(root / "step-000000001")
        assert r["reloaded"]
    # The next save committed; nothing of the failed attempt is left.
    assert sorted(p.name for p in root.iterdir()) == [
        "latest",
        "step-000000001",
        "step-000000003",
    ]
    assert (root / "latest").read_text() == "step-000000003\n"
    with CheckpointReader(
        LocalStorage(str(root / "step-000000001")), read_manifest(root / "step-000000001")
    ) as reader:
        assert reader.verify_all() == []


FAULTS = {
    "state_dict raises": (
        {"kind": "state_dict", "rank": 1},
        1,
        ["RuntimeError: the data loader on rank 1 lost its shard list", "test_error_agreement.py"],
    ),
    "storage raises EIO": (
        {"kind": "eio", "rank": 1},
        1,
        ["OSError: [Errno 5] Input/output error", "shard-00001-of-00002.safetensors"],
    ),
    "disk full": (
        {"kind": "enospc", "rank": 1, "disk_bytes": 1 << 20},
        1,
        ["OSError: [Errno 28] No space left on device", "shard-00001-of-00002.safetensors"],
    ),
}
MODEL_FILE_BYTES = 2 * (512 * 512 + 512) * 4  # + a small header


@pytest.mark.timeout(90)
@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
@pytest.mark.parametrize("case", sorted(FAULTS))
def test_a_save_failing_on_one_rank_fails_on_every_rank(
    tmp_path: Path, case: str, layout: str
) -> None:
    fault, failing, fragments = FAULTS[case]
    if layout == "consolidated" and fault["kind"] != "state_dict":
        # Only rank 0 writes in this layout. Its disk fills up as the optimizer file
        # starts, before any of rank 1's part of the optimizer state has arrived: rank 0
        # must keep receiving (and dropping) it, or rank 1 would hang in its sends.
        fault, failing = dict(fault, rank=0, disk_bytes=MODEL_FILE_BYTES + 4096), 0
        victim = "model" if fault["kind"] == "eio" else "optimizer"
        fragments = [f.replace("shard-00001-of-00002", victim) for f in fragments]
    results = run_ranks(save_with_fault, 2, str(tmp_path), layout, fault, timeout=80)
    check_agreed(results, failing, fragments)
    check_nothing_committed(tmp_path, results)


# ------------------------------------------------------------------------------ load


def load_with_fault(rank: int, world_size: int, path: str, where: str) -> dict[str, Any]:
    state = make_state(rank, seed=1)
    shardsafe.save(path, state, layout="sharded")
    saved = weights(state)
    if where == "plan":  # rank 1's model does not fit the checkpoint
        width = 256 if rank == 1 else 512
        state = {"model": nn.Sequential(nn.Linear(512, 512), nn.Linear(512, width))}
    else:
        state = make_state(rank, seed=7)
    before = weights(state)
    if where == "plan" and rank == 1:
        FAULT["at"] = time.monotonic()  # the mismatch is found as the load starts
    FAULT.update(kind="load_state_dict" if where == "restore" else "", rank=1)
    result = outcome(lambda: shardsafe.load(path, state))
    FAULT.clear()
    now = weights(state)
    result["untouched"] = all(torch.equal(now[k], before[k]) for k in now)
    result["restored"] = saved.keys() == now.keys() and all(
        torch.equal(now[k], saved[k]) for k in now
    )
    return result


@pytest.mark.timeout(60)
def test_a_load_that_does_not_fit_one_rank_fails_on_every_rank_and_restores_nothing(
    tmp_path: Path,
) -> None:
    results = run_ranks(load_with_fault, 2, str(tmp_path / "ckpt"), "plan", timeout=50)
    errors = [r["error"] for r in results]
    assert errors[0] == errors[1] and errors[0] is not None, errors
    cls, msg = errors[0]
    assert cls == "CheckpointMismatchError", msg
    assert msg.startswith("load failed on rank 1: the checkpoint does not match"), msg
    assert "model/1.weight: checkpoint float32[512, 512], live float32[256, 512]" in msg
    latency = max(r["raised"] for r in results) - results[1]["fault"]
    assert latency < AGREEMENT_S
    print(f"agreement latency {latency * 1000:.0f} ms")
    assert all(r["untouched"] for r in results)  # rank 0 too: plans are agreed first


@pytest.mark.timeout(60)
def test_a_restore_failing_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    """The last phase of a load: every rank has read and verified its data, then puts it
    into its objects. A failure there (here a user object's ``load_state_dict``) is agreed
    like any other, but what other ranks (and earlier objects on the failing rank) have
    already restored stays restored: the README says so, and this pins it."""
    results = run_ranks(load_with_fault, 2, str(tmp_path / "ckpt"), "restore", timeout=50)
    check_agreed(results, 1, ["RuntimeError: the data loader on rank 1 cannot seek"])
    assert results[0]["restored"] and results[1]["restored"]  # the model came before it


# ------------------------------------------------------------- the collective rule


def save_on_one_rank(rank: int, world_size: int, root: str, caller: int, then: str) -> Any:
    manager = CheckpointManager(root, keep_last=3)
    state = make_state(rank)
    manager.save(1, state)
    result: dict[str, Any] = {}
    if rank == caller:  # the classic mistake: `if rank == 0: save(...)`
        result = outcome(lambda: manager.save(2, state, entry_timeout=3.0))
    if then == "barrier":
        dist.barrier()
        manager.save(3, state)  # a correct save afterwards works
    if then == "retry":
        dist.barrier()
        manager.save(2, state)  # the same call again, now on every rank
        loaded = make_state(rank, seed=7)  # other weights, so equality means it loaded
        shardsafe.load(manager.latest(), loaded)
        result["retried_equal"] = all(
            torch.equal(a, b)
            for a, b in zip(state["model"].parameters(), loaded["model"].parameters())
        )
    manager.close()
    return result


def save_elsewhere(rank: int, world_size: int, root: str) -> list[str]:
    """Both ranks save; then rank 0 alone saves again (rank 1 is behind); then each rank
    saves to a path of its own; then the manager saves a step of its own on each."""
    state = make_state(rank)
    messages = []
    shardsafe.save(os.path.join(root, "together"), state)
    if rank == 0:
        with pytest.raises(CheckpointError) as alone:
            shardsafe.save(os.path.join(root, "alone"), state, entry_timeout=1.0)
        messages.append(str(alone.value))
    dist.barrier()
    with pytest.raises(CheckpointError) as plain:
        shardsafe.save(os.path.join(root, f"from-rank-{rank}"), state, entry_timeout=1.0)
    messages.append(str(plain.value))
    dist.barrier()  # neither leaves before the other has read the store
    manager = CheckpointManager(os.path.join(root, "run"), keep_last=3)
    with pytest.raises(CheckpointError) as managed:
        manager.save(10 + rank, state, entry_timeout=1.0)
    messages.append(str(managed.value))
    dist.barrier()
    manager.close()
    return messages


@pytest.mark.timeout(60)
def test_ranks_saving_to_different_paths_are_told_where_the_others_went(tmp_path: Path) -> None:
    """Ranks passing different paths (or the manager different steps) were told only
    that the other rank "never arrived", as if it had not called at all; each is now
    told what the other entered instead, and a rank that is behind is told apart."""
    results = run_ranks(save_elsewhere, 2, str(tmp_path), timeout=50)
    together = os.path.join(str(tmp_path), "together")
    assert (
        "rank(s) 1 never arrived within entry_timeout=1s (this is rank 0 of 2). Rank 1 has "
        f"entered nothing since save of {together!r} (call 1), which this rank has passed: "
        "behind (slow, stuck or dead), or skipping this call. Call save on every rank"
    ) in results[0][0], results[0][0]
    for rank, (plain, managed) in enumerate(r[-2:] for r in results):
        other = 1 - rank
        assert f"rank(s) {other} never arrived within entry_timeout=1s" in plain, plain
        mine, theirs = (os.path.join(str(tmp_path), f"from-rank-{r}") for r in (rank, other))
        assert (
            f"Rank {other} last entered save of {theirs!r} (call 1), while this rank "
            f"entered save of {mine!r} (call 1). Call save on every rank"
        ) in plain, plain
        steps = [os.path.join(str(tmp_path), "run", f"step-{10 + r:09d}") for r in (rank, other)]
        assert f"Rank {other} last entered save of {steps[1]!r}" in managed, managed
        assert f"while this rank entered save of {steps[0]!r}" in managed, managed


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("caller", "then"), [(0, "barrier"), (0, "return"), (1, "barrier"), (0, "retry"), (1, "retry")]
)
def test_save_on_one_rank_only_raises_after_entry_timeout(
    tmp_path: Path, caller: int, then: str
) -> None:
    results = run_ranks(save_on_one_rank, 2, str(tmp_path), caller, then, timeout=50)
    r = results[caller]
    assert r["error"] is not None
    cls, msg = r["error"]
    other = 1 - caller
    assert cls == "CheckpointError"
    assert "shardsafe.save must be called on all ranks" in msg, msg
    assert f"rank(s) {other} never arrived within entry_timeout=3s" in msg, msg
    assert f"this is rank {caller} of 2" in msg
    elapsed = r["raised"] - r["start"]
    # Not before entry_timeout. That it was the entry's timeout that ended the wait, not
    # the operation's own or a hang, the message says (and the harness's 50 s ends a
    # hang): no upper bound on the clock, which a loaded CI machine can stretch.
    assert elapsed >= 3.0, elapsed
    print(f"raised after {elapsed:.2f}s")
    if then == "retry":
        # Retrying the very same save on every rank meets and commits: the rank that
        # timed out took its arrival back, so the ranks agree on which call this is.
        assert all(res["retried_equal"] for res in results)
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "latest",
            "step-000000001",
            "step-000000002",
        ]
        return
    assert results[other] == {}
    # Nothing was written for step 2; step 1 is intact.
    assert not (tmp_path / "step-000000002").exists()
    expected = ["latest", "step-000000001"] + (["step-000000003"] if then == "barrier" else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == expected
    step1 = tmp_path / "step-000000001"
    with CheckpointReader(LocalStorage(str(step1)), read_manifest(step1)) as reader:
        assert reader.verify_all() == []


def test_the_default_entry_timeout_is_60_seconds() -> None:
    for fn in (shardsafe.save, shardsafe.load):
        assert inspect.signature(fn).parameters["entry_timeout"].default == 60.0, fn
    # async_save and the manager take save's keywords, defaulted by SaveOptions.
    assert SaveOptions.of().entry_timeout == 60.0


def save_into_unusable_root(rank: int, world_size: int, root: str, background: bool) -> Any:
    """Save through a manager whose root cannot be made; report what this rank raised."""
    manager = CheckpointManager(root)
    start = time.monotonic()
    try:
        if background:
            manager.async_save(1, {"w": torch.ones(4)}, entry_timeout=5.0).wait()
        else:
            manager.save(1, {"w": torch.ones(4)}, entry_timeout=5.0)
        error = None
    except Exception as e:  # what the user sees, whatever its class
        error = (type(e).__name__, str(e))
    took = time.monotonic() - start
    dist.barrier()  # rank 0 stays up until both have raised (its process hosts the store)
    manager.close()
    return {"error": error, "took": took}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("background", [False, True], ids=["save", "async_save"])
@pytest.mark.parametrize("root", ["a file", "under a file", "a dangling link"])
def test_a_manager_root_that_cannot_be_made_fails_on_every_rank_alike(
    tmp_path: Path, root: str, background: bool
) -> None:
    """Rank 0 made the root before the entry barrier and raised the OSError there, alone:
    rank 1 waited at the barrier for entry_timeout and raised another error."""
    (tmp_path / "file").write_bytes(b"mine")
    os.symlink(tmp_path / "nowhere", tmp_path / "link")
    path = {"a file": "file", "under a file": "file/ckpt", "a dangling link": "link"}[root]
    results = run_ranks(save_into_unusable_root, 2, str(tmp_path / path), background, timeout=50)
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    cls, msg = errors[0]
    assert cls in ("CheckpointError", "CheckpointCorruptError"), errors
    assert "save failed on rank 0" in msg, msg
    assert all(r["took"] < AGREEMENT_S for r in results), results
    assert (tmp_path / "file").read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "link"]


def save_a_state_wrong_on_one_rank(rank: int, world_size: int, root: str, how: str) -> Any:
    """Rank 1 passes an empty state (a rank that owns nothing, say); rank 0 a good one."""
    state: dict[str, Any] = {"w": torch.ones(4)} if rank == 0 else {}
    manager = CheckpointManager(root)
    start = time.monotonic()
    try:
        if how.startswith("save"):
            shardsafe.save(os.path.join(root, "ckpt"), state, entry_timeout=30.0)
        elif how in ("async_save", "consolidated async_save"):
            layout = "consolidated" if how.startswith("consolidated") else "sharded"
            path = os.path.join(root, "ckpt")
            shardsafe.async_save(path, state, entry_timeout=30.0, layout=layout).wait()
        else:
            manager.save(1, state, entry_timeout=30.0)
        error = None
    except Exception as e:  # what the user sees, whatever its class
        error = (type(e).__name__, str(e))
    took = time.monotonic() - start
    dist.barrier()  # rank 0 stays up until both have raised (its process hosts the store)
    manager.close()
    return {"error": error, "took": took}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["save", "async_save", "consolidated async_save", "manager"])
def test_a_state_refused_on_one_rank_only_fails_every_rank_at_once(
    tmp_path: Path, how: str
) -> None:
    """The refused rank raised its ValueError before the entry barrier, alone: the other
    waited there for entry_timeout (30 s here) and then said rank 1 never called save.
    A first consolidated ``async_save`` makes its transfer group only once every rank has
    got through the collect phase: made at the call, rank 0 waited in ``new_group`` for
    rank 1, gone, until the process group's timeout."""
    results = run_ranks(save_a_state_wrong_on_one_rank, 2, str(tmp_path), how, timeout=50)
    refusal = (
        "state must be a non-empty dict of name -> value, e.g. "
        "{'model': model, 'optimizer': optimizer}"
    )
    assert results[1]["error"] == ("ValueError", refusal), results
    cls, msg = results[0]["error"]
    assert cls == "CheckpointError", results
    said = f"save failed on rank 1: ValueError: {refusal}"
    if how.endswith("async_save"):  # raised by wait(), which says which save it was
        said = f"the background save to {tmp_path / 'ckpt'} failed: {said}"
    assert msg.startswith(said), msg
    assert list(tmp_path.iterdir()) == [], sorted(p.name for p in tmp_path.iterdir())


def load_into_a_state_wrong_on_one_rank(rank: int, world_size: int, root: str) -> Any:
    """Rank 1 passes its tensor bare, not in a dict; rank 0 a dict."""
    path = os.path.join(root, "ckpt")
    shardsafe.save(path, {"w": torch.arange(4.0)})
    w = torch.zeros(4)
    start = time.monotonic()
    try:
        shardsafe.load(path, {"w": w} if rank == 0 else w, entry_timeout=30.0)  # type: ignore[arg-type]
        error = None
    except Exception as e:
        error = (type(e).__name__, str(e))
    took = time.monotonic() - start
    dist.barrier()
    return {"error": error, "took": took, "w": w.tolist()}


@pytest.mark.timeout(60)
def test_a_load_state_refused_on_one_rank_only_fails_every_rank_at_once(tmp_path: Path) -> None:
    results = run_ranks(load_into_a_state_wrong_on_one_rank, 2, str(tmp_path), timeout=50)
    refusal = "state must be a dict of name -> object to restore, not Tensor"
    assert results[1]["error"] == ("ValueError", refusal), results
    cls, msg = results[0]["error"]
    assert (cls, msg.startswith(f"load failed on rank 1: ValueError: {refusal}")) == (
        "CheckpointError",
        True,
    ), msg
    assert [r["w"] for r in results] == [[0.0] * 4] * 2  # nothing restored on either rank


def an_option_wrong_on_one_rank(rank: int, world_size: int, root: str, how: str) -> Any:
    """Rank 1 passes a value its options refuse; rank 0 good ones."""
    path = os.path.join(root, "ckpt")
    manager = shardsafe.CheckpointManager(path)
    if how.startswith("load"):
        manager.save(3, {"w": torch.arange(4.0)})
        path = manager.path_for(3)
    w = torch.zeros(4)
    bad: dict[str, Any] = {}
    if rank == 1:
        bad = {"read_threads": 0} if "load" in how else {"buffer_bytes": 1000}
        if how.endswith("misspelled"):
            bad = {"read_thread": 4}
    try:
        if how.startswith("save"):
            shardsafe.save(path, {"w": w}, entry_timeout=30.0, **bad)
        elif how == "async_save":
            shardsafe.async_save(path, {"w": w}, entry_timeout=30.0, **bad).wait()
        elif how in ("load", "load misspelled"):
            shardsafe.load(path, {"w": w}, entry_timeout=30.0, **bad)
        elif how == "manager.save":
            manager.save(4, {"w": w}, entry_timeout=30.0, **bad)
        elif how == "manager.async_save":
            manager.async_save(4, {"w": w}, entry_timeout=30.0, **bad).wait()
        else:
            manager.load_latest({"w": w}, entry_timeout=30.0, **bad)
        error = None
    except Exception as e:
        error = (type(e).__name__, str(e))
    dist.barrier()
    return {"error": error, "w": w.tolist()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "how",
    [
        "save",
        "save misspelled",
        "async_save",
        "load",
        "load misspelled",
        "manager.save",
        "manager.async_save",
        "load_latest",
        "load_latest misspelled",
    ],
)
def test_an_option_refused_on_one_rank_only_fails_every_rank_at_once(
    tmp_path: Path, how: str
) -> None:
    """Options were checked before the entry: rank 1 raised its ValueError alone, and rank
    0 waited there for entry_timeout (30 s here), then said rank 1 never called. So did
    the CheckpointManager's verbs after shardsafe.save's were mended (found in review). An
    option name misspelled on one rank (a TypeError) was still raised alone (found in
    review)."""
    results = run_ranks(an_option_wrong_on_one_rank, 2, str(tmp_path), how, timeout=50)
    refusal = (
        "read_threads=0 must be a number of threads from 1 to 64, or None for this rank's "
        "share of the CPUs"
        if "load" in how
        else "buffer_bytes=1000 is too small; use at least 1 MiB"
    )
    kind = "ValueError"
    if how.endswith("misspelled"):  # save and load: Python refused it, on rank 1 alone
        kind, refusal = (
            "TypeError",
            (
                "unknown load option(s) ['read_thread']; the options are ['buffer_bytes', "
                "'entry_timeout', 'read_threads', 'storage', 'storage_options', 'strict', "
                "'timeout', 'untrusted_bytes_limit', 'verify']"
                if "load" in how
                else "unknown save option(s) ['read_thread']; the options are ['buffer_bytes', "
                "'entry_timeout', 'hooks', 'layout', 'storage', 'storage_options', 'timeout', "
                "'verify_replicas']"
            ),
        )
    assert results[1]["error"] == (kind, refusal), results
    cls, msg = results[0]["error"]
    operation = "load" if "load" in how else "save"
    said = f"{operation} failed on rank 1: {kind}: {refusal}"
    if how.endswith("async_save"):
        to = f"to {tmp_path / 'ckpt'}"
        if how.startswith("manager"):
            to = f"of step 4 to {tmp_path / 'ckpt' / 'step-000000004'}"
        said = f"the background save {to} failed: {said}"
    assert (cls, msg.startswith(said)) == ("CheckpointError", True), msg
    assert [r["w"] for r in results] == [[0.0] * 4] * 2
    if how in ("save", "save misspelled", "async_save"):
        assert list(tmp_path.iterdir()) == []
    elif how.startswith("manager"):  # no step written (the root's lock may be taken)
        assert not [n for n in os.listdir(tmp_path / "ckpt") if n.startswith("step-")]


def save_with_options_that_differ(rank: int, world_size: int, root: str, name: str) -> Any:
    given = {"layout": "sharded" if rank == 0 else "consolidated"}
    if name == "verify_replicas":
        given = {"verify_replicas": rank == 1}
    try:
        shardsafe.save(os.path.join(root, "ckpt"), {"w": torch.ones(4)}, **given)
        error = None
    except Exception as e:
        error = (type(e).__name__, str(e))
    dist.barrier()
    return error


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["layout", "verify_replicas"])
def test_save_options_that_differ_between_ranks_are_refused_on_every_rank(
    tmp_path: Path, name: str
) -> None:
    """Rank 1's layout="consolidated" was ignored in silence beside rank 0's "sharded"
    (rank 0's plan decides), and so was one rank's verify_replicas=True."""
    errors = run_ranks(save_with_options_that_differ, 2, str(tmp_path), name, timeout=50)
    first, second = ("'sharded'", "'consolidated'") if name == "layout" else ("False", "True")
    said = (
        f"save failed on rank 0: the ranks passed different options: "
        f"{name}={first} on rank 0 but {name}={second} on rank 1; pass the same {name} on "
        "every rank (nothing was written)"
    )
    assert errors == [("CheckpointError", said)] * 2, errors
    assert list(tmp_path.iterdir()) in ([], [tmp_path / "ckpt"])
    assert not (tmp_path / "ckpt" / "manifest.json").exists()


def save_with_rank0_slower_than_the_timeout(rank: int, world_size: int, root: str) -> Any:
    hooks = SaveHooks(before_write=lambda: time.sleep(4.0))  # rank 0 only (e.g. a lock)
    path = os.path.join(root, "ckpt")
    return outcome(lambda: shardsafe.save(path, make_state(rank), timeout=2.0, hooks=hooks))


@pytest.mark.timeout(150)
def test_a_rank_that_timed_out_leaves_its_payload_for_a_slow_rank_0_to_read(
    tmp_path: Path,
) -> None:
    """Rank 1 timed out waiting for a slow rank 0 and deleted its payload of the phase on
    its way out; rank 0 then posted, found every rank posted, and blocked reading that
    payload until the store's timeout (120 s here, 30 min by default). It now reads it;
    and rank 1's verdict, posted as its failure of the later phases, is what rank 0
    raises as soon as it goes on (before, it waited a whole timeout of its own, and then
    blamed rank 1)."""
    results = run_ranks(save_with_rank0_slower_than_the_timeout, 2, str(tmp_path), timeout=140)
    said = (
        "rank(s) 0 did not finish the 'collect' phase of save within 2s (this is rank 1); "
        "they may have died or hung. The previous checkpoint is untouched."
    )
    assert results[1]["error"] == ("CheckpointError", said)
    assert results[0]["error"] == ("CheckpointError", f"save failed on rank 1: {said}")
    assert not (tmp_path / "ckpt" / "manifest.json").exists()


class _SlowFirstWriteOnRank0(LocalStorage):
    """Rank 0's first data file of a save takes 8 s to start (a slow disk)."""

    def create(self, name: str, size_hint: int = 0) -> LocalFileSink:
        if dist.get_rank() == 0:
            time.sleep(8.0)
        return LocalFileSink(create_new(self.fd, name), self.where(name))


def save_while_rank0_writes_past_the_timeout(rank: int, world_size: int, root: str) -> Any:
    manager = CheckpointManager(os.path.join(root, "run"), keep_last=1)
    manager.save(1, make_state(rank))
    try:
        return outcome(
            lambda: manager.save(2, make_state(rank), storage=_SlowFirstWriteOnRank0, timeout=3)
        )
    finally:
        manager.close()


@pytest.mark.timeout(150)
def test_a_rank_that_timed_out_writing_never_leaves_a_committed_checkpoint_without_its_shard(
    tmp_path: Path,
) -> None:
    """keep_last=1. Rank 1 wrote its shard of step 2, then timed out waiting for rank 0,
    still writing. Before, it deleted its shard on its way out; rank 0 then found every
    rank's write posted and committed a manifest naming the deleted file, moved latest to
    it, and retention deleted step 1: no loadable checkpoint was left. Now rank 0 sees,
    before it commits, that rank 1 left, and raises its verdict; step 1 stays latest."""
    results = run_ranks(save_while_rank0_writes_past_the_timeout, 2, str(tmp_path), timeout=140)
    said = (
        "rank(s) 0 did not finish the 'write' phase of save within 3s (this is rank 1); "
        "they may have died or hung. The previous checkpoint is untouched."
    )
    assert results[1]["error"] == ("CheckpointError", said)
    assert results[0]["error"][0] == "CheckpointError"
    assert results[0]["error"][1].startswith(
        f"save failed on rank 1 (rank(s) 0 failed too): {said}"
    )
    run = tmp_path / "run"
    assert (run / "latest").read_text() == "step-000000001\n"
    assert not (run / "step-000000002" / "manifest.json").exists()
    manager = CheckpointManager(str(run))
    assert manager.latest() == str(run / "step-000000001")
    manager.close()


def manifest_replaced_between_two_reads(rank: int, world_size: int, root: str) -> Any:
    """Rank 0 reads checkpoint A's manifest; then, before rank 1 reads its own copy,
    checkpoint B (saved by one process beforehand: another data file) is copied over
    A's directory."""
    import shutil

    from shardsafe.checkpoint.storage.local import LocalStorage

    a, b, flag = os.path.join(root, "a"), os.path.join(root, "b"), os.path.join(root, "read")
    shardsafe.save(a, {"w": torch.full((4,), 1.0)})
    read_small = LocalStorage.read_small

    def then_flag(self: Any, name: str, limit: int) -> bytes:
        raw = read_small(self, name, limit)
        if name == "manifest.json":
            Path(flag).touch()
        return raw

    def after_a_copy(self: Any, name: str, limit: int) -> bytes:
        if name == "manifest.json":
            for _ in range(3000):
                if os.path.exists(flag):
                    break
                time.sleep(0.01)
            for entry in os.listdir(b):
                shutil.copy(os.path.join(b, entry), os.path.join(a, entry))
        return read_small(self, name, limit)

    LocalStorage.read_small = then_flag if rank == 0 else after_a_copy  # type: ignore[method-assign]
    w = torch.zeros(4)
    try:
        shardsafe.load(a, {"w": w})
        error = None
    except Exception as e:
        error = (type(e).__name__, str(e))
    return {"error": error, "w": w.tolist()}


@pytest.mark.timeout(60)
def test_ranks_that_read_different_manifests_restore_nothing(tmp_path: Path) -> None:
    """Each rank reads its own copy of the manifest: a checkpoint copied over the
    directory between two ranks' reads (``aws s3 cp --recursive``, another job's save)
    made rank 0 restore one checkpoint and rank 1 another, both reporting success
    (found in review, on S3)."""
    shardsafe.save(tmp_path / "b", {"w": torch.full((4,), 2.0)})  # one process: its own file
    results = run_ranks(manifest_replaced_between_two_reads, 2, str(tmp_path), timeout=50)
    said = (
        f"load failed on rank 0: the manifest of {tmp_path / 'a'} changed during the load: "
        "rank 0 and rank 1 read different ones (another save or a copy replaced the "
        "checkpoint while it was read); load again once nothing writes to it (nothing was "
        "restored)"
    )
    assert [r["error"] for r in results] == [("CheckpointError", said)] * 2
    assert [r["w"] for r in results] == [[0.0] * 4] * 2
