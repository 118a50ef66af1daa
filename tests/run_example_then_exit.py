"""Run an example script as ``__main__``, then leave with ``os._exit`` (see ``clean_exit``).

The examples are what users run, so they end the ordinary way. A test that launches one
(under torchrun or ``accelerate launch``) runs it through this wrapper instead, so that
torch's teardown abort at interpreter exit (pytorch/pytorch#179291, seen in CI on the
pipeline example after every step had run and printed, and on the Trainer scripts) cannot
fail a run that did all it had to. An exception
from the example still fails the process: it propagates before the exit.

Usage: ``LAUNCHER ... run_example_then_exit.py EXAMPLE.py [example args...]``; the
example sees ``sys.argv`` as if it had been launched itself.
"""

from __future__ import annotations

import atexit
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.clean_exit import end_process

if __name__ == "__main__":
    example = sys.argv[1]
    sys.argv = [example, *sys.argv[2:]]
    runpy.run_path(example, run_name="__main__")
    # What an ordinary exit would still do at the Python level, os._exit skips: the atexit
    # handlers (shardsafe's root lock is released by one). Only torch's C++ teardown,
    # which is where the abort comes from, is left out.
    atexit._run_exitfuncs()
    end_process(0)
