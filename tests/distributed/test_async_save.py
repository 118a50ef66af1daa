"""``async_save``: the state at the call is what lands on disk, whatever the caller does
next; errors in the background are agreed on every rank; one save in flight.

Every test runs real gloo ranks (``tests/harness.py``). After ``async_save`` returns, the
caller overwrites every parameter and every optimizer state tensor in place (and steps
again); the checkpoint, once ``wait()`` returns, must load bitwise equal to a clone
taken at the moment of the call.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardsafe
from shardsafe import CheckpointError, CheckpointManager
from shardsafe.checkpoint.storage.files import LocalFileSink, create_new
from shardsafe.checkpoint.storage.local import LocalStorage
from tests.distributed import test_fsdp, zero_setup
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)
LAYOUTS = ["sharded", "consolidated"]


def _tensors(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Every tensor a save of (model, optimizer) holds on this rank, cloned, by name."""
    local = getattr(opt, "optim", opt)
    out = {f"model/{k}": _local(v).clone() for k, v in model.state_dict().items()}
    for i, state in enumerate(local.state.values()):
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"opt/{i}/{name}"] = _local(value).clone()
    return out


def _bits(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor (NaN-safe, unlike equality)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _trash(model: Any, opt: Any) -> None:
    """Overwrite every parameter, buffer and optimizer state tensor in place (keeping
    them valid, so that training can go on: state grows by 1, the step count too)."""
    local = getattr(opt, "optim", opt)
    with torch.no_grad():
        for v in model.state_dict().values():
            _local(v).fill_(0.25)
        for state in local.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    _local(value).add_(1.0)


def _build(kind: str, seed: int) -> tuple[Any, Any, Any]:
    if kind == "fsdp":
        model = test_fsdp.fsdp(seed)
        return model, model, test_fsdp.adamw(model)
    model, wrapped, opt = zero_setup.build(kind, seed)
    return model, wrapped, opt


def _train(kind: str, wrapped: Any, opt: Any, start: int, steps: int, rank: int) -> None:
    if kind == "fsdp":
        test_fsdp.train(wrapped, opt, start, steps, rank)
    else:
        zero_setup.train(wrapped, opt, start, steps, rank)


def snapshot_run(rank: int, world: int, path: str, kind: str, layout: str) -> bool:
    model, wrapped, opt = _build(kind, 0)
    _train(kind, wrapped, opt, 0, 3, rank)
    at_call = _tensors(model, opt)
    handle = shardsafe.async_save(path, {"model": model, "optimizer": opt}, layout=layout)
    _trash(model, opt)  # the caller moves on at once ...
    _train(kind, wrapped, opt, 3, 1, rank)  # ... and even steps again
    assert handle.wait() == path and handle.done()
    fresh_model, fresh_wrapped, fresh_opt = _build(kind, 1)
    _train(kind, fresh_wrapped, fresh_opt, 0, 1, rank)  # so it has live state to fill
    shardsafe.load(path, {"model": fresh_model, "optimizer": fresh_opt})
    got = _tensors(fresh_model, fresh_opt)
    assert got.keys() == at_call.keys()
    for name, value in at_call.items():
        assert _bits(got[name]) == _bits(value), name
    return True


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["plain", "zero", "oss", "fsdp"])
def test_the_checkpoint_is_the_state_at_the_call(tmp_path: Path, kind: str, layout: str) -> None:
    assert run_ranks(snapshot_run, 2, str(tmp_path / "ckpt"), kind, layout) == [True, True]


# ------------------------------------------------------------- what a rank stages


def staged_bytes_run(rank: int, world: int, path: str, kind: str, layout: str) -> dict[str, int]:
    from safetensors import safe_open

    from shardsafe.checkpoint.background import DEFAULT_STAGER

    model, wrapped, opt = _build(kind, 0)
    _train(kind, wrapped, opt, 0, 2, rank)
    held = sum(t.numel() * t.element_size() for t in _tensors(model, opt).values())
    DEFAULT_STAGER.release()
    state = {"model": model, "optimizer": opt}
    if layout == "sharded":  # a full stage first: the sharded save must free what it skips
        shardsafe.async_save(f"{path}-full", state, layout="consolidated").wait()
    shardsafe.async_save(path, state, layout=layout).wait()
    written = 0
    if layout == "sharded":
        with safe_open(f"{path}/shard-{rank:05d}-of-{world:05d}.safetensors", "pt") as f:
            tensors = [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118
            written = sum(t.numel() * t.element_size() for t in tensors)
    return {"held": held, "staged": DEFAULT_STAGER.nbytes, "written": written}


@pytest.mark.parametrize("kind", ["plain", "zero"])
def test_a_rank_stages_only_what_it_writes_when_its_state_is_replicated(
    tmp_path: Path, kind: str
) -> None:
    """DDP (and ZeRO's replicated parameters): each replicated tensor is written by one
    rank, so an asynchronous save plans first and each rank copies only its share."""
    results = run_ranks(staged_bytes_run, 2, str(tmp_path / "ckpt"), kind, "sharded")
    for r in results:
        assert 0 < r["staged"] == r["written"] <= r["held"], results
    assert sum(r["staged"] for r in results) < sum(r["held"] for r in results), results
    if kind == "plain":  # every tensor replicated: the two shares are the state, once
        assert results[0]["written"] + results[1]["written"] == results[0]["held"]


def test_without_replicated_state_or_in_the_consolidated_layout_a_rank_stages_it_all(
    tmp_path: Path,
) -> None:
    consolidated = run_ranks(staged_bytes_run, 2, str(tmp_path / "c"), "plain", "consolidated")
    fsdp = run_ranks(staged_bytes_run, 2, str(tmp_path / "f"), "fsdp", "sharded")
    for r in consolidated + fsdp:
        assert r["staged"] == r["held"] > 0, (consolidated, fsdp)


def planned_error_run(rank: int, world: int, root: str) -> dict[str, Any]:
    """A failure in the collect phase, which a DDP save runs at the call: the call still
    returns a handle on every rank, and every handle raises the same error."""
    from shardsafe.checkpoint import SaveHooks

    def refuse() -> None:
        raise RuntimeError("not today")

    model, wrapped, opt = _build("plain", 0)
    _train("plain", wrapped, opt, 0, 1, rank)
    path = os.path.join(root, "ckpt")
    handle = shardsafe.async_save(
        path, {"model": model, "optimizer": opt}, hooks=SaveHooks(before_write=refuse)
    )
    _train("plain", wrapped, opt, 1, 1, rank)  # collectives still line up on every rank
    return _outcome(handle, path)


def test_a_failure_while_planning_at_the_call_is_raised_by_every_handle(tmp_path: Path) -> None:
    results = run_ranks(planned_error_run, 2, str(tmp_path))
    assert results[0]["error"] == results[1]["error"], results
    assert results[0]["error"].startswith(
        f"the background save to {tmp_path / 'ckpt'} failed: save failed on rank 0: "
        "RuntimeError: not today"
    )
    assert results[0]["exists"] is False


def staging_error_run(rank: int, world: int, root: str) -> dict[str, Any]:
    """Staging fails on rank 1 after the plan was made at the call: the failure is
    agreed in the write phase, and every handle raises it."""
    from shardsafe.checkpoint.io.staging import Stager

    if rank == 1:

        def no_room(self: Stager, items: Any, keep: Any = None) -> Any:
            raise MemoryError("no room for the staging buffers")

        Stager.stage = no_room  # type: ignore[method-assign]
    model, wrapped, opt = _build("plain", 0)
    _train("plain", wrapped, opt, 0, 1, rank)
    path = os.path.join(root, "ckpt")
    handle = shardsafe.async_save(path, {"model": model, "optimizer": opt})
    return _outcome(handle, path)


def _outcome(handle: Any, path: str) -> dict[str, Any]:
    """The handle's agreed error (None if it committed) and whether ``path`` exists."""
    try:
        handle.wait(timeout=30)
        error = None
    except CheckpointError as e:
        error = str(e)
    dist.barrier()
    return {"error": error, "exists": os.path.exists(path)}


def test_a_staging_failure_after_planning_is_raised_by_every_handle(tmp_path: Path) -> None:
    results = run_ranks(staging_error_run, 2, str(tmp_path))
    assert results[0]["error"] == results[1]["error"], results
    assert results[0]["error"].startswith(
        f"the background save to {tmp_path / 'ckpt'} failed: save failed on rank 1: "
        "MemoryError: no room for the staging buffers"
    )
    assert results[0]["exists"] is False


# ---------------------------------------------------------------- errors in background

FAULT: dict[str, Any] = {}


class _FailingSink(LocalFileSink):
    def write(self, data: memoryview) -> None:
        where = os.path.basename(os.path.dirname(self.path))
        if FAULT.get("rank") == dist.get_rank() and FAULT.get("only", where) == where:
            FAULT["at"] = time.monotonic()
            raise OSError(errno.EIO, os.strerror(errno.EIO), self.path)
        super().write(data)


class FailingStorage(LocalStorage):
    def create(self, name: str, size_hint: int = 0) -> LocalFileSink:
        return _FailingSink(create_new(self.fd, name), self.where(name))


def background_error_run(rank: int, world: int, root: str, layout: str) -> dict[str, Any]:
    model, wrapped, opt = _build("zero", 0)
    _train("zero", wrapped, opt, 0, 2, rank)
    manager = CheckpointManager(root, keep_last=3)
    manager.async_save(1, {"model": model, "optimizer": opt}, layout=layout).wait()
    FAULT.update(rank=1 if layout == "sharded" else 0)
    handle = manager.async_save(
        2, {"model": model, "optimizer": opt}, layout=layout, storage=FailingStorage
    )
    _train("zero", wrapped, opt, 2, 1, rank)  # training goes on meanwhile
    try:
        handle.wait(timeout=30)
        error = None
    except CheckpointError as e:
        error = str(e)
    raised = time.monotonic()
    fault_at = FAULT.get("at")
    FAULT.clear()
    dist.barrier()
    return {
        "error": error,
        "fault_at": fault_at,
        "raised": raised,
        "latest": manager.latest(),
        "step2": os.path.exists(manager.path_for(2)),
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_background_failure_on_one_rank_reaches_every_handle(tmp_path: Path, layout: str) -> None:
    results = run_ranks(background_error_run, 2, str(tmp_path), layout)
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    failing = 1 if layout == "sharded" else 0
    step2 = tmp_path / "step-000000002"
    assert errors[0].startswith(
        f"the background save of step 2 to {step2} failed: save failed on rank {failing}: "
        "OSError: [Errno 5]"
    ), errors[0]
    fault_at = results[failing]["fault_at"]
    assert fault_at is not None and all(r["raised"] - fault_at < 10 for r in results)
    for r in results:
        assert r["latest"] == str(tmp_path / "step-000000001")  # the previous one stays
        assert r["step2"] is False
    assert os.listdir(tmp_path / "step-000000001")


def staged_copies_fail_on_rank_1(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 1's staged copies fail as its writer thread waits for them (as an overlapped
    device-to-host copy's error surfaces there), before the save's phases begin."""
    import threading

    from shardsafe.checkpoint.io import staging

    if rank == 1:
        ready = staging.Staged.ready

        def failing(self: Any) -> None:
            if threading.current_thread().name == "shardsafe-save":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            ready(self)

        staging.Staged.ready = failing  # type: ignore[method-assign]
    start = time.monotonic()
    handle = shardsafe.async_save(os.path.join(root, "c"), {"t": torch.ones(4) * rank})
    try:
        handle.wait(timeout=60)
        error = None
    except CheckpointError as e:
        error = str(e)
    return {"error": error, "took": time.monotonic() - start}


def test_staged_copies_failing_on_one_ranks_writer_fail_every_handle_alike(
    tmp_path: Path,
) -> None:
    """That failure skipped the save's phases, which tell the others: they waited for
    rank 1's heartbeat to stop (16 s) and said it had stopped responding, never why."""
    results = run_ranks(staged_copies_fail_on_rank_1, 2, str(tmp_path), timeout=100)
    said = (
        f"the background save to {tmp_path / 'c'} failed: save failed on rank 1: "
        "RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    assert [r["error"][: len(said)] for r in results] == [said, said], results
    assert not (tmp_path / "c" / "manifest.json").exists()


def never_waited_run(rank: int, world: int, root: str) -> list[str]:
    """An error nobody waited for surfaces from the next save; the save after works."""
    model, _, opt = _build("plain", 0)
    state = {"model": model, "optimizer": opt}
    FAULT.update(rank=1, only="a")  # fails a's background write, whenever it runs
    shardsafe.async_save(os.path.join(root, "a"), state, storage=FailingStorage)
    seen = []
    try:
        shardsafe.save(os.path.join(root, "b"), state)
    except CheckpointError as e:
        seen.append(f"next save: {str(e).split(': OSError')[0]}")
    shardsafe.save(os.path.join(root, "b"), state)
    FAULT.clear()
    seen.append(f"then: {sorted(os.listdir(os.path.join(root, 'b')))[0]}")
    return seen


def test_an_error_nobody_waited_for_is_raised_by_the_next_save(tmp_path: Path) -> None:
    results = run_ranks(never_waited_run, 2, str(tmp_path))
    assert (
        results[0]
        == results[1]
        == [
            f"next save: the background save to {tmp_path / 'a'} failed: save failed on rank 1",
            "then: manifest.json",
        ]
    )
    assert not (tmp_path / "a" / "manifest.json").exists()


# ----------------------------------------------------------------- one save in flight


def in_flight_run(rank: int, world: int, root: str) -> dict[str, Any]:
    model, wrapped, opt = _build("zero", 0)
    _train("zero", wrapped, opt, 0, 2, rank)
    state = {"model": model, "optimizer": opt}
    manager = CheckpointManager(root, keep_last=2)
    paths = []
    for step in (1, 2, 3):
        handle = manager.async_save(step, state)  # each waits for the one before
        paths.append(handle.path)
        _train("zero", wrapped, opt, 2 + step, 1, rank)
    last = manager.wait()
    handle.close()
    try:
        handle.wait()
        after_close = ""
    except CheckpointError as e:
        after_close = str(e)
    return {
        "paths": paths,
        "last": last,
        "complete": manager.complete_steps(),
        "latest_file": open(os.path.join(root, "latest")).read(),
        "after_close": after_close,
    }


def test_one_save_in_flight_and_retention_after_each_commit(tmp_path: Path) -> None:
    results = run_ranks(in_flight_run, 2, str(tmp_path))
    for r in results:
        assert r["paths"] == [str(tmp_path / f"step-00000000{s}") for s in (1, 2, 3)]
        assert r["last"] == str(tmp_path / "step-000000003")
        assert r["complete"] == [2, 3]  # keep_last=2, applied after each commit
        assert r["latest_file"] == "step-000000003\n"
        assert (
            r["after_close"].startswith("this SaveHandle (for ")
            and "was closed" in (r["after_close"])
        )
