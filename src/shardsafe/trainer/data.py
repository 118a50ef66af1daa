"""Resumable data order: which samples each rank trains on, and where an epoch stands.

The trainer draws sample indices itself instead of iterating the user's ``DataLoader``,
for two reasons:

* **Resume without replay.** Each epoch has one global order (a permutation seeded by
  ``seed + epoch``, the same on every rank). Step ``k`` of the epoch consumes positions
  ``[k*B*W, (k+1)*B*W)`` of that order, rank ``r`` taking every ``W``-th of them. So the
  samples consumed so far are always a *prefix* of the order, and the data position is
  one number: ``(epoch, position)``. A resumed run starts its batch sampler at
  ``position`` and never loads the batches already trained on.
* **Any world size.** Because the position counts samples of the global order, a run
  resumed with a different number of ranks simply splits the rest of the epoch across
  the new ranks.

Every step consumes exactly ``B*W`` samples; an epoch's remainder smaller than that is
dropped (the next epoch is a new permutation, so no sample is favoured).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)


@dataclass(frozen=True)
class LoaderSpec:
    """What the trainer keeps of the user's ``DataLoader``: everything but its sampler."""

    dataset: Dataset[Any]
    batch_size: int
    shuffle: bool
    collate_fn: Callable[[list[Any]], Any] | None = None
    num_workers: int = 0
    pin_memory: bool = False
    worker_init_fn: Callable[[int], None] | None = None


def loader_spec(source: object, batch_size: int | None) -> LoaderSpec:
    """Read a ``DataLoader`` (or a map-style ``Dataset`` plus ``batch_size``) into a spec."""
    if isinstance(source, DataLoader):
        if batch_size is not None and batch_size != source.batch_size:
            # Trainer(batch_size=...) is for a Dataset; a loader's own one was used silently.
            raise ValueError(
                f"Trainer(batch_size={batch_size}) applies to a Dataset passed to fit(), but the "
                f"data is a DataLoader with batch_size={source.batch_size}; leave one of them out"
            )
        return _from_loader(source)
    if isinstance(source, IterableDataset):
        raise ValueError(_ITERABLE)
    if isinstance(source, Dataset) and isinstance(source, Sized):
        if batch_size is None:
            raise ValueError(
                "fit() was given a Dataset but no batch size; pass Trainer(batch_size=...) "
                "or a DataLoader(dataset, batch_size=..., shuffle=True)"
            )
        return LoaderSpec(source, batch_size, shuffle=True)
    raise ValueError(
        "no training data: return a DataLoader from train_dataloader(), or pass a DataLoader "
        f"or a map-style Dataset to fit(); got {type(source).__name__}"
    )


_ITERABLE = (
    "an IterableDataset cannot be resumed exactly (its position cannot be skipped to); "
    "use a map-style Dataset (with __len__ and __getitem__)"
)


def _from_loader(loader: DataLoader[Any]) -> LoaderSpec:
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(_ITERABLE)
    if loader.batch_size is None:
        # batch_size=None (no batching) has no batch_sampler: it was named as the cause.
        how = "with a batch_sampler" if loader.batch_sampler is not None else "with batch_size=None"
        raise ValueError(
            f"the DataLoader was built {how}; the trainer needs batch_size= "
            "(and shuffle=) to split batches across ranks and resume mid-epoch"
        )
    sampler = loader.sampler
    # Exactly these classes: a subclass, or a RandomSampler of another num_samples, draws
    # an order (or an epoch length) the trainer's own would silently replace.
    plain_random = (
        type(sampler) is RandomSampler
        and not sampler.replacement
        and sampler.num_samples == len(loader.dataset)  # type: ignore[arg-type]
    )
    if plain_random:
        shuffle = True
    elif type(sampler) is SequentialSampler:
        shuffle = False
    elif isinstance(sampler, DistributedSampler):
        shuffle = sampler.shuffle
    else:
        raise ValueError(
            f"the DataLoader uses a {type(sampler).__name__}, which the trainer cannot resume "
            "mid-epoch; build it with shuffle=True or shuffle=False and no sampler"
        )
    return LoaderSpec(
        loader.dataset,
        loader.batch_size,
        shuffle,
        loader.collate_fn,
        loader.num_workers,
        loader.pin_memory,
        loader.worker_init_fn,
    )


@dataclass
class DataPosition:
    """Where the run stands in its data: the epoch, and samples of its order consumed."""

    epoch: int = 0
    position: int = 0


class ResumableBatchSampler(Sampler[list[int]]):
    """This rank's batches of one epoch, from ``start`` on (see the module docstring)."""

    def __init__(
        self, spec: LoaderSpec, *, rank: int, world_size: int, seed: int, epoch: int, start: int
    ) -> None:
        self.size = len(spec.dataset)  # type: ignore[arg-type]
        self.batch_size = spec.batch_size
        self.shuffle = spec.shuffle
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = epoch
        self.start = start

    def order(self) -> torch.Tensor:
        """The epoch's global order of sample indices, identical on every rank."""
        if not self.shuffle:
            return torch.arange(self.size, device="cpu")
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=generator, device="cpu")

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        per_step = self.batch_size * self.world_size
        for begin in range(self.start, self.size - per_step + 1, per_step):
            yield order[begin : begin + per_step][self.rank :: self.world_size].tolist()

    def __len__(self) -> int:
        return max(0, (self.size - self.start) // (self.batch_size * self.world_size))


class DataStream:
    """Batches for this rank across epochs, remembering the position for checkpoints."""

    def __init__(
        self, spec: LoaderSpec, start: DataPosition, *, rank: int, world_size: int, seed: int
    ) -> None:
        per_step = spec.batch_size * world_size
        if len(spec.dataset) < per_step:  # type: ignore[arg-type]
            raise ValueError(
                f"the dataset has {len(spec.dataset)} samples, fewer than one step needs "  # type: ignore[arg-type]
                f"(batch_size {spec.batch_size} x {world_size} processes); use a smaller "
                "batch size or more data"
            )
        self.spec = spec
        self.per_step = per_step
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.current = DataPosition(start.epoch, start.position)
        self._batches: Iterator[Any] | None = None

    def next_batch(self) -> tuple[Any, int]:
        """The next batch and its index within the epoch."""
        while True:
            if self._batches is None:
                self._batches = iter(self._loader())
            try:
                batch = next(self._batches)
            except StopIteration:
                self._batches = None
                self.current = DataPosition(self.current.epoch + 1, 0)
                continue
            batch_idx = self.current.position // self.per_step
            self.current.position += self.per_step
            return batch, batch_idx

    def _loader(self) -> DataLoader[Any]:
        spec, epoch = self.spec, self.current.epoch
        sampler = ResumableBatchSampler(
            spec,
            rank=self.rank,
            world_size=self.world_size,
            seed=self.seed,
            epoch=epoch,
            start=self.current.position,
        )
        return DataLoader(
            spec.dataset,
            batch_sampler=sampler,
            collate_fn=spec.collate_fn,
            num_workers=spec.num_workers,
            pin_memory=spec.pin_memory,
            worker_init_fn=spec.worker_init_fn,
            # Its own generator: starting an iterator then draws no number from the global
            # RNG, whose state a resume restores exactly. It seeds the data workers, so it
            # differs per rank (each rank's workers draw their own augmentations). With
            # workers, a mid-epoch resume restarts their RNG streams: bitwise-exact resume
            # needs num_workers=0 or a dataset whose randomness is a function of the index.
            generator=torch.Generator().manual_seed(hash((self.seed, epoch, self.rank))),
        )

    def state(self) -> dict[str, int]:
        """What a checkpoint records of the data position."""
        return {"epoch": self.current.epoch, "position": self.current.position}
