"""One rank looks, every rank acts on what it found.

Reading the object store to decide where a resume comes from is done by rank 0 alone:
ranks that looked on their own could see it differently (or one of them fail), and then
load different checkpoints. Rank 0's answer, or its error, is broadcast; a rank 0 that
failed without telling the others would leave them waiting in the broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import CheckpointError

T = TypeVar("T")


def rank_zero_decides(strategy: Any, decide: Callable[[], T], what: str) -> T:
    """``decide()`` on rank 0, its result on every rank (``strategy.broadcast``).

    A ``CheckpointError`` there is raised on every rank with its message; any other error
    as ``CheckpointError("<what> failed: <type>: <message>")``; a ``KeyboardInterrupt``
    (any ``BaseException``) is re-raised on rank 0 once the others have heard of it.
    """
    found: tuple[str, Any] = ("", None)
    interrupted: BaseException | None = None
    if strategy.is_global_zero:
        try:
            found = ("ok", decide())
        except CheckpointError as e:
            found = ("error", str(e))
        except BaseException as e:  # the store's own errors, or Ctrl-C
            found = ("error", f"{what} failed: {type(e).__name__}: {e}")
            interrupted = e if not isinstance(e, Exception) else None
    kind, value = strategy.broadcast(found)
    if interrupted is not None:
        raise interrupted
    if kind == "error":
        raise CheckpointError(str(value))
    result: T = value
    return result
