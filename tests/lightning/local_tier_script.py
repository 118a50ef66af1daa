"""``lightning_script.py``'s run with a local tier (``local_checkpoint_dir=...``).

    python tests/lightning/local_tier_script.py --root DIR --local-dir LOCAL
        [--local-every 5] [--every 10] [--devices N] [--max-steps 15] [--resume PATH|last]
        [--step-delay S] [--log NAME] [--fsdp]

The same module, data and loss log as ``lightning_script.py`` (a plain Adam and a StepLR
schedule; 5 steps an epoch on 2 ranks) under ``ShardsafeDDPStrategy`` (``--fsdp``: FSDP2
under ``ShardsafeModelParallelStrategy``), with ``ModelCheckpoint(every_n_train_steps=
--every, save_last=True)`` into ``DIR/ckpts`` as the persistent tier. After ``fit`` each
rank writes ``DIR/outcome-<rank>.json``: ``{"restored": {"step": ..., "tiers": [...]}}``
when the fit resumed from the local tier, else ``{"restored": null}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import warnings
from pathlib import Path

import pytorch_lightning as pl
from lightning_script import LossLog, Regression  # type: ignore[import-not-found]  # (its directory)
from pytorch_lightning.callbacks import ModelCheckpoint

from shardsafe.lightning import ShardsafeDDPStrategy, ShardsafeModelParallelStrategy
from tests.clean_exit import end_process


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--local-dir", required=True)
    p.add_argument("--local-every", type=int, default=5)
    p.add_argument("--keep-local", type=int, default=2)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=15)
    p.add_argument("--resume")
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--log", default="losses.jsonl")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 under ShardsafeModelParallelStrategy")
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--ema", action="store_true", help="Lightning's EMAWeightAveraging")
    args = p.parse_args()
    for name in ("pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    warnings.filterwarnings("always", message="shardsafe: ")  # shardsafe's own are shown
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    module = Regression("plain", fsdp=args.fsdp)
    module.step_delay = args.step_delay
    local = {
        "local_checkpoint_dir": args.local_dir,
        "local_every": args.local_every,
        "keep_local": args.keep_local,
    }
    strategy: ShardsafeDDPStrategy | ShardsafeModelParallelStrategy = (
        ShardsafeModelParallelStrategy(
            **local, data_parallel_size=args.devices, tensor_parallel_size=1
        )
        if args.fsdp
        else ShardsafeDDPStrategy(**local)
    )
    checkpoints = ModelCheckpoint(
        dirpath=root / "ckpts",
        every_n_train_steps=args.every,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        callbacks=[checkpoints, LossLog(root / args.log), *_averaging(args.ema)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(module, ckpt_path=args.resume)
    restored = strategy.local_restored
    outcome = None if restored is None else {"step": restored.step, "tiers": restored.tiers}
    rank = int(os.environ.get("LOCAL_RANK", 0))
    (root / f"outcome-{rank}.json").write_text(json.dumps({"restored": outcome}))
    end_process(0, wait_for_others=False)  # see tests/clean_exit.py


def _averaging(wanted: bool) -> list[pl.Callback]:
    """Lightning's EMAWeightAveraging, which edits the checkpoint's state_dict."""
    if not wanted:
        return []
    from pytorch_lightning.callbacks import EMAWeightAveraging

    return [EMAWeightAveraging(decay=0.9)]


if __name__ == "__main__":
    main()
