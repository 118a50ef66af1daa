"""Parsing and validating a large, legitimate manifest: size, time and peak memory.

A synthetic FSDP2 run: ``ranks`` ranks, ``params`` parameters each sharded on dim 0 into
one chunk per rank, so ``ranks * params`` chunk records, written by shardsafe's own
manifest writer in each format version (1: a JSON object per chunk; 2, what ``save``
writes: one table of binary columns). Each measurement runs in a fresh process: the
bytes are read, then ``manifest.parse`` (what ``load``, ``inspect`` and ``verify`` all
start with: the CRC32, the JSON and every hostile-input check) runs, and then
``inspect``'s document is built from it (which builds every chunk record). Peak memory
is the process's peak RSS during the parse, above what it held with the bytes already
in memory.

Targets (issue #17): at 1,024 ranks x 1,000 parameters, parse + validate <= 2 s and the
manifest <= 256 MiB.

Run alone:  python benchmarks/manifest_scale.py [--chunks 1024000] [--versions 1,2]
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

from _common import Target, table, verdicts  # noqa: E402
from _report import Section  # noqa: E402

SIZES = ((100, 1000), (1024, 1000))
"""(ranks, parameters per rank): 100,000 and 1,024,000 chunk records."""
VERSIONS = (1, 2)
PARSE_TARGET_S = 2.0
SIZE_TARGET_MIB = 256
TARGET_CHUNKS = 1024 * 1000
"""The size the targets are set for; smaller runs show their figures without one."""


def build(path: str, ranks: int, params: int, version: int = 2) -> int:
    """Write the manifest of the synthetic run, in format ``version``, into directory
    ``path``; its size."""
    import torch

    from shardsafe.checkpoint.format.manifest import ChunkRecord, Manifest, TensorRecord
    from shardsafe.checkpoint.plan.save_plan import shard_file_name
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
    raw = manifest.to_json(version)
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(raw)
    return len(raw)


def measure(path: str) -> dict[str, float]:
    """In this (fresh) process: parse time, inspect time, peak extra RSS."""
    import shardsafe
    from shardsafe.checkpoint.format.manifest import parse

    with open(os.path.join(path, "manifest.json"), "rb") as f:
        raw = f.read()
    base = _rss_now()
    start = time.perf_counter()
    parse(raw, "manifest.json")
    parsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    shardsafe.inspect(path)
    described = time.perf_counter() - start
    return {"parse_s": parsed, "inspect_s": described, "peak_extra": peak - base}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run(*args: str) -> dict[str, float]:
    """This script in a fresh process. Building runs in one of its own too: a child's peak
    RSS (``ru_maxrss``) starts at its parent's, which building a million records raises."""
    out = subprocess.run(
        [sys.executable, __file__, *args], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def section(
    sizes: tuple[tuple[int, int], ...] = SIZES, versions: tuple[int, ...] = VERSIONS
) -> Section:
    rows = [["format", "chunk records", "ranks x params", "manifest", "bytes per chunk",
             "parse + validate s", "inspect s", "parse peak extra RSS"]]  # fmt: skip
    targets = []
    for ranks, params in sizes:
        n = ranks * params
        for version in versions:
            with tempfile.TemporaryDirectory() as tmp:
                size = _run("--build", tmp, str(ranks), str(params), str(version))["bytes"]
                got = _run("--measure", tmp)
            rows.append(
                [
                    f"v{version}",
                    f"{n:,}",
                    f"{ranks} x {params}",
                    f"{size / 2**20:,.1f} MiB",
                    f"{size / n:.0f}",
                    f"{got['parse_s']:.2f}",
                    f"{got['inspect_s']:.2f}",
                    f"{got['peak_extra'] / 2**20:,.0f} MiB",
                ]
            )
            at_target = n == TARGET_CHUNKS
            targets.append(
                Target(
                    f"v{version}: parse + validate {n:,} chunk records, s",
                    got["parse_s"],
                    PARSE_TARGET_S if at_target else None,
                )
            )
            targets.append(
                Target(
                    f"v{version}: manifest of {n:,} chunk records, MiB",
                    size / 2**20,
                    SIZE_TARGET_MIB if at_target else None,
                )
            )
    text = (
        "A synthetic FSDP2 manifest (each parameter a chunk per rank) written by shardsafe "
        "in each format version, parsed in a fresh process; `inspect` builds its document "
        "from the parsed manifest (it reads the file again, and builds every chunk "
        "record).\n\n" + table(rows)
    )
    return Section(text, targets, {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--build", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--chunks", type=int, help="only this many chunk records (1000 params)")
    parser.add_argument("--versions", default="1,2", help="format versions (default: 1,2)")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    if args.build:
        path, ranks, params, version = args.build
        print(json.dumps({"bytes": build(path, int(ranks), int(params), int(version))}))
        return
    sizes = ((max(args.chunks // 1000, 1), 1000),) if args.chunks else SIZES
    versions = tuple(int(v) for v in args.versions.split(","))
    result = section(sizes, versions)
    print(result.text)
    print()
    print(verdicts(result.targets))


if __name__ == "__main__":
    main()
