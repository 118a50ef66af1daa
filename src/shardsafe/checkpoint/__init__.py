"""The checkpoint engine: format, planning, I/O and the save/load phases.

Four layers under the phases, each importing only those below it (``docs/design.md``
draws them; ``tests/unit/test_layering.py`` pins them):

* ``format/``: what the bytes mean, checked as hostile input (the manifest, its version-2
  table, safetensors headers, CRCs, geometry);
* ``storage/``: bytes in and out of one directory or object-store prefix (the ``Storage``
  protocol and its capabilities, local files, object stores, locks, removal, placement);
* ``plan/``: pure decisions (``collecting`` + ``offer`` -> ``save_plan``, ``plan_parts``,
  ``transfers`` | ``load_plan``);
* ``io/``: carrying a plan out (``writing``, ``consolidate_*``, ``staging`` | ``reader``,
  ``in_place``);
* the phases on top: ``saving`` | ``loading``, ``background`` (a save on a thread),
  ``manager`` (step directories), ``replacing`` (a save into a taken name), ``streaming``
  (the converters' writer); ``api`` and ``options`` (the public entry points); the
  read-only reports ``verifying`` and ``inspecting`` with ``finding``.

Glossary (a tensor piece, stage by stage):

state entry
    one name of the ``state`` dict passed to ``save``/``load`` and its object; recorded in
    the manifest as a :class:`~shardsafe.protocol.SavedValue` (name, adapter kind, JSON
    metadata). Entries of kind ``"value"`` are *plain data* (tensors and JSON-able values).
tensor key
    the name of one saved tensor, ``<entry>/<path>`` (``optimizer/fc.weight/exp_avg``).
chunk
    a piece of a tensor, placed in the global tensor by offsets. An adapter yields
    :class:`~shardsafe.protocol.Chunk` s (with the tensor); a rank's *offer* describes
    them (:class:`~shardsafe.checkpoint.plan.offer.ChunkOffer`, shapes only); the *save plan*
    puts each in a data file (:class:`~shardsafe.checkpoint.plan.save_plan.FileEntry`); the
    manifest records where it landed (:class:`~shardsafe.checkpoint.format.manifest.ChunkRecord`,
    with its CRC32s; format version 2 keeps them all in one *chunk table*, ``manifest_table``);
    a data file's header describes its bytes (``HeaderEntry``).
save plan / load plan
    the whole of what a save writes (every data file, which rank writes it, which chunk
    offers fill it) / what a load on one rank restores (every entry, the *read requests*
    of its adapter).
consolidating rank
    rank 0, which writes every file of a consolidated checkpoint while other ranks *send*
    (``consolidate_sender``) and it *receives* (``consolidate_receiver``).
phase
    a step every rank ends together (``shardsafe.distributed.Phase``): the outcome, or the
    first rank's error, is agreed on all of them.
"""

from __future__ import annotations

from .format.manifest_format import Layout
from .options import LoadOptions, SaveHooks, SaveOptions, VerifyMode

__all__ = ["Layout", "LoadOptions", "SaveHooks", "SaveOptions", "VerifyMode"]
