"""``shardsafe.save`` under a name that may already hold a checkpoint (Lightning's
``last.ckpt``): the save goes to a staging directory, then takes the name
(``storage/placement.py`` says how, and what is refused).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from .options import SaveHooks, SaveOptions
from .saving import save
from .storage.locations import open_storage
from .storage.placement import Placement


def save_replacing(path: str, state: Mapping[str, Any], options: SaveOptions) -> None:
    """``shardsafe.save`` to ``path``, replacing a checkpoint already there. Every rank.

    ``options.hooks`` must be the defaults: the placement uses both.
    """
    if options.hooks != SaveHooks():
        raise ValueError("save_replacing() runs its own save hooks; pass SaveOptions without")
    placement = Placement.of(path)
    hooks = SaveHooks(before_write=placement.check, after_commit=placement.publish)
    storage = functools.partial(options.storage or open_storage, follow=False)
    save(placement.staging_path, state, SaveOptions.of(options, hooks=hooks, storage=storage))
