"""A Lightning training run as a user writes it, driven by the tests in this directory.

    python tests/lightning/lightning_script.py --root DIR [--optimizer zero|oss|plain]
        [--devices N] [--max-steps N] [--resume PATH|last] [--step-delay S] [--layout L]
        [--log NAME] [--fail-rank R --fail-step S] [--bad-hparam] [--save-last]
        [--dump-restored FILE] [--save-at-end NAME] [--lightning-ddp] [--fsdp]
        [--dirpath NAME|URL] [--save-last [link]] [--fail-everywhere STEP]
        [--filename F --every N --top-k K] [--slow-commit S] [--slow-write S]

``Trainer(accelerator="cpu", devices=N, strategy=ShardsafeDDPStrategy(...))``: Lightning's
launcher runs this script again for every other rank (``--lightning-ddp``: Lightning's
own ``"ddp"`` strategy and ``.ckpt`` files instead; ``--fsdp``: FSDP2 in ``configure_model``
under ``ShardsafeModelParallelStrategy``). A small regression with Adam
(plain, or wrapped by the user in ZeroRedundancyOptimizer or fairscale OSS) and a StepLR
schedule; ``ModelCheckpoint(every_n_train_steps=5, save_top_k=2, monitor="step",
mode="max")`` into ``DIR/ckpts`` (``--dirpath``: another name, or a URL). 40 samples, 4
per rank and batch: an epoch is 5 steps on 2 ranks, so every checkpoint falls on an epoch
boundary.

What it leaves for the tests: ``DIR/<NAME>`` (``--log``, default ``losses.jsonl``; rank 0:
step and loss, one line per step, written as it goes), ``DIR/outcome-<rank>.json`` (how
``fit`` ended on each rank, with its pid), and with ``--dump-restored`` the optimizer
state and weights as they are right after a resume, gathered into torch's format on
rank 0. ``--save-at-end NAME``
calls ``trainer.save_checkpoint(DIR/NAME)`` twice after ``fit`` (the second replaces the
first).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader, TensorDataset

from shardsafe.interop import gather_optimizer_state_dict
from shardsafe.lightning import ShardsafeDDPStrategy, ShardsafeModelParallelStrategy
from tests.clean_exit import end_process

SAMPLES, BATCH = 40, 4


class Regression(pl.LightningModule):
    def __init__(
        self, optimizer: str, lr: float = 0.05, activation: Any = None, fsdp: bool = False
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.step_delay = 0.0

    def configure_model(self) -> None:
        """With ``fsdp``: FSDP2 on every layer and the root, as ModelParallelStrategy wants."""
        if self.hparams["fsdp"]:
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(self.step_delay)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        kind, lr = self.hparams["optimizer"], self.hparams["lr"]
        if kind == "zero":
            opt: Any = ZeroRedundancyOptimizer(
                self.parameters(), optimizer_class=torch.optim.Adam, lr=lr
            )
        elif kind == "oss":
            from fairscale.optim import OSS

            opt = OSS(self.parameters(), optim=torch.optim.Adam, lr=lr)
        else:
            opt = torch.optim.Adam(self.parameters(), lr=lr)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> Any:
        return batch[0], self.net(batch[0])

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(SAMPLES, 16, generator=g)
        y = x @ torch.randn(16, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def evaluation_data() -> tuple[torch.Tensor, torch.Tensor]:
    """16 held-out samples of the same rule: what validate, test and predict run on."""
    g = torch.Generator().manual_seed(1)
    rule = torch.randn(SAMPLES, 16, generator=g), torch.randn(16, 1, generator=g)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(2))
    return x, x @ rule[1]


class LossLog(Callback):
    """Rank 0 appends each step's loss as it goes, so a test can kill the run mid-way."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *_: Any) -> None:
        if trainer.is_global_zero:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss": float(outputs["loss"])}))
                f.write("\n")


class FailingState(Callback):
    """Its state_dict raises on one rank from a given step on: a bug in a user's callback."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step
        self.trainer: pl.Trainer | None = None

    def setup(self, trainer: pl.Trainer, module: Any, stage: str) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        if trainer and trainer.global_rank == self.rank and trainer.global_step >= self.step:
            raise RuntimeError(f"state_dict failed on purpose on rank {self.rank}")
        return {"calls": 1}


class FailEverywhere(Callback):
    """Raises on every rank at the end of a given step: a bug in the training code."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"training failed on purpose at step {self.step}")


class DumpRestored(Callback):
    """Right after a resume, before any step: the live optimizer state and weights."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
        optimizer = trainer.optimizers[0]
        if module.hparams["fsdp"]:  # DTensor shards: gathered whole (on rank 0) by torch
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights, by_name = get_state_dict(module, [optimizer], options=options)
            names = [n for n, _ in module.named_parameters()]
            gathered = indexed(by_name, names) if trainer.is_global_zero else None
        else:
            gathered = gather_optimizer_state_dict(optimizer, module)
            weights = {k: v.clone() for k, v in module.state_dict().items()}
        if trainer.is_global_zero:
            torch.save({"optimizer": gathered, "model": weights}, self.path)


def indexed(by_name: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name, in torch's index-keyed format."""
    index = {name: i for i, name in enumerate(names)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]
    return {"state": {index[n]: s for n, s in by_name["state"].items()}, "param_groups": groups}


def main() -> None:
    args = parse()
    if args.slow_commit or args.slow_write:
        slow_saves(args.slow_write, args.slow_commit)
    for name in ("pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    # A class as a hyper-parameter: picklable (Lightning keeps it), but not JSON.
    activation = nn.ReLU if args.bad_hparam else None
    module = Regression(args.optimizer, activation=activation, fsdp=args.fsdp)
    module.step_delay = args.step_delay
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy(args),
        max_steps=args.max_steps,
        callbacks=callbacks(args, root),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    outcome = root / f"outcome-{int(os.environ.get('LOCAL_RANK', 0))}.json"
    try:
        if args.evaluate is not None:
            evaluate(trainer, module, args, root)
            outcome.write_text(json.dumps({"pid": os.getpid(), "error": None}))
            end_process(0, wait_for_others=False)  # see tests/clean_exit.py
        else:
            trainer.fit(module, ckpt_path=args.resume)
            if args.validate_best:  # where Lightning knows a best checkpoint: after a fit
                args.evaluate, args.resume = "validate", "best"
                evaluate(trainer, module, args, root)
        if args.save_at_end:
            for _ in range(2):
                trainer.save_checkpoint(beside(root, args.save_at_end))
    except BaseException as e:
        outcome.write_text(json.dumps({"pid": os.getpid(), "error": f"{type(e).__name__}: {e}"}))
        traceback.print_exc()
        # After a failed fit, torch's teardown at exit aborted rank 0 about 1 run in 15
        # here, even after destroy_process_group(): see tests/clean_exit.py.
        end_process(1, wait_for_others=False)
    outcome.write_text(json.dumps({"pid": os.getpid(), "error": None}))
    end_process(0, wait_for_others=False)  # the strategy's teardown destroyed the group


def slow_saves(before_write: float, before_name: float) -> None:
    """Each save's data files start ``before_write`` seconds late (in the writer, not in
    the training loop), and each save takes its name ``before_name`` seconds after its
    commit (a slow disk): a background save is still without its name, uncommitted or
    committed, when the next steps run."""
    from shardsafe.checkpoint.storage import local, placement

    create, publish = local.LocalStorage.create, placement.Placement.publish

    def late_create(self: local.LocalStorage, name: str, size_hint: int = 0) -> Any:
        if name.endswith(".safetensors"):
            time.sleep(before_write)
        return create(self, name, size_hint)

    def late_publish(self: placement.Placement) -> None:
        time.sleep(before_name)
        publish(self)

    local.LocalStorage.create = late_create  # type: ignore[method-assign]
    placement.Placement.publish = late_publish  # type: ignore[method-assign]


def evaluate(trainer: pl.Trainer, module: Any, args: argparse.Namespace, root: Path) -> None:
    """``trainer.validate/test/predict(ckpt_path=args.resume)``; each rank writes what it got."""
    rank = trainer.global_rank
    loader = DataLoader(TensorDataset(*evaluation_data()), batch_size=BATCH)
    if args.evaluate == "predict":
        batches = trainer.predict(module, loader, ckpt_path=args.resume)
        torch.save(batches, root / f"predicted-{rank}.pt")
        return
    run = trainer.validate if args.evaluate == "validate" else trainer.test
    metrics = run(module, loader, ckpt_path=args.resume, verbose=False)
    (root / f"{args.evaluate}-{rank}.json").write_text(json.dumps(metrics))


def strategy(args: argparse.Namespace) -> Any:
    if args.lightning_ddp:
        return "ddp"
    if args.fsdp:
        return ShardsafeModelParallelStrategy(
            layout=args.layout,
            data_parallel_size=args.devices,
            tensor_parallel_size=1,
            async_save=args.async_save,
        )
    return ShardsafeDDPStrategy(layout=args.layout, async_save=args.async_save)


def beside(root: Path, name: str) -> str | Path:
    """``root/name``, or ``name`` itself if it is a URL."""
    return name if "://" in name else root / name


def callbacks(args: argparse.Namespace, root: Path) -> list[Callback]:
    found: list[Callback] = [
        ModelCheckpoint(
            dirpath=beside(root, args.dirpath),
            filename=args.filename,
            every_n_train_steps=args.every,
            save_top_k=args.top_k,
            monitor="step",
            mode="max",
            save_last=args.save_last,
        ),
        LossLog(root / args.log),
    ]
    if args.fail_rank is not None:
        found.append(FailingState(args.fail_rank, args.fail_step))
    if args.fail_everywhere is not None:  # and Lightning's checkpoint on exception
        found += [FailEverywhere(args.fail_everywhere), OnExceptionCheckpoint(root)]
    if args.dump_restored:
        found.append(DumpRestored(Path(args.dump_restored)))
    return found


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--optimizer", choices=["zero", "oss", "plain"], default="zero")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=15)
    p.add_argument("--resume")
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--layout", default="sharded")
    p.add_argument("--fail-rank", type=int)
    p.add_argument("--fail-step", type=int, default=10)
    p.add_argument("--fail-everywhere", type=int)
    p.add_argument("--bad-hparam", action="store_true")
    p.add_argument("--save-last", nargs="?", const=True, default=False)  # or "link"
    p.add_argument("--dirpath", default="ckpts")  # under --root, or a URL (s3://...)
    p.add_argument("--dump-restored")
    p.add_argument("--log", default="losses.jsonl")
    p.add_argument("--save-at-end")
    p.add_argument("--lightning-ddp", action="store_true")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--filename")  # ModelCheckpoint's (default: Lightning's "{epoch}-{step}")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--slow-commit", type=float, default=0.0)  # seconds before each publish
    p.add_argument("--slow-write", type=float, default=0.0)  # seconds before each write
    p.add_argument("--evaluate", choices=["validate", "test", "predict"])
    p.add_argument("--validate-best", action="store_true", help="after the fit, in its Trainer")
    return p.parse_args()


if __name__ == "__main__":
    main()
