"""How one rank's failure is told to every rank: posted reports and the agreed error."""

from __future__ import annotations

import traceback
from dataclasses import dataclass

from ..errors import ERROR_CLASSES, CheckpointError
from .phases import Phase


@dataclass
class RankFailure:
    """What one rank reported when it failed a phase."""

    rank: int
    error_type: str
    message: str


def error_type(error: BaseException) -> str:
    return type(error).__name__ if isinstance(error, CheckpointError) else "CheckpointError"


def error_message(error: BaseException) -> str:
    if isinstance(error, CheckpointError):
        return str(error)
    last = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    if isinstance(error, KeyboardInterrupt) and not str(error):
        return f"KeyboardInterrupt: interrupted (Ctrl-C or SIGINT){where}"
    return f"{type(error).__name__}: {error}{where}"


def as_checkpoint_error(error: BaseException) -> CheckpointError:
    if isinstance(error, CheckpointError):
        return error
    return CheckpointError(error_message(error))


def agreed_error(failures: list[RankFailure], operation: str, *, total: int = 0) -> CheckpointError:
    """The error every rank raises: the first failing rank's, of its class; the others
    named in rank order. ``total``: how many ranks failed, if more than ``failures``
    reports (only a few are read)."""
    first = failures[0]
    cls = ERROR_CLASSES.get(first.error_type, CheckpointError)
    others = ""
    if len(failures) > 1:
        more = total - len(failures)
        also = f" and {more} more" if more > 0 else ""
        ranks = sorted(f.rank for f in failures[1:])
        others = f" (rank(s) {', '.join(map(str, ranks))}{also} failed too)"
    elif total > 1:
        others = f" ({total - 1} more rank(s) failed too)"
    return cls(f"{operation} failed on rank {first.rank}{others}: {first.message}")


def missing_message(
    operation: str,
    phase: Phase,
    missing: list[int],
    timeout: float,
    rank: int,
    world_size: int,
    called_as: str | None = None,
    elsewhere: str = "",
) -> str:
    """The error for ranks that did not post ``phase`` within ``timeout``. ``called_as``:
    what the user calls, where the operation is not a function of theirs (a tiered
    manager's agreements and loads): named instead of ``shardsafe.<operation>``.
    ``elsewhere``: where missing ranks entered instead (``Link.elsewhere``)."""
    ranks = ", ".join(map(str, missing))
    instead = f" {elsewhere[:1].upper()}{elsewhere[1:]}." if elsewhere else ""
    if phase is Phase.ENTRY and called_as is not None:
        return (
            f"{called_as} must be called on every rank, in the same order, outside any "
            f"`if rank == 0:` block, but rank(s) {ranks} never arrived within {timeout:g}s "
            f"(this is rank {rank} of {world_size}).{instead}"
        ).rstrip(".")
    if phase is Phase.ENTRY:
        return (
            f"shardsafe.{operation} must be called on all ranks, but rank(s) {ranks} "
            f"never arrived within entry_timeout={timeout:g}s (this is rank {rank} of "
            f"{world_size}).{instead} Call {operation} on every rank, outside any "
            "`if rank == 0:` block, with the same path. Nothing was written."
        )
    return (
        f"rank(s) {ranks} did not finish the '{phase.value}' phase of {operation} within "
        f"{timeout:g}s (this is rank {rank}); they may have died or hung. "
        "The previous checkpoint is untouched."
    )


def dead_message(
    operation: str, phase: Phase, dead: list[int], dead_after: float, rank: int
) -> str:
    ranks = ", ".join(map(str, dead))
    return (
        f"rank(s) {ranks} stopped responding during the '{phase.value}' phase of {operation} (no "
        f"heartbeat for {dead_after:g}s; this is rank {rank}): they have probably died "
        "(killed, out of memory)."
    )
