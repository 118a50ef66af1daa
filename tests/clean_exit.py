"""End a test's worker process without the interpreter's teardown.

torch's gloo groups keep C++ worker threads (and the store rank 0 hosts) alive until
static destruction at exit. Where a script leaves a group alive, as Hugging Face's
Trainer and Accelerate do, that teardown sometimes destroys a thread that still runs and
the process dies of SIGABRT ("terminate called without an active exception") after
everything it had to do: seen in CI in about 1 run in 70 of the Lightning script and once
in the Trainer script, and reported to torch (pytorch/pytorch#179291, abandoned). It is
not shardsafe's, and not what the tests check, which is what a run did.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist


def end_process(status: int = 0, *, wait_for_others: bool = True) -> NoReturn:
    """Flush and ``os._exit(status)``; first wait for every rank when the run succeeded.

    The barrier keeps a rank from leaving while another is still in a collective with it
    (that rank would then fail on the lost peer). A failed run skips it: its ranks may
    not all reach this point.
    """
    if wait_for_others and dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
