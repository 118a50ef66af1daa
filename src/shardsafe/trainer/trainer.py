"""``Trainer``: runs a :class:`TrainingModule` with a strategy, checkpoints and resumes it."""

from __future__ import annotations

from ..checkpoint.format.manifest_format import Layout
from ..strategies import STRATEGIES
from ..tiers.manager import LOCAL_DEFAULTS
from .config import TrainerConfig
from .data import loader_spec
from .failures import reported_and_fatal, say_interrupted
from .launcher import INTERRUPTED, current_environment, launch, script_command
from .loop import FitResult, train
from .module import TrainingModule
from .resuming import find_checkpoint, interrupted_message


class Trainer:
    """Train with checkpoints that survive crashes and resume exactly::

        trainer = shardsafe.Trainer(strategy="ddp", devices=2, max_steps=1000,
                                    checkpoint_every=100, run_dir="runs/exp1")
        trainer.fit(MyModule(), resume="latest")

    ``devices=N`` in a plain ``python train.py`` makes this process a launcher: it runs the
    script again as N workers (as torchrun would) and exits with their status, so code
    after ``fit`` runs only in the workers. Under torchrun, ``fit`` joins torchrun's
    process group instead; the two give identical results.

    Checkpoints go to ``run_dir/checkpoints`` (one per ``checkpoint_every`` steps and at
    the end); rank 0 appends each step's loss, averaged over ranks, to
    ``run_dir/metrics.jsonl``. See :class:`TrainerConfig` for every setting.

    ``local_checkpoint_dir="/dev/shm/exp1"`` adds a local tier
    (:class:`shardsafe.TieredCheckpointManager`): every ``local_every`` steps each rank
    also saves its own state on its node's disk (copied to a rank on another node when
    the run spans several), and ``resume="latest"`` continues from the newest step of
    either tier, printing which one. ``run_dir/checkpoints`` keeps its cadence.
    """

    def __init__(
        self,
        *,
        max_steps: int,
        run_dir: str,
        strategy: str = "single",
        devices: int = 1,
        checkpoint_every: int | None = None,
        layout: Layout = "sharded",
        seed: int = 0,
        keep_last: int | None = None,
        batch_size: int | None = None,
        async_save: bool = False,
        local_checkpoint_dir: str | None = None,
        local_every: int = LOCAL_DEFAULTS["local_every"],
        keep_local: int = LOCAL_DEFAULTS["keep_local"],
    ) -> None:
        self.config = TrainerConfig(
            max_steps=max_steps,
            run_dir=run_dir,
            strategy=strategy,
            devices=devices,
            checkpoint_every=checkpoint_every,
            layout=layout,
            seed=seed,
            keep_last=keep_last,
            batch_size=batch_size,
            async_save=async_save,
            local_checkpoint_dir=local_checkpoint_dir,
            local_every=local_every,
            keep_local=keep_local,
        )

    def fit(
        self, module: TrainingModule, data: object = None, *, resume: str | None = None
    ) -> FitResult:
        """Train ``module`` to ``max_steps``; call it on every process (like ``save``).

        ``data``: a ``DataLoader`` or map-style ``Dataset``, if the module has no
        ``train_dataloader()``. ``resume``: ``None`` starts a new run (refused if
        ``run_dir`` holds checkpoints), ``"latest"`` continues from the newest committed
        checkpoint (or starts if there is none), a path continues from that checkpoint.
        With a local tier, ``"latest"`` takes the newest step of either tier.
        """
        if not isinstance(module, TrainingModule):
            raise TypeError(
                f"fit() needs a shardsafe.TrainingModule, got {type(module).__name__}; "
                "subclass TrainingModule and define training_step and configure_optimizers"
            )
        if data is not None:
            loader_spec(data, self.config.batch_size)  # a bad one fails here, not in N workers
        env = current_environment(self.config.devices)
        if env is None:
            find_checkpoint(self.config, resume)  # refuse a bad resume once, before launching
            status = launch(script_command(), self.config.devices)
            if status == INTERRUPTED:
                say_interrupted(self._interrupted)
            raise SystemExit(status)
        strategy = STRATEGIES[self.config.strategy](env)
        with reported_and_fatal(env, self._interrupted):
            try:
                strategy.setup()
                result = train(module, data, strategy, self.config, resume)
            except BaseException:
                strategy.abandon()
                raise
            strategy.teardown()
        return result

    def _interrupted(self) -> str:
        """What a run stopped by Ctrl-C says: the last good checkpoint, and how to go on."""
        return interrupted_message(self.config)
