"""The victim of the kill tests: a run that checkpoints every step until it is SIGKILLed.

    python tests/e2e/kill_target.py ROOT --layout sharded [--rank R --world-size W --port P]
        [--die-at POINT]

State (12 MiB in all) is a deterministic function of the step, so whoever loads a
checkpoint can tell that every byte of it belongs to one and the same step:
``model`` weights and the plain ``extra`` tensor hold ``base + step`` and ``step`` holds
the step. With several ranks, each step also runs one gloo ``all_reduce`` (what DDP does
in a training step), the model is replicated (both ranks write data files in the sharded
layout), and a ZeRO optimizer adds 4 MiB of state per rank (in the consolidated layout
rank 1 sends its part to rank 0 during every save).

It prints ``saving <step> <t>`` before and ``saved <step> <t>`` after each save
(``t`` from ``time.monotonic()``, flushed at once), so the test can aim its kill inside a
save. ``--die-at`` makes the process SIGKILL itself at one exact point of a save instead
(see ``DIE_AT``), to cover windows too narrow to hit by timing alone. ``--async`` saves
with ``CheckpointManager.async_save`` and changes every tensor (to ``base + step + 1000``)
while the background write runs: a checkpoint must still hold ``base + step``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardsafe
from shardsafe.checkpoint.storage.files import LocalFileSink, create_new
from shardsafe.checkpoint.storage.local import LocalStorage

KEEP_LAST = 3
FIRST_STEP = 1
DIE_AFTER_STEP = 4
"""``--die-at`` fires in the save of this step, after three complete ones (and retention)."""

DIE_AT = (
    "data-write",  # half-way through writing a data file
    "manifest-rename",  # manifest temp file written and fsynced, not yet renamed
    "latest-rename",  # checkpoint committed, latest temp file written, not yet renamed
    "retention",  # latest moved, an old checkpoint's manifest removed, its files not yet
)


def build_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(4)))  # 4 MiB
    return {"model": model, "extra": {"buf": torch.randn(1 << 20)}, "step": 0}  # + 4 MiB


def set_step(state: dict[str, Any], base: dict[str, torch.Tensor], step: int) -> None:
    """Make every tensor ``base + step``: what a checkpoint of ``step`` must hold."""
    with torch.no_grad():
        for name, p in state["model"].state_dict().items():
            p.copy_(base[name] + step)
        state["extra"]["buf"].copy_(base["extra/buf"] + step)
    state["step"] = step


def base_of(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    base = {k: v.detach().clone() for k, v in state["model"].state_dict().items()}
    base["extra/buf"] = state["extra"]["buf"].clone()
    return base


def _zero_optimizer(model: nn.Module) -> Any:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()  # every rank now holds AdamW state for its part of the parameters
    return opt


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class _DyingSink(LocalFileSink):
    def write(self, data: memoryview) -> None:
        if self.written > 1 << 20:
            _die()
        super().write(data)


class _DyingStorage(LocalStorage):
    """Fault injection through ``save(storage=...)``: SIGKILL at a data or manifest point."""

    point = ""

    def create(self, name: str, size_hint: int = 0) -> LocalFileSink:
        if self.point == "data-write":
            return _DyingSink(create_new(self.fd, name), self.where(name))
        return super().create(name)  # type: ignore[return-value]

    def commit(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        if self.point == "manifest-rename" and name == "manifest.json":  # not the marker's
            tmp = f".{name}.tmp-{os.getpid()}"
            sink = LocalFileSink(create_new(self.fd, tmp), self.where(tmp))
            sink.write(memoryview(data))
            sink.finish()
            _die()
        super().commit(name, data, exclusive=exclusive)


def _arm_outside_storage(point: str) -> None:
    """The pointer and retention are written by the manager, not the storage seam of
    ``save``: wrap the two calls they make, in this process only."""
    if point == "latest-rename":
        replace = os.replace

        def dying_replace(src: Any, dst: Any, **kwargs: Any) -> None:
            if os.path.basename(os.fspath(dst)) == "latest":
                _die()
            replace(src, dst, **kwargs)

        os.replace = dying_replace  # type: ignore[assignment]
    elif point == "retention":
        remove = LocalStorage.remove

        def dying_remove(self: LocalStorage, name: str) -> None:
            if name.endswith(".safetensors") and not self.exists("manifest.json"):
                _die()  # the manifest is already gone, the data files are not
            remove(self, name)

        LocalStorage.remove = dying_remove  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--layout", default="sharded")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--die-at", choices=DIE_AT)
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    if args.world_size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{args.port}",
            rank=args.rank,
            world_size=args.world_size,
            timeout=datetime.timedelta(seconds=60),
        )
    state = build_state()
    base = base_of(state)
    if args.world_size > 1:
        state["optimizer"] = _zero_optimizer(state["model"])
    manager = shardsafe.CheckpointManager(args.root, keep_last=KEEP_LAST)
    storage = None
    if args.die_at in ("data-write", "manifest-rename"):
        _DyingStorage.point = args.die_at
        storage = _DyingStorage
    print("ready", flush=True)
    for step in range(FIRST_STEP, FIRST_STEP + args.steps):
        set_step(state, base, step)
        if dist.is_initialized():
            dist.all_reduce(torch.ones(1))  # the collective of a training step
        if step == DIE_AFTER_STEP and args.die_at:
            _arm_outside_storage(args.die_at)
        print(f"saving {step} {time.monotonic():.6f}", flush=True)
        options: dict[str, Any] = {
            "layout": args.layout,
            "entry_timeout": 10.0,
            "storage": storage if step == DIE_AFTER_STEP else None,
        }
        if args.asynchronous:
            handle = manager.async_save(step, state, **options)
            # Training goes on: the tensors change while the background write runs.
            set_step(state, base, step + 1000)
            if dist.is_initialized():
                dist.all_reduce(torch.ones(1))
            handle.wait()
        else:
            manager.save(step, state, **options)
        print(f"saved {step} {time.monotonic():.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
