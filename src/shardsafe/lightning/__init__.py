"""shardsafe for PyTorch Lightning: sharded, resharding, pickle-free Lightning checkpoints.

::

    from shardsafe.lightning import ShardsafeDDPStrategy

    trainer = Trainer(strategy=ShardsafeDDPStrategy(layout="sharded"), accelerator="cpu",
                      devices=2, callbacks=[ModelCheckpoint(every_n_train_steps=5)])
    trainer.fit(model)                             # checkpoints are shardsafe directories
    trainer.fit(model, ckpt_path="ckpts/epoch=0-step=5.ckpt")   # resume, any world size
    model = load_from_checkpoint(MyModule, "ckpts/epoch=0-step=5.ckpt")   # one process

Needs ``pytorch-lightning>=2.2,<3`` (``pip install "shardsafe[lightning]"``) or the
``lightning`` package (``lightning.pytorch``); see :mod:`._namespace` for which is used.
``ShardsafeModelParallelStrategy`` does the same for Lightning's ``ModelParallelStrategy``
(FSDP2 / tensor parallelism in ``configure_model``; Lightning 2.3+). ``docs/lightning.md``
says what is saved, what resumes exactly, and why there is no variant
of Lightning's ``FSDPStrategy``.
"""

from __future__ import annotations

from .from_checkpoint import load_from_checkpoint
from .strategy import ShardsafeDDPStrategy, ShardsafeModelParallelStrategy

__all__ = ["ShardsafeDDPStrategy", "ShardsafeModelParallelStrategy", "load_from_checkpoint"]
