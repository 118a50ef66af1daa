"""The adapter protocol and registry: how any kind of state becomes checkpoint entries.

An adapter knows one kind of object (a module, an optimizer, a ZeRO optimizer, ...). On
save it turns the object into a :class:`SaveItem`: JSON metadata plus the tensor chunks
this rank holds, each with its global shape and offsets. On load it says which regions
it needs (:class:`LoadPlan`) and then puts the tensors back. The engine does all the
I/O and communication; adapters never touch files or process groups, so a new sharded
optimizer is supported by writing one small class and calling
:func:`register_adapter` — no change to shardsafe itself.

Lookup is by :meth:`Adapter.handles`, newest registration first, so a user's adapter
overrides a built-in one for the objects it claims.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..checkpoint.entries import JSON, LoadPlan, SavedValue, SaveItem
from ..errors import CheckpointError


@dataclass
class Context:
    """What an adapter may know about the save or load it takes part in."""

    name: str
    """The key of this value in the user's state dict: the prefix of all its tensor keys."""
    rank: int
    world_size: int
    param_names: Mapping[int, str] = field(default_factory=dict)
    """``id(parameter)`` -> fully qualified name, from the modules in the same state dict."""
    saved_world_size: int = 0
    """At load: the world size the checkpoint was written with."""
    strict: bool = True
    saved_tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    """At load: every tensor key in the checkpoint with its dtype and global shape."""

    def key(self, *parts: str) -> str:
        """The tensor key for ``parts`` under this value, e.g. ``optimizer/fc.weight/exp_avg``."""
        return "/".join((self.name, *parts))

    def param_fqn(self, param: torch.Tensor) -> str:
        fqn = self.param_names.get(id(param))
        if fqn is None:
            raise CheckpointError(
                f"state[{self.name!r}] holds a parameter of shape {list(param.shape)} that is "
                "not in any module of the same state dict, so it has no name to be saved "
                f"under. Pass the model alongside it, e.g. {{'model': model, {self.name!r}: "
                f"{self.name}}}."
            )
        return fqn


class Adapter(ABC):
    """Saves and restores one kind of object. Subclass it and :func:`register_adapter`."""

    kind: ClassVar[str]
    """Recorded in the manifest; a value loads only into an adapter of the same kind."""
    returns_value: ClassVar[bool] = False
    """True if ``load`` hands :meth:`restore`'s result back to its caller, and restores
    values of this kind that the caller did not pass (plain data)."""

    @abstractmethod
    def handles(self, obj: object) -> bool:
        """True if this adapter knows how to save and load ``obj``."""

    @abstractmethod
    def save(self, obj: Any, ctx: Context) -> SaveItem:
        """This rank's metadata and chunks for ``obj``. Must not communicate."""

    def merge(self, metas: list[JSON]) -> JSON:
        """Combine the metadata every rank produced into what the manifest records.

        The default keeps rank 0's, right for replicated state. Sharded state (each rank
        knowing only its part) overrides this.
        """
        return metas[0]

    @abstractmethod
    def plan_load(self, obj: Any, saved: SavedValue, ctx: Context) -> LoadPlan:
        """The tensor regions this rank needs to restore ``obj``, plus any mismatches."""

    def validate(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: Context
    ) -> None:
        """Check, without changing ``obj``, that :meth:`restore` will accept this data.

        Runs on every value after every rank has read and verified its tensors, and
        before anything is restored anywhere, so a checkpoint that would fail half-way
        through restoring fails here instead, with nothing modified. Raise
        :class:`CheckpointCorruptError` (malformed metadata) or
        :class:`CheckpointMismatchError` (does not fit ``obj``). The default checks
        nothing.
        """
        return None

    @abstractmethod
    def restore(
        self, obj: Any, saved: SavedValue, tensors: Mapping[str, torch.Tensor], ctx: Context
    ) -> Any:
        """Put the loaded tensors (CPU, keyed by tensor key) back into ``obj``.

        Returns the value to hand back to the caller of ``load`` (plain values only).
        """


_REGISTRY: list[Adapter] = []


def register_adapter(adapter: Adapter) -> None:
    """Make ``adapter`` available to every save and load; it takes precedence over earlier ones."""
    if not isinstance(adapter, Adapter):
        raise TypeError(f"register_adapter() needs an Adapter instance, got {type(adapter)!r}")
    kind = getattr(adapter, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise TypeError(
            f"adapter {type(adapter).__qualname__} has no 'kind': set a class attribute such "
            "as kind = 'my-sharded-table'. It is recorded in the manifest, and a saved value "
            "loads only through an adapter of the same kind."
        )
    _REGISTRY.insert(0, adapter)


def find_adapter(obj: object, name: str) -> Adapter:
    for adapter in _REGISTRY:
        if adapter.handles(obj):
            return adapter
    raise CheckpointError(
        f"state[{name!r}] is a {type(obj).__qualname__}, which shardsafe does not know how to "
        "save: it is not a module, optimizer, tensor, JSON-able value or an object with "
        "state_dict()/load_state_dict(). Register an adapter for it with "
        "shardsafe.register_adapter()."
    )
