"""verify and load open each data file once, by descriptor, under a swapping thread."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

import shardsafe
from shardsafe import CheckpointCorruptError
from shardsafe.checkpoint.loading import read_manifest
from shardsafe.checkpoint.storage.local import LocalStorage
from shardsafe.checkpoint.verifying import find_problems
from tests.opens import outside, recorded_opens
from tests.unit.attacks.common import (
    CFG,
    RACE_SECONDS,
    Swapper,
    X,
    assert_bitwise,
    bits,
    data_file,
    fast_switching,
    fifo_reader_probe,
    header_span,
    linker,
    make_model,
    opens_with_flags,
    outside_but_private,
    private_copy,
    run_cli,
    staged_fifo,
    symlinker,
    weights,
)

pytestmark = pytest.mark.timeout(60)


def _decoy_of(real: Path, where: Path) -> Path:
    """The real file with every tensor byte inverted: its header (and header CRC) is the
    real one's, so reading it would surface as a data checksum mismatch."""
    raw = bytearray(real.read_bytes())
    start = header_span(real)
    raw[start:] = bytes(b ^ 0xFF for b in raw[start:])
    where.write_bytes(bytes(raw))
    return where


REFUSALS_IN_A_RACE = (
    "is a symbolic link",
    "is not a regular file (a named pipe (FIFO))",
    "was replaced while it was being opened",
)


def _race_setup(ckpt: Path, tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    target = data_file(ckpt)
    stage = tmp_path / "stage"
    stage.mkdir()
    master = stage / "master.safetensors"
    shutil.copyfile(target, master)
    decoy = _decoy_of(target, tmp_path / "decoy.safetensors")
    return target, stage, master, decoy


def test_verify_never_reads_a_decoy_swapped_in_while_it_runs(copy_of: Any, tmp_path: Path) -> None:
    ckpt = copy_of("sharded")
    target, stage, master, decoy = _race_setup(ckpt, tmp_path)
    manifest = read_manifest(ckpt)
    assert run_cli("verify", str(ckpt))[0] == 0  # imports the command before recording
    outcomes = {"ok": 0, "refused": 0}
    seen: set[str] = set()
    fifo = staged_fifo(stage)
    makers = [linker(master), symlinker(decoy), linker(fifo), symlinker(f"../../{decoy.name}")]
    deadline = time.monotonic() + RACE_SECONDS
    with (
        recorded_opens() as opened,
        fast_switching(),
        fifo_reader_probe(fifo) as probe,
        Swapper(target, stage, makers) as swapper,
    ):
        i = 0
        while time.monotonic() < deadline or not (outcomes["ok"] and outcomes["refused"]):
            assert time.monotonic() < deadline + 20, outcomes
            i += 1
            if i % 4 == 0:
                rc, out, err = run_cli("verify", str(ckpt))
                assert rc in (0, 1), (rc, out, err)
                problems = [] if rc == 0 else [line for line in out.splitlines()[:-1]]
                assert err == "", err
                assert rc == 1 or out.startswith("OK: "), out
            elif i % 4 == 1:
                with LocalStorage(str(ckpt)) as storage:
                    problems = find_problems(storage, manifest)
            else:
                problems = find_problems(str(ckpt), manifest)
            for problem in problems:
                assert any(f in problem for f in REFUSALS_IN_A_RACE), problem
                seen.update(f for f in REFUSALS_IN_A_RACE if f in problem)
            outcomes["refused" if problems else "ok"] += 1
    assert swapper.swaps > 20 and probe["readers_seen"] == 0, (swapper.swaps, probe)
    assert outside_but_private(opened, ckpt) == []
    assert not any(os.path.realpath(p) == os.path.realpath(decoy) for p in opened)
    assert {"is a symbolic link", "is not a regular file (a named pipe (FIFO))"} & seen
    assert find_problems(str(ckpt), manifest) == []  # the real file is back: OK again


def test_load_never_reads_a_decoy_swapped_in_while_it_runs(
    copy_of: Any, pristine: dict[str, Any], tmp_path: Path
) -> None:
    ckpt = copy_of("sharded")
    target, stage, master, decoy = _race_setup(ckpt, tmp_path)
    outcomes = {"loaded": 0, "refused": 0}
    fifo = staged_fifo(stage)
    makers = [linker(master), symlinker(decoy), linker(fifo), symlinker("/dev/zero")]
    deadline = time.monotonic() + RACE_SECONDS
    with (
        recorded_opens() as opened,
        fast_switching(),
        fifo_reader_probe(fifo) as probe,
        Swapper(target, stage, makers) as swapper,
    ):
        while time.monotonic() < deadline or not (outcomes["loaded"] and outcomes["refused"]):
            assert time.monotonic() < deadline + 20, outcomes
            state = {"model": make_model(1)}
            before = weights(state["model"])
            try:
                out = shardsafe.load(ckpt, state)
            except CheckpointCorruptError as e:
                assert any(f in str(e) for f in REFUSALS_IN_A_RACE), str(e)
                assert_bitwise(weights(state["model"]), before)
                outcomes["refused"] += 1
            else:
                assert_bitwise(weights(state["model"]), pristine["model"])
                assert bits(out["x"]) == bits(X) and out["cfg"] == CFG
                outcomes["loaded"] += 1
    assert swapper.swaps > 20 and probe["readers_seen"] == 0, (swapper.swaps, probe)
    assert outside(opened, ckpt) == []


def test_verify_cross_checks_a_private_copy_not_the_checkpoint_path(
    copy_of: Any, tmp_path: Path
) -> None:
    """The safetensors cross-check reads a temp copy of the header bytes shardsafe read:
    the data file's name is opened once, with O_PATH, and never by a path again."""
    ckpt = copy_of("consolidated")
    manifest = read_manifest(ckpt)
    with opens_with_flags() as flagged:
        assert find_problems(str(ckpt), manifest) == []
    for name in manifest.files:
        mine = [flags for path, flags in flagged if os.path.basename(path) == name]
        assert len(mine) == 1, (name, mine)
        assert mine[0] & os.O_PATH, (name, mine)
    copies = [p for p, _ in flagged if private_copy(p)]
    assert len([p for p in copies if p.endswith("header.safetensors")]) == len(manifest.files)
