"""Hostile-input validation stays near-linear: the timings the unit tests used to assert.

The tests in ``tests/unit/attacks/`` and ``tests/unit/test_manifest_v2.py`` check
that these inputs are parsed or refused correctly; how long that takes is measured here,
where a loaded machine cannot fail the suite (a wall-clock assertion failed two full test
runs on a busy 2-core machine and passed alone). Cases, each the best of ``--repeat``:

* 16,000 chunks along dim 1 of one tensor, and a 2-d grid of 125 x 128 chunks: parse
  (the grid check is what a quadratic implementation would make slow);
* 16 chunks whose CRC counts would overflow a 64-bit sum: refused before anything is
  summed or allocated;
* ``shardsafe inspect`` (text and ``--json``) of 10,000 values and tensors;
* ``shardsafe inspect --json`` of 12,000 one-chunk files against 6,000: the growth,
  which must stay near 2x (linear), not 4x (quadratic);
* ``load`` refusing an unknown dtype name (``_inductor``) in a manifest.

Targets: the limits the tests held (5 s, 5 s, 10 s, a growth <= 3x, 1 s).

Run alone:  python benchmarks/validation_scale.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests.forge: hostile manifests, checksummed

import torch  # noqa: E402
from tests import forge  # noqa: E402

import shardsafe  # noqa: E402
from _common import Target, machine, table, verdicts  # noqa: E402
from _report import Section  # noqa: E402
from shardsafe import cli  # noqa: E402
from shardsafe.checkpoint.format.manifest import parse  # noqa: E402

SHARD = "shard-00000-of-00001.safetensors"


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    """The fastest of ``repeat`` runs: a busy machine slows one run, not the algorithm."""
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def inspect_cli(*args: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["inspect", *args])
    if rc != 0:
        raise RuntimeError(f"inspect failed: {err.getvalue()}")


def overflowing_crc_counts() -> bytes:
    """Sixteen chunks of 2**59 checksum blocks each, so that the counts sum to 2**63."""
    chunks = [
        {"file": SHARD, "name": f"c{i}", "offsets": [i], "shape": [1], "crc32": [0]}
        for i in range(16)
    ]
    doc = forge.pack(
        {
            "format": "shardsafe",
            "version": 2,
            "layout": "sharded",
            "world_size": 1,
            "checksum": {"algorithm": "crc32", "block_bytes": 8, "covers": ["data", "manifest"]},
            "info": {},
            "files": {SHARD: {"bytes": 2**62}},
            "values": {"t": {"kind": "value", "meta": {"__tensor__": "t"}}},
            "tensors": {"t": {"dtype": "uint8", "shape": [2**62], "chunks": chunks}},
        }
    )
    doc["chunks"]["offsets"] = forge.pack_column([0] * 16, "i64")
    doc["chunks"]["shape"] = forge.pack_column([2**62] * 16, "i64")
    return forge.manifest_bytes(doc)


def refused(raw: bytes) -> None:
    try:
        parse(raw)
    except shardsafe.CheckpointCorruptError:
        return
    raise RuntimeError("the manifest was accepted")


def written(root: Path, name: str, doc: dict[str, Any]) -> str:
    ckpt = root / name
    ckpt.mkdir()
    forge.write_manifest(ckpt, doc)
    return str(ckpt)


def hostile_dtype(root: Path) -> str:
    ckpt = root / "dtype"
    shardsafe.save(ckpt, {"t": torch.ones(2)})
    doc = forge.read_manifest(ckpt)
    doc["tensors"]["t"]["dtype"] = "_inductor"
    forge.write_manifest(ckpt, doc)
    return str(ckpt)


def load_refused(path: str) -> None:
    try:
        shardsafe.load(path, {})
    except shardsafe.CheckpointCorruptError:
        return
    raise RuntimeError("the hostile dtype was accepted")


def measure(repeat: int, root: Path) -> tuple[list[list[str]], list[Target]]:
    along = forge.manifest_bytes(forge.grid_doc(1, 16_000))
    grid = forge.manifest_bytes(forge.grid_doc(125, 128))
    overflow = overflowing_crc_counts()
    wide_ckpt = written(root, "wide", forge.wide_doc(10_000, SHARD))
    half = written(root, "half", forge.grid_doc(1, 6_000, file_per_chunk=True))
    whole = written(root, "whole", forge.grid_doc(1, 12_000, file_per_chunk=True))
    dtype = hostile_dtype(root)
    seconds = {
        "parse 16,000 chunks along dim 1": best_of(repeat, lambda: parse(along)),
        "parse a 125 x 128 grid of chunks": best_of(repeat, lambda: parse(grid)),
        "refuse CRC counts summing past 2**63": best_of(repeat, lambda: refused(overflow)),
        "inspect 10,000 values (text and --json)": best_of(
            repeat, lambda: (inspect_cli(wide_ckpt), inspect_cli("--json", wide_ckpt))
        ),
        "inspect --json, 6,000 one-chunk files": best_of(
            repeat, lambda: inspect_cli("--json", half)
        ),
        "inspect --json, 12,000 one-chunk files": best_of(
            repeat, lambda: inspect_cli("--json", whole)
        ),
        "load refusing dtype '_inductor'": best_of(repeat, lambda: load_refused(dtype)),
    }
    rows = [[case, f"{s:.3f}"] for case, s in seconds.items()]
    growth = seconds["inspect --json, 12,000 one-chunk files"] / max(
        seconds["inspect --json, 6,000 one-chunk files"], 1e-9
    )
    targets = [
        Target("parse 16,000 chunks along dim 1, s", seconds[rows[0][0]], 5.0),
        Target("parse a 125 x 128 grid of chunks, s", seconds[rows[1][0]], 5.0),
        Target("refuse overflowing CRC counts, s", seconds[rows[2][0]], 5.0),
        Target("inspect 10,000 values, text and --json, s", seconds[rows[3][0]], 10.0),
        Target("inspect time, 12,000 files / 6,000 files (2 = linear)", growth, 3.0),
        Target("load refusing a hostile dtype name, s", seconds[rows[6][0]], 1.0),
    ]
    return rows, targets


def section(repeat: int = 3) -> Section:
    root = Path(tempfile.mkdtemp(prefix="shardsafe-validation-"))
    try:
        rows, targets = measure(repeat, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = f"Best of {repeat}, one process:\n\n{table([['case', 'seconds'], *rows])}"
    return Section(text, targets, {}, {})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"machine: {machine()}\n")
    done = section(args.repeat)
    print(f"## Hostile-input validation at scale\n\n{done.text}\n\n{verdicts(done.targets)}")


if __name__ == "__main__":
    main()
