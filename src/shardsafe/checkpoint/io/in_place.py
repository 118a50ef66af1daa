"""Loading straight into the live tensors the bytes belong in, so a load holds no copy.

Most of what a load reads replaces tensors that already exist: a module's parameters and
buffers, the state of an optimizer that has stepped. Adapters name them (``targets``);
:func:`route` keeps those that fit their request exactly (dtype, shape, a real device,
no overlapping memory) and leaves the rest (a fresh optimizer's state, RNG state,
plain values) to be read into new tensors, which the objects then adopt. :func:`fill`
reads each target's box into it, checksums checked piece by piece, on a few threads
where the rank has cores to spare (``threaded_reads.py``), and, when a checksum fails,
says exactly what state the live objects were left in.

The verify modes (``LoadOptions.verify``) differ only in when :func:`fill` runs: with
``"first"`` every targeted byte has already been read and checked once (``check``), so
a failure here means the file changed during the load; with ``"inline"`` this is the
only read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ...adapters import dtensor
from ...errors import CheckpointCorruptError, CheckpointError
from ...protocol import ReadRequest
from ..format.manifest import Manifest
from ..format.tensor_bytes import has_memory
from ..plan.load_plan import LoadPlan, guarded
from . import threaded_reads
from .reader import CheckpointReader

_NAMED = 3
"""How many restored keys an error lists by name."""


@dataclass
class Routes:
    """This rank's requests: those read into new tensors, and those read in place."""

    fresh: list[ReadRequest] = field(default_factory=list)
    in_place: list[tuple[ReadRequest, torch.Tensor]] = field(default_factory=list)


def route(plan: LoadPlan, manifest: Manifest) -> Routes:
    """Split ``plan``'s requests by whether a live tensor offered for the key fits it."""
    offered: dict[str, torch.Tensor | None] = {}
    for item in plan.entries:
        if item.obj is None:  # a value nobody passed: no live object to fill
            continue
        found = guarded(item, "targets", item.adapter.targets, item.obj, item.saved)
        for key, target in found.items():
            # Two entries offering different tensors for one key: read it fresh.
            offered[key] = target if offered.get(key, target) is target else None
    requests = plan.requests
    asked = Counter(req.key for req in requests)
    routes = Routes()
    for req in requests:
        target = offered.get(req.key)
        if target is not None and asked[req.key] == 1 and _fits(target, req, manifest):
            routes.in_place.append((req, target))
        else:
            routes.fresh.append(req)
    return routes


def _fits(target: object, req: ReadRequest, manifest: Manifest) -> bool:
    """A plain tensor of exactly the box's dtype and shape, whose elements are provably
    distinct, whose values are its memory's (no pending conjugation or negation) and
    which torch lets this thread write (not an inference tensor outside inference mode).
    Any other is left to its object's restore, which replaces it or copies into it."""
    if not isinstance(target, torch.Tensor) or dtensor.is_dtensor(target):
        return False
    rec = manifest.tensors[req.key]
    shape = req.shape if req.shape is not None else rec.shape
    return (
        target.dtype == rec.dtype
        and tuple(target.shape) == tuple(shape)
        and target.device.type in ("cpu", "cuda")
        and not (target.is_conj() or target.is_neg())
        and not (target.is_inference() and not torch.is_inference_mode_enabled())
        and _distinct(target)
    )


def _distinct(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory, by a sufficient test: with its
    dimensions taken by increasing stride, each stride passes the furthest element the
    smaller ones reach (true of every dense or permuted tensor and its slices). A view
    that fails it (``as_strided`` over itself) is left to its object's own copy."""
    reach = 0
    for stride, n in sorted((abs(st), n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= reach:
            return False
        reach += (n - 1) * stride
    return True


def fill(
    reader: CheckpointReader,
    in_place: Sequence[tuple[ReadRequest, torch.Tensor]],
    *,
    verify: str,
    rank: int,
    threads: int = 1,
    sizes: Sequence[int] | None = None,
) -> None:
    """Read every box into its target, on up to ``threads`` threads (``sizes``: bytes per
    box; ``threaded_reads.py``); on any failure (a bad byte, an I/O error, a target that
    refused its copy), raise saying exactly which targets were restored.

    On the calling thread: CUDA targets (their copies go on its current stream), tensors
    whose rows are wider than a read piece (each would hold a buffer of a row), and
    targets that share memory with another (tied weights, when the checkpoint holds
    both keys): those are filled one after the other, in file order, so a checkpoint
    whose tied keys differ leaves the later key's values, never a mix of two."""
    targets = [target for _, target in in_place]
    sharing = {id(targets[i]) for i in _sharing(targets)} if threads > 1 else set()
    outcome = threaded_reads.run(
        reader,
        in_place,
        _read_into,
        threads=threads,
        sizes=sizes if sizes is not None else [1] * len(in_place),
        home=lambda pair: (
            pair[1].device.type == "cuda" or id(pair[1]) in sharing or reader.wide_rows(pair[0].key)
        ),
    )
    if not outcome.failures:
        return
    first = outcome.failures[min(outcome.failures)]
    error = first.error if isinstance(first, _Refused) else first
    keys = [req.key for req, _ in in_place]
    failed = {i for i, e in outcome.failures.items() if not isinstance(e, _Refused)}
    finished = set(outcome.results)
    partly = failed | _overwritten_by_twins(targets, failed, finished)
    later = _holding_a_later_twin(targets, finished - partly)
    partly |= {i for i, j in later.items() if j is None}
    tied = {i: j for i, j in later.items() if j is not None}
    done = [keys[i] for i in sorted(finished - partly - set(tied))]
    # Whatever went wrong (a bad byte, an I/O error, a target torch refused to write),
    # the message says which targets now hold what.
    cls = type(error) if isinstance(error, CheckpointError) else CheckpointError
    raise cls(
        partly_restored(
            error,
            verify,
            rank,
            done,
            [keys[i] for i in sorted(partly)],
            len(keys),
            tied=[(keys[i], keys[j]) for i, j in sorted(tied.items())],
        )
    ) from error


class _Refused(Exception):
    """A target's read that failed before anything was written into it (a data file that
    cannot be opened or does not match the manifest, a bad checksum in the bytes before
    the target's): the target is untouched."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _read_into(reader: CheckpointReader, pair: tuple[ReadRequest, torch.Tensor]) -> None:
    req, target = pair
    try:
        reader.read_into(req.key, req.offsets, req.shape, target)
    except Exception as e:
        if reader.wrote:
            raise
        raise _Refused(e) from e


_Span = tuple[str, int, int]

_EXACT_BYTES = 256 << 20
"""The largest stretch of memory an error's account marks byte by byte to tell whether
two interleaved views share an element; beyond it they are assumed to."""


def _spans(t: torch.Tensor) -> list[_Span] | None:
    """The device and byte ranges ``t``'s elements lie in (all of each range, for a
    strided view): one for a tensor with memory of its own, those of the tensors it
    wraps for a wrapper subclass (``__tensor_flatten__``); ``None`` if unknown."""
    try:
        base = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    except Exception:  # torch raises RuntimeError or NotImplementedError
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is None:
            return None
        try:
            names = flatten()[0]
            inner = [getattr(t, name) for name in names]
        except Exception:  # the subclass's own code
            return None
        found: list[_Span] = []
        for part in inner:
            spans = _spans(part) if isinstance(part, torch.Tensor) and part.numel() else []
            if spans is None:
                return None
            found.extend(spans)
        return found
    extent = sum((int(n) - 1) * abs(int(stride)) for n, stride in zip(t.shape, t.stride())) + 1
    return [(str(t.device), int(base), int(base) + extent * t.element_size())]


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory (unknown spans may). Two plain tensors
    whose ranges meet are compared element by element (this runs only on an error's
    account), so interleaved views (``w[:, 0::2]`` and ``w[:, 1::2]``) do not."""
    if not a.numel() or not b.numel():
        return False
    if a is b:
        return True
    sa, sb = _spans(a), _spans(b)
    if sa is None or sb is None:
        return True
    met = [(x, y) for x in sa for y in sb if x[0] == y[0] and x[1] < y[2] and y[1] < x[2]]
    if not met:
        return False
    if len(sa) == 1 and len(sb) == 1 and has_memory(a) and has_memory(b):
        return _share_an_element(a, b, met[0][0], met[0][1])
    return True


def _share_an_element(a: torch.Tensor, b: torch.Tensor, sa: _Span, sb: _Span) -> bool:
    """Whether a byte of ``a``'s elements is one of ``b``'s, marking ``a``'s bytes in a
    mask of the stretch the two ranges cover (if it is at most ``_EXACT_BYTES``)."""
    low, high = min(sa[1], sb[1]), max(sa[2], sb[2])
    if high - low > _EXACT_BYTES:
        return True
    mask = torch.zeros(high - low, dtype=torch.bool, device="cpu")
    _bytes_of(mask, a, sa[1] - low).fill_(True)
    return bool(_bytes_of(mask, b, sb[1] - low).any())


def _bytes_of(mask: torch.Tensor, t: torch.Tensor, offset: int) -> torch.Tensor:
    """The entries of ``mask`` (one per byte, ``offset`` where ``t`` starts) that ``t``'s
    elements occupy."""
    size = t.element_size()
    shape = (*t.shape, size)
    strides = (*(abs(int(stride)) * size for stride in t.stride()), 1)
    return mask.as_strided(shape, strides, offset)


def _overwritten_by_twins(
    targets: Sequence[torch.Tensor], failed: set[int], finished: set[int]
) -> set[int]:
    """The targets that hold neither the checkpoint's values for their own key nor their
    previous values, because a target sharing their memory was written: a finished one
    whose twin then failed part-way, and an unwritten one (refused, or never started)
    whose twin was written at all. Compared only among those that may share memory."""
    written = failed | finished
    twins = _twins(targets)
    found = set()
    for i in sorted(set(twins) - failed):
        others = failed if i in finished else written
        if any(_overlap(targets[i], targets[j]) for j in twins[i] & others):
            found.add(i)
    return found


def _holding_a_later_twin(
    targets: Sequence[torch.Tensor], finished: set[int]
) -> dict[int, int | None]:
    """The finished targets whose memory a later finished target then wrote (twins are
    filled in index order, on one thread): each maps to that twin if the two are the same
    tensor in the same memory (tied weights: it holds the twin's values), else to ``None``
    (it holds a mix)."""
    twins = _twins(targets)
    found: dict[int, int | None] = {}
    for i in sorted(set(twins) & finished):
        later = sorted(j for j in twins[i] & finished if j > i)
        overwriting = [j for j in later if _overlap(targets[i], targets[j])]
        if overwriting:
            same = all(_same_memory(targets[i], targets[j]) for j in overwriting)
            found[i] = overwriting[-1] if same else None
    return found


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory."""
    spans = _spans(a)
    return (
        spans is not None
        and has_memory(a)
        and spans == _spans(b)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _sharing(targets: Sequence[torch.Tensor]) -> set[int]:
    """The indices of the targets that may share memory with another (their ranges
    meet), or whose memory is unknown."""
    return set(_twins(targets))


def _twins(targets: Sequence[torch.Tensor]) -> dict[int, set[int]]:
    """For each target whose ranges meet another's, the targets that may share its
    memory: those in the same run of meeting ranges, and every target whose memory is
    unknown (which may share anyone's, so that all are then twins). Ranges sorted by
    start: O(n log n) plus the pairs within runs."""
    unknown: set[int] = set()
    ranges: list[tuple[str, int, int, int]] = []
    for i, t in enumerate(targets):
        if t.numel():
            spans = _spans(t)
            if spans is None:
                unknown.add(i)
            else:
                ranges.extend((*span, i) for span in spans)
    ranges.sort()
    runs: list[set[int]] = []
    run: set[int] = set()
    device, end = "", 0
    for dev, start, stop, i in ranges:
        if run and dev == device and start < end:
            run.add(i)
            end = max(end, stop)
            continue
        runs.append(run)
        run, device, end = {i}, dev, stop
    runs.append(run)
    twins: dict[int, set[int]] = {}
    for members in runs:
        if len(members) > 1:
            for i in members:
                twins.setdefault(i, set()).update(members - {i})
    if unknown:  # rare: a wrapper subclass that does not say what it wraps
        for i, t in enumerate(targets):
            if t.numel():
                twins.setdefault(i, set()).update(unknown - {i})
        for i in unknown:
            twins[i].update(j for j, t in enumerate(targets) if j != i and t.numel())
    return twins


def partly_restored(
    error: BaseException,
    verify: str,
    rank: int,
    done: Sequence[str],
    partly: Sequence[str],
    total: int,
    tied: Sequence[tuple[str, str]] = (),
) -> str:
    """The message for failures while filling ``partly``, the targets in ``done`` filled,
    each first key of ``tied`` holding the second's values (it shares its memory and
    was filled before it), the other targets of the ``total`` untouched."""
    if not isinstance(error, CheckpointCorruptError):
        why = "each tensor is copied into its live object as it is read"
    elif verify == "first":
        why = (
            "every byte had passed its checksum before restoring began (verify='first'), "
            "so the file was modified during the load"
        )
    else:
        why = "with verify='inline' each tensor is copied into its live object as it is read"
    what = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
    named = ", ".join(repr(k) for k in done[:_NAMED])
    more = f" and {len(done) - _NAMED} more" if len(done) > _NAMED else ""
    restored = f" ({named}{more})" if done else ""
    overwritten = (
        f"{', '.join(map(repr, partly))} {'is' if len(partly) == 1 else 'are'}"
        if partly
        else "none is"
    )
    rest = total - len(done) - len(partly) - len(tied)
    holding = "".join(
        f"{key!r} shares its memory with {twin!r} and holds that key's values, "
        for key, twin in tied
    )
    return (
        f"{what}. This was found while restoring: {why}. On rank {rank}, {len(done)} of the "
        f"{total} tensors loaded in place hold the checkpoint's values{restored}, "
        f"{holding}{overwritten} partly overwritten, and the other {rest} keep their previous "
        "values; no object's restore step had run, so everything else (param groups, "
        "module extra state, RNG, tensors not loaded in place) is unchanged. Load a good "
        "checkpoint before using these objects."
    )
