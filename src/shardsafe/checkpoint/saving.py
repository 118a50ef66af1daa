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

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._version import __version__
from ..distributed import Coordinator, Phase
from ..errors import CheckpointCorruptError, CheckpointError
from ..protocol import Adapter, SavedValue
from .format.manifest import MANIFEST_NAME, ChunkRecord, Manifest, TensorRecord, parse
from .format.manifest_format import CRC_BLOCK_BYTES, crc_block_count
from .format.safetensors_header import build_header
from .io.writing import write_plan
from .io.written import WriteOptions, WrittenFile, remove_quietly
from .options import SaveOptions, opener_of
from .plan import plan_parts
from .plan.collecting import Collected, check_state, collect
from .plan.offer import Offer, check_same_entries, chunks_of
from .plan.per_rank import split_differing
from .plan.save_plan import SavePlan, plan_save
from .references import missing_tensors
from .storage import target_directory
from .storage.locations import anchored
from .storage.protocol import Storage

AFTERMATH: dict[Phase | None, str] = {
    None: "Nothing was committed; the previous checkpoint is untouched.",
    Phase.COMMIT: (
        "Every rank had written its data, so rank 0 may have committed the checkpoint "
        "anyway: it exists if and only if its manifest.json does."
    ),
}
"""What a rank dying in a phase of a save means for the checkpoint."""
BACKGROUND_PIECE_BYTES = 256 << 10
"""A background save checksums and writes pieces this large: well inside a core's L2
cache, so the write's copy reads what the CRC just read from cache, not from memory."""


def save(path: str, state: Mapping[str, Any], options: SaveOptions) -> None:
    """Run the phases of a save on this rank (see the module docstring)."""
    persist(begin(path, state, options))


@dataclass
class Planned:
    """What the collect phase decided, as this rank needs it to write and commit."""

    plan: SavePlan
    """Rank 0: the whole plan; any other rank: its part (``plan_parts``)."""
    token: str
    """The name of rank 0's probe in the target, which every rank checks it can see."""
    offers: list[Offer]
    """Every rank's offer (rank 0 only: it writes the manifest)."""
    entries: dict[str, SavedValue] = field(default_factory=dict)
    """Every state entry as the manifest records it, every rank's metadata merged (rank 0
    only), made before any data is written so that a refusal writes nothing."""

    def chunks_read(self, rank: int) -> set[int]:
        """Which of ``rank``'s chunks (by offer index) its write phase reads: the only
        ones an asynchronous save must stage."""
        return {
            source.index
            for f in self.plan.files
            for entry in f.entries
            for source in entry.sources
            if source.rank == rank
        }


@dataclass
class SaveRun:
    """A save between its two halves: entered and collected (``begin``), not yet written
    (``persist``). An asynchronous save runs ``persist`` on a background thread."""

    path: str
    coord: Coordinator
    opened: Storage | None
    """The target's storage, opened after the entry barrier (``None`` until then, and
    if opening failed: ``error`` holds why)."""
    options: SaveOptions
    existed: bool
    items: Collected = field(default_factory=dict)
    error: BaseException | None = None
    """This rank's failure while collecting or staging: raised in the next phase this
    rank enters (collect, or write once planned), so that every rank raises it."""
    group: Any = None
    """The process group for the consolidated layout's transfers (``None``: the default)."""
    background: bool = False
    """Written beside a training loop (``async_save``): files are checksummed and written
    by one thread, in cache-sized pieces (``StreamWriter``), around the page cache until
    ``hurry`` is set."""
    planned: Planned | None = None
    """Set when the collect phase already ran (``plan``, at an asynchronous call)."""
    failed: CheckpointError | None = None
    """The agreed error of a collect phase run at the call: ``persist`` raises it."""
    hurry: threading.Event = field(default_factory=threading.Event)
    """Set once someone waits for a background save: from then on it writes through the
    page cache, at full speed, instead of around it (``direct_writes.py``)."""

    @property
    def storage(self) -> Storage:
        """The opened target. Only the phases after a successful open use it: a failed
        open is ``error``, raised before they touch the target."""
        if self.opened is None:
            raise RuntimeError(f"shardsafe: the save to {self.path} has no open target")
        return self.opened

    def close(self) -> None:
        """End the run on this rank: its agreement, then its storage (closed even if an
        interrupt ends the agreement's close)."""
        try:
            self.coord.close()
        finally:
            if self.opened is not None:
                self.opened.close()


def begin(path: str, state: Mapping[str, Any], options: SaveOptions) -> SaveRun:
    """Meet every rank (the entry barrier) and turn this rank's state into save items.

    A failure after the barrier is kept in the run, so that ``persist`` posts it in the
    collect phase and every rank raises it: ``persist`` must follow on every rank. The
    target is opened after the barrier, and first looked at there: an object store's
    client that cannot be made on one node (s3fs missing from its image, a broken
    credentials file) or a request that fails on one rank alone raised there, before,
    while the others waited out ``entry_timeout`` and then blamed it for not calling
    ``save``. A usage error (an empty ``state``, a bad key) is raised as the
    ``ValueError`` it is, but after this rank has met the others and told them
    (``Coordinator.refuse``): a state that is wrong on one rank alone fails them all at
    once, not after ``entry_timeout``.
    """
    coord = Coordinator("save", path, timeout=options.timeout, aftermath=AFTERMATH)
    try:
        check_state(state)
        opener = opener_of(anchored(path), options.storage, options.storage_options)
    except ValueError as e:  # this rank's alone, perhaps (an empty state on one rank)
        coord.refuse(e, options.entry_timeout)
        raise
    coord.enter(options.entry_timeout)
    run = SaveRun(path, coord, None, options, existed=True)  # until known: keep it
    try:
        run.opened = opener()
        run.existed = target_directory.refuse_committed(run.opened)
        run.items = collect(state, coord.rank, coord.world_size)
    except Exception as e:
        run.error, run.items = e, {}
    except BaseException as e:  # Ctrl-C in a state_dict: no persist will end this run
        coord.abandon(e)
        run.close()
        raise
    return run


def persist(run: SaveRun) -> None:
    """The collect (unless already run), write and commit phases of ``run`` (see the
    module docstring)."""
    coord = run.coord
    try:
        if run.failed is not None:
            raise run.failed
        _phases(run)
    except BaseException as e:
        if isinstance(e, CheckpointError) and coord.rank == 0 and not run.existed:
            target_directory.remove_uncommitted(run.storage)  # everything in it was ours
        coord.abandon(e)  # unless agreed (Ctrl-C between phases, or in a wait): tell them
        raise
    finally:
        run.close()


def plan(run: SaveRun) -> None:
    """Run the collect phase now, so that the caller knows which chunks this rank will
    write (``Planned.chunks_read``) before it stages them. Its agreed error is kept for
    ``persist`` to raise (on every rank alike); anything else propagates, and the caller
    must close the run."""
    try:
        run.planned = _collect_phase(run)
    except CheckpointError as e:
        run.failed = e


def _collect_phase(run: SaveRun) -> Planned:
    """The collect phase: every rank offers what it holds, rank 0 plans and sends each
    rank its part. A failure kept in ``run.error`` is raised inside it, so it is agreed."""
    coord, options, items = run.coord, run.options, run.items
    names = list(items)
    offers: list[Offer] = []
    entries: dict[str, SavedValue] = {}

    def decide(payloads: list[Any]) -> list[Any]:
        """Rank 0's plan from every offer; each other rank gets its part (plan_parts)."""
        _check_same_options([raw.get("options", {}) for raw in payloads])
        offers.extend(Offer.from_json(r, raw) for r, raw in enumerate(payloads))
        check_same_entries(offers, names, coord.rank)
        split_differing(offers)  # before the merge: it renames keys in the metadata
        entries.update(_merged({name: adapter for name, (adapter, _) in items.items()}, offers))
        whole = plan_save([o.chunks for o in offers], options.layout, names)
        if not run.background:  # a background save checks behind the training (_write)
            check_loadable(whole, entries)
        # Before any rank writes a data file (the parts are sent after this returns): what
        # the next save may clear if this one is interrupted, and nothing else.
        target_directory.record_plan(run.storage, token, [f.name for f in whole.files])
        # The others' parts carry the name of rank 0's probe, which each checks it can see.
        parts = [plan_parts.part_of(whole, r) | {"probe": token} for r in range(1, len(offers))]
        return [whole, *parts]

    with coord.phase(Phase.COLLECT, decide=decide) as collected:
        if run.error is not None:
            error, run.error = run.error, None
            raise error
        token = ""
        if coord.rank == 0:
            if options.hooks.before_write is not None:
                options.hooks.before_write()
            token = target_directory.prepare(run.storage)
        offer = Offer.of(
            coord.rank,
            {name: item for name, (_, item) in items.items()},
            checksums=options.verify_replicas,
        )
        collected.payload = offer.to_json() | {"options": _agreed_options(options)}
    if coord.rank == 0:
        return Planned(collected.part, token, offers, entries)
    return Planned(plan_parts.from_part(collected.part), collected.part["probe"], offers)


def _phases(run: SaveRun) -> None:
    planned = run.planned if run.planned is not None else _collect_phase(run)
    coord, storage = run.coord, run.storage
    written = _write(run, planned)
    with coord.phase(Phase.COMMIT):
        if coord.rank == 0:
            coord.raise_if_left(Phase.COMMIT)
            storage.remove(target_directory.probe_name(planned.token))
            commit(
                storage,
                planned.plan,
                planned.entries,
                written,
                run.options.hooks.after_commit,
                exclusive=True,
            )


def _agreed_options(options: SaveOptions) -> dict[str, Any]:
    """The options every rank must pass alike: rank 0's plan follows its own."""
    return {"layout": options.layout, "verify_replicas": options.verify_replicas}


def _check_same_options(given: list[dict[str, Any]]) -> None:
    """Refuse options that differ between ranks: a rank's ``layout="consolidated"`` was
    ignored in silence where rank 0 passed ``"sharded"`` (and a rank's
    ``verify_replicas=True`` checked nothing where another's was False)."""
    for name, first in given[0].items():
        for rank, options in enumerate(given):
            if options.get(name) != first:
                raise CheckpointError(
                    f"the ranks passed different options: {name}={first!r} on rank 0 but "
                    f"{name}={options.get(name)!r} on rank {rank}; pass the same {name} on "
                    "every rank (nothing was written)"
                )


def _merged(adapters: dict[str, Adapter], offers: list[Offer]) -> dict[str, SavedValue]:
    """Every entry as the manifest records it: its adapter merges every rank's metadata
    (ranks may hold different parts of it: pipeline stages, per-rank experts). A merge
    that finds the ranks' metadata cannot be described as one entry refuses the save."""
    merged = {}
    for name, adapter in adapters.items():
        metas = [offer.entries[name].meta for offer in offers]
        try:
            meta = adapter.merge(metas)
        except CheckpointError as e:
            raise CheckpointError(f"cannot save state[{name!r}]: {e}") from None
        merged[name] = SavedValue(name, offers[0].entries[name].kind, meta)
    return merged


def _write(run: SaveRun, planned: Planned) -> list[dict[str, WrittenFile]]:
    """The write phase: this rank's files of the plan; rank 0 learns what every rank wrote."""
    coord, storage, items = run.coord, run.storage, run.items
    cache_bytes = BACKGROUND_PIECE_BYTES if run.background else 0
    direct_until = run.hurry if run.background else None
    options = WriteOptions(CRC_BLOCK_BYTES, run.options.buffer_bytes, cache_bytes, direct_until)
    written: dict[str, WrittenFile] = {}
    try:
        with coord.phase(Phase.WRITE, only_rank0_reads=True) as phase:
            try:
                if run.error is not None:  # staging failed after the plan was made
                    raise run.error
                if coord.rank != 0:
                    target_directory.check_shared(storage, planned.token, coord.rank)
                elif run.background:  # off the caller's stall, before rank 0 writes a byte
                    check_loadable(planned.plan, planned.entries)
                chunks = chunks_of({name: item for name, (_, item) in items.items()})
                written = write_plan(planned.plan, coord.rank, chunks, storage, options, run.group)
                phase.payload = written
            finally:
                items.clear()  # drop references to staged state before waiting on others
    except CheckpointError:
        if not run.coord.gave_up:  # agreed: nobody commits. Else rank 0 still may
            remove_quietly(storage, list(written))
        raise
    return phase.payloads


def commit(
    storage: Storage,
    plan: SavePlan,
    entries: dict[str, SavedValue],
    written: list[dict[str, WrittenFile]],
    after_commit: Callable[[], None] | None,
    extra_info: Mapping[str, Any] | None = None,
    *,
    exclusive: bool = False,
) -> None:
    """Write the manifest of ``plan`` last, once the data files are durable (also the
    converters' commit, see ``streaming.py``). ``extra_info`` joins the manifest's
    ``info`` (a rank checkpoint's placements, ``tiers/rank_checkpoint.py``).

    ``exclusive`` (a save's): refused if a manifest appeared meanwhile. Two saves to one
    path at once (a job launched twice): the second took the first's files for an
    interrupted save's and cleared them, committed, and the first's manifest then
    replaced its own, naming data it did not describe; the first save returned as if
    committed (found in review). Now the later commit fails and the committed checkpoint
    stays as it was (where the store has conditional creates, and locally)."""
    # Not parsed again: check_loadable parsed this manifest, but for its checksums, before
    # any data was written, and the writers report what the plan said they would write.
    raw = manifest_of(plan, entries, written, _info(extra_info), CRC_BLOCK_BYTES).to_json()
    # The data files' directory entries must be durable before the manifest that names
    # them is (a power loss must not leave a manifest without its files): each writer's
    # file was finished, so its name is durable (Storage.create; dir_sync.py), before
    # the write phase agreed.
    try:
        storage.commit(MANIFEST_NAME, raw, exclusive=exclusive)
    except FileExistsError:
        raise CheckpointError(
            f"another save committed a checkpoint at {storage.directory} "
            "while this one was writing there, so this save did not commit (that checkpoint "
            "is kept as it is): two saves to one path at once replace each other's files. "
            "Save each run to a path of its own, or through a CheckpointManager, whose lock "
            "keeps a second run off its root"
        ) from None
    storage.remove(target_directory.INCOMPLETE_MARKER)
    if after_commit is not None:
        after_commit()


def check_loadable(
    plan: SavePlan, entries: dict[str, SavedValue], extra_info: Mapping[str, Any] | None = None
) -> None:
    """Refuse, before any data is written, a save whose manifest ``load`` would refuse.

    The manifest ``commit`` will write is built now, with the file sizes the plan implies
    and the widest value for each checksum the writers have yet to compute (so that it is
    at least as large as the one committed, and its size limit holds for that too), and
    given to the very parser ``load``, ``inspect`` and ``verify`` use: what it refuses
    (metadata nested too deeply for the reader, a data file's header over safetensors'
    limit, ...) is refused here, with nothing written, and ``commit`` need not parse its
    manifest again. (A background save checks at the start of its write phase instead, to
    keep the few milliseconds off the training's stall: rank 0 then writes nothing, and
    the files other ranks began are removed when the failure is agreed.)
    """
    planned: dict[str, WrittenFile] = {}
    for fplan in plan.files:
        header = build_header([(e.name, e.dtype, e.shape) for e in fplan.entries])
        planned[fplan.name] = {
            "bytes": len(header) + sum(e.nbytes for e in fplan.entries),
            "crc": {
                e.name: [_WIDEST_CRC] * crc_block_count(e.nbytes, CRC_BLOCK_BYTES)
                for e in fplan.entries
            },
            "header_crc32": _WIDEST_CRC,
        }
    manifest = manifest_of(plan, entries, [planned], _info(extra_info), CRC_BLOCK_BYTES)
    try:
        parse(manifest.to_json())
        missing = missing_tensors(manifest)
    except CheckpointCorruptError as e:
        missing = [str(e)]
    if missing:
        # An entry naming a tensor no rank offered: a DTensor on a sub-mesh that only
        # ranks outside its mesh hold (review), which saved, then loaded nowhere.
        raise CheckpointError(
            f"refusing to save a checkpoint that shardsafe could not load back: {missing[0]} "
            "(nothing was written)"
        ) from None


_WIDEST_CRC = 0xFFFFFFFF
"""A CRC32 as large as any: the placeholder ``check_loadable`` gives the checksums."""


def _info(extra_info: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        "shardsafe_version": __version__,
        "torch_version": torch.__version__,
        "created_unix": time.time(),
        **(extra_info or {}),
    }


def manifest_of(
    plan: SavePlan,
    values: dict[str, SavedValue],
    written: list[dict[str, WrittenFile]],
    info: dict[str, Any],
    block_bytes: int,
) -> Manifest:
    """The manifest of a save: its plan, every entry's merged metadata, and what each
    rank reports it wrote (file sizes and header CRCs from the writer; tensor CRCs from
    whichever rank computed them, the writer or a sender)."""
    files: dict[str, int] = {}
    header_crcs: dict[str, int] = {}
    crcs: dict[tuple[str, str], tuple[int, ...]] = {}
    for per_rank in written:
        for name, res in per_rank.items():
            files[name] = max(files.get(name, 0), res["bytes"])
            if res["header_crc32"] >= 0:
                header_crcs[name] = res["header_crc32"]
            crcs.update(((name, t), tuple(v)) for t, v in res["crc"].items())
    chunks: dict[str, list[ChunkRecord]] = {key: [] for key in plan.tensors}
    for fplan in plan.files:
        for e in fplan.entries:
            record = ChunkRecord(fplan.name, e.name, e.offsets, e.shape, crcs[fplan.name, e.name])
            chunks[e.key].append(record)
    tensors = {
        key: TensorRecord(dtype, shape, tuple(chunks[key]))
        for key, (dtype, shape) in plan.tensors.items()
    }
    return Manifest(
        plan.layout, plan.world_size, block_bytes, values, tensors, files, info, header_crcs
    )
