"""Which adapter handles an object: a registry, searched newest registration first.

So a user's adapter overrides a built-in one for the objects it claims, without any
change to shardsafe. The engine finds adapters only here.
"""

from __future__ import annotations

import torch

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


def adapter_for(obj: object, name: str) -> tuple[Adapter, object]:
    """The adapter for ``state[name]`` and the object it works on.

    That is ``obj`` itself, except for a wrapper that only delegates to an optimizer inside
    it (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``, any
    object whose ``optimizer`` shares its ``state`` and ``param_groups``): a built-in
    optimizer adapter would save the wrapper through its ``state_dict()``, which for a
    wrapped ZeRO or OSS optimizer raises on every rank, so the optimizer inside is saved
    and loaded as if it had been passed bare. A wrapper with state of its own beside the
    inner optimizer's (a Lookahead's slow weights) is refused: saved as one optimizer it
    would lose one of the two. A delegating wrapper whose ``state_dict()`` adds entries of
    its own is saved itself (:func:`_adds_entries`). A user's adapter registered for a
    wrapper's class gets the wrapper.
    """
    seen: set[int] = set()
    while True:
        adapter = find_adapter(obj, name)
        found = _wrapped_optimizer(obj)
        if found is None or id(found[1]) in seen or not _built_in_optimizer(adapter):
            return adapter, obj
        attribute, inner = found
        if not _delegates(obj, inner):
            raise CheckpointError(
                f"state[{name!r}] (a {type(obj).__qualname__}) wraps an optimizer "
                f"({type(inner).__qualname__}, at .{attribute}) whose state it does not share: "
                f"saved as one optimizer, either the {type(obj).__qualname__}'s state or the "
                f"{type(inner).__qualname__}'s would be lost. Register an adapter for "
                f"{type(obj).__qualname__} that saves both (shardsafe.register_adapter)."
            )
        if _adds_entries(obj, inner):
            return adapter, obj
        seen.add(id(obj))
        obj = inner


def _built_in_optimizer(adapter: Adapter) -> bool:
    built_in = type(adapter).__module__.startswith("shardsafe.adapters.")
    return built_in and adapter.kind == "optimizer"


def _wrapped_optimizer(obj: object) -> tuple[str, torch.optim.Optimizer] | None:
    """The optimizer at ``obj.optimizer``, if there is one (other than ``obj``), else one
    at another attribute whose ``param_groups`` are ``obj``'s own: SAM (and its copies)
    keeps the optimizer that steps, and its momentum, at ``.base_optimizer``, and saved
    through its own ``state`` that momentum was silently lost."""
    try:
        inner = getattr(obj, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not obj:
            return "optimizer", inner
        groups = getattr(obj, "param_groups", None)
        attributes = list(vars(obj).items()) if groups is not None else []
    except Exception:  # a property of a user's object that raises: no wrapped optimizer
        return None
    for attribute, value in attributes:
        if _steps_groups_of(value, obj, groups):
            return attribute, value
    return None


def _steps_groups_of(value: object, obj: object, groups: object) -> bool:
    """Whether ``value`` is another optimizer whose param groups are ``groups``."""
    try:
        is_other = isinstance(value, torch.optim.Optimizer) and value is not obj
        return is_other and getattr(value, "param_groups", None) is groups
    except Exception:
        return False


def _adds_entries(obj: object, inner: torch.optim.Optimizer) -> bool:
    """Whether the wrapper's ``state_dict()`` holds entries beside its optimizer's
    (``PostLocalSGDOptimizer``'s averager ``step``): saved as the optimizer inside, they
    were dropped in silence and the averaging schedule restarted at every resume (found
    in review). Such a wrapper is saved and loaded itself, through its own
    ``state_dict``/``load_state_dict``. ``False`` where either raises (a wrapped ZeRO's
    cannot be asked)."""
    try:
        own, inner_keys = obj.state_dict(), inner.state_dict()  # type: ignore[attr-defined]
        return isinstance(own, dict) and bool(set(own) - set(inner_keys))
    except Exception:
        return False


def _delegates(obj: object, inner: torch.optim.Optimizer) -> bool:
    """Whether ``obj``'s state and groups are ``inner``'s own (the same objects)."""
    try:
        same_state = getattr(obj, "state", None) is inner.state
        return same_state and getattr(obj, "param_groups", None) is inner.param_groups
    except Exception:
        return False


def returning_adapter(kind: str) -> Adapter | None:
    """The adapter that restores entries of ``kind`` nobody asked for (plain data), if any."""
    for adapter in _REGISTRY:
        if adapter.kind == kind and adapter.returns_value:
            return adapter
    return None
