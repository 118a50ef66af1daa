"""``shardsafe verify PATH``: prove that a checkpoint's bytes are exactly what was saved.

Exit status 0: the manifest's own checksum matches, every data file is present, is a
regular file of the size the manifest recorded, has a safetensors header whose CRC32
matches and which agrees with the manifest and with the official
``safetensors.safe_open`` (so any safetensors tool can load it), and every tensor's
CRC32 blocks match. Exit status 1: anything else, with one line per problem naming the
file and, where the problem is inside a tensor, its key. All problems are reported, not
just the first, so one run tells how much of a damaged checkpoint is still good.

A checkpoint written before shardsafe checksummed its manifest and headers verifies with
a note saying what could not be checked.

Every file is opened once, without following links, and read through that descriptor.
The cross-check with safetensors runs on a private copy of the header bytes that were
read and checksummed (with a sparse data section of the file's size), never on the
checkpoint's path, which could be swapped for a symlink or a FIFO in between. Memory is
one checksum block, whatever sizes the manifest claims.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ._format import human_bytes, natural_key, plural, terminal_safe

if TYPE_CHECKING:
    from ..checkpoint.manifest import Manifest
    from ..checkpoint.reader import CheckpointReader
    from ..checkpoint.safetensors_io import HeaderEntry
    from ..checkpoint.storage import Storage

HELP = "check every data file and checksum of a checkpoint (exit status 1 if any is bad)"

_KEYS_SHOWN = 5
_OUT_OF_MEMORY = "os error 12"
"""How safetensors' Rust reader reports ENOMEM (a mapping refused under ``ulimit -v``)."""
_UNCHECKED = {
    "manifest": "the manifest's own content",
    "headers": "the data files' safetensors headers",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="a checkpoint directory (holds manifest.json)")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint.locations import open_storage
    from ._common import load_manifest

    notes: list[str] = []
    with open_storage(args.path) as storage:
        manifest = load_manifest(args.path, storage)
        problems = find_problems(storage, manifest, notes)
    files, tensors = (
        plural(len(manifest.files), "data file"),
        plural(len(manifest.tensors), "tensor"),
    )
    if problems:
        for problem in problems:
            print(f"  {terminal_safe(problem)}")
        print(
            terminal_safe(
                f"FAILED: {plural(len(problems), 'problem')} in {args.path} ({files}, {tensors})"
            )
        )
        return 1
    size = manifest.total_bytes
    print(
        terminal_safe(
            f"OK: {files}, {tensors}, {size} bytes ({human_bytes(size)}) verified in {args.path}"
        )
    )
    unchecked = [text for part, text in _UNCHECKED.items() if part not in manifest.covers]
    if unchecked:
        notes.append(
            f"not checked: {' and '.join(unchecked)}, which this checkpoint carries no "
            "checksum for (it was written by an older shardsafe)"
        )
    for note in notes:
        print(terminal_safe(f"note: {note}"))
    return 0


def find_problems(
    storage: Storage | str, manifest: Manifest, notes: list[str] | None = None
) -> list[str]:
    """One line per problem, files first (in name order), then tensors (in key order).

    ``notes`` collects what could not be checked here without being a problem with the
    checkpoint (safetensors' own reader unable to map a large file under a memory limit).
    """
    from ..checkpoint.locations import open_storage
    from ..checkpoint.reader import CheckpointReader

    if isinstance(storage, str):
        with open_storage(storage) as opened:
            return find_problems(opened, manifest, notes)
    notes = [] if notes is None else notes
    keys = _keys_by_file(manifest)
    problems: list[str] = []
    with CheckpointReader(storage, manifest, keep_header_bytes=True) as reader:
        unreadable = reader.check_files()
        for name in sorted(manifest.files, key=natural_key):
            if name in unreadable:
                problems.append(f"{unreadable[name]}; it holds {_some(keys[name])}")
            if name in reader.header_bytes:
                problems += _check_with_safetensors(reader, name, notes)
        # Tensors in an unreadable file were reported with it; check the rest.
        problems += _unique(reader.verify_all(skip_files=set(unreadable)))
    return problems


def _keys_by_file(manifest: Manifest) -> dict[str, list[str]]:
    keys: dict[str, dict[str, None]] = {name: {} for name in manifest.files}
    for key in sorted(manifest.tensors, key=natural_key):
        for chunk in manifest.tensors[key].chunks:
            keys[chunk.file][key] = None
    return {name: list(found) for name, found in keys.items()}


def _check_with_safetensors(reader: CheckpointReader, name: str, notes: list[str]) -> list[str]:
    """Problems the official safetensors reader has with a file's header.

    shardsafe parses headers itself (to check offsets before trusting them); this guards
    against the two parsers disagreeing, which would make a file that passes here fail
    in another tool. It reads a private copy of exactly the header bytes shardsafe read.
    """
    from safetensors import safe_open

    from ..checkpoint.safetensors_io import parse_header

    raw = reader.header_bytes[name]
    size = reader.manifest.files[name]
    try:
        ours: dict[str, HeaderEntry] | None = parse_header(name, raw, size)
    except Exception:  # reported by the reader already
        ours = None
    with tempfile.TemporaryDirectory(prefix="shardsafe-verify-") as private:
        copy = os.path.join(private, "header.safetensors")
        with open(copy, "wb") as f:
            f.write(raw)
            f.truncate(size)  # a sparse data section: nothing is allocated for it
        try:
            with safe_open(copy, framework="pt") as f:
                slices = {t: f.get_slice(t) for t in f.keys()}  # noqa: SIM118 - not a dict
                found = {t: (s.get_dtype(), s.get_shape()) for t, s in slices.items()}
        except Exception as e:  # safetensors raises its own error types, mmap failures too
            if _OUT_OF_MEMORY in str(e):  # it maps the whole file: not the file's fault
                notes.append(
                    f"{name} was not cross-checked with safetensors.safe_open, which could not "
                    f"map its {size} bytes here ({e}); shardsafe's own checks, the same rules, "
                    "passed"
                )
                return []
            return [f"{name} cannot be opened by safetensors.safe_open: {e}"]
    return [] if ours is None else _differences(name, ours, found)


def _differences(
    name: str, ours: dict[str, HeaderEntry], found: dict[str, tuple[str, list[int]]]
) -> list[str]:
    from .. import dtypes

    problems = []
    for tname in sorted(found.keys() & ours.keys(), key=natural_key):
        code, shape = found[tname]
        entry = ours[tname]
        if code != dtypes.safetensors_code(entry.dtype) or tuple(shape) != entry.shape:
            problems.append(
                f"{name}: safetensors reads tensor {tname!r} as {code}{list(shape)}, "
                f"shardsafe as {dtypes.safetensors_code(entry.dtype)}{list(entry.shape)}"
            )
    if found.keys() != ours.keys():
        problems.append(
            f"{name}: safetensors and shardsafe list different tensors "
            f"({sorted(found.keys() ^ ours.keys())[:_KEYS_SHOWN]})"
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
