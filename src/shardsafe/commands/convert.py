"""``shardsafe convert SRC DST``: move a checkpoint between shardsafe, DCP, Hugging Face
and ``torch.save``, one tensor at a time (see :mod:`shardsafe.converters`).

The source format is detected. The destination must not exist yet (or be an empty
directory): nothing is ever overwritten, so there is no ``--force``. ``--dry-run``
prints the files that would be written and their sizes, and writes nothing.
"""

from __future__ import annotations

import argparse
import sys
import warnings

HELP = (
    "convert a checkpoint between shardsafe, DCP, Hugging Face safetensors and torch.save "
    "(streaming, verified)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src",
        metavar="SRC",
        help="a shardsafe or DCP checkpoint directory, a Hugging Face .safetensors file, "
        "index or directory, or a torch.save/Lightning .ckpt file (local path or URL)",
    )
    parser.add_argument(
        "dst",
        metavar="DST",
        help="a new directory (for --to torch: a new file); local path or URL",
    )
    parser.add_argument(
        "--to",
        choices=("shardsafe", "dcp", "hf", "torch"),
        default="shardsafe",
        help="the format to write (default: shardsafe)",
    )
    parser.add_argument(
        "--only",
        metavar="NAME",
        action="append",
        help="convert only this state entry (e.g. model); repeat for several",
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="cast the model's floating-point weights (module entries) to this dtype",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        type=_shard_size,
        metavar="SIZE",
        help="--to hf: largest shard file, decimal units as huggingface_hub (default 5GB)",
    )
    parser.add_argument(
        "--strip-prefix", metavar="P", help="--to hf: remove P from the front of weight names"
    )
    parser.add_argument("--add-prefix", metavar="P", help="--to hf: put P in front of weight names")
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="--to hf: the model's config.json (or a folder holding it, with "
        "generation_config.json if there), written beside the weights for from_pretrained",
    )
    parser.add_argument(
        "--generation-config", metavar="PATH", help="--to hf: a generation_config.json to write"
    )
    parser.add_argument(
        "--dcp-layout",
        choices=("nested", "flat"),
        default="nested",
        help="--to dcp: nested (model.<fqn>, optimizer.state.<fqn>.<name>; default) or "
        "flat (torchtitan's: weights at the top level, optimizer state flattened)",
    )
    parser.add_argument(
        "--untrusted-bytes-limit",
        type=_byte_count,
        default=None,
        metavar="SIZE",
        help="most bytes the source may make the conversion allocate beyond what it holds, "
        "for expanded views and DCP chunks larger than their bytes in the file (bytes, or "
        "e.g. 8GiB; default 1GiB); raise it only for a file you trust",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would be written; write nothing"
    )


def _shard_size(text: str) -> str:
    """``--max-shard-size``: refused while parsing, as a usage error (exit status 2),
    before anything is read; passed on as given (``convert`` reads it the same way)."""
    from ..converters.hf import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _byte_count(text: str) -> int:
    """``--untrusted-bytes-limit``: a number of bytes (0 allowed) or a size (``8GiB``)."""
    from ..converters.hf import parse_size

    if text.strip().isdigit():
        return int(text)
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of bytes or a size such as 512MiB or 8GiB"
        ) from None


def run(args: argparse.Namespace) -> int:
    from .._text import terminal_safe
    from ..checkpoint.options import DEFAULT_UNTRUSTED_BYTES
    from ..converters import convert, describe
    from ..converters.torch_file import PICKLE_WARNING

    limit = args.untrusted_bytes_limit  # None: convert's default, as load's
    try:
        # Every other warning is said, one line each: all were silenced with the pickle
        # note's, and a conversion to DCP that turns an optimizer's numbered state into
        # text keys (its momentum lost at the next load_state_dict) said nothing.
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            result = convert(
                args.src,
                args.dst,
                to=args.to,
                only=args.only,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                strip_prefix=args.strip_prefix,
                add_prefix=args.add_prefix,
                dry_run=args.dry_run,
                dcp_layout=args.dcp_layout,
                config=args.config,
                generation_config=args.generation_config,
                untrusted_bytes_limit=DEFAULT_UNTRUSTED_BYTES if limit is None else limit,
            )
    except ValueError as e:  # a bad option value (a config file, a prefix): a usage error,
        # exit status 2 as argparse's own and ``fit``'s (it was 1, a failure's)
        print(f"shardsafe convert: error: {terminal_safe(str(e))}", file=sys.stderr)
        return 2
    for text in _our_warnings(said):
        if PICKLE_WARNING not in text:  # the pickle note is printed with the result
            text = text.removeprefix("shardsafe: ")
            print(f"shardsafe convert: warning: {terminal_safe(text)}", file=sys.stderr)
    for line in describe(result).splitlines():
        print(terminal_safe(line))
    return 0


def _our_warnings(said: list[warnings.WarningMessage]) -> list[str]:
    """The texts of the warnings shardsafe itself gave (the libraries' own, torch's
    deprecations among them, stay out of a command's output)."""
    from .. import _warnings

    return [str(w.message) for w in said if _warnings.is_ours(w)]
