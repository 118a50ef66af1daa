"""The ``shardsafe`` command line: ``shardsafe COMMAND [options]``.

Each command is a module in :mod:`shardsafe.commands` (see that package for the three
names it must expose). This file only knows their names: it imports a command's module
when that command runs, so a heavy command (``fit`` pulls in the trainer) costs nothing
to the others. A command whose module is absent is simply not offered, which lets a
command land in its own change.

Exit status: 0 success, 1 failure (a checkpoint problem, a failed verification, an
I/O error), 2 usage error. Expected failures print ``shardsafe: error: <message>`` on
stderr, never a traceback; the commands that read checkpoints (``inspect``,
``verify``) print even a bug in shardsafe as one such line, since their input may be
hostile. Everything printed from a checkpoint is escaped for the terminal.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from typing import Protocol, cast

from ._text import silence_stdout, terminal_safe
from ._version import __version__
from .checkpoint.storage.store_failures import STORE_FAILED_AT
from .errors import CheckpointError

COMMANDS: tuple[str, ...] = ("fit", "inspect", "verify", "convert")
"""Command module names, in the order ``--help`` lists them."""
READS_CHECKPOINTS = frozenset({"inspect", "verify", "convert"})
"""Commands whose input is a checkpoint (hostile input): they never show a traceback."""

_PACKAGE = "shardsafe.commands"


class Command(Protocol):
    """What a command module provides (checked structurally; modules are not classes)."""

    HELP: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def available() -> list[str]:
    """The names in :data:`COMMANDS` whose module exists, without importing any of them."""
    return [name for name in COMMANDS if importlib.util.find_spec(f"{_PACKAGE}.{name}")]


def load(name: str) -> Command:
    return cast(Command, importlib.import_module(f"{_PACKAGE}.{name}"))


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or (``only``) one whose other commands are bare names.

    With ``only`` set, only that command's module is imported; the other commands are
    still registered by name so that a typo's error message lists every choice.
    """
    parser = argparse.ArgumentParser(
        prog="shardsafe",
        description="shardsafe: correct, fast, crash-safe checkpoints for PyTorch.",
        epilog="Run 'shardsafe COMMAND --help' for a command's options. Exit status: 0 success, "
        "1 failure (the message says why), 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"shardsafe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in available():
        if only is not None and name != only:
            sub.add_parser(name)
            continue
        try:
            command = load(name)
        except ImportError as e:  # a broken optional command must not break the others
            sub.add_parser(name, help=f"(unavailable: {e})")
            continue
        cmd_parser = sub.add_parser(name, help=command.HELP, description=command.HELP)
        command.add_arguments(cmd_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (the console script exits with it)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = args_list[0] if args_list and args_list[0] in available() else None
    try:
        args = build_parser(only=chosen).parse_args(args_list)
    except SystemExit as e:  # argparse: --help, --version (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 2
    try:
        return load(args.command).run(args)
    except BrokenPipeError:  # `shardsafe inspect ... | head`: the reader left, not an error
        silence_stdout()
        return 1
    except (CheckpointError, OSError, ImportError) as e:
        cause = e.__cause__
        if (
            str(e).startswith(STORE_FAILED_AT)
            and cause is not None
            and from_object_store_client(cause)
        ):
            print(_unreachable(cause), file=sys.stderr)  # the library names it; we say how
            return 1
        # Line by line: a mismatch lists its problems one per line (escaped whole, they
        # came out as one line full of \x0a); every other character is escaped.
        text = "\n".join(terminal_safe(line) for line in str(e).split("\n"))
        print(f"shardsafe: error: {text}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shardsafe: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if from_object_store_client(e):
            print(_unreachable(e), file=sys.stderr)
            return 1
        if args.command not in READS_CHECKPOINTS:
            raise  # fit: the traceback may be the user's own code's
        print(
            f"shardsafe: error: {args.command} failed unexpectedly: {type(e).__name__}: "
            f"{terminal_safe(str(e))} (a bug in shardsafe: please report it with the "
            "checkpoint's manifest.json)",
            file=sys.stderr,
        )
        return 1


OBJECT_STORE_CLIENTS = ("botocore", "aiobotocore", "s3fs", "gcsfs", "google", "aiohttp")
"""Packages whose exceptions are the object store's answer (no credentials, access
denied, no such bucket, endpoint unreachable, a connection dropped: aiohttp is the HTTP
client under s3fs and gcsfs), not a bug in shardsafe: fsspec's clients raise them as
they are, and not all of them are ``OSError``."""


def _unreachable(error: BaseException) -> str:
    """The line for a store that refused or could not be reached, with what to check."""
    return (
        f"shardsafe: error: the object store refused or could not be reached: "
        f"{type(error).__name__}: {terminal_safe(str(error))} (check the URL, the credentials "
        "and the endpoint: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)"
    )


def from_object_store_client(error: BaseException) -> bool:
    """Whether ``error`` (or a class it derives from) comes from an object store's client."""
    return any(cls.__module__.split(".")[0] in OBJECT_STORE_CLIENTS for cls in type(error).__mro__)
