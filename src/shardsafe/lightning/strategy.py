"""The Lightning strategies whose checkpoints are shardsafe checkpoints.

Each is a Lightning strategy with :class:`~.hooks.ShardsafeCheckpointing` put in front of
it: training is Lightning's own, untouched; only saving, loading and removing checkpoints
change (see :mod:`.hooks` for which hooks and why).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._namespace import lightning
from .hooks import ShardsafeCheckpointing

if TYPE_CHECKING:
    from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy
else:
    _strategies = lightning().strategies
    DDPStrategy = _strategies.DDPStrategy

    class _NoModelParallel(_strategies.Strategy):
        """Stands in for ``ModelParallelStrategy`` on Lightning 2.2, which has none."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError(
                "ShardsafeModelParallelStrategy needs Lightning's ModelParallelStrategy, "
                "added in Lightning 2.3: pip install -U 'shardsafe[lightning]'"
            )

    ModelParallelStrategy = getattr(_strategies, "ModelParallelStrategy", _NoModelParallel)


class ShardsafeDDPStrategy(ShardsafeCheckpointing, DDPStrategy):
    """Lightning's ``DDPStrategy`` whose checkpoints are shardsafe checkpoints.

    ``Trainer(strategy=ShardsafeDDPStrategy(layout="sharded"), accelerator=..., devices=N)``.
    ``trainer.save_checkpoint(path)`` and ``ModelCheckpoint`` write the directory ``path``
    (``.../epoch=0-step=5.ckpt``) on every rank, a ``ZeroRedundancyOptimizer`` or fairscale
    ``OSS`` returned by ``configure_optimizers`` without consolidating it;
    ``fit(ckpt_path=...)`` resumes from such a directory at any world size, or from an
    ordinary Lightning ``.ckpt`` file. ``local_checkpoint_dir="/dev/shm/run1",
    local_every=50`` adds a node-local tier that ``fit()`` and ``fit(ckpt_path="last")``
    resume from when it is newer (:mod:`.local_tier`). Keywords: see
    :class:`ShardsafeCheckpointing`; the rest go to ``DDPStrategy``.
    """


class ShardsafeModelParallelStrategy(ShardsafeCheckpointing, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism applied in
    ``configure_model``) whose checkpoints are shardsafe checkpoints instead of DCP's.

    Each rank writes its own DTensor shards (``layout="sharded"``) or streams them to rank 0
    (``"consolidated"``: plain, whole tensors); a resume reshards to any world size. It
    resumes from shardsafe checkpoints only: Lightning's model-parallel checkpoints are
    DCP directories, and a ``.ckpt`` file's whole tensors do not fit a sharded module.
    """

    reads_ckpt_files = False
