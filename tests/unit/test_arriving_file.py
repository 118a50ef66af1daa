"""``ArrivingFile``: a data file's bytes checked as they arrive, in pieces of any size,
with the reader's own checks (what ``shardsafe verify`` finds, it finds)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardsafe
from shardsafe.checkpoint.format.manifest import MANIFEST_NAME, parse
from shardsafe.checkpoint.io.arriving import ArrivingFile, pieces_by_file

pytestmark = pytest.mark.timeout(60)

SHARD = "shard-00000-of-00001.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, bytes]:
    """A checkpoint of several tensors, one over a 16 MiB checksum block, one empty: its
    manifest and its data file's bytes."""
    path = tmp_path_factory.mktemp("arriving") / "ckpt"
    torch.manual_seed(0)
    state = {
        "big": torch.randn(5 << 20),  # 20 MiB: two checksum blocks
        "small": torch.arange(7, dtype=torch.int16),
        "empty": torch.zeros(0),
        "matrix": torch.randn(33, 65),
    }
    shardsafe.save(str(path), state)
    manifest = parse((path / MANIFEST_NAME).read_bytes(), "test")
    return manifest, (path / SHARD).read_bytes()


def checking(manifest: Any) -> ArrivingFile:
    return ArrivingFile(manifest, SHARD, pieces_by_file(manifest)[SHARD])


def arrive(manifest: object, data: bytes, cuts: list[int]) -> str | None:
    arriving = checking(manifest)
    view = memoryview(data)
    at = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        arriving.feed(view[at:cut])
        at = cut
    return arriving.finish()


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=21 << 20), max_size=12))
def test_an_intact_file_passes_however_it_is_cut(
    saved: tuple[object, bytes], cuts: list[int]
) -> None:
    manifest, data = saved
    assert arrive(manifest, data, [c for c in cuts if c <= len(data)]) is None


@pytest.mark.parametrize("where", [-1, -(5 << 20) * 4 + (16 << 20) + 3])
def test_one_flipped_data_byte_is_named_like_verify_names_it(
    saved: tuple[object, bytes], where: int
) -> None:
    manifest, data = saved
    damaged = bytearray(data)
    damaged[where] ^= 1
    problem = arrive(manifest, bytes(damaged), [1000, 9 << 20])
    assert problem is not None and problem.startswith(f"checksum mismatch in {SHARD}, tensor ")


def test_a_flipped_header_byte_fails_its_checksum(saved: tuple[object, bytes]) -> None:
    manifest, data = saved
    damaged = bytearray(data)
    damaged[20] ^= 1
    problem = arrive(manifest, bytes(damaged), [3, 11])
    assert problem is not None and "damaged safetensors header" in problem


def test_a_huge_declared_header_is_refused_before_any_is_kept(
    saved: tuple[object, bytes],
) -> None:
    manifest, data = saved
    forged = (10**15).to_bytes(8, "little") + data[8:]
    arriving = checking(manifest)
    arriving.feed(memoryview(forged)[:8])
    assert arriving.problem is not None and "declares 1000000000000000 header bytes" in (
        arriving.problem
    )
    arriving.feed(memoryview(forged)[8:])  # the rest still arrives; nothing is held
    assert len(arriving._head) == 8


def test_too_few_bytes_are_a_problem(saved: tuple[object, bytes]) -> None:
    manifest, data = saved
    arriving = checking(manifest)
    arriving.feed(memoryview(data)[:-1])
    assert arriving.finish() == f"{SHARD}: {len(data) - 1} of its {len(data)} bytes arrived"


def test_a_zero_length_prefix_is_refused_not_looped_on(saved: tuple[object, bytes]) -> None:
    """What a sender that cannot read its own file sends: zeros. Once looped on forever."""
    manifest, data = saved
    problem = arrive(manifest, bytes(len(data)), [8, 4096])
    assert problem is not None and "damaged safetensors header" in problem


def test_a_tensor_the_manifest_does_not_list_is_refused(saved: tuple[Any, bytes]) -> None:
    """The reader never reads an unlisted tensor; a replica must not hold unchecked bytes."""
    manifest, data = saved
    tensors = {k: v for k, v in manifest.tensors.items() if k != "small"}
    fewer = dataclasses.replace(manifest, tensors=tensors)
    problem = arrive(fewer, data, [])
    assert problem == f"{SHARD} holds tensors its manifest does not list: ['small']"
