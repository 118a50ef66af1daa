"""``save``: the phases of writing a checkpoint and the agreement between them.

enter (timed barrier) -> collect (adapters turn state into chunks; every rank posts its
offer, the shapes of what it holds; rank 0 alone reads them all, plans, and sends each
rank its part of the plan) -> write (that part: data files, each fsynced) -> commit
(rank 0 writes ``manifest.json`` last, atomically).

Every phase is a block that ends with an agreement (``shardsafe.distributed``), so an
error on any rank stops all ranks at the same point with the same error, and nothing is
committed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._version import __version__
from ..distributed import Coordinator, Phase
from ..errors import CheckpointCorruptError, CheckpointError
from ..protocol import Adapter, SavedValue
from . import plan_parts, target_directory
from .collecting import Collected, check_state, collect
from .manifest import MANIFEST_NAME, Manifest, parse
from .manifest_format import CRC_BLOCK_BYTES
from .offer import Offer, check_same_entries, chunks_of
from .options import SaveOptions, storage_factory
from .save_plan import SavePlan, plan_save
from .storage import Storage
from .writing import WriteOptions, WrittenFile, remove_quietly, write_plan

AFTERMATH: dict[Phase | None, str] = {
    None: "Nothing was committed; the previous checkpoint is untouched.",
    Phase.COMMIT: (
        "Every rank had written its data, so rank 0 may have committed the checkpoint "
        "anyway: it exists if and only if its manifest.json does."
    ),
}
"""What a rank dying in a phase of a save means for the checkpoint."""


def save(path: str, state: Mapping[str, Any], options: SaveOptions) -> None:
    """Run the phases of a save on this rank (see the module docstring)."""
    persist(begin(path, state, options))


@dataclass
class SaveRun:
    """A save between its two halves: entered and collected (``begin``), not yet written
    (``persist``). An asynchronous save runs ``persist`` on a background thread."""

    path: str
    coord: Coordinator
    storage: Storage
    options: SaveOptions
    existed: bool
    items: Collected = field(default_factory=dict)
    error: BaseException | None = None
    """This rank's failure while collecting or staging, agreed on in the collect phase."""
    group: Any = None
    """The process group for the consolidated layout's transfers (``None``: the default)."""


def begin(
    path: str,
    state: Mapping[str, Any],
    options: SaveOptions,
    *,
    stage: Callable[[Collected], Collected] | None = None,
) -> SaveRun:
    """Meet every rank (the entry barrier) and turn this rank's state into save items.

    A failure after the barrier is kept in the run, so that ``persist`` posts it in the
    collect phase and every rank raises it: ``persist`` must follow on every rank.
    """
    check_state(state)
    storage = storage_factory(options.storage, options.storage_options)(path)
    try:
        existed = target_directory.refuse_committed(storage)
        coord = Coordinator("save", path, timeout=options.timeout, aftermath=AFTERMATH)
        coord.enter(options.entry_timeout)
    except BaseException:
        storage.close()
        raise
    run = SaveRun(path, coord, storage, options, existed)
    try:
        run.items = collect(state, coord.rank, coord.world_size)
        if stage is not None:
            run.items = stage(run.items)
    except Exception as e:
        run.error, run.items = e, {}
    return run


def persist(run: SaveRun) -> None:
    """The collect, write and commit phases of ``run`` (see the module docstring)."""
    coord, storage = run.coord, run.storage
    try:
        _phases(run)
    except CheckpointError:
        if coord.rank == 0 and not run.existed:
            target_directory.remove_uncommitted(storage)  # everything in it was ours
        raise
    finally:
        coord.close()
        storage.close()


def _phases(run: SaveRun) -> None:
    coord, storage, options, items = run.coord, run.storage, run.options, run.items
    names = list(items)
    offers: list[Offer] = []

    def plan(payloads: list[Any]) -> list[Any]:
        """Rank 0's plan from every offer; each other rank gets its part (plan_parts)."""
        offers.extend(Offer.from_json(r, raw) for r, raw in enumerate(payloads))
        check_same_entries(offers, names, coord.rank)
        whole = plan_save([o.chunks for o in offers], options.layout, names)
        # The others' parts carry the name of rank 0's probe, which each checks it can see.
        parts = [plan_parts.part_of(whole, r) | {"probe": token} for r in range(1, len(offers))]
        return [whole, *parts]

    with coord.phase(Phase.COLLECT, decide=plan) as collected:
        if run.error is not None:
            raise run.error
        token = ""
        if coord.rank == 0:
            if options.hooks.before_write is not None:
                options.hooks.before_write()
            token = target_directory.prepare(storage)
        offer = Offer.of(coord.rank, {name: item for name, (_, item) in items.items()})
        collected.payload = offer.to_json()
    if coord.rank == 0:
        save_plan = collected.part
    else:
        save_plan, token = plan_parts.from_part(collected.part), collected.part["probe"]
    adapters = {name: adapter for name, (adapter, _) in items.items()}
    written = _write(coord, storage, items, save_plan, options, run.group, token)
    with coord.phase(Phase.COMMIT):
        if coord.rank == 0:
            entries = _merged(adapters, offers)
            storage.remove(target_directory.probe_name(token))
            commit(storage, save_plan, entries, written, options.hooks.after_commit)


def _merged(adapters: dict[str, Adapter], offers: list[Offer]) -> dict[str, SavedValue]:
    """Every entry as the manifest records it: its adapter merges every rank's metadata."""
    merged = {}
    for name, adapter in adapters.items():
        metas = [offer.entries[name].meta for offer in offers]
        merged[name] = SavedValue(name, offers[0].entries[name].kind, adapter.merge(metas))
    return merged


def _write(
    coord: Coordinator,
    storage: Storage,
    items: Collected,
    plan: SavePlan,
    options: SaveOptions,
    group: Any,
    token: str,
) -> list[dict[str, WrittenFile]]:
    """The write phase: this rank's files of the plan; rank 0 learns what every rank wrote."""
    written: dict[str, WrittenFile] = {}
    try:
        with coord.phase(Phase.WRITE, only_rank0_reads=True) as phase:
            try:
                if coord.rank != 0:
                    target_directory.check_shared(storage, token, coord.rank)
                chunks = chunks_of({name: item for name, (_, item) in items.items()})
                write_options = WriteOptions(CRC_BLOCK_BYTES, options.buffer_bytes)
                written = write_plan(plan, coord.rank, chunks, storage, write_options, group)
                phase.payload = written
            finally:
                items.clear()  # drop references to staged state before waiting on others
    except CheckpointError:
        remove_quietly(storage, list(written))
        raise
    return phase.payloads


def commit(
    storage: Storage,
    plan: SavePlan,
    entries: dict[str, SavedValue],
    written: list[dict[str, WrittenFile]],
    after_commit: Callable[[], None] | None,
) -> None:
    """Write the manifest of ``plan`` last, once the data files are durable (also the
    converters' commit, see ``streaming.py``)."""
    info = {
        "shardsafe_version": __version__,
        "torch_version": torch.__version__,
        "created_unix": time.time(),
    }
    raw = loadable(Manifest.build(plan, entries, written, info, CRC_BLOCK_BYTES))
    # The data files' directory entries must be durable before the manifest that names
    # them is (a power loss must not leave a manifest without its files): each writer's
    # file was finished, so its name is durable (Storage.create; dir_sync.py), before
    # the write phase agreed.
    storage.commit(MANIFEST_NAME, raw)
    storage.remove(target_directory.INCOMPLETE_MARKER)
    if after_commit is not None:
        after_commit()


def loadable(manifest: Manifest) -> bytes:
    """The manifest's bytes, once the parser ``load`` uses has accepted them: what save
    writes, load, inspect and verify accept."""
    raw = manifest.to_json()
    try:
        parse(raw)
    except CheckpointCorruptError as e:
        raise CheckpointError(
            f"refusing to commit a checkpoint that shardsafe could not load back: {e}"
        ) from None
    return raw
