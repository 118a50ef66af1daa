"""The exceptions shardsafe raises.

Every failure a user can act on is a :class:`CheckpointError`, so one ``except`` clause
catches them all; the children say what kind of action is needed::

    CheckpointError                  base: anything a save or load could not do
    ├── CheckpointCorruptError       bytes on disk are wrong: checksum, truncation,
    │   │                            missing file, malformed or hostile manifest
    │   └── CheckpointVersionError   written by a newer format than this shardsafe reads
    ├── CheckpointMismatchError      the checkpoint is fine, but does not fit the live
    │                                objects: keys, shapes or dtypes differ
    └── CheckpointNotFoundError      no committed checkpoint at the path

In a multi-rank run the error raised on every rank is the same class, and its message
names the failing rank (see ``shardsafe.distributed``).
"""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint could not be saved or loaded; the message says why and how to fix it."""


class CheckpointCorruptError(CheckpointError):
    """The files of a checkpoint are damaged, incomplete, or not what the manifest says."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not match the objects it is loaded into."""


class CheckpointVersionError(CheckpointCorruptError):
    """The manifest declares a format version this shardsafe does not know.

    A child of :class:`CheckpointCorruptError` because, from this reader's point of view,
    the manifest cannot be trusted; the message says to upgrade shardsafe.
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no committed checkpoint (no ``manifest.json``) at the given path.

    Also a ``FileNotFoundError``, so that code written for files (``except
    FileNotFoundError``, Lightning's own expectations of a missing checkpoint) catches it.
    """


ERROR_CLASSES: dict[str, type[CheckpointError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        CheckpointCorruptError,
        CheckpointMismatchError,
        CheckpointVersionError,
        CheckpointNotFoundError,
    )
}
"""By name, so an error raised on one rank can be re-raised as the same class elsewhere."""


def with_message(error: BaseException, message: str) -> CheckpointError:
    """A new error of ``error``'s shardsafe class (its own class if it takes a message
    alone, else the nearest public one it derives from; :class:`CheckpointError` for
    anything else) saying ``message``: to add what a failure left behind."""
    for cls in type(error).__mro__:
        if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
            continue
        try:
            return cls(message)
        except TypeError:  # a subclass whose __init__ wants more than a message
            continue
    return CheckpointError(message)
