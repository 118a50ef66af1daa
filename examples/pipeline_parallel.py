"""Train with pipeline x data parallelism on 4 processes, checkpoint, resume as FSDP2 on 2.

    torchrun --nproc-per-node 4 examples/pipeline_parallel.py --run-dir runs/pp --steps 6
    torchrun --nproc-per-node 2 examples/pipeline_parallel.py --run-dir runs/pp --steps 12 \
        --resume

or both at once (this script runs the two torchrun commands above itself):

    python examples/pipeline_parallel.py --run-dir runs/pp

The first run splits a small model into 2 pipeline stages the way torchtitan does (each
stage is the whole model with the other stage's layers deleted, so parameter names stay
the model's own: ``layers.2.weight`` on stage 1), runs them with
``torch.distributed.pipelining`` (GPipe, 2 microbatches), and replicates each stage on 2
ranks (data parallel: gradients averaged over the stage's replicas). Every rank calls
``shardsafe.save`` with its own stage and AdamW: each tensor is written once, by one of
the replicas holding it, and the manifest describes the whole model.

The second run builds the whole model, shards it with FSDP2 (``fully_shard``) over 2
ranks, and ``shardsafe.load``s the same checkpoint into it: parameters and AdamW state
are resharded on the way in. It trains on from the saved step on the same data (rank r
takes replica r's batch), so the loss continues where the first run left it, as if it
had never stopped. Gloo, CPU only; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch import nn

import shardsafe

WIDTH, LAYERS, STAGES, REPLICAS, MICROBATCHES, BATCH = 32, 4, 2, 2, 2, 16


class Net(nn.Module):
    """``tok`` -> ``layers.0`` .. ``layers.3`` -> ``out``; a stage holds some of them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every process
        self.tok: nn.Module | None = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH) for i in range(LAYERS)})
        self.out: nn.Module | None = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x)
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return self.out(x) if self.out is not None else x


def stage_of(model: Net, stage: int) -> Net:
    """Pipeline stage ``stage`` of ``STAGES``: the model with the other layers deleted."""
    per = LAYERS // STAGES
    for name in list(model.layers):
        if int(name) // per != stage:
            del model.layers[name]
    if stage != 0:
        model.tok = None
    if stage != STAGES - 1:
        model.out = None
    return model


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s batch at ``step``: inputs and a fixed nonlinear rule's outputs."""
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step * 100 + replica))
    rule = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)) / WIDTH**0.5
    return x, torch.sin(x @ rule)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train_pipeline(run_dir: str, steps: int) -> None:
    """PP x DP (2 x 2) on 4 ranks: rank r runs stage r // 2 as replica r % 2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (STAGES, REPLICAS), mesh_dim_names=("pp", "dp"))
    stage_index, replica = mesh.get_coordinate() or (0, 0)
    dp = mesh.get_group("dp")
    stage = stage_of(Net(), stage_index)
    opt = adamw(stage)
    pipe = PipelineStage(
        stage, stage_index, STAGES, torch.device("cpu"), group=mesh.get_group("pp")
    )
    schedule = ScheduleGPipe(pipe, MICROBATCHES, loss_fn=loss_fn)
    last = stage_index == STAGES - 1
    for step in range(steps):
        x, y = batch(step, replica)
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        for p in stage.parameters():  # data parallel: average over the stage's replicas
            assert p.grad is not None
            dist.all_reduce(p.grad, group=dp)
            p.grad /= REPLICAS
        opt.step()
        if last:  # the mean over microbatches and replicas: the global batch's loss
            loss = torch.stack(losses).mean()
            dist.all_reduce(loss, group=dp)
            if replica == 0:
                print(f"step {step:2d}  loss {loss.item() / REPLICAS:.6f}  (PP x DP, 4 ranks)")
    path = os.path.join(run_dir, f"step-{steps:06d}")
    shardsafe.save(path, {"model": stage, "optimizer": opt, "step": steps})
    if dist.get_rank() == 0:
        manifest = shardsafe.read_manifest(path)
        print(
            f"saved {path}: {len(manifest.tensors)} tensors in {len(manifest.files)} files "
            f"written by {dist.get_world_size()} ranks (each tensor once)"
        )


def resume_fsdp(run_dir: str, steps: int) -> None:
    """The whole model, FSDP2 over 2 ranks, loaded from the newest pipeline checkpoint."""
    from torch.distributed.fsdp import fully_shard

    model = Net()
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    opt = adamw(model)
    path = os.path.join(run_dir, max(n for n in os.listdir(run_dir) if n.startswith("step-")))
    start = shardsafe.load(path, {"model": model, "optimizer": opt})["step"]
    rank = dist.get_rank()
    if rank == 0:
        print(f"resumed {path} at step {start} as FSDP2 on {dist.get_world_size()} ranks")
    for step in range(start, steps):
        x, y = batch(step, rank)  # rank r takes replica r's batch, as before
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()  # FSDP2 averages the gradients over the 2 ranks
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(
                f"step {step:2d}  loss {total.item() / dist.get_world_size():.6f}  (FSDP2, 2 ranks)"
            )


def launch_both(args: argparse.Namespace) -> None:
    """Not started by torchrun: run the two torchrun commands of the docstring."""
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    me = [os.path.abspath(__file__), "--run-dir", args.run_dir]
    for n, extra in (
        (4, ["--steps", str(args.save_at)]),
        (2, ["--steps", str(args.steps), "--resume"]),
    ):
        subprocess.run([*base, f"--nproc-per-node={n}", *me, *extra], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/pipeline_parallel")
    parser.add_argument("--steps", type=int, default=12, help="train up to this step")
    parser.add_argument("--resume", action="store_true", help="resume as FSDP2 on 2 ranks")
    parser.add_argument(
        "--save-at", type=int, default=6, help="without torchrun: the first run's steps"
    )
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        launch_both(args)
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        if args.resume:
            resume_fsdp(args.run_dir, args.steps)
        else:
            if dist.get_world_size() != STAGES * REPLICAS:
                raise SystemExit(f"start the pipeline run on {STAGES * REPLICAS} processes")
            train_pipeline(args.run_dir, args.steps)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
