"""One GPU: what a checkpoint of CUDA state costs the training loop, and how fast it comes
back. shardsafe (``save``, ``async_save``, ``load``, and ``TieredCheckpointManager``'s
local tier) against torch.distributed.checkpoint (DCP) on the same state, one process.

Setup: an MLP of ``--layers`` ``Linear(--width, --width)`` on the GPU with AdamW, one
step taken (``--width 2048 --layers 16``: 768 MiB of parameters and moments). Every tool
writes into the same scratch directory on the machine's disk, but the tiered manager's
local tier, which goes where its users put it: ``/dev/shm`` when it has room (the output
says where). Each row: one warm-up, then the median of ``--repeat``; the GPU is
synchronized before each timer starts, so no earlier kernel is charged to a tool.

* **stall**: from the call until the caller may change its tensors: the call itself for
  both ``async_save``s (each returns once the state is copied to host memory; shardsafe's
  into pinned buffers it reuses) and the tiered manager's ``async_save`` (local tier
  only); the whole call for the blocking saves.
* **to durable**: from the call until the checkpoint is committed (``wait()``, the
  future's ``result()``).
* **copy floor**: one ``copy_`` of every tensor into preallocated pinned host buffers
  (``non_blocking``, then one synchronize): what staging cannot go below.
* **load**: into live CUDA tensors of fresh objects, zeroed before each (untimed):
  ``shardsafe.load`` (both verify modes, on its default threads and on one:
  ``checkpoint/io/threaded_reads.py``), the tiered manager's ``load_latest`` from its
  local tier (constructing the manager included), DCP's ``get_state_dict`` +
  ``dcp.load`` + ``set_state_dict``; timed until the GPU is synchronized after it. After
  each load (untimed) every tensor is compared with the saved ones, bitwise.
* **one training step**: forward, backward and AdamW step of a batch of 256, alone and
  with a ``CheckpointManager.async_save`` started at its beginning, staged at the call
  or overlapped with the forward and backward (``overlap=True``, as the Trainer does).
* **GPU MiB added**: the peak of ``torch.cuda.max_memory_allocated()`` during the call
  above what was allocated before it.

Run:  python benchmarks/gpu_checkpoint.py [--width 2048] [--layers 16] [--repeat 3]
      python benchmarks/gpu_checkpoint.py --device cpu --width 64 --layers 2 --repeat 1
      (a smoke run without a GPU: no pinned memory, the same code paths otherwise)
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from torch import nn

from _common import Target, clean, disk, machine, mib, table, verdicts
from _common import state_tensors as tensors

STALL_VS_DCP = 0.5
"""The asynchronous save's target (``async_checkpoint.py``): at most half DCP's stall."""
TIER_STALL_VS_ASYNC = 1.0
"""The tiered manager's (``tiered_recovery.py``): a local save stalls no more than
``async_save``."""
TIER_LOAD_VS_DCP = 0.5
"""The tiered manager's: a restore from the local tier in at most half a DCP load."""


def build(device: str, width: int, layers: int, seed: int) -> tuple[nn.Module, Any]:
    """The MLP and its AdamW on ``device``, one step taken (the moments exist)."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(32, width, device=device)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Timer:
    """Runs a call ``repeat`` times after a warm-up (``prepare()`` before each, untimed);
    keeps the median seconds to its return and to ``finish(result)`` (the save durable),
    and the peak GPU memory added."""

    def __init__(self, device: str, repeat: int) -> None:
        self.device, self.repeat = device, repeat

    def __call__(
        self,
        call: Callable[[], Any],
        finish: Callable[[Any], Any] | None = None,
        prepare: Callable[[], Any] | None = None,
    ) -> dict[str, float]:
        seconds, done, added = [], [], 0
        for i in range(self.repeat + 1):
            if prepare is not None:  # untimed: deleting the last copy, say
                prepare()
            sync(self.device)
            before = torch.cuda.memory_allocated() if self.device == "cuda" else 0
            if self.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            result = call()
            returned = time.perf_counter()
            if finish is not None:
                finish(result)
            finished = time.perf_counter()
            sync(self.device)
            if i:  # the first is the warm-up
                seconds.append(returned - start)
                done.append(finished - start)
                if self.device == "cuda":
                    added = max(added, torch.cuda.max_memory_allocated() - before)
        return {
            "s": statistics.median(seconds),
            "durable": statistics.median(done),
            "gpu": added / 2**20,
        }


ALONE = "alone, no save"


def training_steps(
    device: str,
    width: int,
    model: nn.Module,
    opt: Any,
    state: dict[str, Any],
    root: str,
    timer: Timer,
) -> dict[str, dict[str, float]]:
    """One training step (batch 256) alone, and with a save started at its beginning
    through ``CheckpointManager.async_save``: staged first (the call returns once copied),
    or with ``overlap=True`` as the Trainer does (the copies run on a side stream under
    the forward and backward; ``wait_staged()`` before the optimizer step). Timed to the
    end of the step (the save then goes on in the background; each is waited for after
    the timer stops)."""
    import shardsafe

    batch = torch.randn(256, width, device=device)

    def forward_backward() -> None:
        model(batch).pow(2).mean().backward()

    def finish_step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)

    def alone() -> None:
        forward_backward()
        finish_step()

    manager = shardsafe.CheckpointManager(os.path.join(root, "steps"), keep_last=2)
    steps_saved = itertools.count(1)

    def saving(overlap: bool) -> Callable[[], Any]:
        def step() -> Any:
            handle = manager.async_save(next(steps_saved), state, overlap=overlap)
            forward_backward()
            handle.wait_staged()
            finish_step()
            return handle

        return step

    rows = {ALONE: timer(alone)}
    rows["async_save at its start (returns once staged)"] = timer(saving(False), lambda h: h.wait())
    rows["async_save(overlap=True) at its start, wait_staged() before opt.step"] = timer(
        saving(True), lambda h: h.wait()
    )
    manager.close()
    return rows


SHM_TIER = f"/dev/shm/shardsafe-gpu-bench-{os.getpid()}"


def local_tier_root(root: str, nbytes: int) -> str:
    """Where the tiered manager's local tier goes: :data:`SHM_TIER` if ``/dev/shm`` has
    room for its copies, else under ``root``. ``main`` removes both, whatever happens."""
    shm = os.path.dirname(SHM_TIER)
    if os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 6 * nbytes:
        return SHM_TIER
    return os.path.join(root, "local-tier")


def run(device: str, width: int, layers: int, repeat: int, root: str) -> tuple[str, list[Target]]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load_into
    from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save_to

    import shardsafe

    model, opt = build(device, width, layers, seed=0)
    saved = [t.cpu().clone() for t in tensors(model, opt)]
    state = {"model": model, "optimizer": opt}
    nbytes = sum(t.numel() * t.element_size() for t in saved)
    local_root = local_tier_root(root, nbytes)
    timer = Timer(device, repeat)
    rows: dict[str, dict[str, float]] = {}

    pinned = device == "cuda"
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in saved]

    def copy_floor() -> None:
        for b, t in zip(buffers, tensors(model, opt)):
            b.copy_(t, non_blocking=pinned)
        sync(device)

    rows["floor: one copy into preallocated pinned host buffers"] = timer(copy_floor)
    buffers.clear()

    def path(name: str) -> str:
        return os.path.join(root, name)

    def fresh_dir(name: str) -> Callable[[], None]:
        return lambda: clean(path(name))

    rows["shardsafe save (blocking)"] = timer(
        lambda: shardsafe.save(path("ss-sync"), state), prepare=fresh_dir("ss-sync")
    )
    rows["shardsafe async_save"] = timer(
        lambda: shardsafe.async_save(path("ss-async"), state),
        lambda h: h.wait(),
        prepare=fresh_dir("ss-async"),
    )

    def tiered() -> shardsafe.TieredCheckpointManager:
        """The local tier only (``persist_every=None``), on one node (``replicas=0``)."""
        return shardsafe.TieredCheckpointManager(
            path("tiers-persistent"), local_root, persist_every=None, replicas=0
        )

    manager = tiered()
    steps_saved = itertools.count(1)
    rows["TieredCheckpointManager async_save (local tier)"] = timer(
        lambda: manager.async_save(next(steps_saved), state), lambda _: manager.wait()
    )
    manager.close()

    def dcp_save() -> None:
        msd, osd = get_state_dict(model, opt)
        dcp_save_to({"model": msd, "optim": osd}, checkpoint_id=path("dcp-sync"))

    def dcp_async() -> Any:
        msd, osd = get_state_dict(model, opt)
        return dcp_async_save({"model": msd, "optim": osd}, checkpoint_id=path("dcp-async"))

    rows["DCP save (blocking)"] = timer(dcp_save, prepare=fresh_dir("dcp-sync"))
    rows["DCP async_save, default stager"] = timer(
        dcp_async, lambda f: f.result(), prepare=fresh_dir("dcp-async")
    )

    fresh, fresh_opt = build(device, width, layers, seed=1)
    target = {"model": fresh, "optimizer": fresh_opt}

    def zero() -> None:  # untimed: a load that did nothing would show
        with torch.no_grad():
            for t in tensors(fresh, fresh_opt):
                t.zero_()

    def synced(load: Callable[[], Any]) -> Callable[[], None]:
        def call() -> None:
            load()
            sync(device)  # the copies to the device are part of the load

        return call

    def check(_: Any) -> None:  # timed only as "to durable", which loads do not show
        got = tensors(fresh, fresh_opt)
        if not all(torch.equal(a.cpu(), b) for a, b in zip(got, saved)):
            raise AssertionError("a load did not restore the saved state")

    def load_row(load: Callable[[], Any]) -> dict[str, float]:
        return timer(synced(load), check, prepare=zero)

    loads: dict[str, dict[str, float]] = {}
    for verify in ("first", "inline"):
        loads[f"shardsafe load, verify={verify}"] = load_row(
            lambda v=verify: shardsafe.load(path("ss-sync"), target, verify=v)  # type: ignore[misc]
        )
        loads[f"shardsafe load, verify={verify}, read_threads=1"] = load_row(
            lambda v=verify: shardsafe.load(path("ss-sync"), target, verify=v, read_threads=1)  # type: ignore[misc]
        )

    def tier_load() -> None:
        restarted = tiered()
        restarted.load_latest(target)
        tier = restarted.restored.tiers if restarted.restored else None
        restarted.close()
        if tier != ["local"]:
            raise AssertionError(f"restored from {tier}, not the local tier")

    loads["TieredCheckpointManager load_latest (local tier)"] = load_row(tier_load)

    def dcp_load() -> None:
        msd, osd = get_state_dict(fresh, fresh_opt)
        sd: dict[str, Any] = {"model": msd, "optim": osd}
        dcp_load_into(sd, checkpoint_id=path("dcp-sync"))
        set_state_dict(fresh, fresh_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    loads["DCP load (get_state_dict, dcp.load, set_state_dict)"] = load_row(dcp_load)
    steps = training_steps(device, width, model, opt, state, root, timer)
    places = f"scratch {disk(root)}; local tier {disk(local_root)}"

    step_rows = [["one training step (forward, backward, AdamW step)", "s", "x alone"]] + [
        [name, f"{r['s']:.3f}", f"{r['s'] / steps[ALONE]['s']:.2f}"] for name, r in steps.items()
    ]
    header = ["save", "stall s", "to durable s", "GPU MiB added"]
    save_rows = [header] + [
        [name, f"{r['s']:.3f}", f"{r['durable']:.3f}", f"{r['gpu']:.1f}"]
        for name, r in rows.items()
    ]
    load_rows = [["load into live tensors", "s", "GPU MiB added"]] + [
        [name, f"{r['s']:.3f}", f"{r['gpu']:.1f}"] for name, r in loads.items()
    ]
    stall = rows["shardsafe async_save"]["s"]
    dcp_stall = rows["DCP async_save, default stager"]["s"]
    tier_stall = rows["TieredCheckpointManager async_save (local tier)"]["s"]
    dcp_load_s = loads["DCP load (get_state_dict, dcp.load, set_state_dict)"]["s"]
    targets = [
        Target("gpu: async_save stall / DCP async_save stall", stall / dcp_stall, STALL_VS_DCP),
        Target(
            "gpu: tiered local save stall / async_save stall",
            tier_stall / stall,
            TIER_STALL_VS_ASYNC,
        ),
        Target(
            "gpu: tiered restore from local / DCP load",
            loads["TieredCheckpointManager load_latest (local tier)"]["s"] / dcp_load_s,
            TIER_LOAD_VS_DCP,
        ),
        Target(
            "gpu: shardsafe load (verify=first) / DCP load",
            loads["shardsafe load, verify=first"]["s"] / dcp_load_s,
            None,
        ),
    ]
    text = (
        f"state: {mib(nbytes)} on {device} ({layers} x Linear({width}, {width}) + AdamW); "
        f"median of {repeat}; {places}\n\n"
        f"{table(save_rows)}\n\n{table(load_rows)}\n\n{table(step_rows)}"
    )
    return text, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/shardsafe-gpu-bench")
    args = parser.parse_args()
    # DCP says, on every call, that it runs without a process group: so does this one.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: run with --device cpu for a smoke run")
    root = os.path.join(args.dir, f"run-{os.getpid()}")
    os.makedirs(root, exist_ok=True)
    print(f"machine: {machine()}\n")
    try:
        text, targets = run(args.device, args.width, args.layers, args.repeat, root)
    finally:  # also after a failure (a load that came back wrong): nothing left in RAM
        clean(root)
        clean(SHM_TIER)
    print(f"{text}\n\n{verdicts(targets)}")


if __name__ == "__main__":
    main()
