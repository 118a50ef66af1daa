"""Replication links a data file the receiver already holds instead of receiving it
(``tiers/transfer.py``): when it does, when it must not, and what it never links.

The rank checkpoints here are written by ``rank_checkpoint.write`` exactly as the local
tier writes them; the linking is called as the receiver calls it, with the sender's
manifest, the receiver's own checkpoint of the step, and the new replica directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardsafe.checkpoint.format.manifest import MANIFEST_NAME, parse
from shardsafe.checkpoint.plan.collecting import collect
from shardsafe.checkpoint.storage.local import LocalStorage
from shardsafe.tiers import rank_checkpoint, transfer

pytestmark = pytest.mark.timeout(60)

BULK, SMALL = "shard-00000-of-00001.safetensors", "small-00000-of-00001.safetensors"


def state(seed: int, small: float) -> dict[str, Any]:
    """A 1.4 MiB weight (the bulk file) and a bias (the small file) that holds ``small``."""
    torch.manual_seed(seed)
    model = nn.Linear(600, 600)
    with torch.no_grad():
        model.bias.fill_(small)
    return {"model": model}


def write(path: Path, rank: int, st: dict[str, Any]) -> None:
    path.mkdir(parents=True)
    with LocalStorage(str(path)) as storage:
        rank_checkpoint.write(storage, collect(st, 0, 1), rank=rank, world_size=2, step=1)


def link(theirs: Path, own: Path, replica: Path) -> set[str]:
    """What the receiver links of ``theirs`` from ``own`` into the new ``replica``."""
    manifest = parse((theirs / MANIFEST_NAME).read_bytes(), "theirs")
    replica.mkdir()
    with LocalStorage(str(replica)) as storage:
        return transfer._link_identical(manifest, lambda: LocalStorage(str(own)), storage)


def test_small_chunks_are_set_apart_so_the_large_ones_fill_a_file_shared_by_replicas(
    tmp_path: Path,
) -> None:
    write(tmp_path / "theirs", 0, state(0, small=0.0))
    write(tmp_path / "own", 1, state(0, small=1.0))  # same weight, its own small state
    assert sorted(os.listdir(tmp_path / "own")) == [MANIFEST_NAME, BULK, SMALL]
    assert link(tmp_path / "theirs", tmp_path / "own", tmp_path / "replica") == {BULK}
    linked, own = (os.stat(tmp_path / d / BULK) for d in ("replica", "own"))
    assert (linked.st_ino, linked.st_nlink) == (own.st_ino, 2)
    assert os.listdir(tmp_path / "replica") == [BULK]  # the small file is still to receive


def test_a_file_with_other_bytes_is_never_linked(tmp_path: Path) -> None:
    write(tmp_path / "theirs", 0, state(0, small=0.0))
    write(tmp_path / "own", 1, state(1, small=0.0))  # another weight, same shapes and names
    # The weight's file differs and is received; the bias's is the same and is linked.
    assert link(tmp_path / "theirs", tmp_path / "own", tmp_path / "replica") == {SMALL}
    assert os.listdir(tmp_path / "replica") == [SMALL]


def test_a_link_swapped_in_for_the_own_file_is_never_linked_or_followed(tmp_path: Path) -> None:
    write(tmp_path / "theirs", 0, state(0, small=0.0))
    write(tmp_path / "own", 1, state(0, small=0.0))
    own = tmp_path / "own" / BULK
    os.rename(own, tmp_path / "moved")
    os.symlink(tmp_path / "moved", own)  # same bytes behind a symbolic link
    assert link(tmp_path / "theirs", tmp_path / "own", tmp_path / "replica") == set()
    assert os.listdir(tmp_path / "replica") == []
    assert os.stat(tmp_path / "moved").st_nlink == 1


def test_an_own_checkpoint_that_does_not_verify_its_headers_links_nothing(
    tmp_path: Path,
) -> None:
    write(tmp_path / "theirs", 0, state(0, small=0.0))
    write(tmp_path / "own", 1, state(0, small=0.0))
    with open(tmp_path / "own" / BULK, "r+b") as f:
        f.seek(9)  # inside the safetensors header, which the manifest checksums
        f.write(b"!")
    assert link(tmp_path / "theirs", tmp_path / "own", tmp_path / "replica") == set()


def test_a_state_of_small_tensors_only_stays_one_file(tmp_path: Path) -> None:
    torch.manual_seed(0)
    write(tmp_path / "own", 0, {"model": nn.Linear(4, 4)})
    assert sorted(os.listdir(tmp_path / "own")) == [MANIFEST_NAME, BULK]


def test_inspect_attributes_both_files_of_a_rank_checkpoint_to_its_one_writer(
    tmp_path: Path,
) -> None:
    import shardsafe

    write(tmp_path / "own", 1, state(0, small=1.0))
    report = shardsafe.inspect(str(tmp_path / "own"))
    assert [(w.rank, sorted(w.files)) for w in report.writers] == [(0, [BULK, SMALL])]
