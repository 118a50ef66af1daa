"""``shardsafe verify PATH``: print :func:`shardsafe.verify`'s report.

Exit status 0: every checksum and data file is right (see
:mod:`shardsafe.checkpoint.verifying` for what is checked), with its notes. Exit status
1: one line per problem, naming the file and, where the problem is inside a tensor, its
key, then a ``FAILED`` line.
"""

from __future__ import annotations

import argparse

from .._text import human_bytes, plural, terminal_safe

HELP = "check every data file and checksum of a checkpoint (exit status 1 if any is bad)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="a checkpoint directory (holds manifest.json)")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint.verifying import verify

    report = verify(args.path)
    files, tensors = plural(report.data_files, "data file"), plural(report.tensors, "tensor")
    if not report.ok:
        for problem in report.problems:
            print(f"  {terminal_safe(problem)}")
        print(
            terminal_safe(
                f"FAILED: {plural(len(report.problems), 'problem')} in {report.path} "
                f"({files}, {tensors})"
            )
        )
        return 1
    size = report.data_bytes
    print(
        terminal_safe(
            f"OK: {files}, {tensors}, {size} bytes ({human_bytes(size)}) verified in {report.path}"
        )
    )
    for note in report.notes:
        print(terminal_safe(f"note: {note}"))
    return 0
