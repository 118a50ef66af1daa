"""``shardsafe.convert``: one function for every pair of formats.

The source is located and described (``detect``, then a reader: nothing but metadata is
read yet), narrowed (``only``) and cast (``dtype``), then handed to the writer of the
destination format, which reads one tensor (or one saved chunk of it) at a time. So the
memory a conversion takes is the largest tensor plus fixed buffers, whatever the
checkpoint's size, and the output is verified before ``convert`` returns.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from .._text import human_bytes
from ..checkpoint.locations import open_storage
from ..checkpoint.options import DEFAULT_UNTRUSTED_BYTES
from ..errors import CheckpointError
from . import dcp_read, dcp_write, hf, shardsafe_format, torch_file
from .bounds import check_allocation
from .detect import locate, split
from .source import FORMATS, Format, Source, cast, select

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DcpLayout = Literal["nested", "flat"]
"""How ``convert(..., to="dcp")`` names the keys (see :func:`convert`)."""
DCP_LAYOUTS: tuple[DcpLayout, ...] = get_args(DcpLayout)


@dataclass(frozen=True)
class Conversion:
    """What a conversion wrote (or, with ``dry_run``, would write)."""

    source_format: Format
    destination_format: Format
    destination: str
    files: list[tuple[str, int]]
    """``(name, bytes)`` of each file written. A dry run's are exact for shardsafe data
    files and Hugging Face files; for ``dcp`` and ``torch`` output, the tensor data
    (their containers add about a kilobyte per tensor)."""
    tensors: int
    tensor_bytes: int
    largest_tensor_bytes: int
    dry_run: bool
    notes: list[str] = field(default_factory=list)


def read_source(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Source:
    """The checkpoint at ``path``, of any format shardsafe converts, described."""
    found = locate(os.fspath(path), storage_options)
    try:
        if found.format == "shardsafe":
            source = shardsafe_format.read(found.storage)
        elif found.format == "dcp":
            source = dcp_read.read(found.storage)
        elif found.format == "hf":
            assert found.name is not None
            source = hf.read(found.storage, found.name)
        else:
            assert found.name is not None
            source = torch_file.read(found.storage, found.name)
    except BaseException:
        found.storage.close()
        raise
    source.closers.insert(0, found.storage.close)
    return source


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: Format = "shardsafe",
    only: Sequence[str] | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    dry_run: bool = False,
    dcp_layout: DcpLayout = "nested",
    progress: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    untrusted_bytes_limit: int = DEFAULT_UNTRUSTED_BYTES,
) -> Conversion:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst``.

    ``src`` is detected: a shardsafe checkpoint (``manifest.json``), a DCP checkpoint
    (``.metadata``), Hugging Face safetensors (a file, an index, or a directory holding
    one), or a ``torch.save``/Lightning ``.ckpt`` file. ``to`` is ``"shardsafe"`` (a new
    directory: a committed, verified checkpoint), ``"dcp"`` (a directory that
    ``torch.distributed.checkpoint.load`` reads), ``"hf"`` (``model.safetensors``, or
    shards of at most ``max_shard_size`` plus ``model.safetensors.index.json``) or
    ``"torch"`` (one ``torch.save`` file: a pickle, see the warning it gives). The
    destination must not exist yet, or be an empty directory: nothing is overwritten.

    ``only`` keeps the named entries (``["model"]``); ``dtype`` casts the floating-point
    weights of modules (``"bfloat16"``; optimizer state keeps its dtype);
    ``strip_prefix``/``add_prefix`` rename Hugging Face weight names. ``dcp_layout``
    (``to="dcp"``): ``"nested"`` (``model.<fqn>``, ``optimizer.state.<fqn>.<name>``: what
    ``dcp.save`` makes of ``get_state_dict``'s dicts) or ``"flat"`` (torchtitan's: weights
    at the top level, optimizer state as ``flatten_optimizer_state_dict=True`` gives it).
    ``dry_run`` writes nothing and returns what would be written. ``progress``: a tqdm bar on stderr
    (default: when stderr is a terminal and tqdm is installed).
    Memory: the largest tensor plus fixed buffers. Paths may be object-store URLs.

    ``untrusted_bytes_limit`` (as ``shardsafe.load``'s) bounds what the source can make
    the conversion allocate beyond the bytes it holds: tensors whose size only the file
    gives (an expanded view, ``torch.zeros(1).expand(n)``, which ``torch.save`` stores as
    one element; a DCP chunk declared larger than its bytes in the file) are materialized
    in full when written, and together they may take at most this many bytes. A source
    asking for more is refused with a ``CheckpointCorruptError`` before anything is read
    or written (also with ``dry_run``); pass a larger limit for a file you trust.
    """
    if to not in FORMATS:
        raise ValueError(f"to={to!r} is not one of {', '.join(FORMATS)}")
    if type(untrusted_bytes_limit) is not int or untrusted_bytes_limit < 0:
        raise ValueError(
            f"untrusted_bytes_limit={untrusted_bytes_limit!r} must be a number of bytes, 0 or more"
        )
    if dcp_layout not in DCP_LAYOUTS:
        raise ValueError(f"dcp_layout={dcp_layout!r} is not 'nested' or 'flat'")
    target_dtype = _dtype(dtype)
    dst_text = os.fspath(dst)
    with read_source(src, storage_options) as source:
        chosen = cast(select(source, list(only) if only else None), target_dtype)
        if to == "hf":
            shards = hf.plan(chosen, max_shard_size, strip_prefix, add_prefix)
            chosen = _only_weights(chosen, shards)
        check_allocation(chosen, untrusted_bytes_limit)
        files = _planned(chosen, to, dst_text, max_shard_size, strip_prefix, add_prefix)
        notes = [torch_file.PICKLE_WARNING] if to == "torch" else []
        result = Conversion(
            source.format,
            to,
            dst_text,
            files,
            len(chosen.tensors),
            chosen.total_bytes,
            chosen.largest_tensor_bytes(),
            dry_run,
            notes,
        )
        if dry_run:
            return result
        with _progress(progress, chosen.total_bytes, f"{source.format} -> {to}") as on_bytes:
            written = _write(
                chosen,
                to,
                dst_text,
                on_bytes,
                storage_options,
                max_shard_size,
                strip_prefix,
                add_prefix,
                dcp_layout == "flat",
            )
    if to == "torch":
        warnings.warn(f"{dst_text}: {torch_file.PICKLE_WARNING}", UserWarning, stacklevel=2)
    return Conversion(**{**result.__dict__, "files": written})


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _only_weights(source: Source, shards: list[hf.Shard]) -> Source:
    keys = {key for s in shards for _, key in s.keys}
    return Source(
        source.format,
        source.where,
        source.values,
        {k: t for k, t in source.tensors.items() if k in keys},
        source.closers,
    )


def _planned(
    source: Source,
    to: str,
    dst: str,
    max_shard_size: str | int,
    strip_prefix: str | None,
    add_prefix: str | None,
) -> list[tuple[str, int]]:
    if to == "shardsafe":
        return shardsafe_format.planned_files(source)
    if to == "dcp":
        return dcp_write.planned_files(source)
    if to == "hf":
        return hf.planned_files(source, hf.plan(source, max_shard_size, strip_prefix, add_prefix))
    return [(split(dst)[1], source.total_bytes)]


def _write(
    source: Source,
    to: str,
    dst: str,
    on_bytes: Callable[[int], None],
    storage_options: Mapping[str, Any] | None,
    max_shard_size: str | int,
    strip_prefix: str | None,
    add_prefix: str | None,
    flat: bool,
) -> list[tuple[str, int]]:
    if to == "torch":
        directory, name = split(dst)
        if not name:
            raise CheckpointError(f"{dst} names no file for the torch.save output")
        with open_storage(directory, storage_options=storage_options) as storage:
            return [(name, torch_file.write(source, storage, name, on_bytes))]
    with open_storage(dst, storage_options=storage_options) as storage:
        if to == "shardsafe":
            manifest = shardsafe_format.write(source, storage, on_bytes)
            return [*sorted(manifest.files.items()), ("manifest.json", manifest.manifest_bytes)]
        if to == "dcp":
            size = dcp_write.write(source, storage, on_bytes, flat=flat)
            return [(dcp_write.DATA_FILE, size)]
        return hf.write(
            source,
            storage,
            max_shard_size=max_shard_size,
            strip_prefix=strip_prefix,
            add_prefix=add_prefix,
            on_bytes=on_bytes,
        )


@contextmanager
def _progress(enabled: bool | None, total: int, what: str) -> Iterator[Callable[[int], None]]:
    """A tqdm bar of bytes converted (on stderr, when it is a terminal, by default)."""
    bar = None
    if enabled is None:
        enabled = sys.stderr.isatty()
    if enabled:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc=what, file=sys.stderr)
        except ImportError:
            bar = None
    try:
        yield (bar.update if bar is not None else (lambda n: None))
    finally:
        if bar is not None:
            bar.close()


def describe(result: Conversion) -> str:
    """Lines for the command line: the files and their sizes."""
    verb = "would write" if result.dry_run else "wrote"
    lines = [
        f"{result.source_format} -> {result.destination_format}: {verb} {result.tensors} "
        f"tensors, {human_bytes(result.tensor_bytes)} of tensor data (largest "
        f"{human_bytes(result.largest_tensor_bytes)}) to {result.destination}"
    ]
    lines += [f"  {name}  {size} bytes ({human_bytes(size)})" for name, size in result.files]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


__all__ = ["Conversion", "DcpLayout", "convert", "describe", "read_source"]
