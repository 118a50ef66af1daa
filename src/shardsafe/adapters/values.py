"""Plain values (tensors and JSON-able data) and generic stateful objects (LR schedulers).

Both are usually identical on every rank, as they are in data-parallel training: then one
copy is recorded and each tensor is written once. Where the ranks' stateful objects differ
(one learning-rate scheduler per pipeline stage, each with its own groups), every rank's
state is recorded as it is (``merge_per_rank``) and each rank gets its own back on load,
at the same world size; states whose metadata differs and that hold tensors are refused
at save. A stateful object's small tensors (a per-rank sampler's generator, a model
wrapper's BatchNorm statistics) are compared on every save and, where the ranks' copies
differ, stored per rank (``checkpoint/plan/per_rank.py``; the entry recorded once,
with the keys each rank has its own copy of: ``own_copies``): each rank restores its
own, and at another world size saving rank 0's, with a warning. Its larger tensors are
stored once and compared only with ``verify_replicas`` (comparing a wrapped model's
weights on every save would cost a read of them). Plain values keep rank 0's, tensors included
(rank 0 writes them: ``lowest_rank_wins``), as they always have: ``load`` returns them
even unasked, at any world size, so a per-rank record (a rank's own loss) would make a
checkpoint unloadable elsewhere.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping
from dataclasses import replace
from typing import Any, Literal

import torch

from .. import _names, _tree, _warnings, dtypes
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from ..protocol import (
    JSON,
    Adapter,
    Chunk,
    LoadContext,
    LoadRequests,
    ReadRequest,
    SaveContext,
    SavedValue,
    SaveItem,
)
from . import dtensor, fsdp1
from .module import check_writable, elements_distinct

_PLAIN = (type(None), bool, int, float, str, bytes, list, tuple, dict, torch.Tensor, torch.dtype)
"""What :class:`PlainDataAdapter` takes as a state entry: whatever ``_tree.encode`` saves
inside a value (numpy scalars too: :func:`_tree.is_numpy_scalar`), so that a value a list
or dict may hold is never refused on its own."""


def encode_replicated(
    value: Any, ctx: SaveContext, kind: str, copies: Literal["rank 0's", "any holder's"]
) -> SaveItem:
    """Encode a tree whose tensors are expected to be the same on every rank (DTensors:
    their shards). ``copies`` says which copy is saved: rank 0's (plain values), or the
    least-loaded holder's (stateful objects: compared with the others under
    ``verify_replicas``, small ones on every save and kept per rank where they differ;
    see the module docstring)."""
    chunks: list[Chunk] = []

    def sink(path: tuple[str, ...], tensor: torch.Tensor) -> str:
        key = ctx.key(*path)
        fsdp1.refuse_sharded_tensor(key, tensor, "save")
        for chunk in dtensor.chunks_of(key, tensor, replicated=True):
            if copies == "rank 0's" and chunk.replicated:
                chunk = replace(chunk, lowest_rank_wins=True)
            elif (
                chunk.replicated
                and not dtensor.is_dtensor(tensor)  # a Replicate DTensor is declared equal
                and _nbytes(tensor) <= OWN_COPY_MAX_BYTES
            ):
                chunk = replace(chunk, per_rank_if_different=True)
            chunks.append(chunk)
        return key

    meta = _tree.encode(value, f"state[{ctx.name!r}]", sink)
    return SaveItem(kind, meta, chunks)


OWN_COPY_MAX_BYTES = 64 << 10
"""A stateful object's tensors up to this size are compared across ranks on every save
and stored per rank where they differ (``checkpoint/plan/per_rank.py``): a generator's
state (5 KiB on CPU, 16 bytes on CUDA), per-rank counters and statistics. Larger ones
are stored once and compared only under ``verify_replicas``: comparing a wrapped
model's weights on every save would cost a read of them."""


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


PER_RANK = _tree.PER_RANK


def merge_per_rank(metas: list[JSON]) -> JSON:
    """One record if every rank's is the same; one shared record and the keys each rank
    has its own copy of if they differ only there (:func:`own_copies`); else every rank's
    (see the module docstring)."""
    if all(meta == metas[0] for meta in metas[1:]):
        return metas[0]
    form = own_copies(metas)
    if form is not None:
        return {PER_RANK: form}
    if any(_tree.tensor_refs(meta) for meta in metas):
        # Compared without own copies' keys, which differ between any two ranks that have
        # them: the rank named is one whose structure differs.
        shared = [_tree.rename_refs(meta, _names.shared_key) for meta in metas]
        differ = next(
            (r for r, meta in enumerate(shared) if meta != shared[0]),
            next(r for r, meta in enumerate(metas) if meta != metas[0]),
        )
        raise CheckpointError(
            f"its structure or non-tensor values differ between ranks 0 and {differ}, and "
            "it holds tensors; shardsafe keeps such a value per rank only when the ranks "
            "differ in the values of small tensors alone, so it would come back wrong on "
            "some rank. Keep its structure and non-tensor values the same on every rank "
            "(hold a per-rank number as a small tensor), or hold per-rank tensors in a "
            "module under names of each rank's own (as experts named by global index "
            "are); nothing was written"
        )
    return {PER_RANK: metas}


def own_copies(metas: list[JSON]) -> dict[str, JSON] | None:
    """``{"shared": record, "own": keys}`` when the ranks' records differ only in their own
    copies of small tensors (``checkpoint/plan/per_rank.py``): the record with the shared
    keys, and the keys each rank holds a copy of its own of (rank ``r``'s record is
    :func:`record_of` it). One record, however many ranks: a model wrapper's whole
    metadata is not repeated per rank for its BatchNorm statistics. ``None`` otherwise."""
    own = {
        shared
        for meta in metas
        for key in _tree.tensor_refs(meta)
        if (shared := _names.shared_key(key)) != key
    }
    if not own:
        return None
    form = {"shared": _tree.rename_refs(metas[0], _names.shared_key), "own": sorted(own)}
    if all(record_of(form, rank) == meta for rank, meta in enumerate(metas)):
        return form
    return None


def record_of(form: Mapping[str, JSON], rank: int) -> JSON:
    """Rank ``rank``'s record of an :func:`own_copies` form."""
    own = set(form["own"])
    return _tree.rename_refs(
        form["shared"], lambda key: _names.own_copy_key(key, rank) if key in own else key
    )


def own_record(saved: SavedValue, ctx: LoadContext, *, warn: bool = False) -> SavedValue:
    """``saved`` as this rank restores it: its own record of a per-rank value (``warn``:
    rank 0 says so when that is saving rank 0's, at another world size)."""
    meta = saved.meta
    if not _per_rank(meta):
        return saved
    records = meta[PER_RANK]
    if isinstance(records, dict):
        form = checked_form(records, saved.name)
        if ctx.world_size == ctx.saved_world_size:
            return _one_record(saved, record_of(form, ctx.rank))
        if warn and ctx.rank == 0:
            _warnings.warn(
                f"shardsafe: state[{saved.name!r}] held tensors that differed between "
                f"the {ctx.saved_world_size} saving ranks (a per-rank generator or "
                f"counter); loading at world size {ctx.world_size}, every rank restores "
                "saving rank 0's",
            )
        return _one_record(saved, record_of(form, 0))
    _check_records(saved, records, ctx.saved_world_size)
    if ctx.world_size != ctx.saved_world_size:
        raise CheckpointMismatchError(
            f"state[{saved.name!r}] was saved with a different value on each of "
            f"{ctx.saved_world_size} ranks (e.g. one scheduler per pipeline stage), so it "
            f"restores rank by rank at world size {ctx.saved_world_size} only, not "
            f"{ctx.world_size}. Leave {saved.name!r} out of the state to load the rest."
        )
    return _one_record(saved, records[ctx.rank])


def check_stateful_meta(saved: SavedValue, saved_world_size: int) -> None:
    """Raise what a load of this stateful entry raises for malformed metadata on any rank
    at the saving world size: ``plan_load``'s checks (:func:`own_record`,
    :func:`full_requests`) on every saving rank's record, needing no live object, so that
    ``verify`` never passes a checkpoint that no load accepts."""
    meta = saved.meta
    if not _per_rank(meta):
        records = [saved]
    elif isinstance(meta[PER_RANK], dict):  # the ranks' records differ only in their keys
        records = [_one_record(saved, record_of(checked_form(meta[PER_RANK], saved.name), 0))]
    else:
        _check_records(saved, meta[PER_RANK], saved_world_size)
        records = [_one_record(saved, record) for record in meta[PER_RANK]]
    for record in records:
        full_requests(record)


def _per_rank(meta: JSON) -> bool:
    """Whether an entry's metadata is a per-rank record (:func:`merge_per_rank`)."""
    return isinstance(meta, dict) and len(meta) == 1 and PER_RANK in meta


def _check_records(saved: SavedValue, records: JSON, saved_world_size: int) -> None:
    """Refuse a per-rank record that is not a list of one record per saving rank."""
    if not isinstance(records, list) or len(records) != saved_world_size:
        raise CheckpointCorruptError(
            f"{saved.entry} holds per-rank values that are not one "
            f"per saving rank ({saved_world_size})"
        )


def checked_form(form: dict[str, Any], name: str) -> dict[str, Any]:
    """An :func:`own_copies` form read from a manifest, or why it is not one."""
    own = form.get("own")
    ok = (
        form.keys() == {"shared", "own"}
        and isinstance(own, list)
        and own  # a save records own copies only where a rank has one (own_copies)
        and all(isinstance(key, str) for key in own)
        and len(set(own)) == len(own)
        and set(own) <= set(_tree.tensor_refs(form["shared"]))
    )
    if not ok:
        raise CheckpointCorruptError(
            f"the manifest entry for {name!r} holds a malformed record of per-rank copies"
        )
    return form


def _one_record(saved: SavedValue, record: JSON) -> SavedValue:
    if isinstance(record, dict) and len(record) == 1 and PER_RANK in record:
        raise CheckpointCorruptError(
            f"{saved.entry} holds per-rank values inside a per-rank value, which no save writes"
        )
    return SavedValue(saved.name, saved.kind, record)


def with_own_copies(meta: JSON, own: Mapping[str, str]) -> JSON:
    """``meta`` with each tensor key ``k`` in ``own`` replaced by ``own[k]`` (this rank's
    own copy's key, ``checkpoint/plan/per_rank.py``)."""
    return _tree.rename_refs(meta, lambda key: own.get(key, key))


def representative(meta: JSON, name: str = "") -> JSON:
    """One record of an entry: itself, or saving rank 0's of a per-rank record whose ranks
    differ only in their own copies of small tensors (a converter's single value)."""
    if isinstance(meta, dict) and len(meta) == 1 and isinstance(meta.get(PER_RANK), dict):
        return record_of(checked_form(meta[PER_RANK], name), 0)
    return meta


def module_tensor_keys(saved: SavedValue, stored: Container[str]) -> list[str]:
    """The tensor keys a module entry's metadata names, in order (``stored``: every
    tensor key of its checkpoint, which tells a name with a ``/`` apart); non-string
    names (or a ``tensors`` that is no list), which the adapter refuses on load, are left
    out."""
    meta = saved.meta if isinstance(saved.meta, dict) else {}
    listed = meta.get("tensors", [])
    names = [n for n in listed if isinstance(n, str)] if isinstance(listed, list) else []
    key = _names.module_keys(saved.name, names, stored)
    return [key(n) for n in names]


def full_requests(saved: SavedValue) -> LoadRequests:
    """Every tensor the saved tree refers to, whole; the tree's structure checked first."""
    _tree.check_structure(saved.meta, saved.entry)
    return LoadRequests(requests=[ReadRequest(ref) for ref in _tree.tensor_refs(saved.meta)])


class PlainDataAdapter(Adapter):
    """Tensors and JSON-able values (kind ``"value"``). Load returns them, even unasked; a
    live tensor is also filled in place, the entry itself or one inside a live dict, list
    or tuple (:func:`nested_live`)."""

    kind = "value"
    returns_value = True

    def handles(self, obj: object) -> bool:
        return isinstance(obj, _PLAIN) or _tree.is_numpy_scalar(obj)

    def save(self, obj: Any, ctx: SaveContext) -> SaveItem:
        return encode_replicated(obj, ctx, self.kind, "rank 0's")

    def plan_load(self, obj: Any, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        plan = full_requests(saved)
        if not isinstance(obj, torch.Tensor):
            return _nested_plan(plan, obj, saved, ctx)
        fsdp1.refuse_sharded_tensor(ctx.name, obj, "load")
        ref = _tensor_ref(saved.meta)
        if ref is None:
            plan.requests = []
            plan.mismatched.append(
                f"state[{ctx.name!r}] is a live tensor {dtypes.dtype_name(obj.dtype)}"
                f"{list(obj.shape)}, but the checkpoint holds a {_tree.describe(saved.meta)} "
                "for it"
            )
            return plan
        # Whatever key the metadata names, it must fit the live tensor it is copied into;
        # a live DTensor takes this rank's box of it (its shard, read alone).
        whole = ReadRequest(ref, dtype=obj.dtype, global_shape=tuple(obj.shape))
        plan.requests = [shard_request(whole, obj if dtensor.is_dtensor(obj) else None, ctx)]
        return plan

    def targets(self, obj: Any, saved: SavedValue, ctx: LoadContext) -> dict[str, torch.Tensor]:
        """The live tensors (a DTensor's local shard), read straight into: ``{"model":
        model.state_dict()}`` needs no second copy, and the engine sees every live tensor
        of the load, so that one tensor passed under two names is checked as tied
        weights are (``io/tied_keys.py``), however each is passed."""
        return {
            key: dtensor.local_of(live)
            for key, live in _live(obj, saved, nested_live(obj, ctx)).items()
        }

    def validate(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: LoadContext
    ) -> None:
        _tree.decode(saved.meta, tensors)
        # Refused now, not after other entries restored.
        for key, live in _live(obj, saved, nested_live(obj, ctx)).items():
            name = f"state[{ctx.name!r}]" if live is obj else f"state[{ctx.name!r}] at {key!r}"
            check_writable(name, dtensor.local_of(live))
            _refuse_overlapping(name, dtensor.local_of(live))

    def restore(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: LoadContext
    ) -> Any:
        found = nested_live(obj, ctx)  # walked once here, for the fill and the update
        live = _live(obj, saved, found)
        with torch.no_grad():
            for key, tensor in live.items():
                local = dtensor.local_of(tensor)
                if tensors[key] is not local:  # not read in place (``targets``)
                    local.copy_(tensors[key])  # a DTensor's: this rank's box of it
        # Handed back as the live tensors themselves (a DTensor as one), never needing grad.
        returned = {key: t.detach() if t.requires_grad else t for key, t in live.items()}
        value = _tree.decode(saved.meta, {**tensors, **returned})
        if found is not None:  # else nothing in it is updated (plan_load)
            update_in_place(obj, value)
        return value


def update_in_place(live: Any, saved: Any, seen: set[int] | None = None) -> None:
    """Make the live dicts and lists of a plain value hold what was saved, as ``dcp.load``
    does: each value the checkpoint has replaces the live one (a number, a string, a
    key the live dict lacks; :func:`merged`), so that the user's containers are the
    ones that hold it. Nothing the checkpoint lacks is removed. Why: a DCP user's
    ``{"optim": optimizer.state_dict()}`` came back with its tensors filled and its
    learning rates, steps and counters as they were, in silence (found in review).
    ``seen``: the ids of the live containers updated so far (see :func:`merged`)."""
    seen = set() if seen is None else seen
    seen.add(id(live))
    if isinstance(live, dict) and isinstance(saved, dict):
        for key, value in saved.items():
            current = live.get(key, _ABSENT)
            live[key] = value if current is _ABSENT else merged(current, value, seen)
    elif isinstance(live, list) and isinstance(saved, list):
        for i, value in enumerate(saved[: len(live)]):
            live[i] = merged(live[i], value, seen)
        live.extend(saved[len(live) :])


def merged(current: Any, value: Any, seen: set[int] | None = None) -> Any:
    """What a live container holds where the checkpoint holds ``value``: a live tensor
    stays (it was filled in place, or the checkpoint has no tensor for it, which
    ``strict=False`` leaves as it is), a live dict or list is updated in place, a tuple
    (a namedtuple as one) rebuilt around its updated items; anything else is the saved
    value. A live dict or list met again (one object at two paths: a fresh
    ``SequentialLR``'s ``_last_lr`` is its first scheduler's) is not written twice, the
    last path's values winning at both: this path gets the saved value itself."""
    seen = set() if seen is None else seen
    if current is value or isinstance(current, torch.Tensor):
        return current
    if (isinstance(current, dict) and isinstance(value, dict)) or (
        isinstance(current, list) and isinstance(value, list)
    ):
        if id(current) in seen:
            return value
        update_in_place(current, value, seen)
        return current
    if isinstance(current, tuple) and isinstance(value, tuple) and len(current) == len(value):
        items = [merged(c, v, seen) for c, v in zip(current, value, strict=True)]
        return type(current)(*items) if hasattr(current, "_fields") else tuple(items)
    return value


_ABSENT = object()


def _live(
    obj: Any, saved: SavedValue, found: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """The live tensors a plain value's load fills, by the key of their saved copy: the
    entry itself, or those inside it (``found``: :func:`nested_live`'s) that the
    checkpoint holds a tensor for."""
    if isinstance(obj, torch.Tensor):
        ref = _tensor_ref(saved.meta)
        return {ref: obj} if ref is not None else {}
    refs = set(_tree.tensor_refs(saved.meta))
    return {key: live for key, live in (found or {}).items() if key in refs}


def _tensor_ref(meta: JSON) -> str | None:
    """The key of a value saved as one tensor, else ``None``."""
    ref = meta.get("__tensor__") if isinstance(meta, dict) and len(meta) == 1 else None
    return ref if isinstance(ref, str) else None


def _refuse_overlapping(name: str, tensor: torch.Tensor) -> None:
    """Refuse a live tensor two of whose elements share memory (``as_strided`` over
    itself), which no copy can give the checkpoint's values: torch's ``copy_`` writes
    into it without a word when it cannot prove the overlap, and the tensor (which
    ``load`` returns) came back wrong. Exact: a view that only fails the quick test
    (interleaved strides) is counted element by element."""
    if tensor.numel() < 2 or elements_distinct(tensor):
        return
    span = 1 + sum((n - 1) * abs(st) for st, n in zip(tensor.stride(), tensor.shape))
    offsets = torch.arange(span).as_strided(tensor.shape, tensor.stride())
    if torch.unique(offsets).numel() == tensor.numel():
        return
    raise CheckpointMismatchError(
        f"{name} is a view whose elements overlap in memory (shape {list(tensor.shape)}, "
        f"strides {list(tensor.stride())}), so it cannot hold the checkpoint's values. "
        "Give it memory of its own (.clone()) before loading. Nothing was restored."
    )


def nested_live(obj: Any, ctx: LoadContext) -> dict[str, torch.Tensor] | None:
    """The tensors inside a live dict, list or tuple passed as a plain value, by the key
    their saved copy has (the same path: ``_tree.encode``'s keys).

    Why: ``shardsafe.load(path, {"model": model.state_dict()})`` is how DCP's users load
    (``dcp.load`` fills such tensors in place); returning the values without filling
    them left the model as it was, in silence. ``None`` for a live tree that cannot be
    encoded (it holds something no save accepts): nothing in it is filled or updated,
    with a warning (:meth:`PlainDataAdapter.plan_load`), and its values are returned."""
    if not isinstance(obj, (dict, list, tuple)):
        return {}
    found: dict[str, torch.Tensor] = {}

    def sink(path: tuple[str, ...], tensor: torch.Tensor) -> str:
        key = _names.join(ctx.name, *path)
        found[key] = tensor
        return key

    try:
        _tree.encode(obj, f"state[{ctx.name!r}]", sink)
    except CheckpointError:
        return None
    return found


def _nested_plan(plan: LoadRequests, obj: Any, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
    """``plan`` with each request for a key a live tensor takes checked against it (its
    dtype and shape; a live DTensor's own box), and, on a strict load, every live tensor
    the checkpoint has no tensor for named as missing, and every key or item of a live
    dict or list it has nothing for: refused, as a model's missing weight is (and as
    ``dcp.load`` refuses them), rather than left as it was in silence, beside what the
    load updated."""
    live = nested_live(obj, ctx)
    if live is None:
        _warnings.warn(
            f"shardsafe: state[{ctx.name!r}] holds a value that no checkpoint can hold, so "
            "nothing in it is filled or updated in place; take the saved values from what "
            "load returns",
        )
        return plan
    reported: set[str] = set()  # mismatched: not missing too
    if ctx.strict:
        structure = _tree.decode(saved.meta, _tree.ANY_TENSOR)
        absent: set[str] = set()
        for path, saved_as in _differences(obj, structure, ()):
            key = _names.join(ctx.name, *path)
            if saved_as is None:
                absent.add(key)
            else:
                plan.mismatched.append(f"{key}: the checkpoint holds {saved_as}")
                reported.add(key)
        plan.missing.extend(sorted(absent - set(live)))
    if not live:
        return plan
    requested: set[str] = set()
    requests: list[ReadRequest] = []
    for req in plan.requests:
        target = live.get(req.key)
        if target is not None:
            fsdp1.refuse_sharded_tensor(req.key, target, "load")
            whole = ReadRequest(req.key, dtype=target.dtype, global_shape=tuple(target.shape))
            req = shard_request(whole, target if dtensor.is_dtensor(target) else None, ctx)
            requested.add(req.key)
        requests.append(req)
    plan.requests = requests
    if ctx.strict:  # else left as it is, as a module's missing weight is
        plan.missing.extend(key for key in live if key not in requested | reported)
    return plan


def _differences(
    live: Any, saved: Any, path: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], str | None]]:
    """Where a live dict or list and a saved tree (tensors aside: ``None``) differ: the
    path of each key or item the checkpoint has nothing at (``None``), and of each live
    container or tensor where it holds something else (what it holds: a live dict
    where it holds a number). Values of one kind and another (an ``int`` saved, a
    ``float`` live) are not compared: the saved one replaces the live one."""
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            yield path, f"{_kind(saved)} where the live value is a dict"
            return
        for key, value in live.items():
            if key in saved:
                yield from _differences(value, saved[key], (*path, str(key)))
            else:
                yield (*path, str(key)), None
    elif isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)):
            yield path, f"{_kind(saved)} where the live value is a {type(live).__name__}"
            return
        for i, value in enumerate(live):
            if i < len(saved):
                yield from _differences(value, saved[i], (*path, str(i)))
            else:
                yield (*path, str(i)), None
    elif isinstance(live, torch.Tensor) and saved is not None:
        yield path, f"{_kind(saved)} where the live value is a tensor"


def _kind(saved: Any) -> str:
    """What a saved value (tensors as ``None``) is, as a refusal names it."""
    name = "tensor" if saved is None else type(saved).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


class StatefulAdapter(Adapter):
    """Anything with ``state_dict()``/``load_state_dict()``: LR schedulers, samplers, ..."""

    kind = "stateful"

    def handles(self, obj: object) -> bool:
        return callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)
        )

    def save(self, obj: Any, ctx: SaveContext) -> SaveItem:
        return encode_replicated(obj.state_dict(), ctx, self.kind, "any holder's")

    def merge(self, metas: list[JSON]) -> JSON:
        return merge_per_rank(metas)

    def plan_load(self, obj: Any, saved: SavedValue, ctx: LoadContext) -> LoadRequests:
        plan = full_requests(own_record(saved, ctx, warn=True))
        live = live_dtensors(obj, ctx) if plan.requests else {}
        plan.requests = [shard_request(req, live.get(req.key), ctx) for req in plan.requests]
        return plan

    def validate(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: LoadContext
    ) -> None:
        _tree.decode(own_record(saved, ctx).meta, tensors)

    def restore(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: LoadContext
    ) -> None:
        record = own_record(saved, ctx)
        live = live_dtensors(obj, ctx) if _tree.tensor_refs(record.meta) else {}
        obj.load_state_dict(_tree.decode(record.meta, as_live(tensors, live, ctx)))


def live_dtensors(obj: Any, ctx: LoadContext) -> dict[str, torch.Tensor]:
    """The DTensors of ``obj.state_dict()`` by the key their saved copy has.

    Why: a stateful object may hand out DTensors (DCP's ``AppState`` around an FSDP2 or
    tensor-parallel model: ``get_state_dict``), which its ``load_state_dict`` wants back
    as DTensors sharded the same way; plain whole tensors make torch fail in
    ``load_state_dict`` ("got mixed torch.Tensor and DTensor"). So, as DCP does, the live
    state is asked for its shards: each rank reads only its own box, and gets it back as
    a DTensor. Asked only in a program that has imported DTensor (nothing else can hold
    one). The answer is a hint: a live ``state_dict()`` that fails or cannot be encoded
    (an object that has its state only after its first use) leaves every tensor read
    whole, as before, and ``load_state_dict`` judges."""
    if not dtensor.is_dtensor_imported():
        return {}
    found: dict[str, torch.Tensor] = {}

    def sink(path: tuple[str, ...], tensor: torch.Tensor) -> str:
        key = _names.join(ctx.name, *path)
        if dtensor.is_dtensor(tensor):
            found[key] = tensor
        return key

    try:
        _tree.encode(obj.state_dict(), f"state[{ctx.name!r}]", sink)
    except Exception:  # the hint only (see above); the load goes on as for plain tensors
        return {}
    return found


def shard_request(req: ReadRequest, live: torch.Tensor | None, ctx: LoadContext) -> ReadRequest:
    """``req`` for this rank's box of the live DTensor ``live`` if it matches the saved
    tensor's dtype and shape (else unchanged: read whole, as for a plain tensor)."""
    if live is None:
        return req
    dtensor.refuse_partial_target(req.key, live)
    if ctx.saved_tensors.get(req.key) != (live.dtype, tuple(live.shape)):
        return req
    role, offsets, shape = dtensor.geometry(live)
    whole = tuple(live.shape)
    if role == "replicated":
        return ReadRequest(req.key, dtype=live.dtype, global_shape=whole)
    return ReadRequest(req.key, offsets, shape, live.dtype, whole)


def as_live(
    tensors: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor], ctx: LoadContext
) -> Mapping[str, torch.Tensor]:
    """``tensors`` with each one read for a live DTensor's box (:func:`shard_request`)
    wrapped as a DTensor placed like it."""
    if not live:
        return tensors
    out = dict(tensors)
    for key, template in live.items():
        read = tensors.get(key)
        if read is None or ctx.saved_tensors.get(key) != (template.dtype, tuple(template.shape)):
            continue
        role, _, shape = dtensor.geometry(template)
        if role != "partial" and tuple(read.shape) == shape:
            out[key] = dtensor.like(template, read)
    return out
