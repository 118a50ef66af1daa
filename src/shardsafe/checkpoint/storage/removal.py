"""Deleting a checkpoint directory: only what shardsafe wrote, never through a link.

Shared by :class:`~shardsafe.checkpoint.manager.CheckpointManager` (retention) and the
Lightning strategy (``ModelCheckpoint``'s ``save_top_k``), so that both delete by the same
rules: a directory holding anything shardsafe does not write (a file of yours, a
subdirectory, a symlink) is left in place with a warning, and a deletion interrupted
half-way leaves a directory that is plainly not a checkpoint, never a broken one.
"""

from __future__ import annotations

import errno

from ... import _warnings
from ...errors import CheckpointError, CheckpointNotFoundError
from ..format.manifest import MANIFEST_NAME
from .leftovers import INCOMPLETE_MARKER, OURS, record
from .protocol import Storage

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
"""A write refused for want of room (a full disk, a quota)."""


def foreign_entries(step: Storage) -> list[str]:
    """The entries of ``step`` that shardsafe did not write (anything but its regular files)."""
    return [n for n in step.names() if not (OURS.fullmatch(n) and step.kind(n) == "file")]


def delete_checkpoint(
    root: Storage, name: str, *, replaced: bool = True, uncommitted: bool = False
) -> None:
    """Delete what shardsafe wrote in ``root/name``, never following or deleting a link.

    A directory holding anything else is left untouched, with a warning. Otherwise it is
    marked first with a record of its files (so that a crash mid-way leaves a directory
    the next save recognises as its own leftover, and may clear), then loses the
    manifest, then the data files, then itself. ``replaced``: a newer checkpoint replaced
    it (retention), which a failure's error says is committed; else the error names the
    failed deletion alone (a restore deleting a damaged or a later step's copy).
    ``uncommitted``: retention deletes it as an interrupted save, having found no
    manifest; if its listing shows one after all (an object store's answer that changed
    between two requests), it is left in place with a warning: before, one such answer
    deleted a checkpoint ``keep_last`` kept (found in review).
    """
    try:
        with root.child(name) as step:
            foreign = foreign_entries(step)
            if foreign:
                warn(
                    f"left {step.directory} in place: it holds {foreign[:3]}, which shardsafe "
                    "did not write; delete it yourself if it is no longer needed"
                )
                return
            names = step.names()
            if uncommitted and MANIFEST_NAME in names:
                warn(
                    f"retention left {step.directory} in place: it looked like an interrupted "
                    f"save (no {MANIFEST_NAME} when asked), but its listing holds one; the "
                    "next save looks again"
                )
                return
            if uncommitted and names and INCOMPLETE_MARKER not in names:
                # Neither a checkpoint nor what a save or a deletion of shardsafe's left
                # (both mark the directory first): a user's files under a step's name,
                # which retention deleted while a save into it refused them (found in
                # review: a model.safetensors of one's own in step-000000001).
                warn(
                    f"retention left {step.directory} in place: it holds no {MANIFEST_NAME} "
                    f"and no {INCOMPLETE_MARKER}, so shardsafe did not write it; delete it "
                    "yourself if it is no longer needed"
                )
                return
            recorded = True
            try:
                # What a save into it may clear, and what a later look finishes deleting
                # (placement.clear_interrupted), if this is interrupted.
                record(step, names, deleting=True)
            except OSError as e:
                # No room for the record: a full disk, which deleting is to relieve. The
                # manifest goes first (the directory is then plainly not a checkpoint),
                # and its room takes the record. One without a manifest (an interrupted
                # write or receipt, whose files took the last room) was never a
                # checkpoint: its files go without a record, a crash leaving no more than
                # was there. Raised, nothing on a full disk could be deleted: not by
                # retention, nor by a restore, nor a failed copy's files, so it stayed full.
                if e.errno not in _NO_ROOM:
                    raise
                recorded = False
            if MANIFEST_NAME in names:
                step.remove(MANIFEST_NAME)
                step.sync_directory()
                if not recorded:
                    record(step, names, deleting=True)
            for entry in names:
                if entry not in (MANIFEST_NAME, INCOMPLETE_MARKER):
                    step.remove(entry)
            step.remove(INCOMPLETE_MARKER)
            step.abort_pending_uploads()  # an object store's, invisible in listings
        root.remove_child(name)
    except CheckpointNotFoundError:
        return
    except (OSError, CheckpointError) as e:
        where = root.where(name)
        what = f"deleting the checkpoint {where}"
        if replaced:
            what = f"the new checkpoint is committed, but deleting the old checkpoint {where}"
        raise CheckpointError(f"{what} failed: {e}") from e


def warn(message: str) -> None:
    """A warning attributed to the caller of the public function that led here."""
    _warnings.warn(f"shardsafe: {message}")
