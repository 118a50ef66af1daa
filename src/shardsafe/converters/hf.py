"""Hugging Face weights: ``model.safetensors``, or shards plus ``model.safetensors.index.json``.

Writing follows ``huggingface_hub``'s rules: tensors in key order fill a shard until the
next would pass ``max_shard_size`` (decimal units: ``5GB`` is 5 * 10^9 bytes), a tensor
larger than that gets a shard of its own, shards are named
``model-00001-of-0000N.safetensors``, and the index is
``{"metadata": {"total_size": <bytes of tensor data>}, "weight_map": {name: file}}``. One
shard is written as ``model.safetensors`` without an index. Each file is streamed with
shardsafe's safetensors writer (one tensor in memory at a time, assembled from however
many ranks' chunks), the index is written last, and every file is read back and checked
against the CRC32s computed while writing.

Only model weights go into these files: the module entries (of those ``--only`` keeps).
Names are the module's FQNs, with ``strip_prefix`` removed and ``add_prefix`` put in
front; with several modules, each name is prefixed by its entry name.

Reading parses each header with shardsafe's validating parser (a hostile header cannot
place a tensor outside its file) and reads tensors by byte range.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction

import torch

from .. import _names
from ..checkpoint.format.crc import BlockCrc
from ..checkpoint.format.safetensors_header import HeaderEntry, build_header
from ..checkpoint.format.strict_json import load_json_bytes
from ..checkpoint.format.tensor_bytes import byte_view, memory
from ..checkpoint.io.safetensors_io import StreamWriter, read_header
from ..checkpoint.storage.protocol import FileReader, Storage
from ..errors import CheckpointCorruptError, CheckpointError
from ..protocol import SavedValue
from .dcp_write import refuse_non_empty, remove_if_created
from .open_files import OpenFiles
from .source import Source, one_chunk

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_INDEX_BYTES = 256 << 20
_RESERVED = "__metadata__"
"""The header's metadata, in every safetensors file: no tensor may have that name."""
_BLOCK = 1 << 62
"""One CRC per tensor: the read-back check compares whole tensors."""
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal, as huggingface_hub; ``GiB`` is binary)."""
    if isinstance(text, int):
        size = text
    else:
        found = re.fullmatch(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([A-Za-z]*)\s*", text[:100])
        unit = found.group(2).upper() if found and len(text) <= 100 else None
        if found is None or unit not in _UNITS:
            raise ValueError(
                f"max shard size {text[:100]!r} is not a size such as 5GB, 500MB or 10KB"
            )
        # Exact (a float made 400 nines infinity, and int() of it an OverflowError).
        size = int(Fraction(found.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"max shard size {text!r} must be positive")
    if size >= 2**63:
        raise ValueError(f"max shard size {text!r} is too large: at most {2**63 - 1} bytes")
    return size


@dataclass(frozen=True)
class Shard:
    name: str
    keys: list[tuple[str, str]]
    """(name in the file, source tensor key), in file order."""
    nbytes: int


def weight_names(
    source: Source, strip_prefix: str | None = None, add_prefix: str | None = None
) -> list[tuple[str, str]]:
    """``(HF name, source key)`` for every module tensor of ``source``."""
    modules = [v for v in source.values.values() if v.kind == "module"]
    if not modules:
        held = ", ".join(f"{n} ({v.kind})" for n, v in sorted(source.values.items()))
        raise CheckpointError(
            f"{source.where} holds no model weights to write as Hugging Face weights: none "
            f"of the entries converted ({held or 'nothing'}) is a module, a dict of tensors "
            "by name such as a model's state_dict() (--only keeps entries, it does not "
            "make one a module)"
        )
    out: list[tuple[str, str]] = []
    seen: dict[str, str] = {}
    for value in modules:
        key = _names.module_keys(value.name, value.meta["tensors"], source.tensors)
        for fqn in value.meta["tensors"]:
            name = (
                fqn[len(strip_prefix) :] if strip_prefix and fqn.startswith(strip_prefix) else fqn
            )
            name = f"{add_prefix or ''}{name}"
            if len(modules) > 1:
                name = f"{value.name}.{name}"
            where = f"{value.name}[{fqn!r}]"
            if name == _RESERVED:
                raise CheckpointError(
                    f"{where} would be named {name!r}, which safetensors reserves for the "
                    "file's metadata (the weight would overwrite it); rename it with "
                    "add_prefix (--add-prefix)"
                )
            if name in seen:
                raise CheckpointError(
                    f"two tensors would both be named {name!r}: {seen[name]} and {where}; "
                    "rename one (or convert only one module with --only)"
                )
            seen[name] = where
            out.append((name, key(fqn)))
    return out


def plan_shards(source: Source, names: list[tuple[str, str]], max_bytes: int) -> list[Shard]:
    """huggingface_hub's split: fill each shard in order; an oversized tensor alone."""
    groups: list[list[tuple[str, str]]] = []
    sizes: list[int] = []
    for name, key in names:
        n = source.tensors[key].nbytes
        if not groups or (sizes[-1] + n > max_bytes and groups[-1]):
            groups.append([])
            sizes.append(0)
        groups[-1].append((name, key))
        sizes[-1] += n
    if len(groups) <= 1:
        return [Shard(SINGLE_NAME, groups[0] if groups else [], sum(sizes))]
    total = len(groups)
    return [
        Shard(f"model-{i + 1:05d}-of-{total:05d}.safetensors", g, s)
        for i, (g, s) in enumerate(zip(groups, sizes))
    ]


def write(
    source: Source,
    storage: Storage,
    *,
    max_shard_size: str | int = "5GB",
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    on_bytes: Callable[[int], None] | None = None,
    extra: Mapping[str, bytes] | None = None,
) -> list[tuple[str, int]]:
    """Write the model weights of ``source`` in Hugging Face's layout (module docstring),
    and ``extra`` files beside them (``config.json``: ``hf_config.py``), before the index;
    return each file written and its size."""
    shards = plan(source, max_shard_size, strip_prefix, add_prefix)
    created = refuse_non_empty(storage)
    written: list[str] = []
    sizes: list[tuple[str, int]] = []
    expected: dict[str, dict[str, int]] = {}
    try:
        for shard in shards:
            size, expected[shard.name] = _write_shard(source, storage, shard, on_bytes, written)
            sizes.append((shard.name, size))
        for name, raw in (extra or {}).items():
            written.append(name)
            storage.commit(name, raw)
            sizes.append((name, len(raw)))
        if len(shards) > 1:
            index = index_json(shards)
            written.append(INDEX_NAME)
            storage.sync_directory()
            storage.commit(INDEX_NAME, index)
            sizes.append((INDEX_NAME, len(index)))
        verify(storage, expected)
    except BaseException:
        # Also when the read-back fails: files that do not verify are not left to load
        # (safetensors has no checksums). The index (or the one file) goes first.
        for name in reversed(written):
            storage.remove(name)
        remove_if_created(storage, created)
        raise
    return sizes


def plan(
    source: Source, max_shard_size: str | int, strip_prefix: str | None, add_prefix: str | None
) -> list[Shard]:
    names = weight_names(source, strip_prefix, add_prefix)
    return plan_shards(source, names, parse_size(max_shard_size))


def index_json(shards: list[Shard]) -> bytes:
    weight_map = {name: s.name for s in shards for name, _ in s.keys}
    doc = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": weight_map}
    return (json.dumps(doc, indent=2) + "\n").encode()


def _write_shard(
    source: Source,
    storage: Storage,
    shard: Shard,
    on_bytes: Callable[[int], None] | None,
    written: list[str],
) -> tuple[int, dict[str, int]]:
    """Write one shard; its name joins ``written`` (removed after a failure) only once this
    conversion has created it: a file of that name that appeared meanwhile (another
    conversion into the same directory) is refused by ``create`` and is not ours to
    delete."""
    header = [
        (name, source.tensors[key].dtype, source.tensors[key].shape) for name, key in shard.keys
    ]
    sink = storage.create(shard.name, size_hint=shard.nbytes)
    written.append(shard.name)
    writer = StreamWriter(sink, header, _BLOCK)
    try:
        for _, key in shard.keys:
            tensor = source.tensors[key].load_whole().contiguous()
            writer.write(memory(byte_view(tensor)))
            if on_bytes is not None:
                on_bytes(source.tensors[key].nbytes)
            del tensor
            source.tensors[key].done()
        size, crcs = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return size, {name: values[0] for name, values in crcs.items()}


def verify(storage: Storage, expected: dict[str, dict[str, int]]) -> None:
    """Every written file's header parses (shardsafe's checks, safetensors' rules) and each
    tensor's bytes read back to the CRC32 computed while writing."""
    for name, crcs in expected.items():
        with storage.open_reader(name) as reader:
            entries = read_header(reader)
            if set(entries) != set(crcs):
                raise CheckpointCorruptError(
                    f"{storage.where(name)} does not hold what was written"
                )
            for tname, entry in entries.items():
                if _crc_of(reader, entry) != crcs[tname]:
                    raise CheckpointCorruptError(
                        f"{storage.where(name)}: tensor {tname!r} does not read back as written"
                    )


def _crc_of(reader: FileReader, entry: HeaderEntry) -> int:
    crc = BlockCrc(_BLOCK)
    piece = bytearray(min(entry.nbytes, 16 << 20))
    for start in range(0, entry.nbytes, len(piece) or 1):
        view = memoryview(piece)[: min(len(piece), entry.nbytes - start)]
        reader.read_into(entry.start + start, view)
        crc.update(view)
    return crc.finish()[0]


# -- reading


def read(storage: Storage, name: str) -> Source:
    """``name`` (a ``.safetensors`` file or an index) in ``storage`` as a :class:`Source`
    with one module entry, ``model``, keyed by the file's tensor names. The shards are
    opened a bounded number at a time (``OpenFiles``): an index may name more files than
    the process has descriptors."""
    weight_map = _weight_map(storage, name)
    files = sorted(set(weight_map.values())) if weight_map is not None else [name]
    opened = OpenFiles(storage)
    tensors = {}
    names: dict[str, str] = {}
    try:
        for fname in files:
            for tname, entry in read_header(opened.get(fname)).items():
                if tname in names:
                    raise CheckpointCorruptError(f"tensor {tname!r} is in two files")
                names[tname] = fname
                key = _names.join("model", tname)
                tensors[key] = one_chunk(
                    key, entry.dtype, entry.shape, _reading(opened, fname, entry)
                )
        if weight_map is not None and names != weight_map:
            wrong = sorted(set(names.items()) ^ set(weight_map.items()))[0][0]
            raise CheckpointCorruptError(
                f"{storage.where(name)} does not match its files: e.g. tensor {wrong!r} is "
                "mapped to a file that does not hold it, or held by a file it is not mapped to"
            )
    except BaseException:
        opened.close()
        raise
    values = {"model": SavedValue("model", "module", {"tensors": list(names), "extra": {}})}
    return Source("hf", storage.where(name), values, tensors, [opened.close])


def _weight_map(storage: Storage, name: str) -> dict[str, str] | None:
    """An index's ``weight_map`` (``None`` for a single ``.safetensors`` file)."""
    if not name.endswith(".json"):
        return None
    where = storage.where(name)
    # Strict and bounded (depth, digits): the index is hostile input like any other file.
    doc = load_json_bytes(storage.read_small(name, MAX_INDEX_BYTES), where)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointCorruptError(f"{where} has no weight_map of tensor names to files")
    if not weight_map:  # else a conversion of nothing, whatever the shards beside it hold
        raise CheckpointCorruptError(f"{where} has an empty weight_map: it maps no tensor")
    return weight_map


def _reading(opened: OpenFiles, fname: str, entry: HeaderEntry) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        out = torch.empty(entry.shape, dtype=entry.dtype, device="cpu")
        if entry.nbytes:
            opened.get(fname).read_into(entry.start, memory(byte_view(out)))
        return out

    return load


def planned_files(
    source: Source, shards: list[Shard], extra: Mapping[str, bytes] | None = None
) -> list[tuple[str, int]]:
    """Each file :func:`write` would write and its exact size (``--dry-run``)."""
    files = []
    for shard in shards:
        header = [(n, source.tensors[k].dtype, source.tensors[k].shape) for n, k in shard.keys]
        files.append((shard.name, len(build_header(header)) + shard.nbytes))
    files += [(name, len(raw)) for name, raw in (extra or {}).items()]
    return files + ([(INDEX_NAME, len(index_json(shards)))] if len(shards) > 1 else [])
