"""Where a prepared dataloader is in its data: what decides the order of its next batches.

Accelerate's ``save_state`` keeps a dataloader's sampler only for iterable datasets, and
its ``state_dict`` only with ``use_stateful_dataloader``. Kept here, for every prepared
dataloader: its epoch counter (``iteration``, which reseeds a seedable sampler's shuffle
at each epoch; Accelerate's default sampler draws from a generator of its own, which is
not saved, here or by Accelerate: ``docs/accelerate.md``), a
``SeedableRandomSampler``'s seed and epoch, and with a stateful dataloader its own
``state_dict`` (the position inside the epoch). Without a stateful dataloader, skip the
batches already seen inside the epoch with ``accelerator.skip_first_batches``, as with
Accelerate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class DataLoaderPosition:
    """A prepared dataloader's position, as a stateful object shardsafe saves."""

    def __init__(self, dataloader: Any, prepared: Sequence[Any] = ()) -> None:
        self.dataloader = dataloader
        self.prepared = prepared
        """Every dataloader the accelerator prepared (this one's siblings), to tell which
        of them a ``skip_first_batches`` copy of an iterable dataset's came from."""

    def state_dict(self) -> dict[str, Any]:
        iteration = int(getattr(self.dataloader, "iteration", 0))
        if _in_its_last_batch(self.dataloader, self.prepared):
            # Accelerate counts the epoch done only once its loop ends, after the last
            # batch: saved during it, the resumed loader replayed the finished epoch's
            # shuffle (its next ``__iter__`` reseeds the sampler from ``iteration``).
            iteration += 1
        state: dict[str, Any] = {"iteration": iteration}
        sampler = _seedable_sampler(self.dataloader)
        if sampler is not None:
            state["sampler"] = {"epoch": int(sampler.epoch), "seed": int(sampler.initial_seed)}
        if getattr(self.dataloader, "use_stateful_dataloader", False):
            state["dataloader"] = self.dataloader.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self.dataloader, "set_epoch"):
            self.dataloader.set_epoch(int(state["iteration"]))
        sampler = _seedable_sampler(self.dataloader)
        if sampler is not None and "sampler" in state:
            sampler.initial_seed = int(state["sampler"]["seed"])
            sampler.epoch = int(state["sampler"]["epoch"])
        if "dataloader" in state and getattr(self.dataloader, "use_stateful_dataloader", False):
            self.dataloader.load_state_dict(state["dataloader"])

    def __repr__(self) -> str:
        return f"DataLoaderPosition({type(self.dataloader).__name__})"


def _seedable_sampler(dataloader: Any) -> Any:
    from accelerate.data_loader import SeedableRandomSampler

    get = getattr(dataloader, "get_sampler", None)
    sampler = get() if callable(get) else None
    return sampler if isinstance(sampler, SeedableRandomSampler) else None


def _in_its_last_batch(dataloader: Any, prepared: Sequence[Any]) -> bool:
    """Whether ``dataloader`` has handed out the last batch of an epoch whose loop has
    not ended yet: it is still the accelerator's active dataloader, or the active one is
    its ``skip_first_batches`` copy (a resumed epoch's rest, which counts its own epochs:
    saved in its last batch, the counter was one behind, and the next resume replayed
    the finished epoch's shuffle)."""
    gradient_state = getattr(dataloader, "gradient_state", None)
    active = getattr(gradient_state, "active_dataloader", None)
    if active is None or not getattr(active, "end_of_dataloader", False):
        return False
    return active is dataloader or _skips_into(active, dataloader, prepared)


def _skips_into(active: Any, dataloader: Any, prepared: Sequence[Any]) -> bool:
    """Whether ``active`` is what ``accelerator.skip_first_batches(dataloader, n)`` made:
    a loader of the same dataset whose batches come from a ``SkipBatchSampler`` over
    ``dataloader``'s (an iterable dataset's: one that skips batches itself, and that only
    ``dataloader`` of the prepared ones could have made)."""
    from accelerate.data_loader import SkipBatchSampler

    dataset = getattr(dataloader, "dataset", None)
    if dataset is None or getattr(active, "dataset", None) is not dataset:
        return False
    ours = [getattr(dataloader, "batch_sampler", None), getattr(dataloader, "sampler", None)]
    for skipping in (getattr(active, "batch_sampler", None), getattr(active, "sampler", None)):
        if isinstance(skipping, SkipBatchSampler):
            return any(skipping.batch_sampler is s for s in ours if s is not None)
    # An iterable dataset's copy skips batches itself, and names no loader it came from:
    # it takes its batch size and epoch counter from it. Another prepared loader over the
    # same dataset object (an evaluation loader) that matches as well makes it ambiguous:
    # then no counter moves (before, the evaluation loader's was bumped too).
    if not getattr(active, "skip_batches", 0):
        return False
    matching = [d for d in prepared or [dataloader] if _could_have_made(active, d)]
    return len(matching) == 1 and matching[0] is dataloader


def _could_have_made(active: Any, dataloader: Any) -> bool:
    return (
        getattr(dataloader, "dataset", None) is getattr(active, "dataset", None)
        and getattr(active, "batch_size", None) == getattr(dataloader, "batch_size", None)
        and getattr(active, "iteration", None) == getattr(dataloader, "iteration", None)
    )
