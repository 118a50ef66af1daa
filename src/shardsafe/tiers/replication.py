"""The background half of a local save: write the rank checkpoint, then replicate it.

Two threads per manager, each working through its jobs in order:

* the writer turns a staged snapshot into ``step-<step>/rank-<rank>`` in the node's
  directory (a rank checkpoint, committed manifest-last), then hands the step on;
* the replicator sends this rank's committed checkpoint of the step to its ``targets``
  (ranks on other nodes) and receives its ``sources``' checkpoints of the same step, all
  transfers at once, one thread each (so no order of blocking sends and receives can
  deadlock), over the tiers' own gloo group; then it applies retention.

Every rank replicates every local step, in order, so the pairs of sends and receives
always match; a rank whose write failed still takes part, sending "none". A failed
transfer (a peer gone) is recorded and replication stops with a warning: training goes
on, and recovery uses what was replicated before.

Retention, after each step's replication: this rank's own checkpoints but the
``keep_local`` newest up to that step are deleted (a later step the writer is done with
is not replicated yet, and never pushes a replicated one out), and so are the replicas
it keeps but the ``keep_local`` newest from each source; the newest step that *every*
rank has replicated (counted in the job's store, :class:`Tally`) is always kept, on its
owner and on its replica's node, so an old step goes only once a newer one is safe on
other nodes, and a replication that fails for good still leaves at most
``keep_local + 1`` steps. While no step is replicated everywhere yet, the newest step
every rank has *written* is kept in its place (a whole job restarted on the same nodes
restores it). After a restore (:meth:`Replicator.resumed_from`) the restored
step counts as replicated everywhere until a newer one is counted, and the older steps
found on disk count among the ``keep_local``.

The threads never let an error of a cleanup, or a warning, break off their work: a user's
filter that makes warnings errors (``-W error``) raised them in the thread, between two
messages of a transfer (the peer then waited for the rest until the timeout) or in the
handling of one (the rank stopped replicating for good). A warning so raised is recorded
for ``wait`` to raise (:meth:`Replicator._warn`); a cleanup's error (a directory left in
place because it holds a file of the user's, whose warning was raised) is passed over,
as a cleanup's ``OSError`` always was.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .. import _warnings
from ..checkpoint.plan.collecting import Collected
from ..checkpoint.storage.local import LocalStorage
from ..checkpoint.streaming import Uncommitted
from ..errors import CheckpointError
from . import node_share, rank_checkpoint, transfer
from .node_dir import NodeDir
from .node_share import Linked, NodeShare, Split
from .ranks import background_priority, steps_differ
from .retention import Tally, drop_older, retained

KEPT_ERRORS = 16
"""Errors a replicator keeps for ``wait`` (:meth:`Replicator._record`)."""

KEPT_WARNINGS = 256
"""Warnings a replicator counts (:meth:`Replicator._warn`): one made after that many
others is repeated at every step."""

_STEP = re.compile(r"step[ -]\d+")
"""A step number in a warning, as said or in a directory name."""

FORGOTTEN_COUNTS = 64
"""Counts of forgotten saves a rank leaves in the store while no newer step is counted
everywhere (:meth:`Replicator._drop_counts`)."""


@dataclass
class Peers:
    """Who this rank sends its replicas to, and whose it keeps."""

    targets: list[int]
    sources: list[int]


@dataclass
class Record:
    """What happened to each local step on this rank that is still here (for retention
    and for tests): retention forgets the steps it deletes (``Replicator._prune``)."""

    written: list[int] = field(default_factory=list)
    replicated: list[int] = field(default_factory=list)
    """Steps every target has committed (all written steps, without targets)."""
    received: dict[int, list[int]] = field(default_factory=dict)
    """Per source rank: the steps of its replicas committed here."""
    everywhere: int | None = None
    """The newest step every rank has replicated, once the store has counted it (or the
    step this run restored, until a newer one is counted)."""
    found: dict[int, list[int]] = field(default_factory=dict)
    """Per rank (this one and its sources): its committed checkpoints found here at the
    restore, of the restored step and older ones (retention counts them as written)."""
    errors: list[BaseException] = field(default_factory=list)

    def forget(self, step: int) -> None:
        """``step`` is saved again: its earlier copies are about to be replaced, so what
        happened to them no longer counts (a step is never written, replicated or
        received twice in the record)."""
        for steps in (self.written, self.replicated, *self.received.values()):
            while step in steps:
                steps.remove(step)


class Replicator:
    """The two threads of one manager (see the module docstring)."""

    def __init__(
        self,
        node: NodeDir,
        rank: int,
        world_size: int,
        peers: Peers,
        group: Any,
        keep_local: int,
        tally: Tally | None = None,
        share: NodeShare | None = None,
        run: str = "",
        root: str = "",
    ) -> None:
        self.node, self.rank, self.world_size = node, rank, world_size
        self.run = run
        """The token every rank's local checkpoints record (``rank_checkpoint.run_of``)."""
        self.root = root
        """The persistent tier they record (``rank_checkpoint.root_of``)."""
        self.share = share
        """How this rank shares its node's data-parallel tensors (``node_share.py``)."""
        self.peers, self.group, self.keep_local = peers, group, keep_local
        self.tally = tally
        self.record = Record()
        self._writer = ThreadPoolExecutor(
            1, thread_name_prefix="shardsafe-local-write", initializer=background_priority
        )
        self._sender = ThreadPoolExecutor(
            1, thread_name_prefix="shardsafe-replicate", initializer=background_priority
        )
        self._write: Future[None] | None = None
        self._replications: list[Future[None]] = []
        self._broken = False
        self._saves = 0
        """Local saves submitted so far: every rank submits every local save, in order, so
        the ``n``-th is the same save on every rank (the tally counts each apart)."""
        self._save_of: dict[int, int] = {}
        """Per step: the number of its latest save (a step saved again gets a new one)."""
        self._complete: set[tuple[int, int]] = set()
        """(step, save) of this rank's steps that retention found counted everywhere as it
        was about to delete them (``_unless_complete``)."""
        self._identities: dict[int, dict[str, tuple[int, int]]] = {}
        """Per step this rank wrote: the identity (device, inode) of each data file of its
        checkpoint, as it wrote or linked them (``transfer.receive``'s ``trusted``)."""
        self._restored: int | None = None
        """The step this run restored (:meth:`resumed_from`), complete everywhere then."""
        self._forgotten: list[tuple[int, int]] = []
        """``(step, save)`` of the saves this rank no longer asks the tally about, whose
        counts are deleted from the store once safe (:meth:`_drop_counts`)."""
        self._warned: dict[str, int] = {}
        """Per warning, its step numbers masked: how many times it was made
        (:meth:`_warn` repeats it at the 10th, 100th, ... time only)."""
        self._warned_lock = threading.Lock()
        """The writer's and the sender's threads both warn: each count is read and
        bumped under it, so that two threads never both say the same repeat, nor skip
        one."""

    def submit(self, step: int, items: Collected | None) -> Future[None]:
        """Write ``items`` (a staged snapshot) as this rank's checkpoint of ``step``, then
        replicate it. Waits first for the previous write (whose staging buffers these
        are) and for all but the last replication (so that they cannot pile up).
        ``None``: this rank has nothing for the step (its snapshot failed), but takes part
        in the step's transfers, saying so, so that every pair stays in step."""
        self.wait_written()
        if step in self._save_of:  # saved again: its earlier copies are sent, then replaced
            self._saved_again(step)
        while len(self._replications) > 1:
            self._replications.pop(0).result()
        self._saves += 1
        self._save_of[step] = save = self._saves
        split = self.share.split if self.share is not None else None
        self._write = self._writer.submit(self._write_step, step, save, items, split)
        self._replications.append(
            self._sender.submit(self._replicate_after, step, save, self._write)
        )
        return self._write

    def _saved_again(self, step: int) -> None:
        """``step`` is saved again: once its earlier copies are sent, what happened to them
        no longer counts. If it was the step counted everywhere, the newest older step
        counted (or restored) takes its place: its new copies are not on other nodes yet,
        and before, retention kept only them, deleting the older step that was (with
        ``keep_local=1``, a node lost while the step replicated again left no complete
        step in any node's memory)."""
        self.drain()
        self.record.forget(step)
        earlier = self._save_of.get(step)  # forgotten by its retention if its write failed
        if earlier is not None:
            self._forgotten.append((step, earlier))
        if self.record.everywhere == step:
            self.record.everywhere = self._everywhere_before(step)

    def _everywhere_before(self, step: int) -> int | None:
        """The newest step older than ``step`` that every rank replicated (as the store
        counts them; without a store, as this rank did), or the restored step if older."""
        restored = [self._restored] if self._restored is not None and self._restored < step else []
        if self.tally is None:
            counted = [s for s in self.record.replicated if s < step]
        else:
            found = self._newest_counted(self.tally.everywhere, lambda s: s < step)
            counted = [] if found is None else [found]
        return max(counted + restored, default=None)

    def wait_written(self) -> None:
        """Wait until the last snapshot is on the node's disk (its error is recorded)."""
        if self._write is not None:
            self._write.result()

    def drain(self) -> None:
        """Wait for every write and replication submitted so far."""
        self.wait_written()
        while self._replications:
            self._replications.pop(0).result()

    def close(self) -> None:
        self.drain()
        self._writer.shutdown()
        self._sender.shutdown()

    # -- the threads

    def _write_step(
        self, step: int, save: int, items: Collected | None, split: Split | None
    ) -> None:
        share = self.share if self.share is not None and self.share.active else None
        if items is None:  # no snapshot: an earlier save's copy of this step is not this one's
            self._drop_earlier(step)  # (restored beside the others' copies of this save)
            if share is None:
                return
        storage: LocalStorage | None = None
        written: Uncommitted | None = None
        own: dict[str, tuple[int, int]] = {}
        self._identities.pop(step, None)
        shared = node_share.candidates(items) if items is not None else None
        try:
            if items is not None:
                self._forget_found(step, self.rank)
                # an earlier attempt at this step goes first
                storage = self.node.fresh_rank_storage(step, self.rank)
                written = rank_checkpoint.write_uncommitted(
                    storage,
                    items,
                    rank=self.rank,
                    world_size=self.world_size,
                    step=step,
                    shared=split.part_of if split is not None else None,
                    parts=split.parts if split is not None else 1,
                    own_part=share.position if share is not None else 0,
                    run=save_token(self.run, save),
                    root=self.root,
                )
                own = _identities(storage, written.written)
        except Exception as e:  # recorded; replication sends "none" for this step
            self.failed(step, e)
            if written is not None:  # written, then not found as written: never committed,
                written.abandon()  # and the node's other ranks hear so in the exchange
                written = None
        finally:
            if items is not None:
                items.clear()
        try:
            theirs = Linked({}, {})
            if share is not None:  # even without a write: the node's ranks wait for it
                theirs = share.settle(self.group, step, shared, written, storage)
            if written is not None:
                written.commit(theirs.records)
                self._identities[step] = {**own, **theirs.identities}
                self.record.written.append(step)
                if self.tally is not None:
                    with contextlib.suppress(Exception):  # the store gone: retention keeps less
                        self.tally.mark_written(step, save)
        except Exception as e:
            if written is not None:
                written.abandon()
                self.failed(step, e)
            elif share is not None and share.broken:
                self._record(e)
                self._warn(str(e))
        finally:
            if storage is not None:
                storage.close()
                if step not in self.record.written:  # abandon() keeps the directory made
                    self._clear(step)  # for it: its files would wait for retention

    def _drop_earlier(self, step: int) -> None:
        """Remove this rank's checkpoint of ``step`` from an earlier save of the step."""
        with contextlib.suppress(Exception):  # any: see the module docstring
            self._forget_found(step, self.rank)
            self.node.remove(step, self.rank)

    def _clear(self, step: int) -> None:
        """Remove this rank's failed write of ``step`` (a part its node-mates may have
        linked stays theirs), as retention would only once a newer step is kept."""
        with contextlib.suppress(Exception):  # any: see the module docstring
            if not self.node.committed(step, self.rank):
                self.node.remove(step, self.rank, prune=True)

    def failed(self, step: int, error: Exception) -> None:
        """Record (for ``wait``) and warn that this rank has no local checkpoint of
        ``step``: its write failed, or its snapshot did. Raised by ``wait`` naming the
        step and the rank (the error alone, an ``OSError`` of a full disk, named neither)."""
        said = f"rank {self.rank} could not write its local checkpoint of step {step}: {error}"
        failure = CheckpointError(said)
        if isinstance(error, CheckpointError):  # of its kind (a link refused: corrupt)
            with contextlib.suppress(TypeError):
                failure = type(error)(said)
        failure.__cause__ = error
        self._record(failure)
        self._warn(str(failure))

    def _warn(self, message: str) -> None:
        """Warn ``shardsafe: message`` from a background thread; the same at another step
        again only at its 10th, 100th, ... time (a node's full disk made two warnings per
        step, one line a second for a whole run, each new by its step). A warning the user's
        filter turns into an error (``-W error``, pytest's ``filterwarnings = error``) is
        recorded for ``wait`` to raise instead: raised here, it broke off the thread's
        work between two messages of a transfer (the peer waiting for the rest until the
        timeout), or stopped this rank replicating for good."""
        kind = _STEP.sub("step N", message)
        with self._warned_lock:
            times = self._warned.get(kind, 0) + 1
            if len(self._warned) < KEPT_WARNINGS or kind in self._warned:
                self._warned[kind] = times
        if times > 1 and not _power_of_ten(times):
            return
        if times > 1:
            message += f" (the same at {times} steps so far; said again at {10 * times})"
        try:
            _warnings.warn(f"shardsafe: {message}")
        except Warning as raised:
            self._record(raised)

    def _record(self, error: BaseException) -> None:
        """Keep ``error`` for ``wait``, which raises the first: the later ones were warned
        about when they happened (or counted, as repeats: :meth:`_warn`). At most
        :data:`KEPT_ERRORS` are kept: a local disk full for a whole run kept one (with its
        traceback's frames) per step saved, about 4 KiB each, until a ``wait`` that the
        Trainer makes only at the end of the run."""
        if len(self.record.errors) < KEPT_ERRORS:
            self.record.errors.append(error)

    def _replicate_after(self, step: int, save: int, write: Future[None]) -> None:
        write.result()
        replicated = False
        if not self._broken and (self.peers.targets or self.peers.sources):
            replicated = self._replicate(step)
        elif not self.peers.targets and step in self.record.written:
            self.record.replicated.append(step)
            replicated = True
        if self.tally is not None and replicated:  # this save's copies, not an earlier one's
            with contextlib.suppress(Exception):  # the store gone: retention keeps more
                self.tally.mark(step, save)
        self._retain(step)

    def _replicate(self, step: int) -> bool:
        """Send this rank's checkpoint of ``step`` and receive its sources'; whether every
        target committed this rank's."""
        own = step in self.record.written
        jobs: list[tuple[str, int, Future[bool]]] = []
        transfers = len(self.peers.targets) + len(self.peers.sources)
        with ThreadPoolExecutor(transfers, initializer=background_priority) as pool:
            for target in self.peers.targets:
                jobs.append(("send", target, pool.submit(self._send, step, target, own)))
            for source in self.peers.sources:
                jobs.append(("receive", source, pool.submit(self._receive, step, source)))
        sent = True
        differ: CheckpointError | None = None
        for kind, peer, job in jobs:
            try:
                ok = job.result()
            except transfer.StepsDiffer as e:  # a caller's error: both ends raise it
                if not differ:  # once, though every transfer of the step finds it
                    differ = self._steps_differ(e, peer)
                    self._record(differ)
                    self._warn(str(differ))
                self._broken = True
                ok = False
            except Exception as e:  # a peer gone: stop replicating, keep training
                self._broken = True
                # Raised by wait() as it is: not "a local checkpoint failed" (they are whole).
                stopped = CheckpointError(
                    f"rank {self.rank} stopped replicating its local checkpoints: the "
                    f"{kind} of step {step} with rank {peer} failed: {type(e).__name__}: "
                    f"{e}. Its local checkpoints are whole; from that step on they are not "
                    "copied to other nodes"
                )
                self._record(stopped)
                self._warn(str(stopped))
                ok = False
            if kind == "send":
                sent = sent and ok
            elif ok:
                self.record.received.setdefault(peer, []).append(step)
        if own and sent:
            self.record.replicated.append(step)
        return own and sent

    def _steps_differ(self, e: transfer.StepsDiffer, peer: int) -> CheckpointError:
        """The error both ends of a transfer record when their ranks saved different
        steps at the same local save (``transfer.StepsDiffer``)."""
        return steps_differ(
            e.ours,
            self.rank,
            e.theirs,
            peer,
            then=f"Neither step is complete, and from here on rank {self.rank} does not "
            "replicate its local checkpoints",
        )

    def _send(self, step: int, target: int, own: bool) -> bool:
        if not own:
            return transfer.send(self.group, target, None, step)

        def unopened(e: Exception) -> None:  # the target was told: the transfers go on
            unsent = CheckpointError(
                f"rank {self.rank} could not open its local checkpoint of step {step} to "
                f"send it to rank {target}, which has no replica of it: {e}"
            )
            self._record(unsent)
            self._warn(str(unsent))

        return transfer.send_from(
            self.group,
            target,
            lambda: self.node.rank_storage(step, self.rank, create=False),
            step,
            unopened,
        )

    def _receive(self, step: int, source: int) -> bool:
        self._forget_found(step, source)
        own = step in self.record.written  # committed here: its identical files are linked
        # An interrupted receipt, or an earlier save's copy of the step (never to be
        # restored beside the source's new one, even if the source now sends none).
        # A removal that fails is tried again inside the protocol, where its error (of any
        # kind: a warning made an error by the user's filter too) refuses the copy at
        # once: raised here, it left the sender waiting for this rank until the timeout.
        with contextlib.suppress(Exception):
            self.node.remove(step, source)

        def target() -> LocalStorage:
            return self.node.fresh_rank_storage(step, source)

        why = transfer.receive(
            self.group,
            source,
            rank=source,
            step=step,
            target=target,
            held=(lambda: self.node.rank_storage(step, self.rank, create=False)) if own else None,
            trusted=self._identities.get(step, {}) if own else {},
        )
        if why is not None and why != transfer.NOT_SENT:  # the sender said why it sent none
            self._warn(
                f"rank {self.rank} does not keep rank {source}'s replica of step {step}: it {why}"
            )
        if why is not None:
            # Nothing of a copy not kept is left behind, as a restore's fetch leaves none:
            # the files that did arrive took the room (a full disk) that the next saves
            # need, and retention never deleted them while no copy from the source was
            # kept (one rank directory per step, for the whole run).
            with contextlib.suppress(Exception):  # any: see the module docstring
                self.node.clear_partial(step, source, prune=True)
        return why is None

    def _retain(self, step: int) -> None:
        """Retention after replicating ``step``: its keep window holds steps up to
        ``step`` only (the writer may be done with later ones, not yet replicated)."""
        try:
            everywhere = self._replicated_everywhere()
            if everywhere is None:  # nothing replicated everywhere yet: keep what is whole
                everywhere = self._written_everywhere(upto=step)
            for owner in sorted({self.rank, *self.record.received, *self.record.found}):
                done = (
                    self.record.written
                    if owner == self.rank
                    else self.record.received.get(owner, [])
                )
                steps = {*done, *self.record.found.get(owner, [])}
                kept = retained(steps, self.keep_local, everywhere, upto=step)
                if kept is not None:
                    ask = self._unless_complete(everywhere) if owner == self.rank else None
                    drop_older(self.node, owner, kept, ask)
                    self._prune(owner, kept)
        except Exception as e:  # any: see the module docstring
            self._warn(f"local retention failed: {e}")
        finally:
            self._forget_saves(upto=step)

    def _unless_complete(self, everywhere: int | None) -> Callable[[int], bool] | None:
        """What ``drop_older`` asks before deleting one of this rank's steps: whether it
        may, for a step newer than ``everywhere`` (the newest step counted everywhere, as
        this rank read it) that another rank may by now have seen counted everywhere. Its
        counts are taken back first (:meth:`Tally.withdraw`); a step that had just become
        complete is kept, and remembered as complete, so that later retentions keep it
        without taking its counts back and putting them back again (two to four store
        requests each, until this rank's count caught up). Only the first step deleted
        is asked about (one step a retention)."""
        if self.tally is None:
            return None
        tally, floor, asking = self.tally, -1 if everywhere is None else everywhere, [True]

        def may_delete(held: int) -> bool:
            save = self._save_of.get(held)
            if not asking or held <= floor or save is None:
                asking.clear()
                return True
            if (held, save) in self._complete:
                return False
            try:
                withdrawn = tally.withdraw(held, save)
            except Exception:  # any: the store gone; keep the step, retention keeps more
                return False
            if withdrawn:
                asking.clear()
                return True
            self._complete.add((held, save))
            return False

        return may_delete

    def _prune(self, owner: int, kept: set[int]) -> None:
        """Forget ``owner``'s steps that retention deleted (older than the newest of
        ``kept``, not in it), so that the record (sorted at every step) holds about
        ``keep_local`` steps however long the run, not one per step saved. Removed one by
        one: the writer thread appends to ``written`` meanwhile."""
        newest = max(kept)
        lists = (
            [self.record.written, self.record.replicated]
            if owner == self.rank
            else [self.record.received.get(owner, [])]
        )
        for steps in (*lists, self.record.found.get(owner, [])):
            for gone in [s for s in steps if s < newest and s not in kept]:
                with contextlib.suppress(ValueError):
                    steps.remove(gone)

    def _forget_saves(self, *, upto: int) -> None:
        """Forget the save numbers of steps up to ``upto`` this rank no longer holds (the
        tally is asked about written steps only), and their files' identities."""
        for old in [s for s in list(self._identities) if s <= upto]:
            if old not in self.record.written:
                self._identities.pop(old, None)
        for old in [s for s in list(self._save_of) if s <= upto]:
            if old not in self.record.written:
                save = self._save_of.pop(old, None)
                if save is not None:
                    self._forgotten.append((old, save))
        self._complete = {(s, n) for s, n in self._complete if self._save_of.get(s) == n}
        self._drop_counts()

    def _drop_counts(self) -> None:
        """Delete the tally's counts of the saves this rank forgot, so that the job's store
        holds a few keys per rank, not one per step saved: those of steps older than the
        newest step counted everywhere (every rank counted it, so each has counted the
        older ones it ever will), and the oldest beyond :data:`FORGOTTEN_COUNTS` (while
        no newer step is counted everywhere, a replication failed for good: a rank that
        counts such a step later finds fewer ranks, and retention keeps more)."""
        if self.tally is None:
            self._forgotten.clear()
            return
        newest = self.record.everywhere if self.record.everywhere is not None else -1
        ordered = sorted(self._forgotten)
        older = [c for c in ordered if c[0] < newest]
        rest = [c for c in ordered if c[0] >= newest]
        excess = max(len(rest) - FORGOTTEN_COUNTS, 0)
        for step, save in older + rest[:excess]:
            with contextlib.suppress(Exception):  # the store gone: nothing to keep small
                self.tally.forget(step, save)
        self._forgotten[:] = rest[excess:]

    def resumed_from(self, step: int) -> None:
        """After a restore of ``step``: count it complete everywhere (every rank just
        restored it; the store counts this run's steps only), so that retention never
        deletes it before a newer step is counted; and count the committed checkpoints of
        it and older steps found here (this rank's and its sources') in the keep window,
        so that retention bounds them too. (Never seeded from the disk without a restore:
        newer steps of an abandoned run would then push this run's first steps out.)

        The restore deleted every later step (``Restorer.drop_newer``): in the middle of a
        run, what the record says of them is forgotten, and ``step`` is the newest step
        counted everywhere even if a later one was (kept, a step gone would be the one
        retention protects, and the restored step could be deleted)."""
        self.record.everywhere = self._restored = step
        for later in [s for s in list(self._save_of) if s > step]:
            self._forgotten.append((later, self._save_of.pop(later)))
        for steps in (self.record.written, self.record.replicated, *self.record.received.values()):
            for later in [s for s in steps if s > step]:
                steps.remove(later)
        self.record.found = {}
        for held in self.node.steps():
            for owner in (self.rank, *self.peers.sources):
                if held <= step and self.node.committed(held, owner):
                    self.record.found.setdefault(owner, []).append(held)

    def _forget_found(self, step: int, owner: int) -> None:
        """``owner``'s checkpoint of ``step`` found at the restore is about to be replaced:
        from now on it counts only if this run writes or receives it."""
        found = self.record.found.get(owner, [])
        if step in found:
            found.remove(step)

    def _written_everywhere(self, *, upto: int) -> int | None:
        """The newest step up to ``upto`` that every rank has written (as the job's store
        counts them), or ``None``. Kept in place of the newest step replicated everywhere
        while there is none: a rank killed before its first replication left each node
        its own copy of the step, restorable after a restart of the whole job, and
        before, with ``keep_local=1``, retention after the next step (written on the
        other ranks only) deleted it, and the restarted job found no complete step."""
        if self.tally is None:
            return None
        return self._newest_counted(self.tally.written_everywhere, lambda s: s <= upto)

    def _replicated_everywhere(self) -> int | None:
        """The newest step every rank has replicated (all its targets committed it), as
        the job's store counts them (or restored, :meth:`resumed_from`); without a store
        (one rank), this rank's newest."""
        if self.tally is None:
            steps = list(self.record.replicated)
            if self.record.everywhere is not None:  # the step resumed_from restored
                steps.append(self.record.everywhere)
            return max(steps, default=None)
        found = self._newest_counted(self.tally.everywhere, lambda s: True)
        if found is not None:
            self.record.everywhere = max(self.record.everywhere or -1, found)
        return self.record.everywhere

    def _newest_counted(
        self, counted: Callable[[int, int], bool], admitted: Callable[[int], bool]
    ) -> int | None:
        """The newest of the ``keep_local + 2`` newest steps this rank wrote that
        ``admitted`` lets through whose latest save the job's store has ``counted`` on
        every rank (``Tally.everywhere``, ``Tally.written_everywhere``), or ``None``. A
        store gone counts nothing."""
        steps = sorted((s for s in self.record.written if admitted(s)), reverse=True)
        for step in steps[: self.keep_local + 2]:
            with contextlib.suppress(Exception):
                if counted(step, self._save_of.get(step, 0)):
                    return step
        return None


def save_token(run: str, save: int) -> str:
    """The token a local checkpoint records (``rank_checkpoint.run_of``): the run's, then
    the number of the save, the same on every rank. Copies of one step are restored
    together only if of one save: a step saved again while a rank was gone (killed before
    it could replace its copy) restored the new save on some ranks and the old one on
    the others, each reporting a clean restore. Fixed width: a later save's sorts last."""
    return f"{run}{save:08x}"


def _identities(storage: LocalStorage, names: Iterable[str]) -> dict[str, tuple[int, int]]:
    """The (device, inode) of each of ``names`` in ``storage``, right after this rank
    wrote (or linked and checked) them."""
    found = {}
    for name in names:
        stat = os.stat(name, dir_fd=storage.fd, follow_symlinks=False)
        found[name] = (stat.st_dev, stat.st_ino)
    return found


def _power_of_ten(n: int) -> bool:
    while n > 1 and n % 10 == 0:
        n //= 10
    return n == 1
