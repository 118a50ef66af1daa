"""Which tensors a checkpoint's state entries refer to, and those it does not hold.

Every byte of a checkpoint can be intact and it still not load, if an entry's metadata
names a tensor no data file holds. ``verify`` reports such entries; a save refuses to
commit one (``saving.check_loadable``: a DTensor on a sub-mesh held only by ranks outside
it was saved, named by its module, and stored by nobody). A module of its own, importing
only the adapters' records, so that the save side needs none of the load side.
"""

from __future__ import annotations

from .. import _names, _tree
from .._text import natural_key, plural
from ..adapters.values import PER_RANK, checked_form, module_tensor_keys
from ..errors import CheckpointError
from ..protocol import SavedValue
from .format.manifest import Manifest

KEYS_SHOWN = 5
"""The tensors a problem line names before "... and N more"."""


def missing_tensors(manifest: Manifest, names: list[str] | None = None) -> list[str]:
    """One line per state entry of ``names`` (default all) that refers to tensors
    ``manifest`` does not hold, or whose references cannot be listed (why)."""
    problems = []
    for name in sorted(manifest.values if names is None else names, key=natural_key):
        try:
            wanted = references(manifest.values[name], manifest)
        except CheckpointError as e:
            problems.append(f"state entry {name!r}: {e}")
            continue
        missing = [key for key in wanted if key not in manifest.tensors]
        if missing:
            problems.append(
                f"state entry {name!r} refers to {some(missing)} that the checkpoint does not hold"
            )
    return problems


def references(value: SavedValue, manifest: Manifest) -> list[str]:
    """The tensor keys an entry's metadata refers to, in order, each once: a module's by
    its names; an entry recorded with per-rank copies, every saving rank's record's."""
    meta = value.meta
    if value.kind == "module" and isinstance(meta, dict):
        return list(dict.fromkeys(module_tensor_keys(value, manifest.tensors)))
    if isinstance(meta, dict) and len(meta) == 1 and isinstance(meta.get(PER_RANK), dict):
        form = checked_form(meta[PER_RANK], value.name)
        own, ranks = form["own"], manifest.world_size
        if len(own) * ranks > len(manifest.tensors):  # cannot all be there: not listed
            raise CheckpointError(
                f"it records own copies of {some(own)} for each of {ranks} saving ranks, "
                f"more than the {len(manifest.tensors)} tensors the checkpoint holds"
            )
        mine = set(own)
        shared = [k for k in _tree.tensor_refs(form["shared"]) if k not in mine]
        copies = [_names.own_copy_key(k, rank) for rank in range(ranks) for k in own]
        return list(dict.fromkeys(shared + copies))
    return list(dict.fromkeys(_tree.tensor_refs(meta)))


def some(keys: list[str]) -> str:
    """``'a', 'b' ... and 3 more`` for a problem line that should stay one line."""
    if not keys:
        return "no tensors"
    shown = ", ".join(repr(k) for k in keys[:KEYS_SHOWN])
    more = f" ... and {len(keys) - KEYS_SHOWN} more" if len(keys) > KEYS_SHOWN else ""
    return f"{plural(len(keys), 'tensor')}: {shown}{more}"
