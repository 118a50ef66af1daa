"""Which live targets of a load share memory, and what a failed fill left in each.

Targets that share memory (tied weights, views of one tensor, a wrapper subclass and the
tensor it wraps) must be filled one after the other, on one thread
(``in_place.fill``), and when a fill fails part-way the account of what each target
holds must allow for a twin written after it, or not at all.

The analysis works on byte ranges: a target's range is from its first element's byte to
its last's (for a wrapper subclass, the ranges of the tensors it wraps,
``__tensor_flatten__``). Ranges that meet form a group (union-find over a sweep sorted
by start: O(n log n) however the ranges interleave). Only the error path looks inside a
group, through a mask of the group's bytes (at most :data:`EXACT_BYTES`): each target's
elements are marked or tested once, so interleaved views that share no element are told
apart and the account stays linear in the targets' bytes. A group whose memory is
unknown or too large is judged as a whole: any write in it counts for all its members.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..format.tensor_bytes import has_memory

Span = tuple[str, int, int]

PAIRWISE = 64
"""The largest group in which an error's account looks for tied twins (targets that are
the same tensor in the same memory; compared pair by pair, by their ranges only): within
one, the bytes are still marked once each (:func:`_touched_later_by_others`)."""

EXACT_BYTES = 256 << 20
"""The largest stretch of memory an account marks byte by byte to tell whether two
interleaved views share an element; beyond it they are assumed to."""


def spans(t: torch.Tensor) -> list[Span] | None:
    """The device and byte ranges ``t``'s elements lie in (all of each range, for a
    strided view): one for a tensor with memory of its own, those of the tensors it
    wraps for a wrapper subclass; ``None`` if unknown."""
    try:
        base = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    except Exception:  # torch raises RuntimeError or NotImplementedError
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is None:
            return None
        try:
            inner = [getattr(t, name) for name in flatten()[0]]
        except Exception:  # the subclass's own code
            return None
        found: list[Span] = []
        for part in inner:
            parts = spans(part) if isinstance(part, torch.Tensor) and part.numel() else []
            if parts is None:
                return None
            found.extend(parts)
        return found
    extent = sum((int(n) - 1) * abs(int(stride)) for n, stride in zip(t.shape, t.stride())) + 1
    return [(str(t.device), int(base), int(base) + extent * t.element_size())]


def groups(targets: Sequence[torch.Tensor]) -> list[list[int]]:
    """The groups (indices in order) of targets whose ranges meet, each of two or more;
    if a target's memory is unknown, one group of every target (it may share anyone's)."""
    ranges: list[tuple[str, int, int, int]] = []
    for i, t in enumerate(targets):
        if not t.numel():
            continue
        found = spans(t)
        if found is None:  # rare: a wrapper subclass that does not say what it wraps
            every = [j for j, other in enumerate(targets) if other.numel()]
            return [every] if len(every) > 1 else []
        ranges.extend((*span, i) for span in found)
    ranges.sort()
    parent = list(range(len(targets)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    device, end, last = "", 0, -1
    for dev, start, stop, i in ranges:
        if last >= 0 and dev == device and start < end:
            parent[root(i)] = root(last)
            end = max(end, stop)
        else:
            device, end = dev, stop
        last = i
    members: dict[int, list[int]] = {}
    for i in sorted({i for _, _, _, i in ranges}):
        members.setdefault(root(i), []).append(i)
    return [group for group in members.values() if len(group) > 1]


def sharing(targets: Sequence[torch.Tensor]) -> set[int]:
    """The indices of the targets that may share memory with another."""
    return {i for group in groups(targets) for i in group}


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory (unknown ranges may). Two tensors with
    memory of their own whose ranges meet are compared element by element, so
    interleaved views (``w[:, 0::2]`` and ``w[:, 1::2]``) do not."""
    if not a.numel() or not b.numel():
        return False
    if a is b:
        return True
    sa, sb = spans(a), spans(b)
    if sa is None or sb is None:
        return True
    met = [(x, y) for x in sa for y in sb if x[0] == y[0] and x[1] < y[2] and y[1] < x[2]]
    if not met:
        return False
    if len(sa) == 1 and len(sb) == 1 and has_memory(a) and has_memory(b):
        return _share_an_element(a, b, met[0][0], met[0][1])
    return True


def _ranges_meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of ``a`` and ``b`` meet (unknown ones do)."""
    if not a.numel() or not b.numel():
        return False
    sa, sb = spans(a), spans(b)
    if sa is None or sb is None:
        return True
    return any(x[0] == y[0] and x[1] < y[2] and y[1] < x[2] for x in sa for y in sb)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory."""
    found = spans(a)
    return (
        found is not None
        and has_memory(a)
        and found == spans(b)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def overwritten_by_twins(
    targets: Sequence[torch.Tensor], failed: set[int], finished: set[int]
) -> set[int]:
    """The targets that hold neither the checkpoint's values for their own key nor their
    previous values, because a target sharing their memory was written: a finished one
    whose twin then failed part-way, and an unwritten one (refused, or never started)
    whose twin was written at all."""
    found: set[int] = set()
    for group in groups(targets):
        bytes_of = _Bytes(targets, group)
        failed_here = [j for j in group if j in failed]
        written = [j for j in group if j in failed or j in finished]
        by_failed, by_written = bytes_of.marked(failed_here), bytes_of.marked(written)
        for i in group:
            if i in finished:
                touched = by_failed.touches(i, failed_here)
            else:  # failed targets are reported as such; unwritten ones by any write
                touched = i not in failed and by_written.touches(i, written)
            if touched:
                found.add(i)
    return found


def holding_a_later_twin(
    targets: Sequence[torch.Tensor], candidates: set[int], finished: set[int]
) -> dict[int, int | None]:
    """Of the ``candidates`` (finished targets not already found overwritten), those
    whose memory a later ``finished`` target then wrote (twins are filled in index
    order, on one thread): each maps to the last such twin if all are the same tensor in
    the same memory and themselves hold the checkpoint's values (tied weights: it holds
    that twin's), else to ``None`` (it holds a mix). In a group of more than
    :data:`PAIRWISE` members (views that interleave) no tie is looked for: a target
    touched later holds a mix."""
    found: dict[int, int | None] = {}
    for group in groups(targets):
        done = [i for i in group if i in finished]
        if len(group) <= PAIRWISE:
            others = _touched_later_by_others(targets, done, _Bytes(targets, group))
            for pos, i in enumerate(done):
                if i not in candidates or not targets[i].numel():
                    continue
                twins = [j for j in done[pos + 1 :] if same_memory(targets[i], targets[j])]
                if i in others:
                    found[i] = None
                elif twins:
                    found[i] = twins[-1] if all(j in candidates for j in twins) else None
            continue
        by_later = _Bytes(targets, group).marked([])
        later: list[int] = []
        for i in reversed(done):
            if i in candidates and later and by_later.touches(i, later):
                found[i] = None
            by_later.add(i)
            later.append(i)
    return found


def _touched_later_by_others(
    targets: Sequence[torch.Tensor], done: list[int], memory: _Bytes
) -> set[int]:
    """The members of ``done`` (one group, filled in this order) an element of which a
    later member that is not their twin (:func:`same_memory`) shares. With the group's
    memory known: one sweep from the last member back over a byte map of the twin class
    that wrote each byte later (or "several"), each member's bytes visited twice, so
    linear in the group's bytes; else by ranges, conservatively."""
    classes: dict[int, int] = {}
    for i in done:
        twin = next((j for j in done if j < i and same_memory(targets[i], targets[j])), i)
        classes[i] = classes.get(twin, len(set(classes.values())))
    if not memory.exact:  # ranges only: no pair's elements are compared
        return {
            i
            for pos, i in enumerate(done)
            if any(
                classes[j] != classes[i] and _ranges_meet(targets[i], targets[j])
                for j in done[pos + 1 :]
            )
        }
    several = len(done)  # a class number no member has (PAIRWISE fits in int8)
    written = torch.full((memory.size,), -1, dtype=torch.int8, device="cpu")
    found: set[int] = set()
    for i in reversed(done):
        mine = classes[i]
        views = [
            _bytes_of(written, part, span[1] - memory.low)
            for part in _parts(targets[i])
            for span in [(spans(part) or [("", memory.low, 0)])[0]]
        ]
        if any(bool(((v != -1) & (v != mine)).any()) for v in views):
            found.add(i)
        for v in views:
            v.copy_(torch.where((v == -1) | (v == mine), mine, several).to(torch.int8))
    return found


class _Bytes:
    """The memory of one group of targets: a mask of its bytes if every member's memory
    is known, on one device, within :data:`EXACT_BYTES`; else the group as a whole."""

    def __init__(self, targets: Sequence[torch.Tensor], group: list[int]) -> None:
        self.targets = targets
        found = [spans(targets[i]) for i in group]
        known = [s for s in found if s is not None]
        flat = [span for s in known for span in s]
        self.low = min((span[1] for span in flat), default=0)
        high = max((span[2] for span in flat), default=0)
        self.exact = (
            len(known) == len(found)
            and len({span[0] for span in flat}) <= 1
            and high - self.low <= EXACT_BYTES
        )
        self.size = high - self.low

    def marked(self, members: list[int]) -> _Mask:
        mask = _Mask(self, torch.zeros(self.size if self.exact else 0, dtype=torch.bool))
        for j in members:
            mask.add(j)
        return mask


class _Mask:
    """Bytes marked as written by some members of a group."""

    def __init__(self, memory: _Bytes, mask: torch.Tensor) -> None:
        self.memory, self.mask, self.any = memory, mask, False

    def add(self, j: int) -> None:
        self.any = True
        if self.memory.exact:
            for part in _parts(self.memory.targets[j]):
                _bytes_of(self.mask, part, self._offset(part)).fill_(True)

    def touches(self, i: int, members: list[int]) -> bool:
        """Whether ``i``'s memory holds a marked byte (``members``: those marked, for a
        group judged as a whole: whether any was, but ``i`` itself)."""
        if not self.memory.exact:
            return any(j != i for j in members)
        return any(
            bool(_bytes_of(self.mask, part, self._offset(part)).any())
            for part in _parts(self.memory.targets[i])
        )

    def _offset(self, part: torch.Tensor) -> int:
        (span,) = spans(part) or [("", self.memory.low, 0)]
        return span[1] - self.memory.low


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors with memory of their own that hold ``t``'s elements: ``t``, or for a
    wrapper subclass the tensors it wraps (recursively)."""
    if has_memory(t):
        return [t] if t.numel() else []
    names = t.__tensor_flatten__()[0]  # type: ignore[attr-defined]  # known: see spans()
    inner = [getattr(t, name) for name in names]
    return [part for x in inner if isinstance(x, torch.Tensor) for part in _parts(x)]


def _share_an_element(a: torch.Tensor, b: torch.Tensor, sa: Span, sb: Span) -> bool:
    """Whether a byte of ``a``'s elements is one of ``b``'s, marking ``a``'s bytes in a
    mask of the stretch the two ranges cover (if it is at most :data:`EXACT_BYTES`)."""
    low, high = min(sa[1], sb[1]), max(sa[2], sb[2])
    if high - low > EXACT_BYTES:
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
