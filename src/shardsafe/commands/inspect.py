"""``shardsafe inspect PATH``: print :func:`shardsafe.inspect`'s report as tables.

``--json`` prints the report's :meth:`~shardsafe.checkpoint.inspecting.InspectReport.to_dict`
document instead (stable field names, described there). No data file is opened.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from .._text import human_bytes, plural, terminal_safe
from ..checkpoint.format.gc_pause import paused
from ._format import table

if TYPE_CHECKING:
    from ..checkpoint.inspecting import InspectReport, Totals

HELP = "show what a checkpoint holds: layout, tensors, values, sizes"

_MAX_FILES_SHOWN = 20
_MAX_WRITERS_SHOWN = 64
_VALUE_PREVIEW = 60


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="a checkpoint directory (holds manifest.json)")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document instead of tables"
    )


def run(args: argparse.Namespace) -> int:
    from ..checkpoint.inspecting import inspect

    with paused():  # a report of many files is many small objects, in no cycle
        report = inspect(args.path)
        if args.json:  # ASCII: control chars escaped
            print(json.dumps(report.to_dict(), indent=2, allow_nan=False))
        else:
            print("\n".join(terminal_safe(line) for line in render(report)))
    return 0


def render(report: InspectReport) -> list[str]:
    """The human-readable tables (lines still to be made terminal-safe)."""
    return [
        *_header(report),
        "",
        *_values_table(report),
        "",
        *_tensors_table(report),
        "",
        *_files_table(report),
        "",
        *_writers_table(report),
        "",
        _total_line(report.totals),
    ]


def _header(r: InspectReport) -> list[str]:
    created = r.created.replace("T", " ").replace("+00:00", " UTC") if r.created else "?"
    writers = ", ".join(
        f"{name} {version}"
        for name, version in (("shardsafe", r.shardsafe_version), ("torch", r.torch_version))
        if version
    )
    rows = [
        ["checkpoint", r.path],
        ["layout", r.layout],
        ["world size", f"{r.world_size} at save"],
        ["format", f"{r.format} version {r.format_version}"],
        ["created", f"{created} by {writers}" if writers else created],
        ["checksums", f"{r.checksum_algorithm} per {human_bytes(r.checksum_block_bytes)} block"],
        ["size", _size(r.totals)],
        ["tensors", f"{r.totals.tensors}, {human_bytes(r.totals.tensor_bytes)} of data"],
    ]
    return table(rows)


def _values_table(r: InspectReport) -> list[str]:
    rows = [["VALUE", "KIND", "TENSORS", "SIZE", ""]]
    for v in r.values:
        preview = _preview(v.value) if v.kind == "value" else ""
        rows.append(
            [
                terminal_safe(v.name),
                terminal_safe(v.kind),
                str(v.tensors),
                human_bytes(v.tensor_bytes),
                preview,
            ]
        )
    return table(rows, right=(2, 3))


def _preview(value: Any) -> str:
    text = json.dumps(value, separators=(", ", ": "))  # ASCII: escapes control chars
    return text if len(text) <= _VALUE_PREVIEW else text[: _VALUE_PREVIEW - 3] + "..."


def _ranks(ranks: tuple[int | None, ...]) -> str:
    return ",".join("?" if r is None else str(r) for r in ranks)


def _tensors_table(r: InspectReport) -> list[str]:
    """One row per key; with more than one writing rank, the ranks that wrote it."""
    chunked = any(t.chunks > 1 for t in r.tensors)
    by_rank = len(r.writers) > 1
    head = ["TENSOR", "DTYPE", "SHAPE", "SIZE"] + (["CHUNKS"] if chunked else [])
    rows: list[list[str]] = [head + (["WRITTEN BY RANK"] if by_rank else [])]
    group: str | None = None
    for t in r.tensors:  # sorted by key, so each value's tensors are adjacent
        if t.value != group and len(rows) > 1:
            rows.append([])
        group = t.value
        shape = "[" + ", ".join(map(str, t.shape)) + "]"
        row = [terminal_safe(t.key), t.dtype, shape, human_bytes(t.bytes)]
        row += [str(t.chunks)] if chunked else []
        rows.append(row + ([_ranks(t.writers)] if by_rank else []))
    return table(rows, right=(3, 4) if chunked else (3,))


def _files_table(r: InspectReport) -> list[str]:
    files = r.files
    rows = [["FILE", "TENSORS", "SIZE"]]
    rows += [[f.name, str(f.tensors), human_bytes(f.bytes)] for f in files[:_MAX_FILES_SHOWN]]
    lines = table(rows, right=(1, 2))
    if len(files) > _MAX_FILES_SHOWN:
        lines.append(f"... and {len(files) - _MAX_FILES_SHOWN} more (see --json)")
    return lines


def _writers_table(r: InspectReport) -> list[str]:
    """Which rank wrote what: its files, bytes and keys, and its bytes over the mean of
    the writers' (how evenly a save spread the writing)."""
    writers = r.writers
    mean = sum(w.bytes for w in writers) / len(writers) if writers else 0
    rows = [["WRITER RANK", "FILES", "KEYS", "SIZE", "X MEAN"]]
    for w in writers[:_MAX_WRITERS_SHOWN]:
        files = w.files
        shown = files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} more)"
        ratio = f"{w.bytes / mean:.2f}" if mean else "-"
        rank = "?" if w.rank is None else str(w.rank)
        rows.append([rank, shown, str(w.tensors), human_bytes(w.bytes), ratio])
    lines = table(rows, right=(0, 2, 3, 4))
    if len(writers) > _MAX_WRITERS_SHOWN:
        lines.append(f"... and {len(writers) - _MAX_WRITERS_SHOWN} more (see --json)")
    return lines


def _size(t: Totals) -> str:
    return (
        f"{human_bytes(t.bytes)} as saved: {plural(t.data_files, 'data file')} "
        f"({human_bytes(t.data_bytes)}) + manifest.json ({human_bytes(t.manifest_bytes)})"
    )


def _total_line(t: Totals) -> str:
    return (
        f"total: {plural(t.tensors, 'tensor')} in {plural(t.data_files, 'data file')}, "
        f"{t.bytes} bytes ({human_bytes(t.bytes)}) with manifest.json"
    )
