"""``shardsafe.save`` under a name that may already hold a checkpoint (Lightning's
``last.ckpt``): the save goes to a staging directory, then takes the name
(``storage/placement.py`` says how, and what is refused; on an object store, where there
is no rename, ``storage/object_placement.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..distributed import Coordinator, Phase, world
from . import background
from .background import SaveHandle
from .io.staging import Stager
from .options import SaveHooks, SaveOptions
from .saving import save
from .storage.locations import check_options, is_url, open_storage
from .storage.placement import Placement

if TYPE_CHECKING:
    from .storage.object_placement import ObjectPlacement


def save_replacing(path: str, state: Mapping[str, Any], options: SaveOptions) -> None:
    """``shardsafe.save`` to ``path``, replacing a checkpoint already there. Every rank.

    ``options.hooks`` must be the defaults: the placement uses both.
    """
    background.drain()  # a save in flight to this name must publish before we look
    placement, placed = _placed(path, options)
    save(placement.staging_path, state, placed)


def async_save_replacing(
    path: str, state: Mapping[str, Any], options: SaveOptions, stager: Stager | None = None
) -> SaveHandle:
    """:func:`save_replacing` in the background (``shardsafe.async_save``): returns once
    the state is staged; the name is taken (or replaced) only after the commit, by the
    writer thread, so ``path`` never shows a checkpoint that is not complete."""
    background.drain()  # a save in flight to this name must publish before we look
    placement, placed = _placed(path, options)
    return background.async_save(placement.staging_path, state, placed, stager)


def _placed(path: str, options: SaveOptions) -> tuple[Placement | ObjectPlacement, SaveOptions]:
    if options.hooks != SaveHooks():
        raise ValueError("save_replacing() runs its own save hooks; pass SaveOptions without")
    if options.storage is None:  # the usage error as save's, not wrapped by the agreement
        check_options(path, options.storage_options)
    placement = _object_placement(path, options) if is_url(path) else Placement.of(path)
    hooks = SaveHooks(before_write=placement.check, after_commit=placement.publish)
    storage = functools.partial(options.storage or open_storage, follow=False)
    return placement, SaveOptions.of(options, hooks=hooks, storage=storage)


def _object_placement(path: str, options: SaveOptions) -> ObjectPlacement:
    """Rank 0 reads the store and decides where the save goes; every rank uses its
    decision (a rank reading the store on its own could see it differently, or fail, and
    the ranks would then save to different places); its error is every rank's."""
    from .storage.object_placement import ObjectPlacement, split

    if world()[1] == 1:
        return ObjectPlacement.of(path, options.storage_options)
    parent, name = split(path)
    # '#' is never in an object name, so this tag is never a save's own
    coord = Coordinator("save", f"{parent}/{name}#placement", timeout=options.timeout)
    try:
        coord.enter(options.entry_timeout)

        def decide(payloads: list[Any]) -> list[str]:
            return [ObjectPlacement.of(path, options.storage_options).staging] * len(payloads)

        with coord.phase(Phase.PLACE, decide=decide) as chosen:
            pass
    finally:
        coord.close()
    return ObjectPlacement(parent, name, str(chosen.part), options.storage_options)
