"""``shardsafe inspect PATH``: what a checkpoint holds, read from its manifest alone.

No data file is opened, so this is instant even for a checkpoint of hundreds of GB, and
works on a checkpoint whose data files are damaged (``shardsafe verify`` checks those).

``--json`` prints one JSON document with these fields (stable; new fields may be added,
existing ones keep their name and meaning)::

    path               absolute path of the checkpoint directory
    format             "shardsafe"
    format_version     int, the manifest's format version
    layout             "sharded" | "consolidated"
    world_size         int, number of ranks that saved it
    created_unix       float seconds since the epoch, or null if not recorded
    created            the same as ISO 8601 in UTC ("2025-01-31T12:00:00+00:00"), or null
    shardsafe_version  str or null: the shardsafe that wrote it
    torch_version      str or null: the torch that wrote it
    checksum           {"algorithm": "crc32", "block_bytes": int}
    values             list, sorted by name, of the saved state values:
                         name, kind ("module", "optimizer", "rng", "value", ...),
                         tensors (int), tensor_bytes (int),
                         value (the saved JSON data; only for kind "value")
    tensors            list, sorted by key (numbers in natural order), of:
                         key, value (name of the state value it belongs to, or null),
                         dtype ("float32", ...), shape (list of int), numel, bytes,
                         chunks (number of saved pieces), files (data files holding it),
                         writers (ranks that wrote its pieces, sorted; see ``writer``)
    files              list, sorted by name, of the data files: name, bytes, tensors
                         (number of tensor pieces stored in it), writer (the rank that
                         wrote it, or null)
    writers            list, sorted by rank (null last), of the ranks that wrote data
                         files: rank, files (their names), bytes, tensors (number of
                         keys with a piece in them)
    totals             data_files, data_bytes (sum of data file sizes), manifest_bytes,
                       bytes (data_bytes + manifest_bytes: the checkpoint on disk),
                       tensors, tensor_bytes (sum of tensor sizes), values

Byte counts of data files are those the manifest recorded at save time. A file's writer
is read from its name: under layout "sharded" rank ``r`` of ``n`` writes
``shard-<r>-of-<n>.safetensors`` (a replicated tensor, a pipeline stage's or a buffer, is
in the file of the one rank that wrote it); under "consolidated" rank 0 writes every file.
A file whose name says nothing (a manifest from elsewhere) has writer null.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from datetime import datetime, timezone
from typing import Any

from ._format import human_bytes, natural_key, plural, printable, table, terminal_safe

HELP = "show what a checkpoint holds: layout, tensors, values, sizes"

_MAX_FILES_SHOWN = 20
_MAX_WRITERS_SHOWN = 64
_SHARD_NAME = re.compile(r"shard-([0-9]{5,12})-of-([0-9]{5,12})\.safetensors")
_VALUE_PREVIEW = 60


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="a checkpoint directory (holds manifest.json)")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document instead of tables"
    )


def run(args: argparse.Namespace) -> int:
    doc = describe(args.path)
    if args.json:
        print(json.dumps(doc, indent=2, allow_nan=False))  # ASCII: control chars escaped
    else:
        print("\n".join(terminal_safe(line) for line in render(doc)))
    return 0


# ---------------------------------------------------------------------------- document


def describe(path: str) -> dict[str, Any]:
    """The ``--json`` document for the checkpoint at ``path`` (see the module docstring)."""
    from ..checkpoint.chunk_table import chunk_files
    from ..checkpoint.locations import is_url
    from ._common import load_manifest

    manifest = load_manifest(path)  # read once; everything below comes from it
    names = sorted(manifest.values, key=natural_key)
    writer = {name: _writer(name, manifest.layout) for name in manifest.files}
    file_names = sorted(manifest.files, key=natural_key)  # sorted once: there may be many
    tensors = [_tensor(key, rec, manifest.values, writer) for key, rec in manifest.tensors.items()]
    tensors.sort(key=lambda t: natural_key(t["key"]))
    by_value: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for t in tensors:
        if t["value"] is not None:
            by_value[t["value"]].append(t)
    pieces: dict[str, int] = dict.fromkeys(manifest.files, 0)
    for rec in manifest.tensors.values():
        for file in chunk_files(rec.chunks):
            pieces[file] += 1
    created = _number(manifest.info.get("created_unix"))
    data_bytes = manifest.total_bytes
    tensor_bytes = sum(t["bytes"] for t in tensors)
    return {
        "path": path if is_url(path) else os.path.abspath(path),
        "format": "shardsafe",
        "format_version": manifest.version,
        "layout": manifest.layout,
        "world_size": manifest.world_size,
        "created_unix": created,
        "created": _iso(created),
        "shardsafe_version": _text(manifest.info.get("shardsafe_version")),
        "torch_version": _text(manifest.info.get("torch_version")),
        "checksum": {"algorithm": "crc32", "block_bytes": manifest.block_bytes},
        "values": [_value(manifest.values[n], by_value[n]) for n in names],
        "tensors": tensors,
        "files": [
            {
                "name": name,
                "bytes": manifest.files[name],
                "tensors": pieces[name],
                "writer": writer[name],
            }
            for name in file_names
        ],
        "writers": _writers(file_names, manifest.files, writer, tensors),
        "totals": {
            "data_files": len(manifest.files),
            "data_bytes": data_bytes,
            "manifest_bytes": manifest.manifest_bytes,
            "bytes": data_bytes + manifest.manifest_bytes,
            "tensors": len(tensors),
            "tensor_bytes": tensor_bytes,
            "values": len(names),
        },
    }


def _owner(key: str, values: dict[str, Any]) -> str | None:
    """The state value a tensor key belongs to: its first segment (value names hold no
    ``/``), if the manifest has such a value."""
    name = key.split("/", 1)[0]
    return name if name in values else None


def _writer(name: str, layout: str) -> int | None:
    """The rank that wrote data file ``name``: the ``r`` of ``shard-<r>-of-<n>`` under
    layout "sharded", rank 0 under "consolidated"; None if the name does not say."""
    if layout == "consolidated":
        return 0
    match = _SHARD_NAME.fullmatch(name)
    if match is None or int(match[1]) >= int(match[2]):
        return None
    return int(match[1])


def _writers(
    names: list[str],
    files: dict[str, int],
    writer: dict[str, int | None],
    tensors: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Per writing rank: its files, their bytes and the number of keys stored in them
    (one pass over the files and one over the tensors)."""
    by_rank: dict[int | None, list[str]] = {}
    for name in names:
        by_rank.setdefault(writer[name], []).append(name)
    keys: dict[int | None, int] = dict.fromkeys(by_rank, 0)
    for t in tensors:
        for rank in {writer[f] for f in t["files"]}:
            keys[rank] += 1
    ranks = sorted(by_rank, key=lambda r: (r is None, r or 0))
    return [
        {
            "rank": rank,
            "files": by_rank[rank],
            "bytes": sum(files[f] for f in by_rank[rank]),
            "tensors": keys[rank],
        }
        for rank in ranks
    ]


def _tensor(
    key: str, rec: Any, values: dict[str, Any], writer: dict[str, int | None]
) -> dict[str, Any]:
    from .. import dtypes
    from ..checkpoint.chunk_table import chunk_files

    files = list(dict.fromkeys(chunk_files(rec.chunks)))
    ranks = {writer[f] for f in files}
    return {
        "key": key,
        "value": _owner(key, values),
        "dtype": dtypes.dtype_name(rec.dtype),
        "shape": list(rec.shape),
        "numel": math.prod(rec.shape),
        "bytes": rec.nbytes,
        "chunks": len(rec.chunks),
        "files": files,
        "writers": sorted(r for r in ranks if r is not None) + ([None] if None in ranks else []),
    }


def _value(saved: Any, mine: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": saved.name,
        "kind": saved.kind,
        "tensors": len(mine),
        "tensor_bytes": sum(t["bytes"] for t in mine),
    }
    if saved.kind == "value":
        out["value"] = saved.meta
    return out


def _number(value: object) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None  # type: ignore[arg-type]


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _iso(unix: float | None) -> str | None:
    if unix is None:
        return None
    try:
        return datetime.fromtimestamp(unix, tz=timezone.utc).isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):  # a manifest from anywhere: absurd times
        return None


# ---------------------------------------------------------------------------- text


def render(doc: dict[str, Any]) -> list[str]:
    """The human-readable tables, built from the same document ``--json`` prints."""
    return [
        *_header(doc),
        "",
        *_values_table(doc),
        "",
        *_tensors_table(doc),
        "",
        *_files_table(doc),
        "",
        *_writers_table(doc),
        "",
        _total_line(doc),
    ]


def _header(doc: dict[str, Any]) -> list[str]:
    created = doc["created"].replace("T", " ").replace("+00:00", " UTC") if doc["created"] else "?"
    writers = ", ".join(
        f"{name} {doc[field]}"
        for name, field in (("shardsafe", "shardsafe_version"), ("torch", "torch_version"))
        if doc[field]
    )
    t = doc["totals"]
    block = human_bytes(doc["checksum"]["block_bytes"])
    rows = [
        ["checkpoint", doc["path"]],
        ["layout", doc["layout"]],
        ["world size", f"{doc['world_size']} at save"],
        ["format", f"{doc['format']} version {doc['format_version']}"],
        ["created", f"{created} by {writers}" if writers else created],
        ["checksums", f"{doc['checksum']['algorithm']} per {block} block"],
        ["size", _size(doc["totals"])],
        ["tensors", f"{t['tensors']}, {human_bytes(t['tensor_bytes'])} of data"],
    ]
    return table(rows)


def _values_table(doc: dict[str, Any]) -> list[str]:
    rows = [["VALUE", "KIND", "TENSORS", "SIZE", ""]]
    for v in doc["values"]:
        preview = _preview(v["value"]) if "value" in v else ""
        rows.append(
            [
                printable(v["name"]),
                printable(v["kind"]),
                str(v["tensors"]),
                human_bytes(v["tensor_bytes"]),
                preview,
            ]
        )
    return table(rows, right=(2, 3))


def _preview(value: Any) -> str:
    text = json.dumps(value, separators=(", ", ": "))  # ASCII: escapes control chars
    return text if len(text) <= _VALUE_PREVIEW else text[: _VALUE_PREVIEW - 3] + "..."


def _ranks(ranks: list[int | None]) -> str:
    return ",".join("?" if r is None else str(r) for r in ranks)


def _tensors_table(doc: dict[str, Any]) -> list[str]:
    """One row per key; with more than one writing rank, the ranks that wrote it."""
    chunked = any(t["chunks"] > 1 for t in doc["tensors"])
    by_rank = len(doc["writers"]) > 1
    head = ["TENSOR", "DTYPE", "SHAPE", "SIZE"] + (["CHUNKS"] if chunked else [])
    rows: list[list[str]] = [head + (["WRITTEN BY RANK"] if by_rank else [])]
    group: str | None = None
    for t in doc["tensors"]:  # sorted by key, so each value's tensors are adjacent
        if t["value"] != group and len(rows) > 1:
            rows.append([])
        group = t["value"]
        shape = "[" + ", ".join(map(str, t["shape"])) + "]"
        row = [printable(t["key"]), t["dtype"], shape, human_bytes(t["bytes"])]
        row += [str(t["chunks"])] if chunked else []
        rows.append(row + ([_ranks(t["writers"])] if by_rank else []))
    return table(rows, right=(3, 4) if chunked else (3,))


def _files_table(doc: dict[str, Any]) -> list[str]:
    files = doc["files"]
    rows = [["FILE", "TENSORS", "SIZE"]]
    rows += [
        [f["name"], str(f["tensors"]), human_bytes(f["bytes"])] for f in files[:_MAX_FILES_SHOWN]
    ]
    lines = table(rows, right=(1, 2))
    if len(files) > _MAX_FILES_SHOWN:
        lines.append(f"... and {len(files) - _MAX_FILES_SHOWN} more (see --json)")
    return lines


def _writers_table(doc: dict[str, Any]) -> list[str]:
    """Which rank wrote what: its files, bytes and keys, and its bytes over the mean of
    the writers' (how evenly a save spread the writing)."""
    writers = doc["writers"]
    mean = sum(w["bytes"] for w in writers) / len(writers) if writers else 0
    rows = [["WRITER RANK", "FILES", "KEYS", "SIZE", "X MEAN"]]
    for w in writers[:_MAX_WRITERS_SHOWN]:
        files = w["files"]
        shown = files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} more)"
        ratio = f"{w['bytes'] / mean:.2f}" if mean else "-"
        rank = "?" if w["rank"] is None else str(w["rank"])
        rows.append([rank, shown, str(w["tensors"]), human_bytes(w["bytes"]), ratio])
    lines = table(rows, right=(0, 2, 3, 4))
    if len(writers) > _MAX_WRITERS_SHOWN:
        lines.append(f"... and {len(writers) - _MAX_WRITERS_SHOWN} more (see --json)")
    return lines


def _size(totals: dict[str, Any]) -> str:
    return (
        f"{human_bytes(totals['bytes'])} on disk: {plural(totals['data_files'], 'data file')} "
        f"({human_bytes(totals['data_bytes'])}) + manifest.json "
        f"({human_bytes(totals['manifest_bytes'])})"
    )


def _total_line(doc: dict[str, Any]) -> str:
    t = doc["totals"]
    return (
        f"total: {plural(t['tensors'], 'tensor')} in {plural(t['data_files'], 'data file')}, "
        f"{t['bytes']} bytes ({human_bytes(t['bytes'])}) with manifest.json"
    )
