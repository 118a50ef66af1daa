"""Asynchronous save: the state is staged at the call, written and committed in the
background, with every guarantee of a blocking save.

The call (on every rank) runs the entry barrier and turns the state into save items,
then copies their bytes into reusable staging buffers (``staging.py``) and returns a
:class:`SaveHandle`. Where most of a rank's state is replicated (DDP), the call first
runs the collect phase, so that it stages only what the plan gives this rank to write
(``_plans_first``). A background thread then runs the rest of a save exactly as
``save`` does: the collect (unless already run), write and commit phases, agreed through
the process group's store (never a collective on the training's group; the consolidated
layout's transfers use a process group of their own). So an error on any rank reaches
every rank's handle (an error of a collect phase run at the call too: the call never
raises it), nothing is committed, and ``latest`` stays where it was.

One save is in flight per process: the next ``save`` or ``async_save`` waits for it
first, and raises its error if nobody has seen it yet. Raised by a later call, an error
must say which save it was: it names the save's path (and a manager's step). The thread
is not a daemon, so at interpreter exit a save in flight is finished; killed, it leaves
a directory without a manifest, never a half-visible checkpoint. An error nobody has seen
by then (the script ended without ``wait``) is written to stderr at exit
(``_report_unseen_at_exit``), not lost.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ..distributed.background_groups import background_group, lower_priority
from ..errors import CheckpointError
from .io.staging import Staged, Stager
from .options import SaveOptions
from .saving import SaveRun, begin, persist, plan

_LOCK = threading.Lock()
_IN_FLIGHT: list[SaveHandle] = []
_GROUPS: dict[int, Any] = {}
DEFAULT_STAGER = Stager()
"""The buffers ``shardsafe.async_save`` stages into (a manager has its own)."""


class SaveHandle:
    """A save running in the background. ``wait()`` for it; it is committed when it returns.

    Every rank's handle ends the same way: committed, or raising the same
    :class:`CheckpointError`, which starts with ``the background save of step <step> to
    <path> failed:`` (no step outside a manager).
    """

    def __init__(self, path: str, run: SaveRun, staged: Staged, step: int | None = None) -> None:
        self.path = path
        self.step = step
        self._run: SaveRun | None = run
        self._hurry = run.hurry
        self._staged: Staged | None = staged
        self._copies = staged
        self._finished = threading.Event()
        self._go = threading.Event()
        self._began = threading.Event()
        """Set by the writer thread as it starts (``_start``, interrupted, asks)."""
        self._error: CheckpointError | None = None
        self._seen = False
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="shardsafe-save", daemon=False)

    def done(self) -> bool:
        """True once the save has committed or failed (``wait`` says which)."""
        self._check_open()
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the save is durable and committed; return its path, or raise the
        agreed :class:`CheckpointError`. ``TimeoutError`` if it is still running after
        ``timeout`` seconds (it keeps running).

        Waiting also speeds the rest of the write up: until someone waits, a background
        save keeps its bytes out of the page cache (``O_DIRECT``), so as to take as little
        as it can from training; from the first wait on (even ``wait(timeout=0)``) it
        writes through the page cache, at the disk's full buffered speed."""
        self._check_open()
        timeout = _seconds(timeout)
        self._hurry.set()
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the save to {self.path} is still running after {timeout:g} s")
        self._seen = True
        if self._error is not None:
            raise self._error
        return self.path

    def close(self) -> None:
        """Wait for the save, then release the handle (raising its error if unseen)."""
        if self._closed:
            return
        self._hurry.set()
        self._finished.wait()
        self._closed = True
        self._settle()

    def _settle(self) -> None:
        """Wait for the save, and raise its error if nobody has seen it, leaving the handle
        open: ``CheckpointManager.close`` settles the save it started, whose handle the
        user may still hold. It closed it, and the user's ``wait()`` on a save that had
        committed raised "this SaveHandle was closed", a ``CheckpointError`` as a failed
        save raises (found in review)."""
        self._hurry.set()
        self._finished.wait()
        if self._error is not None and not self._seen:
            self._seen = True
            raise self._error

    def wait_staged(self) -> None:
        """Block until the state's copies have landed in host memory (immediate unless the
        save was started with ``overlap``): after this the caller may change the tensors."""
        self._copies.ready()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(
                f"this SaveHandle (for {self.path}) was closed; keep using it only before "
                "close(), or check the checkpoint with shardsafe.read_manifest"
            )

    def _start(self) -> None:
        """Start the writer and return at once. ``Thread.start`` waits until the new thread
        runs; if it went straight on to the (CPU-bound) save, the caller would wait for
        the GIL for a switch interval (5 ms) before its ``async_save`` could return. So
        the writer first blocks on ``_go``, giving the GIL back, and is let go after."""
        try:
            self._thread.start()
        finally:
            self._go.set()  # even if interrupted: a writer left waiting would hang exit

    def _work(self) -> None:
        self._began.set()
        self._go.wait()
        try:
            lower_priority(WRITER_NICENESS)
            run, staged = self._run, self._staged
            assert run is not None and staged is not None
            try:
                staged.ready()  # an overlapped device copy's error surfaces here
            except Exception as e:
                # Raised in the save's next phase, agreed, as a failed staging is. Raised
                # here, outside the phases, it was this rank's alone: the others waited
                # for its heartbeat to stop, then called it dead, never saying why, and
                # the run's storage and store keys were left open.
                run.error, run.items = e, {}
            persist(run)
        except BaseException as e:
            self._error = self._failed(e)
        finally:
            self._run = self._staged = None  # the staged copies belong to the next save
            self._finished.set()

    def _failed(self, error: BaseException) -> CheckpointError:
        """``error`` as this save's error, of the same class, saying which save failed:
        it may be raised by a later call (the next save, ``close``), far from this one."""
        step = "" if self.step is None else f" of step {self.step}"
        what = f"the background save{step} to {self.path} failed"
        if isinstance(error, CheckpointError):
            named = type(error)(f"{what}: {error}")
        else:
            named = CheckpointError(f"{what}: {type(error).__name__}: {error}")
        named.__cause__ = error
        return named


def _seconds(timeout: float | None) -> float | None:
    """``wait``'s timeout as ``Event.wait`` takes it: one longer than it can wait
    (``math.inf``) is no limit, where it raised 'OverflowError: timestamp out of range
    for platform time_t'; NaN is refused, where it returned at once as a timeout
    ('still running after nan s'). A negative one polls, as ``Event.wait``'s does."""
    if timeout is None:
        return None
    if timeout != timeout:
        raise ValueError(
            f"timeout={timeout!r} is not a number of seconds; pass seconds, or None to wait "
            "until the save has ended"
        )
    return None if timeout > threading.TIMEOUT_MAX else timeout


def drain() -> None:
    """Wait for the save in flight, if any; raise its error if nobody has seen it.

    A save stays in flight until it has ended: interrupted here (Ctrl-C), the next call
    waits for it again. Forgotten before it ended, the next save staged into the buffers
    it was still writing from, and it committed the next save's state under its own
    name, with checksums that matched."""
    with _LOCK:
        # Not the save this thread is running (a hook of it asking the manager for
        # ``latest``): it waited for itself, for ever.
        pending = [h for h in _IN_FLIGHT if h._thread is not threading.current_thread()]
    for handle in pending:
        handle._hurry.set()
        handle._finished.wait()
        with _LOCK:
            if handle in _IN_FLIGHT:
                _IN_FLIGHT.remove(handle)
        if handle._error is not None and not handle._seen:
            handle._seen = True
            raise handle._error


def _report_unseen_at_exit() -> None:
    """At interpreter exit, write to stderr the error of a save nobody waited for.

    The last save of a script is often an ``async_save`` that nothing waits for: its
    error would be raised by the next save, and there is none, so the run ended quietly,
    exit status 0, as if its final checkpoint existed. Non-daemon threads are joined
    before ``atexit`` handlers run, so the save has ended by now; every rank reports its
    handle's (agreed) error."""
    with _LOCK:
        pending = list(_IN_FLIGHT)
    for handle in pending:
        handle._finished.wait()
        if handle._error is not None and not handle._seen:
            handle._seen = True
            sys.stderr.write(
                f"shardsafe: {handle._error}\n(an error of a background save nobody waited "
                "for: call handle.wait(), or manager.close(), before the script ends to "
                "have it raised)\n"
            )
            sys.stderr.flush()


atexit.register(_report_unseen_at_exit)


def async_save(
    path: str,
    state: Mapping[str, Any],
    options: SaveOptions,
    stager: Stager | None = None,
    *,
    overlap: bool = False,
    step: int | None = None,
) -> SaveHandle:
    """Stage ``state`` and save it in the background (see the module docstring).

    ``overlap``: return before device-to-host copies have finished (the caller must call
    ``handle.wait_staged()`` before changing the tensors; the Trainer does, before its next
    optimizer step). ``step``: the manager's step, named in the save's error.
    """
    drain()
    run = begin(path, state, options)
    run.background = True
    try:
        staged = _stage(run, stager or DEFAULT_STAGER)
        if options.layout == "consolidated" and run.coord.world_size > 1:
            run.group = _agreed_transfer_group(run)
        if not overlap:
            staged.ready()
        handle = SaveHandle(path, run, staged, step)
    except BaseException as e:  # an interrupt at the call: no thread will ever end this run
        run.coord.abandon(e)  # the others would wait for this rank's heartbeat to stop
        run.close()
        raise
    with _LOCK:
        _IN_FLIGHT.append(handle)
    try:
        handle._start()
    except BaseException as e:
        # "can't start new thread" (RuntimeError), or an interrupt in Thread.start: before
        # the thread was made, or while start() waited for it to run. A writer that runs
        # stays in flight (the next save waits for it, as for any other); one that never
        # will is taken out, and its run ended here, told to the others.
        started = not isinstance(e, RuntimeError) and handle._began.wait(THREAD_START_S)
        if not started:
            with _LOCK:
                _IN_FLIGHT.remove(handle)
            run.coord.abandon(e)
            run.close()
        raise
    return handle


def _stage(run: SaveRun, stager: Stager) -> Staged:
    """Plan first where that saves copying (``_plans_first``), then stage what this rank
    will write. A failure is kept in the run and raised in its next phase, on every rank."""
    if _plans_first(run):
        plan(run)
    if run.error is not None or run.failed is not None:
        return Staged({}, [])
    keep = None if run.planned is None else run.planned.chunks_read(run.coord.rank)
    try:
        staged = stager.stage(run.items, keep)
    except Exception as e:
        run.error, run.items = e, {}
        return Staged({}, [])
    run.items = staged.items
    return staged


def _plans_first(run: SaveRun) -> bool:
    """Whether to plan at the call, before staging: then this rank stages only what its
    part of the plan writes, where otherwise it stages everything it holds.

    In the sharded layout each replicated tensor is written by one rank, so a DDP rank
    writes about 1/world of its state: planning first halves (two ranks) the copy the
    caller waits for and the host memory it takes. The price, paid at the call: one
    exchange through the store (a few ms), and rank 0 preparing the target directory
    (its marker and probe files) and running the manager's pre-write check. Worth it
    when replicated bytes are at least a quarter of this rank's, on a local or shared
    filesystem; FSDP2, whose replicated tensors are a few scalars, would only pay the
    exchange, and on an object store preparing takes round trips to the server. (The
    consolidated layout's rank 0 writes everything, so it stages all it holds.)

    Each rank decides from what it holds; ranks that decide differently still meet in
    the same phases (one at the call, the other on its writer thread), only the one
    that planned first waits at the call for the other's staging.
    """
    if run.error is not None or run.options.layout != "sharded" or run.coord.world_size == 1:
        return False
    if not run.storage.cheap_metadata:
        return False
    total = replicated = 0
    for _, item in run.items.values():
        for chunk in item.chunks:
            nbytes = chunk.tensor.numel() * chunk.tensor.element_size()
            total += nbytes
            replicated += nbytes if chunk.replicated else 0
    return 0 < total <= 4 * replicated


def _agreed_transfer_group(run: SaveRun) -> Any:
    """The transfer group, made (the first time) only once every rank is known to go on:
    after the collect phase, run here at the call, has succeeded on every rank. A rank
    that left at the call (its state refused, Ctrl-C in a ``state_dict``) never reaches
    ``new_group``, which waited for it until the process group's timeout (30 minutes by
    default) on every other rank. ``None`` if the phase failed: ``persist`` raises it."""
    if id(dist.group.WORLD) not in _GROUPS and run.planned is None and run.failed is None:
        plan(run)
    return None if run.failed is not None else _transfer_group()


def _transfer_group() -> Any:
    """A gloo group of every rank for the background's transfers, made once per default
    group (``new_group`` is collective: every rank calls it here, after the barrier)."""
    world = dist.group.WORLD
    key = id(world)
    if key not in _GROUPS:
        # gloo's threads of this group copy the bytes other ranks send rank 0 (the
        # consolidated layout): they yield to training like the writer thread.
        _GROUPS[key] = background_group(WRITER_NICENESS)
    return _GROUPS[key]


THREAD_START_S = 5.0
"""How long ``async_save``, interrupted in ``Thread.start``, waits for the writer thread to
run before it takes it for never made (a thread that exists runs within milliseconds)."""

WRITER_NICENESS = 19
"""The background writer's niceness: the write takes longer only while training keeps
every core busy, which is when the user wants the steps more than the write; on an idle
core it runs at full speed (``distributed/background_groups.py``)."""
