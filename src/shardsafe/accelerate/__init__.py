"""shardsafe for Hugging Face Accelerate: ``save_state``/``load_state`` that are sharded,
pickle-free, resharding and optionally asynchronous.

::

    from shardsafe.accelerate import load_state, save_state

    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    save_state(accelerator, "ckpts/step-100")                  # every process
    handle = save_state(accelerator, "ckpts/step-200", async_save=True)   # staged now
    load_state(accelerator, "ckpts/step-200")                  # any number of processes

What Accelerate's own ``save_state`` saves (models, optimizers, schedulers, the gradient
scaler, every process's RNGs, ``accelerator.step``, objects registered with
``register_for_checkpointing``) is saved, each in the layout shardsafe gives it:
``state_of(accelerator)`` is that state, for ``shardsafe.save``, ``CheckpointManager`` or
``TieredCheckpointManager``. Needs ``accelerate>=1.0`` (``pip install
"shardsafe[accelerate]"``). ``docs/accelerate.md`` says what differs from Accelerate.
"""

from __future__ import annotations

from .state import load_state, save_state, state_of

__all__ = ["load_state", "save_state", "state_of"]
