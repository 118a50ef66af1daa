"""Which adapter handles an object: a registry, searched newest registration first.

So a user's adapter overrides a built-in one for the objects it claims, without any
change to shardsafe. The engine finds adapters only here.
"""

from __future__ import annotations

from ..errors import CheckpointError
from ..protocol import Adapter

_REGISTRY: list[Adapter] = []


def register_adapter(adapter: Adapter) -> None:
    """Make ``adapter`` available to every save and load; it takes precedence over earlier ones."""
    if not isinstance(adapter, Adapter):
        raise TypeError(f"register_adapter() needs an Adapter instance, got {type(adapter)!r}")
    kind = getattr(adapter, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise TypeError(
            f"adapter {type(adapter).__qualname__} has no 'kind': set a class attribute such "
            "as kind = 'my-sharded-table'. It is recorded in the manifest, and a saved entry "
            "loads only through an adapter of the same kind."
        )
    _REGISTRY.insert(0, adapter)


def find_adapter(obj: object, name: str) -> Adapter:
    """The adapter for ``obj`` (``state[name]``), or a :class:`CheckpointError` saying why not."""
    for adapter in _REGISTRY:
        if adapter.handles(obj):
            return adapter
    raise CheckpointError(
        f"state[{name!r}] is a {type(obj).__qualname__}, which shardsafe does not know how to "
        "save: it is not a module, optimizer, tensor, JSON-able value or an object with "
        "state_dict()/load_state_dict(). Register an adapter for it with "
        "shardsafe.register_adapter()."
    )


def returning_adapter(kind: str) -> Adapter | None:
    """The adapter that restores entries of ``kind`` nobody asked for (plain data), if any."""
    for adapter in _REGISTRY:
        if adapter.kind == kind and adapter.returns_value:
            return adapter
    return None
