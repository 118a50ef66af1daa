"""The public entry points of the engine: ``save``, ``load`` and ``read_manifest``.

Their keyword arguments are :class:`SaveOptions` and :class:`LoadOptions` fields, with the
defaults taken from there (written once).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

from . import background, loading, saving
from .background import SaveHandle
from .finding import hint_for
from .format.manifest_format import Layout
from .loading import read_manifest
from .options import (
    LoadOptions,
    SaveHooks,
    SaveKeywords,
    SaveOptions,
    StorageFactory,
    VerifyMode,
    opener_of,
)
from .refusals import told_if_refused
from .storage.locations import directory_name, path_text

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # a dependency of torch's
    from typing_extensions import Unpack

_S = SaveOptions()
_L = LoadOptions()
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _told_if_misspelled(
    operation: str, refuse: Callable[..., object], name_of: Callable[[str], str]
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """An entry point whose unknown keyword (``read_thread=4``, on one rank) is told to the
    other ranks before it is raised, as ``async_save``'s and the managers' are.

    Python refused the name before the body ran, on that rank alone, and the others
    waited out ``entry_timeout``, then said it never arrived. The signature stays the
    function's own (``functools.wraps``), defaults and all."""

    def decorate(entry: Callable[_P, _R]) -> Callable[_P, _R]:
        known = {"path", "state", *list(inspect.signature(entry).parameters)}

        @functools.wraps(entry)
        def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            unknown = {k: v for k, v in kwargs.items() if k not in known}
            path = args[0] if args else kwargs.get("path")
            if unknown and isinstance(path, (str, os.PathLike)):
                told_if_refused(operation, name_of(path_text(path)), lambda: refuse(**unknown))
            return entry(*args, **kwargs)

        return checked

    return decorate


@_told_if_misspelled("save", SaveOptions.of, str)
def save(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    layout: Layout = _S.layout,
    entry_timeout: float = _S.entry_timeout,
    timeout: float = _S.timeout,
    buffer_bytes: int = _S.buffer_bytes,
    storage: StorageFactory | None = _S.storage,
    hooks: SaveHooks = _S.hooks,
    storage_options: Mapping[str, Any] | None = _S.storage_options,
    verify_replicas: bool = _S.verify_replicas,
) -> None:
    """Save ``state`` to the directory ``path``. Call it on every rank.

    ``state`` maps names to modules (plain or DDP), optimizers (plain, ZeRO, OSS), LR
    schedulers, any object with ``state_dict``/``load_state_dict``, tensors, JSON-able
    values and :class:`shardsafe.RNGState`.

    ``layout="sharded"``: each rank writes its own file, replicated tensors once in
    total. ``"consolidated"``: rank 0 writes one file per state entry
    (``model.safetensors``, ``optimizer.safetensors``, ...), receiving other ranks'
    shards as raw tensors through a buffer of ``buffer_bytes``.

    A rank that does not call ``save`` within ``entry_timeout`` seconds is reported by
    name; a later phase waits at most ``timeout`` seconds for the slowest rank. The
    checkpoint exists once ``path/manifest.json`` does; on any error nothing is committed.

    ``path`` may be an object-store URL (``s3://bucket/run/step-100``; needs
    ``pip install "shardsafe[s3]"``), with fsspec's ``storage_options`` (else the
    standard environment: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).

    ``storage`` (advanced) makes the storage layer for a directory: a subclass of
    ``shardsafe.checkpoint.storage.local.LocalStorage``, e.g. to inject faults in tests.
    ``hooks`` (advanced, :class:`shardsafe.checkpoint.SaveHooks`) runs code on rank 0
    inside the save, its failures agreed like any other (``CheckpointManager`` uses it).

    Tensors held by several ranks (DDP weights, a pipeline stage's weights on its
    data-parallel group, HSDP's replicas of a shard, a shard every tensor-parallel rank
    holds under TP x FSDP2) are written once, by one of them, spread over the holders.
    ``verify_replicas=True`` first checks that the copies really are equal: each holder
    checksums its copy, and copies that differ (diverged replicas) are an error naming the
    tensor and the ranks, before anything is written. It costs one CRC32 pass over each
    rank's tensors (buffers, which may differ, aside). Small tensors of stateful objects
    (up to 64 KiB: a per-rank sampler's generator) are compared on every save, and kept
    per rank where they differ (docs/parallelism.md).
    """
    options = told_if_refused(
        "save",
        path_text(path),
        lambda: SaveOptions(
            layout=layout,
            entry_timeout=entry_timeout,
            timeout=timeout,
            buffer_bytes=buffer_bytes,
            storage=storage,
            hooks=hooks,
            storage_options=storage_options,
            verify_replicas=verify_replicas,
        ),
    )
    background.drain()  # one save in flight: an asynchronous one finishes first
    saving.save(path_text(path), state, options)


def async_save(
    path: str | os.PathLike[str], state: Mapping[str, Any], **options: Unpack[SaveKeywords]
) -> SaveHandle:
    """Like :func:`save`, but return once this rank's state is staged. Call it on every rank.

    What is written is the state at the moment of the call, bitwise, however the caller
    changes its tensors afterwards: every tensor this rank will write is copied into
    staging buffers (reused by later calls: at most one copy of this rank's state in host
    memory; about 1/world of it for DDP, whose ranks first agree on who writes each
    replicated tensor) before it returns. The
    rest of the save (writing, checksums, the commit) runs in a background thread, with
    every guarantee of :func:`save`. ``handle.wait()`` returns once the checkpoint is
    committed, or raises the error every rank agreed on; if you never wait, the next
    ``save``/``async_save`` (which waits for this one first) raises it. The keyword
    arguments are :func:`save`'s, with the same defaults.
    """
    text = path_text(path)
    made = told_if_refused("save", text, lambda: SaveOptions.of(**options))
    return background.async_save(text, state, made)


@_told_if_misspelled("load", LoadOptions.of, directory_name)
def load(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    strict: bool = _L.strict,
    entry_timeout: float = _L.entry_timeout,
    timeout: float = _L.timeout,
    untrusted_bytes_limit: int = _L.untrusted_bytes_limit,
    storage: StorageFactory | None = _L.storage,
    storage_options: Mapping[str, Any] | None = _L.storage_options,
    verify: VerifyMode = _L.verify,
    buffer_bytes: int = _L.buffer_bytes,
    read_threads: int | None = _L.read_threads,
) -> dict[str, Any]:
    """Restore the stateful values of ``state`` in place from ``path``. Call it on every rank.

    Works at any world size, whatever layout and world size the checkpoint was saved
    with. Returns the plain values (JSON data, tensors) the checkpoint holds, as saved.
    ``strict=True``: keys the live objects have and the checkpoint lacks, or the reverse,
    are an error; ``strict=False`` loads what both have. Shapes and dtypes must match.
    An entry of ``state`` the checkpoint does not have at all is an error naming the
    entries it has and the closest one; with ``strict=False`` it is left as it is, with a
    warning, unless no entry of ``state`` is in the checkpoint (nothing would load).
    With the default verify="first", nothing is restored on any rank unless every rank
    has read and verified its data.

    ``untrusted_bytes_limit`` bounds what a checkpoint can make this rank allocate for
    tensors no live object sizes (returned plain tensors, a fresh optimizer's state):
    at most this plus 8 times the live tensors being loaded.

    Bytes go straight into the live tensors they replace (parameters, buffers, the state
    of an optimizer that has stepped; CUDA ones through a few pinned pieces), so the extra
    memory is one buffer of ``buffer_bytes`` plus the tensors no live one holds yet.
    ``verify="first"`` (default) reads and checks every byte before restoring anything,
    then reads it again into place, checked again; ``verify="inline"`` reads once,
    checking each piece as it is copied in, so a corrupt byte is found with live
    tensors partly restored (the error names them).
    Local files are read on up to ``read_threads`` threads (default: this rank's share
    of the CPUs, 1 to 4; ranks that share their cores read on one); an object store on one.

    ``path`` and ``storage_options`` are as :func:`save` takes them, and so is ``storage``
    (advanced): what makes the storage layer for the directory.
    """
    text = path_text(path)
    name = directory_name(text)  # what the ranks agree under
    options, opener = told_if_refused(
        "load",
        name,
        lambda: (
            LoadOptions(
                strict=strict,
                entry_timeout=entry_timeout,
                timeout=timeout,
                untrusted_bytes_limit=untrusted_bytes_limit,
                storage=storage,
                storage_options=storage_options,
                verify=verify,
                buffer_bytes=buffer_bytes,
                read_threads=read_threads,
            ),
            opener_of(text, storage, storage_options),
        ),
    )
    return loading.load_from(opener, name, state, options, hint=hint_for)


__all__ = ["SaveHandle", "async_save", "load", "read_manifest", "save"]
