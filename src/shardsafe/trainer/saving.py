"""Writing a run's checkpoints: to ``run_dir/checkpoints`` only, or to a local tier too.

:class:`Saving` writes the persistent checkpoints (every ``checkpoint_every`` steps and at
the last step), blocking or in the background (``async_save``).

:class:`TieredSaving` (``local_checkpoint_dir``) adds the local tier of a
:class:`~shardsafe.TieredCheckpointManager`: every ``local_every`` steps each rank's own
state goes to the node-local directory (written in the background once staged when
``async_save``, else on disk when the step returns; replicated to peer nodes in the
background either way). The persistent checkpoints are still the Trainer's own: the
tiered manager is built with ``persist_every=None`` and the Trainer saves through its
``persistent`` :class:`~shardsafe.CheckpointManager` itself, because the Trainer's
cadence also saves the last step, with the run's ``layout``, and overlaps an async
save's copies with the next step, none of which the tiered manager's own persistent
saves do. Both tiers are therefore one manager's, which ``load_latest`` chooses between.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from .. import _warnings
from ..checkpoint.background import SaveHandle
from ..checkpoint.manager import CheckpointManager
from ..errors import CheckpointError
from ..tiers import TieredCheckpointManager
from .config import TrainerConfig
from .metrics import say


class Saving:
    """The run's persistent checkpoints, blocking or in the background (``async_save``)."""

    def __init__(self, manager: CheckpointManager, config: TrainerConfig) -> None:
        self.manager, self.config = manager, config
        self.pending: SaveHandle | None = None
        self.forward_changes_state = False
        """Whether the forward changes saved tensors in place: a module with buffers
        (BatchNorm's running statistics; under DDP, rank 0's buffers broadcast into the
        others'). Its async save's copies to host then land before the forward; otherwise
        they overlap the forward and backward and land before the optimizer step."""

    def due(self, step: int) -> bool:
        """Whether anything is saved after ``step``."""
        return self.config.checkpoint_due(step)

    def save(self, step: int, state: dict[str, Any]) -> str | None:
        """Save ``step``; return the newest committed checkpoint, if this call knows one."""
        if not self.config.async_save:
            return self.manager.save(step, state, self.config.save_options)
        done = self.manager.wait() if self.pending is not None else None  # one in flight
        self.pending = self.manager.async_save(step, state, self.config.save_options, overlap=True)
        return done

    def staged(self) -> None:
        """Before parameters change: an async save's copies must have landed."""
        if self.pending is not None:
            self.pending.wait_staged()

    def before_forward(self) -> None:
        """Before the forward: the copies must have landed if it changes saved tensors
        (a CUDA copy on the staging stream would otherwise race the forward's in-place
        updates, and the checkpoint hold the next step's buffers beside this step's
        parameters)."""
        if self.forward_changes_state:
            self.staged()

    def finish(self) -> str | None:
        """Wait for the last save; its path once committed (its error otherwise)."""
        self.pending = None
        return self.manager.wait()

    def close(self) -> None:
        """Nothing to let go of: the root's lock goes with the process."""

    def settle(self) -> None:
        """After the run failed: wait for the save in flight, its error dropped (the run's
        is the one raised), and let go of what :meth:`close` does. Left running, it went
        on writing after ``fit`` had raised, and a ``fit(resume="latest")`` retried in the
        same process (a notebook's cell run again) looked for the newest step while it
        was being committed, resumed the one before, and was refused: a newer step was
        there by the time it started."""
        self.pending = None
        with contextlib.suppress(Exception):
            self.manager.wait()
        with contextlib.suppress(Exception):
            self.close()


class TieredSaving(Saving):
    """:class:`Saving`, and every ``local_every`` steps the local tier (module docstring)."""

    def __init__(self, tiered: TieredCheckpointManager, config: TrainerConfig) -> None:
        super().__init__(tiered.persistent, config)
        self.tiered = tiered

    def due(self, step: int) -> bool:
        return self.tiered.due(step)[0] or super().due(step)

    def save(self, step: int, state: dict[str, Any]) -> str | None:
        if self.tiered.due(step)[0]:
            if self.config.async_save:
                self.tiered.async_save(step, state)  # returns once staged
            else:
                self.tiered.save(step, state)  # returns once on the node's disk
        return super().save(step, state) if super().due(step) else None

    def finish(self) -> str | None:
        """Wait for the last persistent save (raising its error) and for the local tier.

        A failed local write or replication was warned about when it happened and only
        makes the local tier older; the persistent checkpoints are whole, so it does not
        fail a run that has finished."""
        path = super().finish()
        try:
            self.tiered.wait()
        except CheckpointError as e:
            _warnings.warn(
                f"shardsafe: the local tier missed a step during this run ({e}); the "
                f"checkpoints in {self.config.checkpoint_dir} are unaffected",
            )
        return path

    def close(self) -> None:
        """Stop the local tier's threads (everything in flight is done by then)."""
        self.tiered.close()

    def settle(self) -> None:
        """:meth:`Saving.settle`, and the local tier's writes and replications too."""
        with contextlib.suppress(Exception):
            self.tiered.wait()
        super().settle()


def open_tiers(config: TrainerConfig, leader: bool) -> TieredCheckpointManager:
    """The run's tiered manager (collective: every rank builds it at the same point).

    One replica per rank where the run spans several nodes. On one node there is none
    to make; the manager warns about that, which a Trainer run would repeat at every
    start, so rank 0 says it once in the run's log instead, with the rest of the setup.
    """
    assert config.local_checkpoint_dir is not None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"shardsafe: replicas=", category=UserWarning)
        tiered = TieredCheckpointManager(
            config.checkpoint_dir,
            config.local_checkpoint_dir,
            local_every=config.local_every,
            keep_local=config.keep_local,
            persist_every=None,  # the Trainer saves the persistent tier itself (see above)
            keep_last=config.keep_last,
        )
    if leader:
        copies = (
            f"copied to {tiered.replicas} other node(s)"
            if tiered.replicas
            else "one node, so no copy elsewhere: a lost node loses them, not run_dir's"
        )
        say(
            f"local tier: each rank's state every {config.local_every} step(s) in "
            f"{config.local_checkpoint_dir}; {copies}"
        )
    return tiered
