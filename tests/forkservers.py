"""Processes forked from a server that has imported the heavy modules once, for the tests.

A fresh interpreter spends seconds of CPU importing torch (about 2 s here), and more for
``torch._dynamo`` and Lightning (about 5 s); the tests start hundreds of processes. A
server of multiprocessing's ``forkserver`` kind imports them once and forks each process
from itself. Each user of this module (``tests/harness.py``'s ranks,
``tests/forked_scripts.py``'s scripts) has a server of its own, with its own modules,
not multiprocessing's shared one: ``tests/isolated.py`` forks its cases from the shared
one and reports every module a case imports, which it could not see for a module its
server had preloaded (a hostile pickle must not import ``torch._dynamo``, for one).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import threading
from typing import Any

CONTEXT = mp.get_context("forkserver")
_LAUNCHING = threading.Lock()
"""multiprocessing asks one module-level server for every process; a launch swaps in its
own server for its duration, one launch at a time (whichever server it asks)."""


def server(preload: list[str]) -> multiprocessing.forkserver.ForkServer:
    """A server that imports ``preload`` before it forks (a module that is not installed
    is skipped), started on first use."""
    made = multiprocessing.forkserver.ForkServer()
    made.set_forkserver_preload(preload)
    return made


class _Popen(multiprocessing.popen_forkserver.Popen):
    """multiprocessing's forkserver start, asking ``served`` for the process."""

    def __init__(self, process_obj: Any, served: multiprocessing.forkserver.ForkServer) -> None:
        self._served = served
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:
        module = multiprocessing.popen_forkserver.forkserver
        with _LAUNCHING:
            shared = module.connect_to_new_process
            module.connect_to_new_process = self._served.connect_to_new_process
            try:
                super()._launch(process_obj)
            finally:
                module.connect_to_new_process = shared


class ServedProcess(CONTEXT.Process):  # type: ignore[misc, name-defined]
    """A ``multiprocessing.Process`` forked from the class's ``served`` server. Subclass it
    at module level, setting ``served``: the process object is pickled to the server,
    its class by name."""

    served: multiprocessing.forkserver.ForkServer

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _Popen(process_obj, type(process_obj).served)
