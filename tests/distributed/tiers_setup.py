"""A small DDP run under ``TieredCheckpointManager``, shared by the tiered tests: 4 ranks
as 2 simulated nodes of 2 (``SHARDSAFE_NODE``), each node with its own local directory.

Also the victim of the tiered kill test (:func:`kill_target`, run as its own process per
rank) and the check after the kill (:func:`kill_check`)."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import shardsafe
from shardsafe.tiers import TieredCheckpointManager

PER_NODE = 2


def local_dir(base: str, node: int) -> str:
    return os.path.join(base, f"local-node{node}")


def node_manager(base: str, node: int, timeout: float) -> TieredCheckpointManager:
    """A manager of ``base``'s persistent directory and ``node``'s local one, the defaults
    but for ``timeout`` and no persistent saves (a node per rank, for the 2-rank tests)."""
    return TieredCheckpointManager(
        os.path.join(base, "persistent"), local_dir(base, node), persist_every=None, timeout=timeout
    )


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)))
    model.register_comm_hook(None, _each_gradient_alone)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _each_gradient_alone(_, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """DDP's all-reduce, one gradient at a time. DDP regroups its buckets after a
    process's first step, and 4 ranks' sums over a regrouped bucket round differently (1
    ulp): a resumed run, whose first step is not the run's first, would then differ from
    an uninterrupted one for a reason that has nothing to do with checkpoints."""
    world = dist.get_world_size()
    for grad in bucket.gradients():
        dist.all_reduce(grad)
        grad.div_(world)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and optimizer-state tensor, copied, in a fixed order."""
    found = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        found += [v.clone() for _, v in sorted(opt.state[p].items())]
    return found


def train(
    rank: int,
    world: int,
    base: str,
    steps: int,
    options: dict[str, Any] | None = None,
    per_node: int = PER_NODE,
) -> dict[str, Any]:
    """Resume (if anything is there), train to ``steps`` saving every step; what happened
    (``warnings``: the text of every warning the rank saw)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _train(rank, world, base, steps, options, per_node)
    return {**out, "warnings": [str(w.message) for w in caught]}


def _train(
    rank: int, world: int, base: str, steps: int, options: dict[str, Any] | None, per_node: int
) -> dict[str, Any]:
    os.environ["SHARDSAFE_NODE"] = str(rank // per_node)
    model, opt = build()
    state = {"model": model, "optimizer": opt, "rng": shardsafe.RNGState()}
    kwargs = {"local_every": 1, "persist_every": 2, "replicas": 1, **(options or {})}
    manager = TieredCheckpointManager(
        os.path.join(base, "persistent"), local_dir(base, rank // per_node), **kwargs
    )
    try:
        manager.load_latest(state)
        restored = manager.restored
        start = restored.step if restored else 0
        at = {start: tensors(model, opt)}
        losses = []
        for step in range(start + 1, steps + 1):
            gen = torch.Generator().manual_seed(step * 1000 + rank)
            loss = model(torch.randn(4, 8, generator=gen) + torch.rand(1)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            manager.async_save(step, state)
            at[step] = tensors(model, opt)
        manager.wait()
        record = manager._replicator.record
        return {
            "start": start,
            "tiers": restored.tiers if restored else None,
            "losses": losses,
            "at": at,
            "written": list(record.written),
            "replicated": list(record.replicated),
            "received": {k: list(v) for k, v in record.received.items()},
        }
    finally:
        manager.close()


def rank_dirs(base: str, node: int) -> dict[str, list[str]]:
    """``step-...: [rank-...]`` of a node's local directory."""
    root = Path(local_dir(base, node))
    if not root.exists():
        return {}
    return {s.name: sorted(r.name for r in s.iterdir()) for s in sorted(root.iterdir())}


# ------------------------------------------------------------------ the kill test

KILL_OPTIONS: dict[str, Any] = {
    "local_every": 1,
    "persist_every": 4,
    "replicas": 1,
    "keep_local": 2,
    "timeout": 30.0,
}
"""2 ranks as 2 nodes of 1: each rank's checkpoint is replicated to the other's node."""


def kill_state() -> dict[str, Any]:
    """6 MiB per rank: long enough a local write and a replication to be hit by a kill."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512, bias=False) for _ in range(2)))
    return {"model": model, "extra": {"buf": torch.randn(1 << 20)}}


def kill_base() -> dict[str, torch.Tensor]:
    state = kill_state()
    base = {k: v.detach().clone() for k, v in state["model"].state_dict().items()}
    return {**base, "extra/buf": state["extra"]["buf"].clone()}


def set_kill_step(state: dict[str, Any], base: dict[str, torch.Tensor], value: float) -> None:
    """Every tensor ``base + value``: what a checkpoint of step ``value`` holds."""
    with torch.no_grad():
        for name, p in state["model"].state_dict().items():
            p.copy_(base[name] + value)
        state["extra"]["buf"].copy_(base["extra/buf"] + value)


def holds_step(state: dict[str, Any], base: dict[str, torch.Tensor], step: int) -> bool:
    model = state["model"].state_dict()
    return all(torch.equal(p, base[n] + step) for n, p in model.items()) and torch.equal(
        state["extra"]["buf"], base["extra/buf"] + step
    )


def kill_manager(rank: int, base_dir: str) -> TieredCheckpointManager:
    os.environ["SHARDSAFE_NODE"] = str(rank)
    return TieredCheckpointManager(
        os.path.join(base_dir, "persistent"), local_dir(base_dir, rank), **KILL_OPTIONS
    )


DIE_AT = ("write", "receive", "commit")
"""Where ``--die-at POINT:STEP`` kills both ranks (``os.killpg``) from inside rank 0's or
1's process, windows too narrow to hit from outside by timing: ``write``, rank 0 half-way
through the data file of its own local checkpoint of STEP; ``receive``, rank 1 with rank
0's replica of STEP received and written, not yet verified and committed; ``commit``, rank
1 with that replica committed, its sender not yet told."""


def _die() -> None:
    sys.stdout.flush()
    os.killpg(0, signal.SIGKILL)  # this rank's process group: both ranks


def _arm(point: str, step: int, rank: int) -> None:
    """Make this process kill both ranks at ``point`` of ``step`` (see :data:`DIE_AT`)."""
    from shardsafe.checkpoint.storage.files import LocalFileSink
    from shardsafe.tiers import rank_checkpoint, transfer

    if point == "write" and rank == 0:
        write = LocalFileSink.write
        own = f"{os.sep}local-node0{os.sep}step-{step:09d}{os.sep}rank-00000{os.sep}"

        def dying_write(self: LocalFileSink, data: memoryview) -> None:
            if own in self.path and self.written >= 1 << 20:
                _die()
            write(self, data)

        LocalFileSink.write = dying_write  # type: ignore[method-assign]
    elif point in ("receive", "commit") and rank == 1:
        commit = transfer._commit_if_whole

        def dying_commit(storage: Any, manifest: Any, raw: bytes, *received: Any) -> bool:
            replica_of = rank_checkpoint.saved_by(manifest)
            if point == "receive" and replica_of[::2] == (0, step):
                _die()
            committed = commit(storage, manifest, raw, *received)
            if point == "commit" and replica_of[::2] == (0, step):
                _die()
            return committed

        transfer._commit_if_whole = dying_commit


def kill_target() -> None:
    """``python -c 'from tests.distributed.tiers_setup import kill_target; kill_target()'
    RANK WORLD BASE PORT [POINT:STEP]``: save every step until killed, printing ``saving
    <step> <t>`` and ``saved <step> <t>`` (``tests/e2e/kills.py`` aims its kill by them),
    or until it kills itself at ``POINT`` (:data:`DIE_AT`) of ``STEP``."""
    rank, world, base_dir, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if len(sys.argv) > 5:
        point, die_step = sys.argv[5].split(":")
        _arm(point, int(die_step), rank)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    state, base = kill_state(), kill_base()
    manager = kill_manager(rank, base_dir)
    print("ready", flush=True)
    for step in range(1, 10_000):
        set_kill_step(state, base, step)
        dist.all_reduce(torch.ones(1))  # the collective of a training step
        print(f"saving {step} {time.monotonic():.6f}", flush=True)
        manager.save(step, state)  # the local checkpoint is on disk when it returns
        print(f"saved {step} {time.monotonic():.6f}", flush=True)


def kill_check(rank: int, world: int, base_dir: str) -> dict[str, Any]:
    """After the kill: what ``load_latest`` restores, whether it is exactly that step's
    state, and whether saving the next step then works."""
    state, base = kill_state(), kill_base()
    set_kill_step(state, base, -1.0)
    manager = kill_manager(rank, base_dir)
    try:
        values = manager.load_latest(state)
        restored = manager.restored
        assert restored is not None and values is not None, "nothing was restored"
        state["extra"] = values["extra"]  # a plain value: returned, not restored in place
        exact = holds_step(state, base, restored.step)
        set_kill_step(state, base, restored.step + 1)
        manager.save(restored.step + 1, state)
        manager.wait()
        return {"step": restored.step, "tiers": restored.tiers, "exact": exact}
    finally:
        manager.close()
