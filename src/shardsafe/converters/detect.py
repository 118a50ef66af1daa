"""Which format a conversion's source is, from what is at its path.

A directory (or object-store prefix) is a shardsafe checkpoint if it holds
``manifest.json``, a DCP checkpoint if it holds ``.metadata``, Hugging Face weights if it
holds ``model.safetensors.index.json`` or ``model.safetensors``. A file is a safetensors
file (``.safetensors``), a Hugging Face index (``.json``), or else a ``torch.save`` file
(``.pt``, ``.pth``, ``.bin``, a Lightning ``.ckpt``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..checkpoint.finding import where_checkpoints_are
from ..checkpoint.format.manifest_format import MANIFEST_NAME
from ..checkpoint.storage.locations import is_url, local_path, open_storage
from ..checkpoint.storage.protocol import Storage
from ..errors import CheckpointError, CheckpointNotFoundError
from .dcp_metadata import METADATA_NAME
from .hf import INDEX_NAME, SINGLE_NAME
from .source import Format


@dataclass
class Located:
    """A source: its format, the storage of its directory, and the file in it (if any)."""

    format: Format
    storage: Storage
    name: str | None


def split(path: str) -> tuple[str, str]:
    """``(directory, file name)`` of a file path or URL."""
    text = path.rstrip("/")
    if is_url(text):
        head, _, tail = text.rpartition("/")
        return head, tail
    head, tail = os.path.split(local_path(text))
    return head or ".", tail


def _is_file(path: str) -> bool:
    if is_url(path):
        return os.path.splitext(path.rstrip("/"))[1].lower() in (
            ".safetensors", ".json", ".pt", ".pth", ".bin", ".ckpt",
        )  # fmt: skip
    return os.path.isfile(local_path(path))


def _is_prefix(path: str, parent: Storage, name: str) -> bool:
    """Whether a URL named like a file is a prefix: the Lightning strategy saves each
    checkpoint as a directory named like its file (``epoch=0-step=5.ckpt``), and a URL,
    unlike a local path, says nothing of which it is until the store is asked."""
    if not is_url(path):
        return False
    try:
        return parent.kind(name) == "directory"
    except BaseException:
        parent.close()
        raise


def _followed(path: str) -> str:
    """The file a local path names, through a symbolic link: a path the user names may
    be one (``docs/guarantees.md``), as Lightning's ``last.ckpt`` or every file of a
    Hugging Face cache snapshot (``snapshots/<rev>/model.safetensors`` ->
    ``../../blobs/<hash>``) is. Names inside a checkpoint are never followed; an index
    (``.json``) is not either, since the files it names are beside the link."""
    if is_url(path) or not os.path.islink(local_path(path)):
        return path
    return os.path.realpath(local_path(path))


def _linked(path: str, name: str) -> str:
    """Why a directory whose checkpoint file is a symbolic link is refused, and the way
    out (a Hugging Face cache snapshot is made of links into ``blobs/``)."""
    way = (
        f"pass {os.path.join(path, name)} itself (a file you name may be a link)"
        if name == SINGLE_NAME
        else "copy it with its links resolved (cp -rL), or download it with "
        "huggingface_hub.snapshot_download(..., local_dir=...)"
    )
    return (
        f"{path}: {name} is a symbolic link, and links inside a checkpoint are never "
        f"followed (a Hugging Face cache snapshot links its files into blobs/); {way}"
    )


def locate(path: str, storage_options: Mapping[str, Any] | None = None) -> Located:
    """The format of the source at ``path`` (see the module docstring)."""
    if _is_file(path):
        ext = os.path.splitext(split(path)[1])[1].lower()  # the name the user gave
        fmt: Format = "hf" if ext in (".safetensors", ".json") else "torch"
        if ext == ".json" and _followed(path) != path:
            raise CheckpointError(_linked(split(path)[0], split(path)[1]))
        directory, name = split(_followed(path) if ext != ".json" else path)
        storage = open_storage(directory, storage_options=storage_options)
        if not _is_prefix(path, storage, name):
            return Located(fmt, storage, name)
        storage.close()
    storage = open_storage(path, storage_options=storage_options)
    try:
        storage.require_directory()
        candidates: tuple[tuple[str, Format, str | None], ...] = (
            (MANIFEST_NAME, "shardsafe", None),
            (METADATA_NAME, "dcp", None),
            (INDEX_NAME, "hf", INDEX_NAME),
            (SINGLE_NAME, "hf", SINGLE_NAME),
        )
        for name, found, file in candidates:
            if storage.kind(name) == "symlink":
                raise CheckpointError(_linked(path, name))
            if storage.exists(name):
                return Located(found, storage, file)
        names = storage.names()
    except BaseException:
        storage.close()
        raise
    storage.close()
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    shown = ", ".join(names[:5]) + more if names else "nothing"
    raise CheckpointNotFoundError(
        f"{path} is no checkpoint shardsafe can convert: it has no {MANIFEST_NAME} "
        f"(shardsafe), {METADATA_NAME} (DCP), {INDEX_NAME} or {SINGLE_NAME} (Hugging Face); "
        f"it holds {shown}. For a torch.save or Lightning file, pass the file itself"
        f"{where_checkpoints_are(path)}."
    )
