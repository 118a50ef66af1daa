"""What a worker does when it fails: report once, exit at once.

In a multi-process run, one rank's exception usually makes its peers fail too, a moment
later, with a less useful error (a collective whose peer vanished). Printing every
rank's traceback buries the cause, so the first rank to fail claims "first failure" in
the process group's key-value store (an atomic ``compare_set``) and prints its
traceback; a rank that fails later prints one line naming the rank that failed first.

Ctrl-C stops every process: rank 0 of a run no shardsafe launcher watches (one process,
or torchrun's workers) says which checkpoint is the last good one (a shardsafe launcher
says it itself, once its workers are gone).

Then the worker exits with status 1 (a rank that failed second a second later, so that
the launcher names the first) without unwinding further: its peers may be blocked
in a collective it will never join, and the launcher (or torchrun's agent) stops them as
soon as it sees a worker exit non-zero. Outside a launched run (one process, or a
process group the caller made) exceptions propagate as usual.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator

import torch.distributed as dist

from ..strategies.base import Environment
from .launcher import LAUNCHER_VARIABLE

_KEY = "shardsafe/trainer/first-failure/{attempt}"
_DEFER_S = 1.0


@contextlib.contextmanager
def reported_and_fatal(
    env: Environment, interrupted: Callable[[], str] | None = None
) -> Iterator[None]:
    """In a launched worker, turn an exception into one report and ``exit(1)``.

    On Ctrl-C, rank 0 prints ``interrupted()`` unless a shardsafe launcher will."""
    try:
        yield
    except KeyboardInterrupt:
        if interrupted is not None and env.rank == 0 and LAUNCHER_VARIABLE not in os.environ:
            say_interrupted(interrupted)
        if not env.launched:
            raise
        _exit(130)
    except Exception as error:
        if not env.launched:
            raise
        _report(env.rank, error)
        _exit(1)


def say_interrupted(message: Callable[[], str]) -> None:
    """Print ``message()`` on stderr; a second Ctrl-C or a failure while it is made is
    not worth a traceback over the one the user asked for."""
    try:
        text = message()
    except (Exception, KeyboardInterrupt) as e:
        text = f"interrupted (the last checkpoint could not be looked up: {e})"
    print(f"shardsafe: {text}", file=sys.stderr, flush=True)


def _report(rank: int, error: BaseException) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        first: int | None = rank  # failed before the group existed: nobody to defer to
    else:
        first = _claim_first_failure(rank)
    if first == rank:
        print(f"shardsafe: rank {rank} failed:\n{_where_and_what(error)}", file=sys.stderr)
        return
    summary = str(error).strip().splitlines()[0] if str(error).strip() else ""
    cause = (
        f"rank {first} failed first"
        if first is not None
        else "the process group's store is gone (rank 0 has probably exited)"
    )
    print(
        f"shardsafe: rank {rank} stopped because {cause} ({type(error).__name__}: {summary})",
        file=sys.stderr,
        flush=True,
    )
    # Let the rank that failed first exit first, so the launcher names it.
    time.sleep(_DEFER_S)


def _where_and_what(error: BaseException) -> str:
    """The traceback of where it went wrong, then what every rank was told.

    An error agreed between ranks is raised from the exception that caused it: the
    cause's traceback shows the failing line (often the user's own code); the frames of
    the agreement itself would only bury it. A chain of causes that loops (``raise e from
    e`` in the user's code) ends where it comes back: followed round, the report never
    ended, and the run hung, its peers waiting for this rank in a collective.
    """
    root, seen = error, {id(error)}
    while root.__cause__ is not None and id(root.__cause__) not in seen:
        root = root.__cause__
        seen.add(id(root))
    text = "".join(traceback.format_exception(root, chain=False))
    if root is not error:
        text += f"{type(error).__module__}.{type(error).__qualname__}: {error}\n"
    return text


def _claim_first_failure(rank: int) -> int | None:
    """The rank that failed first (maybe this one); ``None`` if the store is unreachable."""
    key = _KEY.format(attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=5))
        return int(store.compare_set(key, "", str(rank)))
    except Exception:
        return None


def _exit(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
