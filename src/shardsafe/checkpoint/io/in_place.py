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
from ...adapters.module import elements_distinct
from ...errors import CheckpointCorruptError, CheckpointError, with_message
from ...protocol import ReadRequest
from ..format.manifest import Manifest
from ..plan.load_plan import LoadPlan, guarded
from . import memory_sharing, threaded_reads, tied_keys
from .reader import CheckpointReader

_NAMED = 3
"""How many restored keys an error lists by name."""


@dataclass
class Routes:
    """This rank's requests: those read into new tensors, and those read in place."""

    fresh: list[ReadRequest] = field(default_factory=list)
    in_place: list[tuple[ReadRequest, torch.Tensor]] = field(default_factory=list)
    shared: list[list[str]] = field(default_factory=list)
    """Keys offered one live tensor (tied weights: ``tied_keys.shared_targets``)."""


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
    routes = Routes(shared=tied_keys.shared_targets(offered))
    requests = plan.requests
    asked = Counter(req.key for req in requests)
    fitting: dict[int, torch.Tensor] = {}
    refused: list[torch.Tensor] = []  # offered, but written by their object's restore
    for n, req in enumerate(requests):
        target = offered.get(req.key)
        if target is not None and asked[req.key] == 1 and _fits(target, req, manifest):
            fitting[n] = target
        elif isinstance(target, torch.Tensor):
            refused.append(target)
    if refused and fitting:
        # A tensor read in place must not share memory with one its object's restore
        # writes later: a failed fill would then have changed it unaccounted for.
        order = list(fitting)
        targets = [fitting[n] for n in order] + refused
        for group in memory_sharing.groups(targets):
            if group[-1] >= len(order):  # the group holds a refused one (indices sorted)
                for i in group:
                    if i < len(order):
                        del fitting[order[i]]
    for n, req in enumerate(requests):
        if n in fitting:
            routes.in_place.append((req, fitting[n]))
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
    if target.layout != torch.strided:  # sparse or mkldnn: no strides, no raw memory
        return False
    rec = manifest.tensors[req.key]
    shape = req.shape if req.shape is not None else rec.shape
    return (
        target.dtype == rec.dtype
        and tuple(target.shape) == tuple(shape)
        and target.device.type in ("cpu", "cuda")
        and not (target.is_conj() or target.is_neg())
        and not (target.is_inference() and not torch.is_inference_mode_enabled())
        and elements_distinct(target)
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
    box; ``threaded_reads.py``); on any failure (a bad byte, an I/O error, a target that
    refused its copy), raise saying exactly which targets were restored.

    On the calling thread: CUDA targets (their copies go on its current stream), tensors
    whose rows are wider than a read piece (each would hold a buffer of a row), and
    targets that share memory with another (tied weights, when the checkpoint holds
    both keys): those are filled one after the other, in file order, so a checkpoint
    whose tied keys differ leaves the later key's values, never a mix of two."""
    targets = [target for _, target in in_place]
    sharing = {id(targets[i]) for i in memory_sharing.sharing(targets)} if threads > 1 else set()
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
    partly = failed | memory_sharing.overwritten_by_twins(targets, failed, finished)
    later = memory_sharing.holding_a_later_twin(targets, finished - partly, finished)
    partly |= {i for i, j in later.items() if j is None}
    tied = {i: j for i, j in later.items() if j is not None}
    done = [keys[i] for i in sorted(finished - partly - set(tied))]
    # Whatever went wrong (a bad byte, an I/O error, a target torch refused to write),
    # the message says which targets now hold what.
    raise with_message(
        error,
        partly_restored(
            error,
            verify,
            rank,
            done,
            [keys[i] for i in sorted(partly)],
            len(keys),
            tied=[(keys[i], keys[j]) for i, j in sorted(tied.items())],
        ),
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
