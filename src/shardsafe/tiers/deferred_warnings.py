"""A restore's warnings, said once every rank is done with the restore.

A restore warns on one rank as it goes (a damaged local copy passed over, a copy that
did not arrive, one that could not be deleted). Said there, a warning that the user's
filter makes an error (``python -W error``, pytest's ``filterwarnings = error``) is
raised on that rank alone, between two exchanges or in the middle of a transfer: the
other ranks then wait for it until the timeout (300 s by default) and fail naming it as
missing. Kept until the restore ends and said then, on the way out of ``load_latest``,
each warning is still raised by such a filter, but only after every rank has finished
the restore's collective work, so the others are not kept waiting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import TracebackType

from .. import _warnings


class DeferredWarnings:
    """Warnings kept during a restore (:meth:`warn`) and said when the outermost ``with``
    block over it ends."""

    def __init__(self) -> None:
        self._kept: list[Warning] = []
        self._depth = 0

    def warn(self, message: str | Warning) -> None:
        """Keep ``message`` (a ``UserWarning``, or the warning given) to be said later."""
        self._kept.append(message if isinstance(message, Warning) else UserWarning(message))

    @contextlib.contextmanager
    def keeping(self) -> Iterator[None]:
        """A block whose warning, raised by the user's filter (a deletion's ``left ... in
        place``), is kept and said later as :meth:`warn`'s are, instead of raised on
        this rank alone in the middle of the restore."""
        try:
            yield
        except Warning as said:
            self.warn(said)

    def __enter__(self) -> DeferredWarnings:
        self._depth += 1
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Say the kept warnings, pointing at the caller of the manager's method that
        entered (this, the restorer's method, the manager's, its caller). While an error
        is raised, a warning the filter makes an error is passed over: the error the
        ranks agreed on is the one raised."""
        self._depth -= 1
        if self._depth:
            return
        kept, self._kept = self._kept, []
        for message in kept:
            try:
                _warnings.warn(message)
            except Warning:
                if error is None:
                    raise
