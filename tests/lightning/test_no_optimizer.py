"""A LightningModule whose ``configure_optimizers`` returns ``None`` (Lightning allows it,
with a warning, and keeps one placeholder optimizer, ``_MockOptimizer``).

The strategy saved the placeholder as an optimizer, and every save failed with
``CheckpointError: KeyError: 'state'``; with the save mended, a resume would have failed
on Lightning's "checkpoint contains only the model" (no optimizer state at all). Now the
placeholder is left out, the checkpoint is still a full one, and the run resumes: one
process, a real ``Trainer`` on CPU, as Lightning's own "ddp" strategy does it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from shardsafe.lightning import ShardsafeDDPStrategy

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def as_it_was() -> Iterator[None]:
    """Lightning's strategy, run in this process, makes the default process group and sets
    its variables (``MASTER_ADDR``, ``WORLD_SIZE``, ...); the tests after this one expect
    neither."""
    before = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(before)


class NoOptimizer(pl.LightningModule):
    """Trained by hand (manual optimization, no optimizer): its weights change each step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.net.weight.add_(0.5)

    def configure_optimizers(self) -> None:
        return None

    def train_dataloader(self) -> DataLoader[Any]:
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def trainer(epochs: int) -> pl.Trainer:
    return pl.Trainer(
        strategy=ShardsafeDDPStrategy(),
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def test_a_module_without_optimizers_saves_and_resumes(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's "no optimizer" and CPU warnings
        first = trainer(1)
        trained = NoOptimizer()
        first.fit(trained)
        first.save_checkpoint(tmp_path / "a.ckpt")
        assert (tmp_path / "a.ckpt" / "manifest.json").is_file()  # a shardsafe checkpoint
        second = trainer(2)
        resumed = NoOptimizer()
        second.fit(resumed, ckpt_path=tmp_path / "a.ckpt")
    assert second.current_epoch == 2
    # 2 batches an epoch: the saved weights (+1.0) and one more epoch (+1.0)
    assert torch.equal(resumed.net.weight, trained.net.weight + 1.0)
