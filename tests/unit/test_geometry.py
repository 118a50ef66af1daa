"""``checkpoint.geometry``: boxes inside N-d tensors, checked against brute force on small grids."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsafe.checkpoint.format import geometry
from shardsafe.checkpoint.format.geometry import Box

_shapes = st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple)


def mask(shape: tuple[int, ...], box: Box) -> torch.Tensor:
    m = torch.zeros(shape, dtype=torch.int64)
    m[tuple(slice(o, o + n) for o, n in zip(*box))] = 1
    return m


@st.composite
def box_in(draw: st.DrawFn, shape: tuple[int, ...]) -> Box:
    offsets, sizes = [], []
    for n in shape:
        o = draw(st.integers(0, n))
        offsets.append(o)
        sizes.append(draw(st.integers(0, n - o)))
    return tuple(offsets), tuple(sizes)


@st.composite
def grid(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A shape and a partition of it into a grid of boxes (cuts along every dim)."""
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple))
    cuts = []
    for n in shape:
        inner = draw(st.sets(st.integers(1, n - 1), max_size=3)) if n > 1 else set()
        cuts.append([0, *sorted(inner), n])
    boxes: list[Box] = [((), ())]
    for c in cuts:
        boxes = [((*o, lo), (*s, hi - lo)) for o, s in boxes for lo, hi in itertools.pairwise(c)]
    return shape, boxes


def test_intersect_examples() -> None:
    assert geometry.intersect(((0, 0), (2, 4)), ((1, 2), (4, 4))) == ((1, 2), (1, 2))
    assert geometry.intersect(((0,), (2,)), ((2,), (2,))) is None  # touching is not meeting
    assert geometry.intersect(((0,), (0,)), ((0,), (5,))) is None  # empty box
    assert geometry.intersect(((), ()), ((), ())) == ((), ())  # 0-d: the one element


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_intersect_matches_brute_force(data: st.DataObject) -> None:
    shape = data.draw(_shapes)
    a, b = data.draw(box_in(shape)), data.draw(box_in(shape))
    both = mask(shape, a) * mask(shape, b)
    got = geometry.intersect(a, b)
    if both.sum() == 0:
        assert got is None
    else:
        assert got is not None and torch.equal(mask(shape, got), both)


def test_tiles_examples() -> None:
    halves = [((0, 0), (2, 6)), ((2, 0), (2, 6))]
    assert geometry.tiles((4, 6), halves)
    assert geometry.tiles((4, 6), list(reversed(halves)))
    assert not geometry.tiles((4, 6), halves[:1])  # hole
    assert not geometry.tiles((4, 6), [*halves, halves[0]])  # duplicate
    assert not geometry.tiles((4, 6), [((0, 0), (3, 6)), ((1, 0), (3, 6))])  # overlap + over
    # Same total volume, but one box overlaps and one leaves a hole.
    assert not geometry.tiles((2, 2), [((0, 0), (1, 2)), ((0, 1), (1, 1)), ((1, 1), (1, 1))])
    assert geometry.tiles((), [((), ())])
    assert not geometry.tiles((), [((), ()), ((), ())])
    assert geometry.tiles((0, 3), [((0, 0), (0, 3))])  # empty tensor
    assert geometry.tiles((0, 3), [])


@settings(max_examples=200, deadline=None)
@given(grid(), st.data())
def test_a_grid_partition_tiles_and_any_damage_is_detected(
    g: tuple[tuple[int, ...], list[Box]], data: st.DataObject
) -> None:
    shape, boxes = g
    order = data.draw(st.permutations(boxes))
    assert geometry.tiles(shape, order)
    victim = data.draw(st.sampled_from(boxes))
    rest = [b for b in boxes if b != victim]
    assert not geometry.tiles(shape, rest)
    assert not geometry.tiles(shape, [*boxes, victim])
    # Move one box by one step along some dim, staying in bounds: overlap + hole.
    dim = data.draw(st.integers(0, len(shape) - 1))
    (off, size) = victim
    step = 1 if off[dim] + size[dim] < shape[dim] else -1
    if off[dim] + step >= 0 and len(boxes) > 1:
        moved = (tuple(o + (step if d == dim else 0) for d, o in enumerate(off)), size)
        assert not geometry.tiles(shape, [*rest, moved])


def test_contiguous_strides() -> None:
    assert geometry.contiguous_strides((2, 3, 4)) == torch.empty(2, 3, 4).stride()
    assert geometry.contiguous_strides(()) == ()
    assert geometry.contiguous_strides((3, 0, 2)) == (2, 2, 1)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_element_span_matches_brute_force(data: st.DataObject) -> None:
    shape = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple))
    box = data.draw(box_in(shape))
    if math.prod(box[1]) == 0:
        return
    index = torch.arange(math.prod(shape)).reshape(shape)
    picked = index[tuple(slice(o, o + n) for o, n in zip(*box))]
    assert geometry.element_span(shape, box) == (int(picked.min()), int(picked.max()) + 1)


def test_splits_on_dim0_only() -> None:
    assert geometry.splits_on_dim0_only((4, 6), [((0, 0), (1, 6)), ((1, 0), (3, 6))])
    assert not geometry.splits_on_dim0_only((4, 6), [((0, 0), (4, 3)), ((0, 3), (4, 3))])
    assert geometry.splits_on_dim0_only((8,), [((0,), (3,)), ((3,), (5,))])
