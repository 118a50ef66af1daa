"""The subcommands of the ``shardsafe`` command line, one small module each.

A command module ``shardsafe.commands.<name>`` exposes exactly three things, which
:mod:`shardsafe.cli` looks up by name::

    HELP: str                                   one line for ``shardsafe --help``
    def add_arguments(parser) -> None           its options, on an argparse parser
    def run(args) -> int                        do the work, return the exit status

Why so rigid: ``cli`` imports only the module of the command being run, so a command
that pulls in heavy dependencies (the trainer, a model) never slows down the others.
Keep the module's top level import-light and import heavy things inside ``run``.
``run`` may raise :class:`shardsafe.CheckpointError` or ``OSError``; ``cli`` turns them
into a one-line message and exit status 1, never a traceback.
"""
