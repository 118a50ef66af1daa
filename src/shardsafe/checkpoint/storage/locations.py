"""Where a checkpoint path points: a local directory or an object-store URL.

A path with a scheme (``s3://bucket/run``, ``gs://...``, ``memory://...``) is never
treated as a local path (``s3:`` would otherwise become a directory in the working
directory, silently). URLs go to :class:`~.object_storage.FsspecStorage`, which needs the
``s3`` extra; without it, the error says which package to install. ``file://`` URLs are
local paths and keep every guarantee of :class:`~.storage.LocalStorage`.
"""

from __future__ import annotations

import contextlib
import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from ...errors import CheckpointError
from .local import LocalStorage
from .protocol import Storage
from .store_failures import store_errors

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)(::[A-Za-z][A-Za-z0-9+.\-]*)*://")
"""A URL, also fsspec's chained form (``simplecache::s3://...``), which is refused
(:func:`open_storage`) rather than taken for a local directory ``simplecache::s3:``."""
INSTALL_HINT = 'pip install "shardsafe[s3]"'


def scheme(path: str | os.PathLike[str]) -> str | None:
    """The URL scheme of ``path`` (``"s3"``), or ``None`` for a local path."""
    found = _URL.match(os.fspath(path))
    return found.group(1).lower() if found else None


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for an object-store URL (anything with a scheme except ``file://``)."""
    return scheme(path) not in (None, "file")


_COLLAPSED_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+:/(?!/)")
"""``s3:/bucket/run``: a URL whose ``//`` was made one ``/``, which ``pathlib.Path`` does
(``str(Path("s3://bucket/run"))``). Taken for a local path, it silently became a
directory ``s3:`` in the working directory; one-letter schemes are left alone."""

_MINIMAL_FILE_URL = re.compile(r"^file:/(?!/)", re.IGNORECASE)
"""``file:/tmp/run``: RFC 8089's form without an authority, also what ``pathlib.Path``
makes of ``file:///tmp/run``; the same path as ``file:///tmp/run`` (it was refused as a
collapsed URL)."""


def local_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a local path; refuses an object-store URL.

    A ``file://`` URL is read as RFC 8089 says: ``file:///p`` and
    ``file://localhost/p`` are ``/p``, percent-escapes are decoded (``Path.as_uri()``
    writes a space as ``%20``). Until then the host became the first directory of a
    relative path (``file://localhost/tmp/x`` saved into ``./localhost/tmp/x``) and
    ``with%20space`` a directory of that name, which a load of the path itself missed.
    """
    text = os.fspath(path)
    if _MINIMAL_FILE_URL.match(text):
        text = "file://" + text[len("file:") :]
    if scheme(text) == "file":
        return _file_url_path(text)
    if is_url(text):
        raise CheckpointError(f"{text} is a URL, not a local path")
    if _COLLAPSED_URL.match(text):
        written = text.partition(":")[0]
        raise CheckpointError(
            f"{text!r} looks like a {written}:// URL whose '//' became '/', which "
            f"pathlib.Path does to a URL (str(Path('{written}://bucket/run')) is "
            f"'{written}:/bucket/run'); pass the URL as a str (a local directory of that "
            f"name: write ./{text})"
        )
    return text


def _file_url_path(url: str) -> str:
    """The local path a ``file://`` URL names; a host other than ``localhost``, a query
    or a fragment is refused (shardsafe reads and writes this machine's files only)."""
    rest = url[len("file://") :]
    host, slash, tail = rest.partition("/")
    if host and host.lower() != "localhost":
        raise CheckpointError(
            f"{url} names a file on the host {host!r}; shardsafe reads this machine's "
            f"files only: write file:///{tail} (three slashes) or the path itself"
        )
    if "?" in rest or "#" in rest:
        raise CheckpointError(
            f"{url} has a query or a fragment ('?' or '#'), which a file:// URL of a "
            "checkpoint does not take; percent-encode them (%3F, %23) if they are part "
            "of the path, or pass the path itself"
        )
    decoded = urllib.parse.unquote(slash + tail, errors="surrogateescape") if slash else "/"
    if "\0" in decoded:
        raise CheckpointError(f"{url} decodes to a path with a NUL byte (%00)")
    return decoded


def anchored(path: str) -> str:
    """``path``, a relative local one joined to the working directory of now (not made
    canonical: ``..`` after a link stays the kernel's to resolve).

    An ``async_save`` opens its target at the call and writes from a thread later: a
    relative path resolved there followed an ``os.chdir`` made in between, and the
    checkpoint went into another tree than the call named. Ranks still agree under the
    path as written (ranks in different directories are told the path is not shared).
    """
    if is_url(path) or scheme(path) == "file" or os.path.isabs(path):
        return path
    if _COLLAPSED_URL.match(path):  # refused as it is written, when opened
        return path
    try:
        return os.path.join(os.getcwd(), path)
    except OSError:  # the working directory was deleted: as the kernel would, relative
        return path


def store_errors_of(path: str) -> contextlib.AbstractContextManager[None]:
    """:func:`~.store_failures.store_errors` for an object-store URL; nothing for a local
    path, whose usage errors (``storage_options`` given for it) are the ``ValueError``
    they are."""
    return store_errors(path) if is_url(path) else contextlib.nullcontext()


def directory_name(path: str | os.PathLike[str]) -> str:
    """The ``directory`` that :func:`open_storage` gives the storage of ``path``, known
    without opening it: what ranks name an operation on it by before any has opened it."""
    text = os.fspath(path)
    return text.rstrip("/") if is_url(text) else local_path(text)


def path_text(path: str | os.PathLike[str]) -> str:
    """``path`` as text: a ``bytes`` path failed deep inside with a ``TypeError`` about
    string patterns (every path here is matched as text: URLs, step names)."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(
            f"path {text!r} is bytes; pass a str or a pathlib.Path (os.fsdecode(path) turns "
            "bytes into one)"
        )
    return text


def check_options(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None) -> None:
    """Refuse ``storage_options`` given for a local path (a usage error, raised where it
    is made: save and load check it before meeting the other ranks)."""
    if storage_options and not is_url(path):
        raise ValueError(
            f"storage_options were given for {os.fspath(path)!r}, which is a local path; they "
            "apply to object-store URLs (s3://..., gs://...) only"
        )


def open_storage(
    path: str | os.PathLike[str],
    *,
    follow: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> Storage:
    """The storage of the checkpoint at ``path``: local directory or object-store prefix."""
    text = os.fspath(path)
    check_options(text, storage_options)
    if not is_url(text):
        return LocalStorage(local_path(text), follow=follow)
    if "::" in text.partition("://")[0]:
        raise CheckpointError(
            f"{text} is an fsspec chained URL, which shardsafe does not open (a caching "
            "layer would change what an upload or a ranged read means); pass the store's "
            "own URL (s3://..., gs://...): a load from it downloads each byte once"
        )
    try:
        from .object_storage import FsspecStorage

        return FsspecStorage(text, follow=follow, storage_options=storage_options)
    except ImportError as e:
        hint = 'pip install "shardsafe[gcs]"' if scheme(text) == "gs" else INSTALL_HINT
        raise CheckpointError(
            f"{text} is an object-store URL, which needs fsspec and the store's driver "
            f"(s3fs for s3://, gcsfs for gs://): {hint} ({e})"
        ) from None
    except ValueError as e:
        if "not known" in str(e) or "protocol" in str(e).lower():
            written = text.partition("://")[0]
            case = "" if written.islower() else f"; schemes are lowercase: {written.lower()}://"
            raise CheckpointError(
                f"{text}: fsspec does not know the scheme {written!r} ({e}){case}"
            ) from None
        raise _unmade(text, e) from e
    except CheckpointError:
        raise
    except Exception as e:  # the driver's own: gcsfs reading a broken credentials file
        raise _unmade(text, e) from e


def _unmade(url: str, error: Exception) -> CheckpointError:
    """The error of a store's client that could not be made, which the driver words as
    its own bare ``KeyError: 'refresh_token'`` (gcsfs, given a credentials file that is
    not one)."""
    return CheckpointError(
        f"{url}: the {scheme(url)}:// client could not be made from its storage_options "
        f"and environment ({type(error).__name__}: {error}); check those options and any "
        "credentials they name on this machine"
    )
