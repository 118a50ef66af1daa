"""``shardsafe verify PATH``: prove that a checkpoint's bytes are exactly what was saved.

Exit status 0: every data file is present, has the size the manifest recorded, has a
valid safetensors header that matches the manifest, opens with the official
``safetensors.safe_open`` (so any safetensors tool can load it) and every tensor's
CRC32 blocks match. Exit status 1: anything else, with one line per problem naming the
file and, where the problem is inside a tensor, its key. All problems are reported, not
just the first, so one run tells how much of a damaged checkpoint is still good.

A directory without ``manifest.json`` is reported as not a checkpoint (exit status 1):
the manifest is written last, so its absence usually means the save was interrupted.

Verification reads every data byte once (plus the headers a second time, through
safetensors); memory use is bounded by the largest single tensor piece.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ._format import human_bytes, natural_key, plural

if TYPE_CHECKING:
    from ..checkpoint.manifest import Manifest
    from ..checkpoint.safetensors_io import HeaderEntry
    from ..checkpoint.storage import LocalStorage

HELP = "check every data file and checksum of a checkpoint (exit status 1 if any is bad)"

_KEYS_SHOWN = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="a checkpoint directory (holds manifest.json)")


def run(args: argparse.Namespace) -> int:
    from ._common import load_manifest

    manifest = load_manifest(args.path)
    problems = find_problems(args.path, manifest)
    files, tensors = (
        plural(len(manifest.files), "data file"),
        plural(len(manifest.tensors), "tensor"),
    )
    if problems:
        for problem in problems:
            print(f"  {problem}")
        print(f"FAILED: {plural(len(problems), 'problem')} in {args.path} ({files}, {tensors})")
        return 1
    size = manifest.total_bytes
    print(f"OK: {files}, {tensors}, {size} bytes ({human_bytes(size)}) verified in {args.path}")
    return 0


def find_problems(path: str, manifest: Manifest) -> list[str]:
    """One line per problem, files first (in name order), then tensors (in key order)."""
    from ..checkpoint.reader import CheckpointReader
    from ..checkpoint.storage import LocalStorage

    storage = LocalStorage(path)
    keys = _keys_by_file(manifest)
    problems: list[str] = []
    unreadable: set[str] = set()
    for name in sorted(manifest.files, key=natural_key):
        headers, problem = _check_file(storage, name, manifest.files[name])
        if headers is None:
            problems.append(f"{problem}; it holds {_some(keys[name])}")
            unreadable.add(name)
            continue
        problems += _check_with_safetensors(os.path.join(path, name), name, headers)
    # Tensors in an unreadable file were reported with it; check the rest chunk by chunk.
    readable = {
        key: rec
        for key, rec in manifest.tensors.items()
        if not any(chunk.file in unreadable for chunk in rec.chunks)
    }
    with CheckpointReader(storage, dataclasses.replace(manifest, tensors=readable)) as reader:
        problems += _unique(reader.verify_all())
    return problems


def _keys_by_file(manifest: Manifest) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {name: [] for name in manifest.files}
    for key in sorted(manifest.tensors, key=natural_key):
        for chunk in manifest.tensors[key].chunks:
            if key not in keys[chunk.file]:
                keys[chunk.file].append(key)
    return keys


def _check_file(
    storage: LocalStorage, name: str, size: int
) -> tuple[dict[str, HeaderEntry] | None, str]:
    """The file's parsed header, or ``None`` and why the file cannot be read at all."""
    from ..checkpoint.safetensors_io import read_header
    from ..errors import CheckpointError

    try:
        with storage.open_reader(name) as reader:
            if reader.size != size:
                return None, (
                    f"data file {name} is {reader.size} bytes but the manifest recorded {size}: "
                    "it was truncated or modified after the save"
                )
            return read_header(reader), ""
    except CheckpointError as e:
        return None, str(e)


def _check_with_safetensors(
    file_path: str, name: str, headers: dict[str, HeaderEntry]
) -> list[str]:
    """Problems the official safetensors reader has with a file that shardsafe can read.

    shardsafe parses headers itself (to check offsets before trusting them); this
    guards against the two parsers disagreeing, which would make a file that passes
    here fail in another tool. Differences between the header and the manifest are
    left to the reader, which reports them with the tensor's key.
    """
    from safetensors import SafetensorError, safe_open

    from ..checkpoint import dtypes

    problems = []
    try:
        with safe_open(file_path, framework="pt") as f:
            names = set(f.keys())
            for tname in sorted(names & set(headers), key=natural_key):
                part = f.get_slice(tname)
                entry = headers[tname]
                if part.get_dtype() != dtypes.safetensors_code(entry.dtype) or tuple(
                    part.get_shape()
                ) != tuple(entry.shape):
                    problems.append(
                        f"{name}: safetensors reads tensor {tname!r} as {part.get_dtype()}"
                        f"{list(part.get_shape())}, shardsafe as "
                        f"{dtypes.safetensors_code(entry.dtype)}{list(entry.shape)}"
                    )
    except (SafetensorError, OSError) as e:
        return [f"{name} cannot be opened by safetensors.safe_open: {e}"]
    if names != set(headers):
        problems.append(
            f"{name}: safetensors and shardsafe list different tensors "
            f"({sorted(names ^ set(headers))})"
        )
    return problems


def _some(keys: list[str]) -> str:
    """``'a', 'b' ... and 3 more`` for a problem line that should stay one line."""
    if not keys:
        return "no tensors"
    shown = ", ".join(repr(k) for k in keys[:_KEYS_SHOWN])
    more = f" ... and {len(keys) - _KEYS_SHOWN} more" if len(keys) > _KEYS_SHOWN else ""
    return f"{plural(len(keys), 'tensor')}: {shown}{more}"


def _unique(lines: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(lines))
