"""Aiming a SIGKILL inside a save, and judging how the surviving rank died: shared by the
kill tests of local (``test_kill.py``) and object-store (``test_s3_kill.py``) saves.

A target prints ``saving <step> <t>`` before and ``saved <step> <t>`` after each save,
``t`` from ``time.monotonic()`` (one clock for every process of the host)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from tests.forked_scripts import start_script

SURVIVOR_EXIT_S = 30.0
"""Heartbeats declare a rank dead after 15 s, checked every second; plus exit. About 16 s
alone; the kill tests run four two-rank trials at once on a small machine, where noticing
and exiting took up to 10 s more (seen at 25.7 s with eight trials at once and the test's
load doubled, and once at 26.6 s with eight in a full CI run). The bound is what the
test is about: far below any collective's timeout (gloo's default is 30 min), never
waiting for one."""


def seeded_moment(seed: int) -> tuple[int, float]:
    """A random moment to kill at: a save among 3..6 and a fraction (0..1.1) of a typical
    save's duration after it starts."""
    rng = random.Random(seed)
    return rng.randint(3, 6), rng.uniform(0.0, 1.1)


def kill_during_a_save(proc: KillTarget, victim_step: int, fraction: float) -> str:
    """Read ``saving``/``saved`` lines; when save ``victim_step`` (3 or later: the typical
    duration is the median of the saves before) starts, SIGKILL the process group
    ``fraction`` of a typical save's duration later. Return where it really died (under
    load the reader can lag the target): ``"in save N"`` or ``"after save N"``."""
    assert victim_step >= 3, "the kill is timed by the saves before it"
    durations: list[float] = []
    started = 0.0
    for line in iter(proc.stdout.readline, ""):
        kind, *rest = line.split()
        if kind == "saving":
            started = float(rest[1])
            if int(rest[0]) == victim_step:
                at = started + fraction * statistics.median(durations)
                time.sleep(max(0.0, at - time.monotonic()))
                os.killpg(proc.pid, signal.SIGKILL)
                last = [line, *proc.stdout.read().splitlines()][-1].split()
                return f"{'in' if last[0] == 'saving' else 'after'} save {last[1]}"
        elif kind == "saved":
            durations.append(float(rest[1]) - started)
    status = proc.wait()
    with open(proc.errors) as errors:
        said = errors.read()[-3000:]
    raise AssertionError(f"the target exited by itself (status {status}):\n{said}")


def survivor_error(dead: int, stderr: str, stdout: str) -> str:
    """What the survivor died of; fails the test if it is not a clear report."""
    last = stdout.strip().splitlines()[-1]
    named = [
        f"rank(s) {dead} stopped responding during the '",
        f"rank(s) {dead} never arrived within entry_timeout",
        f"lost the connection to rank {dead} while receiving its data",
    ]
    if dead == 0:
        named.append("usually rank 0 which hosts the store, has probably exited")
    for line in stderr.splitlines():
        if "shardsafe.errors.CheckpointError: " in line:
            assert any(n in line for n in named), f"does not name rank {dead}: {line}"
            return line.split("CheckpointError: ", 1)[1][:90]
    # No CheckpointError: only acceptable if the survivor was not inside a save, and then
    # the training step's own collective (gloo) reported the dead peer.
    assert last.startswith(("saved ", "ready")), (
        f"died inside a save without a CheckpointError:\n{stderr[-2000:]}"
    )
    assert "Connection reset by peer" in stderr or "Connection closed by peer" in stderr, stderr[
        -2000:
    ]
    return "gloo error in the training step after a finished save"


class KillTarget:
    """A kill test's target, forked from the tests' script server (``tests/forked_scripts.py``)
    instead of started as a fresh interpreter: torch, ``torch._dynamo`` (which an
    optimizer's step imports) and shardsafe are imported there once, not at about 3 s of
    CPU per target, of which the kill tests start some forty. Otherwise it is the process
    ``python script ...`` would be, in a session of its own.

    Its output goes to the file ``output``, or, when that is not given, through a FIFO
    read as a pipe is (``stdout``: a line read waits for the whole line, and the stream
    ends once the target has died): :func:`kill_during_a_save` times its kill by it.
    Its error stream goes to the file ``errors`` (default: one of its own, read by
    :meth:`communicate`). Answers as the ``subprocess.Popen`` the tests used to start:
    ``pid``, ``poll``, ``wait``, ``returncode``, ``communicate``; ``kill`` kills its
    whole session.
    """

    def __init__(
        self,
        argv: list[str],
        env: Mapping[str, str],
        *,
        output: str | None = None,
        errors: str | None = None,
    ) -> None:
        scratch = tempfile.mkdtemp(prefix="shardsafe-kill-target-")
        weakref.finalize(self, shutil.rmtree, scratch, ignore_errors=True)
        self.errors = errors or os.path.join(scratch, "stderr")
        followed = output is None
        output = output or os.path.join(scratch, "stdout")
        for path in (output, self.errors):
            if not os.path.exists(path):
                open(path, "w").close()
        if followed:
            os.unlink(output)
            os.mkfifo(output)
        self._script = start_script(argv, env, output, errors=self.errors)
        self.pid = self._script.pid
        # Opening a FIFO waits for its other end: the target opens it as it starts.
        self.stdout: Any = open(output) if followed else None  # noqa: SIM115 - closed by communicate

    @property
    def returncode(self) -> int | None:
        return self._script.returncode

    def poll(self) -> int | None:
        return self._script.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._script.wait(timeout)

    def kill(self) -> None:
        """SIGKILL its session, unless it has ended. (Dead but not yet reported by the
        server that forked it, its session is gone: nothing to kill.)"""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its whole output and error stream once it has ended (waited for at most
        ``timeout`` seconds; the FIFO is read meanwhile, so a full one never blocks it)."""
        out: list[str] = []
        reader = None
        if self.stdout is not None:
            stream = self.stdout
            reader = threading.Thread(target=lambda: out.append(stream.read()), daemon=True)
            reader.start()
        self.wait(timeout)
        if reader is not None:
            reader.join()
            self.stdout.close()
        with open(self.errors) as errors:
            return "".join(out), errors.read()
