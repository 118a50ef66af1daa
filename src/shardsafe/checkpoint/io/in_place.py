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
    """A plain tensor of exactly the box's dtype and shape, whose elements are distinct."""
    if not isinstance(target, torch.Tensor) or dtensor.is_dtensor(target):
        return False
    rec = manifest.tensors[req.key]
    shape = req.shape if req.shape is not None else rec.shape
    return (
        target.dtype == rec.dtype
        and tuple(target.shape) == tuple(shape)
        and target.device.type in ("cpu", "cuda")
        and all(stride != 0 or n <= 1 for stride, n in zip(target.stride(), target.shape))
    )


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
    box; ``threaded_reads.py``); on a bad byte (or an I/O error), raise saying exactly
    which targets were restored.

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
    if not isinstance(error, (CheckpointCorruptError, OSError)):
        raise error
    keys = [req.key for req, _ in in_place]
    failed = {i for i, e in outcome.failures.items() if not isinstance(e, _Refused)}
    partly = failed | _overwritten_by_twins(targets, failed, set(outcome.results))
    done = [keys[i] for i in sorted(set(outcome.results) - partly)]
    cls = CheckpointCorruptError if isinstance(error, CheckpointCorruptError) else CheckpointError
    raise cls(
        partly_restored(error, verify, rank, done, [keys[i] for i in sorted(partly)], len(keys))
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


def _span(t: torch.Tensor) -> _Span | None:
    """The device and byte range ``t``'s elements lie in (all of them, for a strided
    view); ``None`` if unknown (a wrapper subclass has no storage of its own)."""
    try:
        base = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    except Exception:  # torch raises RuntimeError or NotImplementedError
        return None
    extent = sum((int(n) - 1) * abs(int(stride)) for n, stride in zip(t.shape, t.stride())) + 1
    return (str(t.device), int(base), int(base) + extent * t.element_size())


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory (unknown spans may)."""
    if a is b:
        return bool(a.numel())
    sa, sb = _span(a), _span(b)
    if not a.numel() or not b.numel():
        return False
    if sa is None or sb is None:
        return True
    return sa[0] == sb[0] and sa[1] < sb[2] and sb[1] < sa[2]


def _overwritten_by_twins(
    targets: Sequence[torch.Tensor], failed: set[int], finished: set[int]
) -> set[int]:
    """The targets that hold neither the checkpoint's values for their own key nor their
    previous values, because a target sharing their memory was written: a finished one
    whose twin then failed part-way, and an unwritten one (refused, or never started)
    whose twin was written at all. Compared only among those that share memory."""
    written = failed | finished
    shared = _sharing(targets)
    found = set()
    for i in sorted(shared - failed):
        others = (failed if i in finished else written) & shared
        if any(j != i and _overlap(targets[i], targets[j]) for j in others):
            found.add(i)
    return found


def _sharing(targets: Sequence[torch.Tensor]) -> set[int]:
    """The indices of the targets that share memory with another, or whose memory is
    unknown. Sorted by start: O(n log n)."""
    unknown: set[int] = set()
    spans: list[tuple[str, int, int, int]] = []
    for i, t in enumerate(targets):
        if t.numel():
            span = _span(t)
            if span is None:
                unknown.add(i)
            else:
                spans.append((*span, i))
    spans.sort()
    shared: set[int] = set()
    group: list[int] = []
    device, end = "", 0
    for dev, start, stop, i in spans:
        if group and dev == device and start < end:
            group.append(i)
            end = max(end, stop)
            continue
        if len(group) > 1:
            shared.update(group)
        group, device, end = [i], dev, stop
    if len(group) > 1:
        shared.update(group)
    return shared | unknown


def partly_restored(
    error: BaseException,
    verify: str,
    rank: int,
    done: Sequence[str],
    partly: Sequence[str],
    total: int,
) -> str:
    """The message for failures while filling ``partly``, the targets in ``done`` filled,
    the other targets of the ``total`` untouched."""
    why = (
        "every byte had passed its checksum before restoring began (verify='first'), so "
        "the file was modified during the load"
        if verify == "first"
        else "with verify='inline' each tensor is copied into its live object as it is read"
    )
    named = ", ".join(repr(k) for k in done[:_NAMED])
    more = f" and {len(done) - _NAMED} more" if len(done) > _NAMED else ""
    restored = f" ({named}{more})" if done else ""
    overwritten = (
        f"{', '.join(map(repr, partly))} {'is' if len(partly) == 1 else 'are'}"
        if partly
        else "none is"
    )
    rest = total - len(done) - len(partly)
    return (
        f"{error}. This was found while restoring: {why}. On rank {rank}, {len(done)} of the "
        f"{total} tensors loaded in place hold the checkpoint's values{restored}, "
        f"{overwritten} partly overwritten, and the other {rest} keep their previous "
        "values; no object's restore step had run, so everything else (param groups, "
        "module extra state, RNG, tensors not loaded in place) is unchanged. Load a good "
        "checkpoint before using these objects."
    )
