"""An Accelerate training script saved and resumed with ``shardsafe.accelerate``; run by
``accelerate launch`` on 2 CPU processes from ``test_accelerate.py``.

It trains a small regression for ``--steps`` steps over a shuffled dataloader (seedable
sampler, 8 batches per epoch per process), an ``AdamW`` (optionally inside a
``ZeroRedundancyOptimizer``), a ``StepLR`` and a registered custom object, and writes
each step's loss; ``--fsdp2`` prepares the model through Accelerate's FSDP2 plugin.
``--save-at K`` saves after step K (``--async-save``: in the background); ``--resume DIR``
loads DIR first and continues from its step, skipping the batches already seen in that
epoch, as Accelerate's examples do. ``--dump FILE`` writes
(rank 0, safetensors) the model's and the whole optimizer's tensors and the scheduler's
learning rate right after the first save, or right after the load: what the tests compare.
"""

from __future__ import annotations

import argparse
import gc
import json
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    ProjectConfiguration,
    set_seed,
)
from safetensors.torch import save_file
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from shardsafe.accelerate import load_state, save_state

BATCHES_PER_EPOCH = 8


class Counter:
    """A registered custom object: Accelerate's ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


class OwnTables:
    """A registered object that is not a module, its tensors each process's own: one
    small, one over the 64 KiB up to which shardsafe keeps a stateful object's differing
    tensors per rank."""

    def __init__(self, value: float) -> None:
        self.small = torch.full((4,), value)
        self.large = torch.full((1 << 15,), value)

    def state_dict(self) -> dict[str, Any]:
        return {"small": self.small, "large": self.large}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.small, self.large = state["small"], state["large"]


def own_values(value: float) -> tuple[torch.nn.Module, OwnTables]:
    """Registered objects whose tensors all hold ``value``, each process its own (an EMA
    or statistics kept per process): as Accelerate saves them, the main process's copy
    is what every process loads back."""
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(value)
    return module, OwnTables(value)


def held(module: torch.nn.Module, tables: OwnTables) -> list[float]:
    """Every value the registered objects of :func:`own_values` hold."""
    tensors = [*module.parameters(), tables.small, tables.large]
    return sorted({v for t in tensors for v in t.unique().tolist()})


def dump(path: str, accelerator: Any, model: Any, optimizer: Any, scheduler: Any) -> None:
    """The state a resumed run must have, as tensors named by parameter (``model.``) and
    by parameter index (``optimizer.``, the whole optimizer's, consolidated from ZeRO)."""
    inner = optimizer.optimizer
    if isinstance(inner, ZeroRedundancyOptimizer):
        inner.consolidate_state_dict(to=0)
        if not accelerator.is_main_process:
            return
    # FSDP2's tensors are gathered whole on every process (a collective) before rank 0
    # writes them.
    tensors = {
        f"model.{k}": whole(v) for k, v in accelerator.unwrap_model(model).state_dict().items()
    }
    for index, state in inner.state_dict()["state"].items():
        for name, value in state.items():
            tensors[f"optimizer.{index}.{name}"] = whole(torch.as_tensor(value))
    tensors["scheduler.lr"] = torch.tensor(scheduler.get_last_lr())
    if accelerator.is_main_process:
        save_file(tensors, path)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor (an FSDP2 shard gathered from every process)."""
    if isinstance(tensor, DTensor):
        return tensor.full_tensor().detach().clone()
    return tensor.detach().clone()


def fsdp2_on_cpu(plugin: FullyShardedDataParallelPlugin) -> None:
    """Switch the launched CPU processes to Accelerate's FSDP2 path.

    Accelerate enables its FSDP plugin only for accelerator devices (under ``--cpu`` the
    distributed type stays ``MULTI_CPU``), although its FSDP2 preparation
    (``fully_shard`` over the process group) runs on gloo as it is. Setting the shared
    state is the one step Accelerate would take on GPUs; everything after it, ``prepare``
    included, is Accelerate's own code.
    """
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        shared["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-at", type=int, action="append", default=[])
    parser.add_argument("--save-dir")
    parser.add_argument("--resume")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--zero", action="store_true")
    parser.add_argument("--fsdp2", action="store_true")
    parser.add_argument("--project-dir")
    parser.add_argument("--total-limit", type=int)
    parser.add_argument("--dump")
    parser.add_argument("--expect-load-error", action="store_true")
    parser.add_argument("--not-strict", action="store_true")
    # Accelerate's set_seed(0, device_specific=True): each process's sampler its own seed,
    # so that the dataloader's position differs between the processes (saved per rank).
    parser.add_argument("--seed-per-process", action="store_true")
    args = parser.parse_args()

    project = ProjectConfiguration(
        project_dir=args.project_dir,
        automatic_checkpoint_naming=args.project_dir is not None,
        total_limit=args.total_limit,
    )
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if args.fsdp2 else None
    accelerator = Accelerator(
        cpu=True,
        # Accelerate's own device placement reads optimizer.state_dict(), which a ZeRO
        # optimizer refuses on every rank; on the CPU there is nothing to place anyway.
        device_placement=not args.zero,
        project_config=project,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        fsdp_plugin=plugin,
    )
    if plugin is not None:
        fsdp2_on_cpu(plugin)
    train(accelerator, args)
    # The model (its DDP reducer) goes before the process group: dropped after it, the
    # reducer would destroy the gloo group while holding the GIL that the group's worker
    # thread waits for (a torch deadlock at exit, seen here 1 run in 3).
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


def refused(accelerator: Any, path: str, model: Any, optimizer: Any) -> None:
    """Load a checkpoint that must be refused; print, per process, the error and whether
    the model and the optimizer are as they were."""
    before = [t.clone() for t in model.state_dict().values()]
    optimizer_before = repr(optimizer.state_dict())
    try:
        load_state(accelerator, path)
    except Exception as e:  # the test reads which error, on every process
        error = f"{type(e).__name__}: {e}"
    else:
        error = "no error"
    after = list(model.state_dict().values())
    same = all(torch.equal(a, b) for a, b in zip(before, after)) and (
        repr(optimizer.state_dict()) == optimizer_before
    )
    state = "unchanged" if same else "CHANGED"
    print(f"process {accelerator.process_index}: {error} | state {state}", flush=True)


def train(accelerator: Any, args: argparse.Namespace) -> None:
    set_seed(0, device_specific=args.seed_per_process)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    if args.zero:
        optimizer: Any = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.1
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    # Each process's own values: its index in the run that saves, 10 more in one that
    # resumes, so that what a load brings back is known (the main process's, 0.0).
    offset = 10 if args.resume is not None else 0
    module, tables = own_values(float(offset + accelerator.process_index))
    accelerator.register_for_checkpointing(module, tables)

    step = 0
    if args.resume is not None and args.expect_load_error:
        refused(accelerator, args.resume, model, optimizer)
        if accelerator.is_main_process:
            with open(args.out, "w") as f:
                json.dump({"refused": True}, f)
        return
    if args.resume is not None:
        values = load_state(
            accelerator,
            None if args.resume == "auto" else args.resume,
            strict=not args.not_strict,
        )
        step = counter.seen
        accelerator.print(f"resumed at step {step}: {sorted(values)}")
        print(f"process {accelerator.process_index}: registered {held(module, tables)}", flush=True)
        if args.dump:
            dump(args.dump, accelerator, model, optimizer, scheduler)
    losses: dict[int, float] = {}
    handles = []
    while step < args.steps:
        skip = step % BATCHES_PER_EPOCH
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            counter.seen = step
            losses[step] = loss.item()
            if step in args.save_at:
                where = None if args.save_dir is None else f"{args.save_dir}/step-{step}"
                saved = save_state(accelerator, where, async_save=args.async_save)
                handles.append(saved)
                if args.dump and len(handles) == 1:
                    dump(args.dump, accelerator, model, optimizer, scheduler)
            if step == args.steps:
                break
        if skip:  # the skipping loader does not move the epoch on: the loader it wraps does
            loader.set_epoch(loader.iteration + 1)
    for handle in handles:
        if not isinstance(handle, str):
            handle.wait()
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "step": accelerator.step,
                    "processes": accelerator.num_processes,
                },
                f,
            )


if __name__ == "__main__":
    main()
