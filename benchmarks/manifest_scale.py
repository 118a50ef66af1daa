"""Parsing and validating a large, legitimate manifest: time and peak memory.

A synthetic FSDP2 run: ``ranks`` ranks, ``params`` parameters each sharded on dim 0 into
one chunk per rank, so ``ranks * params`` chunk records, written by shardsafe's own
manifest writer. Each measurement runs in a fresh process: the bytes are read, then
``manifest.parse`` (what ``load``, ``inspect`` and ``verify`` all start with) runs,
and then ``inspect``'s document is built from it. Peak memory is the process's peak RSS
during the parse, above what it held with the bytes already in memory.

Run alone:  python benchmarks/manifest_scale.py [--chunks 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import Target, table  # noqa: E402
from _report import Section  # noqa: E402

SIZES = ((100, 1000), (1000, 1000))
"""(ranks, parameters per rank): 100,000 and 1,000,000 chunk records."""


def build(path: str, ranks: int, params: int) -> int:
    """Write the manifest of the synthetic run into directory ``path``; its size."""
    import torch

    from shardsafe.checkpoint.manifest import ChunkRecord, Manifest, TensorRecord
    from shardsafe.checkpoint.save_plan import shard_file_name
    from shardsafe.protocol import SavedValue

    files = {shard_file_name(r, ranks): 1 << 40 for r in range(ranks)}
    tensors = {}
    for p in range(params):
        name = f"model/layers.{p}.weight"
        chunks = tuple(
            ChunkRecord(shard_file_name(r, ranks), name, (r * 4, 0), (4, 1024), (r,))
            for r in range(ranks)
        )
        tensors[name] = TensorRecord(torch.float32, (4 * ranks, 1024), chunks)
    values = {"model": SavedValue("model", "module", {"tensors": sorted(tensors), "extra": {}})}
    header = dict.fromkeys(files, 0)
    manifest = Manifest("sharded", ranks, 16 << 20, values, tensors, files, {}, header)
    raw = manifest.to_json()
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(raw)
    return len(raw)


def measure(path: str) -> dict[str, float]:
    """In this (fresh) process: parse time, inspect time, peak extra RSS."""
    from shardsafe.checkpoint.manifest import parse
    from shardsafe.commands import inspect

    with open(os.path.join(path, "manifest.json"), "rb") as f:
        raw = f.read()
    base = _rss_now()
    start = time.perf_counter()
    parse(raw, "manifest.json")
    parsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    inspect.describe(path)
    described = time.perf_counter() - start
    return {"parse_s": parsed, "inspect_s": described, "peak_extra": peak - base}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def section(sizes: tuple[tuple[int, int], ...] = SIZES) -> Section:
    rows = [["chunk records", "ranks x params", "manifest", "parse + validate s",
             "inspect s", "parse peak extra RSS", "x manifest size"]]  # fmt: skip
    targets = []
    for ranks, params in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            size = build(tmp, ranks, params)
            out = subprocess.run(
                [sys.executable, __file__, "--measure", tmp],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            got = json.loads(out.stdout.strip().splitlines()[-1])
        n = ranks * params
        rows.append(
            [
                f"{n:,}",
                f"{ranks} x {params}",
                f"{size / 2**20:,.0f} MiB",
                f"{got['parse_s']:.2f}",
                f"{got['inspect_s']:.2f}",
                f"{got['peak_extra'] / 2**20:,.0f} MiB",
                f"{got['peak_extra'] / size:.1f}x",
            ]
        )
        targets.append(Target(f"parse + validate {n:,} chunk records, s", got["parse_s"], None))
    text = (
        "A synthetic FSDP2 manifest (each parameter a chunk per rank) written by shardsafe, "
        "parsed in a fresh process; `inspect` builds its document from the parsed manifest "
        "(it reads the file again).\n\n" + table(rows)
    )
    return Section(text, targets, {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--chunks", type=int, help="only this many chunk records (1000 ranks)")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    sizes = ((max(args.chunks // 1000, 1), 1000),) if args.chunks else SIZES
    print(section(sizes).text)


if __name__ == "__main__":
    main()
