"""``shardsafe.convert``: one function for every pair of formats.

The source is located and described (``detect``, then a reader: nothing but metadata is
read yet), narrowed (``only``) and cast (``dtype``), then handed to the writer of the
destination format, which reads one tensor (or one saved chunk of it) at a time. So the
memory a conversion takes is the largest tensor plus fixed buffers, whatever the
checkpoint's size, and the output is verified before ``convert`` returns.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _warnings, dtypes
from .._text import human_bytes
from ..checkpoint.storage import target_directory
from ..checkpoint.storage.locations import is_url, local_path, open_storage, path_text
from ..errors import CheckpointError
from . import dcp_read, dcp_write, hf, shardsafe_format, torch_file
from .bounds import check_allocation
from .detect import locate, split
from .hf_config import config_files
from .options import ConvertOptions, DcpLayout
from .source import Format, Source, cast, select, single_values

_C = ConvertOptions()


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
    found = locate(path_text(path), storage_options)
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
    to: Format = _C.to,
    only: Sequence[str] | None = _C.only,
    dtype: str | torch.dtype | None = _C.dtype,
    max_shard_size: str | int = _C.max_shard_size,
    strip_prefix: str | None = _C.strip_prefix,
    add_prefix: str | None = _C.add_prefix,
    dry_run: bool = _C.dry_run,
    dcp_layout: DcpLayout = _C.dcp_layout,
    progress: bool | None = _C.progress,
    storage_options: Mapping[str, Any] | None = _C.storage_options,
    untrusted_bytes_limit: int = _C.untrusted_bytes_limit,
    config: Any = _C.config,
    generation_config: Any = _C.generation_config,
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
    ``strip_prefix``/``add_prefix`` rename Hugging Face weight names; ``config`` and
    ``generation_config`` (``to="hf"``) are written beside the weights as ``config.json``
    and ``generation_config.json``, so that ``from_pretrained(dst)`` loads it (a
    transformers config object such as ``model.config``, a dict, or the path of a
    ``.json`` file or of a folder holding ``config.json``). ``dcp_layout``
    (``to="dcp"``): ``"nested"`` (``model.<fqn>``, ``optimizer.state.<fqn>.<name>``) or
    ``"flat"`` (torchtitan's). ``dry_run`` writes nothing and returns what would be
    written. ``progress``: a tqdm bar on stderr (default: when stderr is a terminal and
    tqdm is installed). Memory: the largest tensor plus fixed buffers. Paths may be
    object-store URLs, with fsspec's ``storage_options`` (for the end that is a URL).

    ``untrusted_bytes_limit`` (as ``shardsafe.load``'s) bounds what the source can make
    the conversion allocate beyond the bytes it holds (expanded views, DCP chunks larger
    than their bytes in the file: see :class:`~shardsafe.converters.ConvertOptions`).
    The keyword arguments are ``ConvertOptions``' fields, with its defaults.
    """
    options = ConvertOptions(
        to=to,
        only=only,
        dtype=dtype,
        max_shard_size=max_shard_size,
        strip_prefix=strip_prefix,
        add_prefix=add_prefix,
        dry_run=dry_run,
        dcp_layout=dcp_layout,
        progress=progress,
        storage_options=storage_options,
        untrusted_bytes_limit=untrusted_bytes_limit,
        config=config,
        generation_config=generation_config,
    )
    return _convert(src, path_text(dst), options)


def _convert(src: str | os.PathLike[str], dst: str, options: ConvertOptions) -> Conversion:
    """:func:`convert` with its options validated: plan, then (unless a dry run) write."""
    with read_source(src, _options_for(path_text(src), dst, options)) as source:
        chosen = _chosen(source, options)
        planned = Conversion(
            source.format,
            options.to,
            dst,
            _planned(chosen, dst, options),
            len(chosen.tensors),
            chosen.total_bytes,
            chosen.largest_tensor_bytes(),
            options.dry_run,
            [torch_file.PICKLE_WARNING] if options.to == "torch" else [],
        )
        if options.dry_run:
            _refuse_taken_destination(dst, source.where, options)
            return planned
        what = f"{source.format} -> {options.to}"
        with _progress(options.progress, chosen.total_bytes, what) as on_bytes:
            written = _write(chosen, dst, on_bytes, options)
    if options.to == "torch":
        _warnings.warn(f"{dst}: {torch_file.PICKLE_WARNING}", UserWarning)
    return dataclasses.replace(planned, files=written)


def _chosen(source: Source, options: ConvertOptions) -> Source:
    """What is converted: ``only``'s entries, cast to ``dtype``, for Hugging Face output
    the weights alone; refused if it would allocate more than ``untrusted_bytes_limit``."""
    selected = select(source, list(options.only) if options.only else None)
    chosen = cast(single_values(selected), options.torch_dtype)
    if options.to == "hf":
        chosen = _only_weights(chosen, _hf_plan(chosen, options))
    if options.to in ("shardsafe", "hf"):
        _refuse_unstorable(chosen, options.to)
    elif options.to == "dcp":
        _refuse_outside_torch_save(chosen)
    check_allocation(chosen, options.untrusted_bytes_limit)
    return chosen


def _refuse_unstorable(source: Source, to: Format) -> None:
    """Refuse, before anything is written, a tensor whose dtype safetensors (the files of
    shardsafe and Hugging Face output) has no code for (``float8_e8m0fnu``,
    ``float4_e2m1fn_x2``, ``complex32``, ...), or whose name is no UTF-8 text (a lone
    surrogate, which a pickle can hold): the safetensors header would be JSON that no
    safetensors reader parses. ``torch.save`` and DCP store both."""
    for t in source.tensors.values():
        try:
            t.key.encode("utf-8")
        except UnicodeEncodeError:
            raise CheckpointError(
                f"{source.where}: tensor {t.key!r} has a name that is not UTF-8 text (a lone "
                f"surrogate), which safetensors cannot store, so --to {to} cannot hold it; "
                "convert to torch or dcp instead, or leave its entry out with --only "
                "(nothing was written)"
            ) from None
        if not dtypes.is_supported(t.dtype):
            raise CheckpointError(
                f"{source.where}: tensor {t.key!r} is {dtypes.dtype_name(t.dtype)}, which "
                f"safetensors cannot store, so --to {to} cannot hold it; convert to torch or "
                "dcp instead, or leave its entry out with --only (nothing was written)"
            )


def _refuse_outside_torch_save(source: Source) -> None:
    """Refuse, before anything is written, a tensor whose dtype ``torch.save`` (DCP's
    encoding of each chunk) cannot write (``uint4``, ``qint8``: a pickle can rebuild
    plain tensors of them): the DCP writer failed on it half-way, "failed unexpectedly:
    KeyError: 'dtype torch.uint4 is not recognized'" (found in review)."""
    for t in source.tensors.values():
        if not dtypes.torch_save_stores(t.dtype):
            raise CheckpointError(
                f"{source.where}: tensor {t.key!r} is {dtypes.dtype_name(t.dtype)}, which "
                "torch.save (DCP's encoding) cannot store, so --to dcp cannot hold it; "
                "convert to torch instead, or leave its entry out with --only (nothing was "
                "written)"
            )


def _hf_plan(source: Source, options: ConvertOptions) -> list[hf.Shard]:
    return hf.plan(source, options.max_shard_size, options.strip_prefix, options.add_prefix)


def _only_weights(source: Source, shards: list[hf.Shard]) -> Source:
    keys = {key for s in shards for _, key in s.keys}
    return Source(
        source.format,
        source.where,
        source.values,
        {k: t for k, t in source.tensors.items() if k in keys},
        source.closers,
    )


def _planned(source: Source, dst: str, options: ConvertOptions) -> list[tuple[str, int]]:
    if options.to == "shardsafe":
        return shardsafe_format.planned_files(source)
    if options.to == "dcp":
        return dcp_write.planned_files(source)
    if options.to == "hf":
        extra = config_files(options.config, options.generation_config)
        return hf.planned_files(source, _hf_plan(source, options), extra)
    return [(split(dst)[1], source.total_bytes)]


def _write(
    source: Source, dst: str, on_bytes: Callable[[int], None], options: ConvertOptions
) -> list[tuple[str, int]]:
    storage_options = _options_for(dst, source.where, options)
    if options.to == "torch":
        directory, name = _torch_file(dst)
        with open_storage(directory, storage_options=storage_options) as storage:
            return [(name, torch_file.write(source, storage, name, on_bytes))]
    _refuse_non_directory(dst)
    with open_storage(dst, storage_options=storage_options) as storage:
        if options.to == "shardsafe":
            manifest = shardsafe_format.write(source, storage, on_bytes)
            return [*sorted(manifest.files.items()), ("manifest.json", manifest.manifest_bytes)]
        if options.to == "dcp":
            return dcp_write.write(source, storage, on_bytes, flat=options.dcp_layout == "flat")
        return hf.write(
            source,
            storage,
            max_shard_size=options.max_shard_size,
            strip_prefix=options.strip_prefix,
            add_prefix=options.add_prefix,
            on_bytes=on_bytes,
            extra=config_files(options.config, options.generation_config),
        )


def _refuse_taken_destination(dst: str, source_where: str, options: ConvertOptions) -> None:
    """A dry run refuses what the real run would refuse before writing: an existing
    ``torch.save`` file, a directory that is not empty (DCP, Hugging Face) or holds a
    committed checkpoint (shardsafe), a destination that is no directory. It said it
    "would write" them all."""
    storage_options = _options_for(dst, source_where, options)
    if options.to == "torch":
        directory, name = _torch_file(dst)
        with open_storage(directory, storage_options=storage_options) as storage:
            torch_file.refuse_existing(storage, name)
        return
    _refuse_non_directory(dst)
    with open_storage(dst, storage_options=storage_options) as storage:
        if options.to == "shardsafe":
            target_directory.refuse_unusable(storage)
        else:
            dcp_write.check_empty(storage)


def _torch_file(dst: str) -> tuple[str, str]:
    """The directory and file name of a ``torch.save`` output."""
    directory, name = split(dst)
    if not name:
        raise CheckpointError(f"{dst} names no file for the torch.save output")
    return directory, name


def _options_for(path: str, other: str, options: ConvertOptions) -> Mapping[str, Any] | None:
    """``storage_options`` for one end of a conversion: the object store's, so not for a
    local path when the other end is a URL (``convert("last.ckpt", "s3://...",
    storage_options=...)`` was refused: "storage_options were given for a local path").
    With both ends local they still go through, to be refused as the mistake they are."""
    if options.storage_options is not None and not is_url(path) and is_url(other):
        return None
    return options.storage_options


def _refuse_non_directory(dst: str) -> None:
    """A destination directory that exists as something else (a file, a dangling link)
    is refused by name; creating it failed with only ``[Errno 17] File exists: 'dst'``."""
    if is_url(dst):
        return
    path = local_path(dst)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointError(
            f"{dst} exists and is not a directory (a file or a link to none); convert "
            "into a new directory (nothing is ever overwritten)"
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


__all__ = ["Conversion", "ConvertOptions", "DcpLayout", "convert", "describe", "read_source"]
