"""A ZeRO or OSS rank's local copy holds its own partition of the optimizer state only,
so it restores only into that same partition.

A rank checkpoint is restored by the rank that wrote it, as if every rank had held its
metadata (``rank_checkpoint.view``). For a partitioned optimizer that metadata names
every parameter (the global param groups) but holds state only for those this rank
owned: the others' state is in the other ranks' copies. Loaded into the same optimizer
at the same world size, each rank asks for exactly its own parameters. Loaded into
another sharding (ZeRO resumed as DDP, as FSDP, or as a plain optimizer), each rank asks
for every parameter, and the ones its copy names without state looked like parameters
that had none when saved: they restored with none, silently, and every rank trained on
with fresh Adam moments for the others' parameters (found in review: losses off from the
second step, then the replicas diverged).

So the copy records which entries a partitioned optimizer saved (the adapter's class),
and a load refuses, as a :class:`~shardsafe.CheckpointMismatchError` (the tiers then
restore from the persistent tier, which holds every rank's state), one that restores
such an entry into another adapter, or into a partition that does not hold every
parameter the copy has state for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..adapters.partitioned import PartitionedOptimizerAdapter
from ..adapters.registry import adapter_for
from ..checkpoint.format.manifest import Manifest
from ..checkpoint.plan.collecting import Collected
from ..errors import CheckpointCorruptError, CheckpointMismatchError
from ..protocol import load_names

KEY = "partitioned"
"""The rank checkpoint's ``info`` field: entry name -> the class of the partitioned
optimizer's adapter that saved it."""
_MAX_NAME_CHARS = 4096


def recorded(items: Collected) -> dict[str, str]:
    """The entries of ``items`` a partitioned optimizer saved, with its adapter's class."""
    return {
        name: type(adapter).__qualname__
        for name, (adapter, _) in items.items()
        if isinstance(adapter, PartitionedOptimizerAdapter)
    }


def recorded_in(info: Mapping[str, Any]) -> dict[str, str]:
    """The partitioned entries a rank checkpoint's ``info`` (its ``rank_checkpoint``
    field) records, validated (the survey passes over a copy that fails, as its load
    would refuse it)."""
    return _validated(info.get(KEY, {}))


def refuse_another_partition(
    manifest: Manifest, info: Mapping[str, Any], state: Mapping[str, Any], rank: int
) -> None:
    """Refuse restoring a partitioned entry of this rank checkpoint (``info``: its
    ``rank_checkpoint`` field) into anything but the partition that saved it."""
    partitioned = recorded_in(info)
    if not any(name in state for name in partitioned):
        return
    names = load_names(state)[0]
    for name, saved_class in partitioned.items():
        if name not in state or name not in manifest.values:
            continue
        adapter, obj = adapter_for(state[name], name)
        live_class = type(adapter).__qualname__
        if live_class != saved_class or not isinstance(adapter, PartitionedOptimizerAdapter):
            raise CheckpointMismatchError(
                _held_only(name, saved_class, rank)
                + f"; this load restores it into a {type(obj).__qualname__} ({live_class}), "
                "which needs every parameter's state. " + _WAY_OUT
            )
        meta = manifest.values[name].meta
        saved_state = meta.get("state") if isinstance(meta, dict) else None
        held = set(saved_state) if isinstance(saved_state, dict) else set()
        owned = {names.get(id(p)) for g in adapter.local(obj).param_groups for p in g["params"]}
        elsewhere = sorted(held - owned)
        if elsewhere:
            raise CheckpointMismatchError(
                _held_only(name, saved_class, rank)
                + f"; rank {rank} now owns other parameters (it saved the state of "
                f"{elsewhere[0]!r}, which it no longer owns: the parameters or their "
                "groups changed). " + _WAY_OUT
            )


_WAY_OUT = (
    "A local copy restores only into the optimizer sharding that saved it; the persistent "
    "tier restores into any other"
)


def _held_only(name: str, saved_class: str, rank: int) -> str:
    return (
        f"rank {rank}'s local copy holds state[{name!r}] as its {saved_class} partition: "
        "the optimizer state of the parameters this rank owned, the others' being in the "
        "other ranks' copies"
    )


def _validated(found: Any) -> dict[str, str]:
    """``info``'s partitioned entries, or a corrupt-checkpoint refusal (hostile input)."""
    ok = isinstance(found, dict) and all(
        isinstance(k, str)
        and isinstance(v, str)
        and len(k) <= _MAX_NAME_CHARS
        and len(v) <= _MAX_NAME_CHARS
        for k, v in found.items()
    )
    if not ok:
        raise CheckpointCorruptError(
            f"the manifest's 'rank_checkpoint' {KEY!r} is not a map of entry names to "
            f"adapter names of at most {_MAX_NAME_CHARS} characters"
        )
    return found  # type: ignore[no-any-return]
