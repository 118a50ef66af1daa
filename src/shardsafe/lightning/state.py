"""What a Lightning checkpoint becomes in shardsafe: the entries of the ``state`` it saves.

Lightning builds one dict per save (``_CheckpointConnector.dump_checkpoint``) and hands it
to the strategy. Two of its parts are replaced by the live objects, so that shardsafe's
adapters save them without anything being gathered:

========== =================================================================
entry      what it holds
========== =================================================================
model      the LightningModule (``model/<name>``, its ``state_dict()`` names)
optimizer  the first optimizer, keyed by parameter name (``optimizer_1``, ... for more):
           plain, ``ZeroRedundancyOptimizer`` or fairscale ``OSS``, never consolidated
lightning  everything else Lightning put in the dict: epoch, global_step, loops,
           callbacks, lr_schedulers, precision plugin, hyper_parameters, datamodule
           state, what ``on_save_checkpoint`` hooks added; as JSON and tensors
========== =================================================================

If an ``on_save_checkpoint`` hook replaced or edited ``checkpoint["state_dict"]``, the
edited dict is what gets saved (inside ``lightning``, as tensors) instead of the module.

Lightning gathers that dict *before* calling the strategy, so an exception there (a
callback's ``state_dict`` raising on one rank) would end that rank alone while the
others wait in the save. :func:`guard_dump` makes the gathering hand its exception to the
save instead, where shardsafe agrees it on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.optim import Optimizer

from ..distributed.reports import error_message
from ..errors import CheckpointError
from . import hparams

MODEL = "model"
LIGHTNING = "lightning"
STATE_DICT = "state_dict"
OPTIMIZER_STATES = "optimizer_states"
_GUARDED = "_shardsafe_guarded"


def optimizer_names(count: int) -> list[str]:
    """The state entries of ``count`` optimizers: ``optimizer``, ``optimizer_1``, ..."""
    return ["optimizer"] + [f"optimizer_{i}" for i in range(1, count)]


def real_optimizers(optimizers: Sequence[Optimizer]) -> list[Optimizer]:
    """``optimizers`` without Lightning's stand-in for a module that has none
    (``configure_optimizers`` returning ``None``: Lightning trains nothing and keeps one
    ``_MockOptimizer``, whose ``state_dict()`` is ``{}``). Saved as an optimizer, it failed
    every save with ``KeyError: 'state'``; it has no state to save or restore."""
    return [o for o in optimizers if type(o).__name__ != "_MockOptimizer"]


class FailedDump(dict[str, Any]):
    """What the guarded ``dump_checkpoint`` returns on this rank when it raised."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error


def guard_dump(connector: Any) -> None:
    """Make ``connector.dump_checkpoint`` return a :class:`FailedDump` instead of raising.

    ``Trainer.save_checkpoint`` calls it and then the strategy's ``save_checkpoint`` with
    what it returned; the strategy turns a failure into a save that fails on every rank.
    Installed once per connector (the Trainer's ``_checkpoint_connector``).
    """
    dump = connector.dump_checkpoint
    if getattr(dump, _GUARDED, False):
        return

    @functools.wraps(dump)
    def guarded(weights_only: bool | None = None) -> dict[str, Any]:
        try:
            checkpoint: dict[str, Any] = dump(weights_only)
            return checkpoint
        except Exception as e:  # agreed by the save that follows, on every rank
            return FailedDump(e)

    setattr(guarded, _GUARDED, True)
    setattr(connector, "dump_checkpoint", guarded)  # noqa: B010 - an instance attribute


class _Failure:
    """Stands in for the state of a rank that could not gather it: saving it raises, inside
    shardsafe's collect phase, so every rank ends the save with this error."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def state_dict(self) -> dict[str, Any]:
        raise CheckpointError(
            "gathering Lightning's checkpoint (Trainer.save_checkpoint -> dump_checkpoint: "
            f"callbacks, hooks, loops) failed: {error_message(self.error)}"
        ) from self.error

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # pragma: no cover - never loaded
        raise AssertionError("a failed save has no state to load")


def failed_state(error: Exception) -> dict[str, Any]:
    """The ``state`` of a rank whose part of the save failed before ``shardsafe.save``."""
    return {LIGHTNING: _Failure(error)}


@dataclass
class StateDictRecord:
    """The model state dict handed to Lightning, to tell later whether a hook edited it."""

    returned: dict[str, Any] | None = None
    ids: dict[str, int] = field(default_factory=dict)

    def record(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.returned = state_dict
        self.ids = {k: id(v) for k, v in state_dict.items()}
        return state_dict

    def unchanged(self, state_dict: object) -> bool:
        """True if ``state_dict`` is the recorded dict, with the same keys and tensors."""
        if state_dict is not self.returned or not isinstance(state_dict, dict):
            return False
        return {k: id(v) for k, v in state_dict.items()} == self.ids


def save_state(
    checkpoint: Mapping[str, Any],
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    record: StateDictRecord,
) -> dict[str, Any]:
    """The ``state`` for ``shardsafe.save`` from Lightning's checkpoint dict (see above)."""
    rest = hparams.plain(checkpoint)
    state: dict[str, Any] = {}
    model_state = rest.pop(STATE_DICT, None)
    edited = not record.unchanged(model_state)
    if not edited:
        state[MODEL] = module
    elif model_state is not None:
        rest[STATE_DICT] = model_state  # edited by a hook: saved as it now is
    optimizers = real_optimizers(optimizers)
    if rest.pop(OPTIMIZER_STATES, None) is not None:  # absent from weights-only checkpoints
        if not optimizers:  # a full checkpoint all the same: Lightning's stand-in only
            rest[OPTIMIZER_STATES] = []
        if edited and optimizers:
            # The optimizers' state is keyed by the module's parameter names, so the module
            # is saved too; a load restores it, then applies the edited dict over it after
            # on_load_checkpoint, as Lightning does (restore.load_directory).
            state[MODEL] = module
        state.update(zip(optimizer_names(len(optimizers)), optimizers))
    state[LIGHTNING] = rest
    return state
