"""``shardsafe fit``: train a ``TrainingModule``, or the built-in example, with checkpoints.

    shardsafe fit --strategy ddp --devices 2 --max-steps 60 --checkpoint-every 20 \\
        --run-dir runs/example
    shardsafe fit --strategy ddp --devices 2 --max-steps 100 --checkpoint-every 20 \\
        --run-dir runs/example --resume latest

With ``--devices N`` (N > 1) this process only launches: it runs
``python -m shardsafe fit`` with the same options as N workers, as torchrun would, and
exits with their status. Under torchrun it is one of the workers itself.

Ctrl-C stops the run and says which checkpoint is the last good one (step and path) and
that ``--resume latest`` continues from it; the status is then 130.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys

HELP = "train a TrainingModule (default: a built-in example) with crash-safe checkpoints"

STRATEGY_NAMES = ("single", "ddp", "zero", "fsdp")
"""The names in ``shardsafe.strategies.STRATEGIES``, listed here to keep ``--help`` fast."""
EXAMPLE_OPTIMIZERS = ("adamw", "zero", "oss")

_OPTIONS: tuple[tuple[str, str], ...] = (
    ("--module", "module"),
    ("--strategy", "strategy"),
    ("--devices", "devices"),
    ("--max-steps", "max_steps"),
    ("--checkpoint-every", "checkpoint_every"),
    ("--run-dir", "run_dir"),
    ("--layout", "layout"),
    ("--resume", "resume"),
    ("--seed", "seed"),
    ("--keep-last", "keep_last"),
    ("--example-optimizer", "example_optimizer"),
    ("--async-save", "async_save"),
    ("--local-checkpoint-dir", "local_checkpoint_dir"),
    ("--local-every", "local_every"),
    ("--keep-local", "keep_local"),
)
"""Every option, so a launcher can hand its workers exactly the options it was given."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--module",
        metavar="PKG.MOD:CLASS",
        help="the TrainingModule class to train, built with no arguments "
        "(default: a small MLP regressing a fixed random teacher, on synthetic data)",
    )
    parser.add_argument("--strategy", choices=STRATEGY_NAMES, default="single")
    parser.add_argument("--devices", type=int, default=1, help="processes to train on (default: 1)")
    parser.add_argument("--max-steps", type=int, required=True, help="train up to this step")
    parser.add_argument(
        "--checkpoint-every", type=int, help="save every N steps and at the end (default: never)"
    )
    parser.add_argument("--run-dir", required=True, help="holds checkpoints/ and metrics.jsonl")
    parser.add_argument("--layout", choices=("sharded", "consolidated"), default="sharded")
    parser.add_argument(
        "--resume", metavar="latest|PATH", help="continue from the newest or a given checkpoint"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds weights, data and RNGs (0 to 2**32 - devices)"
    )
    parser.add_argument("--keep-last", type=int, help="keep only the newest K checkpoints")
    parser.add_argument(
        "--async-save",
        action="store_true",
        help="write checkpoints in the background: training goes on while they are written",
    )
    parser.add_argument(
        "--local-checkpoint-dir",
        metavar="DIR",
        help="also save each rank's own state every --local-every steps to this node-local "
        "directory (e.g. /dev/shm/run1); --resume latest takes the newest step of either",
    )
    parser.add_argument(
        "--local-every",
        type=int,
        metavar="N",
        help="with --local-checkpoint-dir: save there every N steps (default: 1)",
    )
    parser.add_argument(
        "--keep-local",
        type=int,
        metavar="K",
        help="with --local-checkpoint-dir: keep the newest K steps there, and one more until "
        "every rank has written the newest (default: 2)",
    )
    parser.add_argument(
        "--example-optimizer",
        choices=EXAMPLE_OPTIMIZERS,
        default="adamw",
        help="the built-in example's optimizer: AdamW, or AdamW wrapped by the example "
        "itself in ZeroRedundancyOptimizer (zero) or fairscale OSS (oss)",
    )


def run(args: argparse.Namespace) -> int:
    from ..tiers.manager import LOCAL_DEFAULTS
    from ..trainer import Trainer
    from ..trainer.failures import say_interrupted
    from ..trainer.launcher import INTERRUPTED, current_environment, launch
    from ..trainer.resuming import find_checkpoint, interrupted_message

    try:
        module_class = _module_class(args)
        for flag, value in (("--local-every", args.local_every), ("--keep-local", args.keep_local)):
            if value is not None and args.local_checkpoint_dir is None:
                raise ValueError(
                    f"{flag} applies to the local tier: pass --local-checkpoint-dir DIR too"
                )
        trainer = Trainer(
            strategy=args.strategy,
            devices=args.devices,
            max_steps=args.max_steps,
            checkpoint_every=args.checkpoint_every,
            run_dir=args.run_dir,
            layout=args.layout,
            seed=args.seed,
            keep_last=args.keep_last,
            async_save=args.async_save,
            local_checkpoint_dir=args.local_checkpoint_dir,
            local_every=LOCAL_DEFAULTS["local_every"]
            if args.local_every is None
            else args.local_every,
            keep_local=LOCAL_DEFAULTS["keep_local"] if args.keep_local is None else args.keep_local,
        )
        env = current_environment(args.devices)
    except ValueError as e:
        print(f"shardsafe fit: error: {e}", file=sys.stderr)
        return 2
    if env is None:
        find_checkpoint(trainer.config, args.resume)  # refuse a bad --resume before launching
        command = [sys.executable, "-m", "shardsafe", "fit", *worker_arguments(args)]
        status = launch(command, args.devices)
        if status == INTERRUPTED:  # the workers are gone: what they left is final
            say_interrupted(lambda: interrupted_message(trainer.config))
        return status

    import torch

    torch.manual_seed(args.seed)  # the same initial weights in every process and every run
    if module_class is None:
        from ..trainer.example import ExampleModule

        module = ExampleModule(seed=args.seed, optimizer=args.example_optimizer)
    else:
        module = module_class()
    try:
        trainer.fit(module, resume=args.resume)
    except KeyboardInterrupt:
        return INTERRUPTED  # rank 0 has said where the run stands (Trainer.fit)
    return 0


def worker_arguments(args: argparse.Namespace) -> list[str]:
    """The command-line options that reproduce ``args``.

    Each value is joined to its flag (``--run-dir=-r``): apart, a value starting with
    ``-`` (which the user wrote as ``--run-dir=-r``) was taken by every worker for an
    option, and the run failed with 'argument --run-dir: expected one argument'."""
    argv: list[str] = []
    for flag, dest in _OPTIONS:
        value = getattr(args, dest)
        if value is True:
            argv.append(flag)  # a switch
        elif value is not None and value is not False:
            argv.append(f"{flag}={value}")
    return argv


def _check_example_optimizer(args: argparse.Namespace) -> None:
    """A user-wrapped ZeRO/OSS optimizer is the plain-DDP case; say so before any launch.

    Under ``single`` there is no process group to shard over, and ``fsdp`` gives ZeRO/OSS
    DTensor parameters they cannot partition: each would fail later with torch's
    traceback. (``zero`` leaves an optimizer that is already sharded as it is.)
    """
    choice = args.example_optimizer
    if choice == "adamw":
        return
    if args.module is not None:
        raise ValueError("--example-optimizer applies only to the built-in example, not --module")
    if args.strategy not in ("ddp", "zero"):
        raise ValueError(
            f"--example-optimizer {choice} makes the example wrap its own optimizer, the "
            f"user-wrapped case, which runs under --strategy ddp (not {args.strategy})"
        )
    if choice == "oss" and importlib.util.find_spec("fairscale") is None:
        raise ValueError("--example-optimizer oss needs fairscale: pip install fairscale==0.4.13")


def _module_class(args: argparse.Namespace) -> type | None:
    """The ``--module`` class (imported, not built), or ``None`` for the built-in example."""
    _check_example_optimizer(args)
    if args.module is None:
        return None
    path, _, name = args.module.partition(":")
    if not path or not name or path.startswith("."):  # relative: import_module's TypeError
        raise ValueError(f"--module {args.module!r} must look like package.module:ClassName")
    from ..trainer import TrainingModule

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does, for the console script too
    try:
        imported = importlib.import_module(path)
    except ModuleNotFoundError as e:
        if e.name is None or not (path == e.name or path.startswith(f"{e.name}.")):
            raise  # the module imports something missing: its own error, as it is
        raise ValueError(
            f"--module {args.module!r}: no module named {e.name!r} (run from the directory "
            "that holds it, or install it)"
        ) from None
    found = getattr(imported, name, None)
    if not (isinstance(found, type) and issubclass(found, TrainingModule)):
        raise ValueError(f"--module {args.module!r} does not name a TrainingModule subclass")
    try:  # built with no arguments: one that needs some was a traceback (found in review)
        inspect.signature(found).bind()
    except TypeError as e:
        raise ValueError(
            f"--module {args.module!r} is built with no arguments, but {name}() needs some "
            f"({e}): give its parameters defaults, or write a subclass that sets them"
        ) from None
    except ValueError:
        pass  # no signature to read: built as it is
    if found.train_dataloader is TrainingModule.train_dataloader:
        # The command line passes fit() no data: each worker raised "no training data:
        # ... pass a DataLoader ... to fit()", a traceback, after the launch (found in review).
        raise ValueError(
            f"--module {args.module!r} has no train_dataloader(): shardsafe fit passes no "
            "data to fit(), so the module must return its DataLoader from train_dataloader()"
        )
    return found
