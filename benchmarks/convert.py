"""Converting a ~1 GiB checkpoint: shardsafe's converters against DCP's ``dcp_to_torch_save``.

Setup: a DCP checkpoint written by ``dcp.save`` of a model state dict of float32 tensors
(``--mib`` in total, the largest ``--largest-mib``), the shape of a real model's weights:
a few large matrices and many smaller ones. Each row runs in a fresh Python process (so
no conversion reuses another's heap); its peak RSS is sampled every 2 ms from just before
the call (torch and shardsafe already imported) to just after it:

  dcp_to_torch_save        torch.distributed.checkpoint.format_utils.dcp_to_torch_save
                           (it loads the whole checkpoint into one process, then saves)
  shardsafe dcp -> torch   shardsafe.convert(..., to="torch"): the same job, streamed
  shardsafe dcp -> shardsafe  shardsafe.convert(...): committed, verified checkpoint
  shardsafe shardsafe -> torch  shardsafe.convert(..., to="torch") from that checkpoint
  shardsafe torch -> shardsafe  shardsafe.convert(...) of dcp_to_torch_save's file
                           (memory-mapped; each tensor's pages dropped once written)

Every shardsafe row includes the verification of what it wrote (a second read).
Target: each shardsafe conversion's peak extra RSS at most the largest tensor plus
64 MiB of fixed buffers, whatever the checkpoint's size.

    python benchmarks/convert.py [--mib 1024] [--largest-mib 128] [--dir /tmp/...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import PeakRSS, Target, machine, mib, table, trim_heap, verdicts

BUFFER_MIB = 64
ROWS = (
    ("dcp_to_torch_save", "dcp", "dcp_to_torch_save.pt"),
    ("shardsafe dcp -> torch", "dcp", "shardsafe.pt"),
    ("shardsafe dcp -> shardsafe", "dcp", "shardsafe-ckpt"),
    ("shardsafe shardsafe -> torch", "shardsafe-ckpt", "from-shardsafe.pt"),
    ("shardsafe torch -> shardsafe", "dcp_to_torch_save.pt", "from-torch"),
)


def sizes(total_mib: int, largest_mib: int) -> list[int]:
    """Tensor sizes in MiB: two of the largest, then halving, then 8 MiB ones to the total."""
    out, left, size = [], total_mib, largest_mib
    while left > 0:
        for _ in range(2):
            take = min(size, left)
            if take > 0:
                out.append(take)
                left -= take
        size = max(size // 2, 8)
    return out


def build(root: str, total_mib: int, largest_mib: int) -> int:
    """The DCP checkpoint under ``root/dcp``; returns the largest tensor's bytes."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    state = {
        f"layers.{i}.weight": torch.randn(n * 2**20 // 4 // 1024, 1024)
        for i, n in enumerate(sizes(total_mib, largest_mib))
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says so
        dcp.save({"model": state}, checkpoint_id=os.path.join(root, "dcp"))
    return max(t.numel() * t.element_size() for t in state.values())


def child(row: str, src: str, dst: str) -> dict[str, Any]:
    """One conversion in this (fresh) process: seconds and peak extra RSS."""
    import torch  # noqa: F401 - imported before the baseline, like shardsafe

    import shardsafe

    trim_heap()
    with PeakRSS() as rss, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        if row == "dcp_to_torch_save":
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            dcp_to_torch_save(src, dst)
        else:
            to = "torch" if dst.endswith(".pt") else "shardsafe"  # src: any format
            shardsafe.convert(src, dst, to=to, progress=False)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "rss": rss.extra}


def run_row(row: str, src: str, dst: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, __file__, "--child", row, src, dst],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{row} failed:\n{out.stderr}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="checkpoint size")
    parser.add_argument("--largest-mib", type=int, default=128, help="largest tensor")
    parser.add_argument("--dir", default="/tmp/shardsafe-bench-convert")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    try:
        report(args)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


def report(args: argparse.Namespace) -> None:
    print(f"machine: {machine()}\n")
    largest = build(args.dir, args.mib, args.largest_mib)
    results = {}
    for row, src, dst in ROWS:
        results[row] = run_row(row, os.path.join(args.dir, src), os.path.join(args.dir, dst))
    print(
        f"DCP checkpoint of {len(sizes(args.mib, args.largest_mib))} float32 tensors, "
        f"{args.mib} MiB, largest {mib(largest)}; each row in a fresh process\n"
    )
    base = results["dcp_to_torch_save"]
    rows = [["conversion", "seconds", "peak extra RSS", "time / dcp_to_torch_save", "RSS / its"]]
    for row, r in results.items():
        rows.append(
            [row, f"{r['seconds']:.2f}", mib(r["rss"]),
             f"{r['seconds'] / base['seconds']:.2f}", f"{r['rss'] / max(base['rss'], 1):.2f}"]
        )  # fmt: skip
    print(table(rows))
    limit = round(largest / 2**20 + BUFFER_MIB, 2)
    targets = [
        Target(f"{row}: peak extra RSS in MiB (largest tensor + {BUFFER_MIB} MiB)",
               r["rss"] / 2**20, limit)
        for row, r in results.items() if row != "dcp_to_torch_save"
    ]  # fmt: skip
    targets.append(
        Target(
            "dcp_to_torch_save: peak extra RSS in MiB (for comparison)", base["rss"] / 2**20, None
        )
    )
    print()
    print(verdicts(targets))


if __name__ == "__main__":
    main()
