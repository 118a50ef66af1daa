"""The checkpoint engine: format, planning, I/O and the save/load phases.

Save and load are mirrors. Modules, save side | load side:

* the phases: ``saving`` | ``loading``; public entry points in ``api``, their options in
  ``options``, the step-directory manager in ``manager``; the read-only reports
  ``verifying`` and ``inspecting`` (``shardsafe.verify``/``inspect``, which the command
  line prints), with ``finding`` (the checkpoint a user's path names, or where to look);
* planning (pure): ``collecting`` + ``offer`` -> ``save_plan`` (+ ``transfers`` for the
  consolidated layout) | ``load_plan``;
* bytes: ``writing`` (+ ``consolidate_sender``, ``consolidate_receiver``,
  ``chunk_bytes``) | ``reader``; both through ``safetensors_io`` and ``storage``
  (``files``: opening names inside a directory safely);
* the manifest: ``manifest`` (writes it, builds it, parses it), ``manifest_format``,
  ``manifest_checks``, ``strict_json``; ``geometry`` for boxes and tilings; ``crc``;
* the directory a save writes: ``target_directory`` (+ ``leftovers``: what a save may
  delete, by its marker's record); a root's writer: ``lock`` (the rules, once) over
  ``lock_backends`` (a hard link on a filesystem, a conditional PUT on an object store;
  a root's ``Storage.lock_backend()``), + ``lock_owner`` (the owner record it checks).

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
    them (:class:`~shardsafe.checkpoint.offer.ChunkOffer`, shapes only); the *save plan*
    puts each in a data file (:class:`~shardsafe.checkpoint.save_plan.FileEntry`); the
    manifest records where it landed (:class:`~shardsafe.checkpoint.manifest.ChunkRecord`,
    with its CRC32s; format version 2 keeps them all in one *chunk table*, ``chunk_table``);
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

from .manifest_format import Layout
from .options import LoadOptions, SaveHooks, SaveOptions, VerifyMode

__all__ = ["Layout", "LoadOptions", "SaveHooks", "SaveOptions", "VerifyMode"]
