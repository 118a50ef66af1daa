"""Warnings that point at the line that called shardsafe, not at shardsafe's own files.

Each warning used to count its ``stacklevel`` by hand, and a count goes stale whenever a
call gains or loses a frame (a wrapper, a helper split out, ``torch.no_grad``'s): several
pointed into shardsafe, where a user can do nothing with the line shown, and a filter on
the user's module (``-W error::UserWarning:train``) never matched them. Here the frame
named is the caller of the outermost shardsafe frame on the stack: the user's
``save``/``load``, the Lightning or Accelerate code that called one of our strategies, or
``threading`` for a background thread's. Frames between shardsafe's own (``contextlib``,
torch's decorators) are passed over. Standard library only, so every layer can use it.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


_MARK = "_said_by_shardsafe"


def warn(message: str | Warning, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)``, attributed to the caller of shardsafe, and
    marked as shardsafe's (:func:`is_ours`)."""
    said = message if isinstance(message, Warning) else category(message)
    setattr(said, _MARK, True)
    warnings.warn(said, stacklevel=callers_level())


def is_ours(said: warnings.WarningMessage) -> bool:
    """Whether a recorded warning is one shardsafe gave (through :func:`warn`): the
    command line prints those and no library's. Its file cannot tell: it names the
    caller of shardsafe, which for the command line is ``runpy`` or the entry point."""
    return bool(getattr(said.message, _MARK, False))


def callers_level() -> int:
    """The ``stacklevel``, for a ``warnings.warn`` made by this function's caller, of the
    frame that called the outermost shardsafe frame. Linear in the stack's depth."""
    frame: FrameType | None = sys._getframe(1)  # the caller: stacklevel 1 of its warnings.warn
    level = outermost = 1
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PACKAGE):
            outermost = level
        frame, level = frame.f_back, level + 1
    return outermost + 1
