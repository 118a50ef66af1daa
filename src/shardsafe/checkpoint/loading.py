"""``load``: the phases of restoring a checkpoint and the agreement between them.

enter (timed barrier) -> plan (read and validate the manifest; the load plan: which
tensor regions each entry needs, every mismatch, bounded allocation; which live tensors
the bytes go straight into) -> read (the regions no live tensor takes, into new tensors;
with ``verify="first"`` also every byte of the others, checked and dropped; then every
adapter checks, without changing anything, that its data will restore) -> restore (the
live tensors filled in place, checksums checked again; adapters put state back).

Memory: beyond the live objects, one reused buffer (``buffer_bytes``) and the tensors
no live one takes (which the objects then adopt), never a copy of the state.

With ``verify="first"`` (the default) nothing is restored until every rank has read,
verified and checked everything it needs, so a corrupt file, hostile metadata or a
mismatch on one rank leaves every rank's objects untouched. With ``verify="inline"``
each byte is read once, and a corrupt one is found while live tensors are being filled:
the error says which were (``in_place.partly_restored``).
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, NoReturn

import torch

from .. import _warnings
from ..adapters import values
from ..distributed import Coordinator, Phase
from ..distributed.reports import error_message
from ..errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    with_message,
)
from ..protocol import ReadRequest
from .format import geometry
from .format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse
from .io import in_place, pinned_ring, threaded_reads, tied_keys
from .io.memory_sharing import sharing
from .io.reader import CACHE_PIECE_BYTES, CheckpointReader, box_of, threads_for
from .options import LoadOptions
from .plan.load_plan import (
    LoadPlan,
    guarded,
    no_entry,
    plan_load,
    request_bytes,
    unexpected_anywhere,
    unexpected_everywhere,
)
from .plan.rank_copies import on_a_rank_copy, rank_copy_as_one_rank
from .storage.locations import open_storage, store_errors_of
from .storage.protocol import Storage
from .storage.spool import Spool, spool_for

AFTERMATH: dict[Phase | None, str] = {
    None: "Nothing was restored on this rank.",
    Phase.RESTORE: (
        "This rank may already have restored some of its objects; load again before using them."
    ),
}


def read_manifest(
    path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> Manifest:
    """Parse and validate ``path/manifest.json`` (a directory or a URL); no data file is
    opened."""
    text = os.fspath(path)
    with store_errors_of(text), open_storage(text, storage_options=storage_options) as storage:
        return read_manifest_from(storage)


def read_manifest_from(storage: Storage) -> Manifest:
    """The validated manifest of an open checkpoint directory."""
    return _read_manifest(storage)[0]


def _read_manifest(storage: Storage) -> tuple[Manifest, str]:
    """:func:`read_manifest_from`, and the fingerprint of the bytes it was parsed from."""
    storage.require_directory()
    if not storage.exists(MANIFEST_NAME):
        raise CheckpointNotFoundError(
            f"{storage.directory} has no {MANIFEST_NAME}, so it is not a committed checkpoint "
            "(a save into it may have been interrupted)"
        )
    raw = storage.read_small(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    return parse(raw, storage.where(MANIFEST_NAME)), f"{len(raw)}:{zlib.crc32(raw):08x}"


Hint = Callable[[Storage], str]
"""Where a directory without a manifest points to (``finding.where_checkpoints_are``, given
by ``api.load``: the finder imports this module), appended to the error; ``""``: nothing."""


def _manifest_to_load(storage: Storage, hint: Hint | None) -> tuple[Manifest, str]:
    """:func:`_read_manifest`, whose error for a checkpoint root or a Trainer's run
    directory (``shardsafe.load("run/checkpoints", ...)``) names the newest checkpoint in
    it, as ``inspect`` and ``verify`` do, instead of suggesting only an interrupted save,
    which sent users looking for a crash."""
    try:
        return _read_manifest(storage)
    except CheckpointNotFoundError as e:
        said = hint(storage) if hint is not None else ""
        if not said:
            raise
        raise CheckpointNotFoundError(f"{e}{said}") from None


def load(
    storage: Storage, state: Mapping[str, Any], options: LoadOptions, *, hint: Hint | None = None
) -> dict[str, Any]:
    """Run the phases of a load on this rank; return the plain values the checkpoint holds.
    ``hint``: see :data:`Hint`."""
    if not isinstance(state, Mapping):
        refuse_state(state, storage.directory, options)
    return load_chosen(storage, lambda manifest: state, options, hint=hint)


def load_from(
    opener: Callable[[], Storage],
    agree_as: str,
    state: Mapping[str, Any],
    options: LoadOptions,
    *,
    hint: Hint | None = None,
) -> dict[str, Any]:
    """:func:`load` of the directory ``opener`` opens inside the plan phase
    (:func:`load_opening`): ``shardsafe.load``'s, whose open of an object-store URL can
    fail on one node alone (its image lacks s3fs, its credentials file is broken)."""
    if not isinstance(state, Mapping):
        refuse_state(state, agree_as, options)
    return load_opening(opener, agree_as, lambda manifest: state, options, hint=hint)


def refuse_state(state: Any, agree_as: str, options: LoadOptions) -> NoReturn:
    """Refuse ``state``, which is not a dict, as the ``ValueError`` it is, once the other
    ranks (meeting under ``agree_as``) are told (``Coordinator.refuse``): it may be this
    rank's alone."""
    refusal = ValueError(
        f"state must be a dict of name -> object to restore, not {type(state).__name__}"
    )
    coord = Coordinator("load", agree_as, timeout=options.timeout, aftermath=AFTERMATH)
    coord.refuse(refusal, options.entry_timeout)
    raise refusal


def load_chosen(
    storage: Storage,
    choose: Callable[[Manifest], Mapping[str, Any]],
    options: LoadOptions,
    *,
    agree_as: str | None = None,
    view: Callable[[Manifest], Manifest] | None = None,
    hint: Hint | None = None,
) -> dict[str, Any]:
    """:func:`load`, with the state to restore chosen from the manifest by ``choose``.

    For callers whose objects depend on what the checkpoint holds (the Lightning strategy
    passes optimizers only if they were saved): ``choose`` runs inside the plan phase, so
    the manifest is read once and a refusal it raises is agreed on every rank.

    ``agree_as`` names the load for the agreement between ranks (default: the
    directory), for ranks that each load a directory of their own (the tiered manager's
    node-local rank checkpoints); ``view`` turns the validated manifest into the one the
    load plans from (``tiers/rank_checkpoint.py``); ``hint``: see :data:`Hint`.
    """
    where = storage.directory if agree_as is None else agree_as
    return _load(lambda: storage, where, choose, options, view=view, hint=hint)


def load_opening(
    opener: Callable[[], Storage],
    agree_as: str,
    choose: Callable[[Manifest], Mapping[str, Any]],
    options: LoadOptions,
    *,
    view: Callable[[Manifest], Manifest] | None = None,
    hint: Hint | None = None,
    warn: Callable[[str], None] | None = None,
    called_as: str | None = None,
) -> dict[str, Any]:
    """:func:`load_chosen` of the directory ``opener`` opens, opened inside the plan phase
    and closed as the load ends. A rank whose directory cannot be opened (an object
    store's client that cannot be made on its node; a tiered manager's node directory
    gone since the ranks chose it, no file descriptor left) fails the plan, agreed on
    every rank, instead of raising alone before the load while the others wait for it
    at the entry until the timeout. ``agree_as`` names the load as every rank spells it
    (``Coordinator``'s path); ``warn``: where the load's warnings go (default: said at
    once, pointing at the caller of ``shardsafe.load``); ``called_as``: see
    ``Coordinator``."""
    with contextlib.ExitStack() as opened:
        return _load(
            lambda: opened.enter_context(opener()),
            agree_as,
            choose,
            options,
            view=view,
            hint=hint,
            warn=warn,
            called_as=called_as,
        )


def _load(
    opener: Callable[[], Storage],
    where: str,
    choose: Callable[[Manifest], Mapping[str, Any]],
    options: LoadOptions,
    *,
    view: Callable[[Manifest], Manifest] | None = None,
    hint: Hint | None = None,
    warn: Callable[[str], None] | None = None,
    called_as: str | None = None,
) -> dict[str, Any]:
    """The phases of a load (the module docstring), agreed as ``where``; ``opener`` gives
    the directory, inside the plan phase. See :func:`load_opening` for the rest."""
    coord = Coordinator(
        "load", where, timeout=options.timeout, aftermath=AFTERMATH, called_as=called_as
    )
    coord.enter(options.entry_timeout)
    try:
        decide = _agree_plan(options.strict, where, own_copies=view is not None)
        with coord.phase(Phase.PLAN, decide=decide) as planned:
            storage = opener()
            manifest, read = _manifest_to_load(storage, hint)
            manifest = view(manifest) if view is not None else rank_copy_as_one_rank(manifest)
            state = choose(manifest)
            try:
                plan = plan_load(
                    manifest,
                    state,
                    strict=options.strict,
                    rank=coord.rank,
                    world_size=coord.world_size,
                    untrusted_bytes_limit=options.untrusted_bytes_limit,
                )
            except CheckpointMismatchError as e:
                raise on_a_rank_copy(e, manifest if view is None else None) from None
            routes = _in_file_order(in_place.route(plan, manifest), manifest)
            tied = tied_keys.differing_pairs(routes.shared, manifest)
            if tied and options.strict:
                raise CheckpointMismatchError(tied_keys.refusal(tied))
            # A view (a tiered manager's) loads each rank's own rank checkpoint, whose
            # manifests differ by design: only the loads of one checkpoint compare them.
            same = read if view is None else ""
            planned.payload = {
                "unexpected": plan.unexpected,
                "left_out": plan.left_out,
                "manifest": same,
            }
            said = [
                f"shardsafe: strict=False leaves state[{name!r}] as it is: "
                f"{no_entry(name, list(manifest.values))}"
                for name in plan.absent  # strict=False: others load, this one stays as is
            ]
            for left in said + ([tied_keys.warning(tied)] if tied else []):
                if warn is not None:
                    warn(left)
                else:  # the caller of shardsafe.load (or of a manager's load_latest)
                    _warnings.warn(left)
        spool = _spool(storage, options, routes, manifest)
        threads = _threads(
            storage, options, spool, coord.world_size, lambda: _files(routes, manifest)
        )
        in_place_sizes = [_bytes(manifest, req) for req, _ in routes.in_place]
        # Each thread has a piece of its own, the pieces within half the budget.
        pieces = min(options.buffer_bytes // 2 // threads, CACHE_PIECE_BYTES)
        cuda_pieces = pinned_ring.piece_bytes_for(options.buffer_bytes)
        reader = CheckpointReader(
            storage, manifest, piece_bytes=pieces, cuda_piece_bytes=cuda_pieces, spool=spool
        )
        with reader, contextlib.closing(spool) if spool else contextlib.nullcontext():
            with coord.phase(Phase.READ):
                tensors = _read(reader, routes, options.verify, in_place_sizes, spool, threads)
                for item in plan.entries:
                    guarded(item, "validate", item.adapter.validate, item.obj, item.saved, tensors)
            with coord.phase(Phase.RESTORE):
                in_place.fill(
                    reader,
                    routes.in_place,
                    verify=options.verify,
                    rank=coord.rank,
                    threads=threads,
                    sizes=in_place_sizes,
                )
                return _restore(plan, state, tensors, [t for _, t in routes.in_place], coord.rank)
    except BaseException as e:
        coord.abandon(e)  # unless agreed (Ctrl-C, a failure between phases): tell the others
        raise
    finally:
        coord.close()


def _agree_plan(strict: bool, where: str, own_copies: bool) -> Callable[[list[Any]], list[Any]]:
    """Rank 0's checks over every rank's plan: that every rank read the same manifest
    (each reads its own copy: a checkpoint copied over the directory between two ranks'
    reads made them restore different checkpoints, each reporting success; found in
    review), and that each unexpected key is held by some rank (a pipeline stage loads
    its own keys; the other stages' are not unexpected). With ``own_copies`` (a view:
    each rank restores its own rank checkpoint, which no other rank reads) each rank's
    unexpected keys, and the entries its copy holds that it left out, are its own."""

    def decide(payloads: list[Any]) -> list[Any]:
        read = [p["manifest"] for p in payloads]
        other = next((r for r, fingerprint in enumerate(read) if fingerprint != read[0]), None)
        if other is not None:
            raise CheckpointError(
                f"the manifest of {where} changed during the load: rank 0 and rank {other} "
                "read different ones (another save or a copy replaced the checkpoint while "
                "it was read); load again once nothing writes to it (nothing was restored)"
            )
        unexpected = [p["unexpected"] for p in payloads]
        if own_copies:  # each rank restores its own copy (a view): no other rank holds them
            unexpected_anywhere(unexpected, [p["left_out"] for p in payloads], strict)
        else:
            unexpected_everywhere(unexpected, strict)
        return [None] * len(payloads)

    return decide


def _spool(
    storage: Storage, options: LoadOptions, routes: in_place.Routes, manifest: Manifest
) -> Spool | None:
    """A spool if the second read of ``verify="first"`` would be a second download (an
    object store); a local file's comes from the page cache."""
    if options.verify != "first" or storage.cheap_rereads:
        return None
    return spool_for(sum(request_bytes(manifest.tensors[r.key], r) for r, _ in routes.in_place))


def _threads(
    storage: Storage,
    options: LoadOptions,
    spool: Spool | None,
    world: int,
    count_files: Callable[[], int],
) -> int:
    """The threads this rank reads with: one if a spool records the reads (one stream),
    else as ``reader.threads_for`` says for ``options.read_threads``."""
    if spool is not None:
        return 1
    return threads_for(storage.cheap_rereads, count_files, options.read_threads, world)


def _files(routes: in_place.Routes, manifest: Manifest) -> int:
    """How many data files hold pieces of the tensors ``routes`` read (at most)."""
    keys = {req.key for req in routes.fresh} | {req.key for req, _ in routes.in_place}
    return len({chunk.file for key in keys for chunk in manifest.tensors[key].chunks})


def _read(
    reader: CheckpointReader,
    routes: in_place.Routes,
    verify: str,
    in_place_sizes: list[int],
    spool: Spool | None = None,
    threads: int = 1,
) -> dict[str, torch.Tensor]:
    """New tensors for what no live tensor takes; the live targets (still holding their old
    values) for the rest, after checking every byte of them if ``verify == "first"`` (kept
    in ``spool`` for the second read, if there is one). On up to ``threads`` threads; an
    error is the earliest request's (``io/threaded_reads.py``). ``in_place_sizes`` are the
    bytes of each in-place request, which share the threads out."""
    manifest = reader.manifest
    fresh = threaded_reads.run(
        reader,
        routes.fresh,
        lambda r, req: r.read(req.key, req.offsets, req.shape),
        threads=threads,
        sizes=[_bytes(manifest, req) for req in routes.fresh],
        home=lambda req: reader.wide_rows(req.key),  # one row-sized buffer at a time
    )
    fresh.raise_first()
    tensors = {req.key: fresh.results[i] for i, req in enumerate(routes.fresh)}
    if verify == "first":
        with spool.recording() if spool else contextlib.nullcontext():
            checked = threaded_reads.run(
                reader,
                [req for req, _ in routes.in_place],
                lambda r, req: r.check(req.key, req.offsets, req.shape),
                threads=threads,
                sizes=in_place_sizes,
            )
            checked.raise_first()
    tensors.update({req.key: target for req, target in routes.in_place})
    return tensors


def _bytes(manifest: Manifest, req: ReadRequest) -> int:
    return request_bytes(manifest.tensors[req.key], req)


def _in_file_order(routes: in_place.Routes, manifest: Manifest) -> in_place.Routes:
    """The requests in the order the data files hold them (whole tensors first, then
    pieces, each by key: ``save_plan._whole_first``), so that an object store's
    read-ahead serves consecutive tensors from one request instead of jumping back and
    forth in a file."""

    def where(req: ReadRequest) -> tuple[str, bool, str]:
        rec = manifest.tensors[req.key]
        box = box_of(rec, req.offsets, req.shape)
        for chunk in rec.chunks:  # the first piece the request reads decides
            if geometry.intersect((chunk.offsets, chunk.shape), box) is not None:
                return (chunk.file, chunk.shape != rec.shape, req.key)
        return ("", False, req.key)

    fresh = sorted(routes.fresh, key=where)
    placed = sorted(routes.in_place, key=lambda pair: where(pair[0]))
    return in_place.Routes(fresh, placed, routes.shared)


def _restore(
    plan: LoadPlan,
    state: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    in_place: list[torch.Tensor],
    rank: int,
) -> dict[str, Any]:
    """Each entry's restore step, in order; if one fails (validation passed, so a live
    object refused its state: a hook of its own, say), the error says what state every
    object was left in (``in_place``: the targets already filled)."""
    returned: dict[str, Any] = {}
    for n, item in enumerate(plan.entries):
        try:
            value = item.adapter.restore(item.obj, item.saved, tensors, item.ctx)
        except Exception as e:
            before = [entry.saved.name for entry in plan.entries[:n]]
            after = [entry.saved.name for entry in plan.entries[n + 1 :]]
            tied = " (a tied weight with the later key's values)" if sharing(in_place) else ""
            clauses = [
                f"on rank {rank}, all {len(in_place)} tensors loaded in place (in every entry) "
                f"had already been filled from the checkpoint{tied}",
                _entries(before, "restored before it") or "no entry was restored before it",
                _entries(after, "not restored, apart from tensors loaded in place"),
                f"state[{item.saved.name!r}] may be partly restored",
            ]
            raise with_message(
                e,
                f"{error_message(e)}. This was found while restoring state"
                f"[{item.saved.name!r}]: {'; '.join(c for c in clauses if c)}. Load a good "
                "checkpoint before using these objects.",
            ) from e
        if item.adapter.returns_value:
            returned[item.saved.name] = value
            _into_state(state, item.saved.name, value)
    return returned


def _into_state(state: Mapping[str, Any], name: str, value: Any) -> None:
    """Put a returned value back into ``state`` where the caller passed one that cannot
    be filled in place (a number, a string, ``None``, a tuple), as ``dcp.load`` does:
    ``{"step": 0}`` holds the saved step after the load, not only in what ``load``
    returns. A dict or list passed was updated in place (``adapters/values.py``) and a
    tensor filled: they stay."""
    if not isinstance(state, MutableMapping) or name not in state:
        return
    current = state[name]
    updated = (isinstance(current, dict) and isinstance(value, dict)) or (
        isinstance(current, list) and isinstance(value, list)
    )
    if not (updated or isinstance(current, torch.Tensor)):
        state[name] = values.merged(current, value)  # a tuple around its live tensors


def _entries(names: list[str], what: str) -> str:
    """``names`` as state entries that ``what`` ("" if there are none)."""
    if not names:
        return ""
    listed = ", ".join(f"state[{name!r}]" for name in names)
    return f"{listed} {'was' if len(names) == 1 else 'were'} {what}"
