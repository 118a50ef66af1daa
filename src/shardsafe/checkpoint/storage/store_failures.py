"""A read the object store fails, told apart from a checkpoint that is damaged.

A store's failure says nothing about the checkpoint: the object may be whole. Raised as
what a damaged checkpoint raises (or as an ``OSError``, as s3fs translates an error
code it does not know), it made a manager's ``latest``/``load_latest``, which pass over
checkpoints that would not load, roll the run back to the step before, with a warning
only. So each is a :class:`StoreFailedError`, which they raise instead:

* a response whose body ended before its length (the connection cut by the store, a
  proxy or a load balancer: aiohttp's ``ClientPayloadError``), once the tries are spent
  (:func:`cut_short`);
* an error code the store answered with after its client's retries (``InternalError``,
  ``ServiceUnavailable``, ``SlowDown``: the ``OSError`` s3fs makes of it,
  :data:`FAILED_ANSWERS`) (:func:`failed_answer`);
* a connection that failed or was reset after the client's retries (aiohttp's
  ``ClientConnectionError``, an ``OSError`` as gcsfs raises it: ``[Errno 104] Connection
  reset by peer``), which rolled a ``gs://`` run back to the step before
  (:func:`lost_connection`);
* a request the store never answered within its client's timeouts, on every retry
  (botocore's ``ReadTimeoutError``/``ConnectTimeoutError``: an endpoint that accepts
  connections and then says nothing), or whose bytes it stopped taking (an upload it
  stopped reading: ``stalled_uploads``) (:func:`unanswered`).

A missing object (``FileNotFoundError``) and access refused (``PermissionError``) are
answers about the checkpoint, and stay what they are.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

from ...errors import CheckpointError


class StoreFailedError(CheckpointError):
    """The object store failed a read, not the checkpoint (the module's doc). Not public:
    other ranks re-raise it as a ``CheckpointError``."""


class UnansweredError(StoreFailedError):
    """A request the store never answered within its client's timeouts (:func:`unanswered`):
    a manager that met it only looking around the root before a save refuses that save at
    once rather than wait it out again."""


def is_cut_short(error: BaseException) -> bool:
    """Whether ``error`` is a response body that ended before its length (aiohttp's
    ``ClientPayloadError``, raised by s3fs and gcsfs alike)."""
    try:
        from aiohttp import ClientPayloadError
    except ImportError:  # a filesystem that does not speak HTTP through aiohttp
        return False
    return isinstance(error, ClientPayloadError)


FAILED_ANSWERS = {errno.EIO, errno.EREMOTEIO, errno.EBUSY}
"""The errors s3fs makes of a store's own failure: ``InternalError`` (``EREMOTEIO``),
``ServiceUnavailable``, ``SlowDown`` and ``OperationAborted`` (``EBUSY``), a code it has
no exception for (``EIO``); with ``RequestTimeout`` (``TimeoutError``)."""


def _is_failed_answer(error: BaseException) -> bool:
    """Whether ``error`` is s3fs's translation of the store's own failure."""
    failed = type(error) is OSError and error.errno in FAILED_ANSWERS
    return failed or isinstance(error, TimeoutError)


def is_garbled(error: BaseException) -> bool:
    """Whether ``error`` is botocore's check of a response's body against the checksum the
    store sent with it failing (``FlexibleChecksumError``): the bytes were damaged on the
    way, not in the store."""
    try:
        from botocore.exceptions import FlexibleChecksumError  # type: ignore[import-untyped]
    except ImportError:
        return False
    return isinstance(error, FlexibleChecksumError)


def garbled(name: str, error: BaseException, tries: int | None = None) -> StoreFailedError:
    """The error for ``name``'s bytes that arrived other than the store sent them."""
    times = f", {tries} times" if tries else ""
    return StoreFailedError(
        f"reading {name} failed: the object store's response did not match the checksum it "
        f"sent with it{times} ({type(error).__name__}: {error}). The bytes were damaged on "
        "the way (a proxy, or the network): nothing is known to be wrong with the "
        "checkpoint; check the connection to the store and load again"
    )


def is_lost_connection(error: BaseException) -> bool:
    """Whether ``error`` is a connection to the store that failed or was reset."""
    if isinstance(error, ConnectionError):
        return True
    try:
        from aiohttp import ClientConnectionError
    except ImportError:
        return False
    return isinstance(error, ClientConnectionError)


def is_unanswered(error: BaseException) -> bool:
    """Whether ``error`` is a request the store did not answer within botocore's
    ``connect_timeout`` or ``read_timeout`` (after its client's retries)."""
    try:
        from botocore.exceptions import (
            ConnectTimeoutError,
            ReadTimeoutError,
        )
    except ImportError:  # no S3 client installed: nothing raises them
        return False
    return isinstance(error, (ConnectTimeoutError, ReadTimeoutError)) or is_stalled(error)


def is_stalled(error: BaseException) -> bool:
    """Whether ``error`` is botocore's ``EndpointConnectionError`` for a connection that
    timed out after it was made (``ETIMEDOUT``: bytes sent that the store never took, the
    ``TCP_USER_TIMEOUT`` of ``stalled_uploads``), not one that could not be made."""
    try:
        from botocore.exceptions import EndpointConnectionError
    except ImportError:
        return False
    if not isinstance(error, EndpointConnectionError):
        return False
    cause: BaseException | None = getattr(error, "kwargs", {}).get("error")
    try:
        from aiohttp import ClientConnectorError
    except ImportError:
        return False
    if isinstance(cause, ClientConnectorError):  # the connection was never made
        return False
    for _ in range(8):  # aiohttp's error, then the OSError under it
        if cause is None:
            return False
        if isinstance(cause, OSError) and cause.errno == errno.ETIMEDOUT:
            return True
        cause = cause.__cause__ or cause.__context__
    return False


RAISE_TIMEOUTS = (
    'storage_options={"config_kwargs": {"read_timeout": 120, "connect_timeout": 30, '
    '"retries": {"total_max_attempts": 3}}}'
)
"""The ``storage_options`` that :func:`unanswered` suggests for a store that is only slow."""


def unanswered(url: str, error: BaseException) -> UnansweredError:
    """The error for a request about ``url`` the store never answered: the endpoint is
    dead, unreachable or stuck, or it is slower than the client's timeouts (say how to
    raise them). Nothing is known to be wrong with the checkpoint."""
    said = " ".join(f"{type(error).__name__}: {error}".split())
    if is_stalled(error):
        said += " (the store stopped taking the bytes sent to it: [Errno 110] Connection timed out)"
    return UnansweredError(
        f"the object store did not answer at {url} within its client's timeouts, on any "
        f"of its retries ({said}): check the endpoint and the network; if the store is "
        f"only slow, raise the timeouts with {RAISE_TIMEOUTS}"
    )


def failed_read(name: str, error: BaseException) -> BaseException:
    """``error`` as :class:`StoreFailedError` if it is a store's failure, else as it is."""
    if is_unanswered(error):
        return unanswered(name, error)
    if is_cut_short(error):
        return cut_short(name, error)
    if is_garbled(error):
        return garbled(name, error)
    if _is_failed_answer(error):
        return failed_answer(name, error)
    if is_lost_connection(error):
        return lost_connection(name, error)
    return error


@contextlib.contextmanager
def store_failures(name: str) -> Iterator[None]:
    """Turn a store's failure to read ``name`` (after its client's own retries) into a
    :class:`StoreFailedError`."""
    try:
        yield
    except Exception as e:
        failed = failed_read(name, e)
        if failed is e:
            raise
        raise failed from e


def cut_short(name: str, error: BaseException, tries: int | None = None) -> StoreFailedError:
    """The error for ``name``'s bytes that never all arrived."""
    times = f", {tries} times" if tries else " on every retry"
    return StoreFailedError(
        f"reading {name} failed: the object store's response ended before all of its "
        f"bytes arrived{times} ({type(error).__name__}: {error}). The connection was cut "
        "(the store, a proxy or a load balancer, or the network): nothing is known to be "
        "wrong with the checkpoint; check the connection to the store and load again"
    )


def failed_answer(name: str, error: BaseException) -> StoreFailedError:
    """The error for a read of ``name`` the store answered with an error code."""
    return StoreFailedError(
        f"reading {name} failed: the object store answered with an error after its "
        f"client's retries ({error}): nothing is known to be wrong with the checkpoint; "
        "check the store (its status, rate limits and quotas) and load again"
    )


def lost_connection(name: str, error: BaseException) -> StoreFailedError:
    """The error for a read of ``name`` whose connection to the store failed."""
    return StoreFailedError(
        f"reading {name} failed: the connection to the object store failed after its "
        f"client's retries ({type(error).__name__}: {error}): nothing is known to be wrong "
        "with the checkpoint; check the network and the store's endpoint, and load again"
    )


STORE_FAILED_AT = "the object store failed at "
"""How :func:`store_errors` begins (the CLI adds what to check to such an error)."""


def failed_at(url: str, error: BaseException) -> CheckpointError:
    """The error for ``url`` whose store's client raised ``error``, on one line (gcsfs
    puts the store's answer on a line of its own)."""
    said = " ".join(f"{type(error).__name__}: {error}".split())
    return CheckpointError(f"{STORE_FAILED_AT}{url}: {said}")


def store_failed_at(url: str, error: BaseException) -> CheckpointError:
    """:func:`unanswered` for a request the store never answered, else :func:`failed_at`."""
    return unanswered(url, error) if is_unanswered(error) else failed_at(url, error)


@contextlib.contextmanager
def writes(url: str) -> Iterator[None]:
    """:func:`answers`, and any other error of the store's client (botocore's
    ``ConnectionClosedError`` for a connection the store closed mid-upload) as a
    ``CheckpointError`` naming ``url``: raw, it named the endpoint's HTTP address and a
    line inside aiobotocore. ``OSError``s and ``CheckpointError``s pass as they are."""
    try:
        yield
    except (OSError, CheckpointError):
        raise
    except Exception as e:
        raise store_failed_at(url, e) from e


@contextlib.contextmanager
def answers(url: str) -> Iterator[None]:
    """Turn a request about ``url`` that the store never answered into :func:`unanswered`;
    let every other error through as it is."""
    try:
        yield
    except Exception as e:
        if not is_unanswered(e):
            raise
        raise unanswered(url, e) from e


@contextlib.contextmanager
def listing_errors(url: str) -> Iterator[None]:
    """:func:`store_errors`, and an ``OSError`` but a missing path's (access refused:
    gcsfs's 403 "Forbidden") as a ``CheckpointError`` naming ``url``: a manager's listing
    runs outside any agreed operation, and raw it escaped a loop's ``except
    CheckpointError`` (a local root's ``OSError`` stays what it is)."""
    try:
        with store_errors(url):
            yield
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as e:
        raise failed_at(url, e) from e


@contextlib.contextmanager
def store_errors(url: str) -> Iterator[None]:
    """Turn an error of the store's client that is neither an ``OSError`` nor a
    ``CheckpointError`` (botocore's ``EndpointConnectionError``, ``NoCredentialsError``,
    ...) into a ``CheckpointError`` naming ``url``."""
    try:
        yield
    except (OSError, CheckpointError):
        raise
    except Exception as e:
        raise failed_at(url, e) from e
