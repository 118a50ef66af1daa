"""``load``: the phases of restoring a checkpoint and the agreement between them.

enter (timed barrier) -> plan (read and validate the manifest; the load plan: which
tensor regions each entry needs, every mismatch, bounded allocation) -> read (only those
regions, checksums verified; then every adapter checks, without changing anything, that
its data will restore) -> restore (adapters put state back).

Nothing is restored until every rank has read, verified and checked everything it
needs, so a corrupt file, hostile metadata or a mismatch on one rank leaves every rank's
objects untouched.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..distributed import Coordinator, Phase
from ..errors import CheckpointNotFoundError
from .load_plan import LoadPlan, guarded, plan_load
from .locations import open_storage
from .manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse
from .options import LoadOptions
from .reader import CheckpointReader
from .storage import Storage

AFTERMATH: dict[Phase | None, str] = {
    None: "Nothing was restored on this rank.",
    Phase.RESTORE: (
        "This rank may already have restored some of its objects; load again before using them."
    ),
}
"""What a rank dying in a phase of a load means for the objects being loaded."""


def read_manifest(
    path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> Manifest:
    """Parse and validate ``path/manifest.json`` (a directory or a URL); no data file is
    opened."""
    with open_storage(os.fspath(path), storage_options=storage_options) as storage:
        return read_manifest_from(storage)


def read_manifest_from(storage: Storage) -> Manifest:
    """The validated manifest of an open checkpoint directory."""
    storage.require_directory()
    if not storage.exists(MANIFEST_NAME):
        raise CheckpointNotFoundError(
            f"{storage.directory} has no {MANIFEST_NAME}, so it is not a committed checkpoint "
            "(a save into it may have been interrupted)"
        )
    raw = storage.read_small(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    return parse(raw, storage.where(MANIFEST_NAME))


def load(storage: Storage, state: Mapping[str, Any], options: LoadOptions) -> dict[str, Any]:
    """Run the phases of a load on this rank; return the plain values the checkpoint holds."""
    if not isinstance(state, Mapping):
        raise ValueError("state must be a dict of name -> object to restore")
    return load_chosen(storage, lambda manifest: state, options)


def load_chosen(
    storage: Storage,
    choose: Callable[[Manifest], Mapping[str, Any]],
    options: LoadOptions,
) -> dict[str, Any]:
    """:func:`load`, with the state to restore chosen from the manifest by ``choose``.

    For callers whose objects depend on what the checkpoint holds (the Lightning strategy
    passes optimizers only if they were saved): ``choose`` runs inside the plan phase, so
    the manifest is read once and a refusal it raises is agreed on every rank.
    """
    coord = Coordinator("load", storage.directory, timeout=options.timeout, aftermath=AFTERMATH)
    coord.enter(options.entry_timeout)
    try:
        with coord.phase(Phase.PLAN):
            manifest = read_manifest_from(storage)
            state = choose(manifest)
            plan = plan_load(
                manifest,
                state,
                strict=options.strict,
                rank=coord.rank,
                world_size=coord.world_size,
                untrusted_bytes_limit=options.untrusted_bytes_limit,
            )
        with coord.phase(Phase.READ):
            tensors = _read(storage, manifest, plan)
            for item in plan.entries:
                guarded(item, "validate", item.adapter.validate, item.obj, item.saved, tensors)
        with coord.phase(Phase.RESTORE):
            return _restore(plan, tensors)
    finally:
        coord.close()


def _read(storage: Storage, manifest: Manifest, plan: LoadPlan) -> dict[str, torch.Tensor]:
    # In the order the data files hold them (a file's tensors are stored sorted by key),
    # so that an object store's read-ahead serves consecutive tensors from one request.
    order = sorted(plan.requests, key=lambda r: (_first_file(manifest, r.key), r.key))
    with CheckpointReader(storage, manifest) as reader:
        return {req.key: reader.read(req.key, req.offsets, req.shape) for req in order}


def _first_file(manifest: Manifest, key: str) -> str:
    chunks = manifest.tensors[key].chunks
    return chunks[0].file if chunks else ""


def _restore(plan: LoadPlan, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    returned: dict[str, Any] = {}
    for item in plan.entries:
        value = item.adapter.restore(item.obj, item.saved, tensors, item.ctx)
        if item.adapter.returns_value:
            returned[item.saved.name] = value
    return returned
