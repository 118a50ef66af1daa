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

Retention, after each step: this rank's own checkpoints but the ``keep_local`` newest
are deleted, and so are the replicas it keeps but the ``keep_local`` newest from each
source; the newest step that *every* rank has replicated (counted in the job's store,
:class:`Tally`) is always kept, on its owner and on its replica's node, so an old step
goes only once a newer one is safe on other nodes, and a replication that fails for
good still leaves at most ``keep_local + 1`` steps.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.plan.collecting import Collected
from ..errors import CheckpointError
from . import rank_checkpoint, transfer
from .node_dir import NodeDir


@dataclass
class Peers:
    """Who this rank sends its replicas to, and whose it keeps."""

    targets: list[int]
    sources: list[int]


@dataclass
class Record:
    """What happened to each local step on this rank (for retention and for tests)."""

    written: list[int] = field(default_factory=list)
    replicated: list[int] = field(default_factory=list)
    """Steps every target has committed (all written steps, without targets)."""
    received: dict[int, list[int]] = field(default_factory=dict)
    """Per source rank: the steps of its replicas committed here."""
    everywhere: int | None = None
    """The newest step every rank has replicated, once the store has counted it."""
    errors: list[BaseException] = field(default_factory=list)


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
    ) -> None:
        self.node, self.rank, self.world_size = node, rank, world_size
        self.peers, self.group, self.keep_local = peers, group, keep_local
        self.tally = tally
        self.record = Record()
        self._writer = ThreadPoolExecutor(
            1, thread_name_prefix="shardsafe-local-write", initializer=_yield_to_training
        )
        self._sender = ThreadPoolExecutor(
            1, thread_name_prefix="shardsafe-replicate", initializer=_yield_to_training
        )
        self._write: Future[None] | None = None
        self._replications: list[Future[None]] = []
        self._broken = False

    def submit(self, step: int, items: Collected | None) -> Future[None]:
        """Write ``items`` (a staged snapshot) as this rank's checkpoint of ``step``, then
        replicate it. Waits first for the previous write (whose staging buffers these
        are) and for all but the last replication (so that they cannot pile up).
        ``None``: this rank has nothing for the step (its snapshot failed), but takes part
        in the step's transfers, saying so, so that every pair stays in step."""
        self.wait_written()
        while len(self._replications) > 1:
            self._replications.pop(0).result()
        self._write = self._writer.submit(self._write_step, step, items)
        self._replications.append(self._sender.submit(self._replicate_after, step, self._write))
        return self._write

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

    def _write_step(self, step: int, items: Collected | None) -> None:
        if items is None:
            return
        try:
            self.node.remove(step, self.rank)  # an earlier attempt at this step
            with self.node.rank_storage(step, self.rank, create=True) as storage:
                rank_checkpoint.write(
                    storage, items, rank=self.rank, world_size=self.world_size, step=step
                )
            self.record.written.append(step)
        except Exception as e:  # recorded; replication sends "none" for this step
            self.record.errors.append(e)
            warnings.warn(
                f"shardsafe: rank {self.rank} could not write its local checkpoint of step "
                f"{step}: {e}",
                stacklevel=1,
            )
        finally:
            items.clear()

    def _replicate_after(self, step: int, write: Future[None]) -> None:
        write.result()
        if not self._broken and (self.peers.targets or self.peers.sources):
            self._replicate(step)
        elif not self.peers.targets and step in self.record.written:
            self.record.replicated.append(step)
        if self.tally is not None and step in self.record.replicated:
            with contextlib.suppress(Exception):  # the store gone: retention keeps more
                self.tally.mark(step)
        self._retain()

    def _replicate(self, step: int) -> None:
        own = step in self.record.written
        jobs: list[tuple[str, int, Future[bool]]] = []
        transfers = len(self.peers.targets) + len(self.peers.sources)
        with ThreadPoolExecutor(transfers, initializer=_yield_to_training) as pool:
            for target in self.peers.targets:
                jobs.append(("send", target, pool.submit(self._send, step, target, own)))
            for source in self.peers.sources:
                jobs.append(("receive", source, pool.submit(self._receive, step, source)))
        sent = True
        for kind, peer, job in jobs:
            try:
                ok = job.result()
            except Exception as e:  # a peer gone: stop replicating, keep training
                self._broken = True
                self.record.errors.append(e)
                warnings.warn(
                    f"shardsafe: rank {self.rank} stops replicating its local checkpoints: "
                    f"the transfer of step {step} with rank {peer} failed: {e}",
                    stacklevel=1,
                )
                ok = False
            if kind == "send":
                sent = sent and ok
            elif ok:
                self.record.received.setdefault(peer, []).append(step)
        if own and sent:
            self.record.replicated.append(step)

    def _send(self, step: int, target: int, own: bool) -> bool:
        if not own:
            return transfer.send(self.group, target, None)
        with self.node.rank_storage(step, self.rank, create=False) as storage:
            return transfer.send(self.group, target, storage)

    def _receive(self, step: int, source: int) -> bool:
        self.node.remove(step, source)  # an interrupted receipt, or an earlier attempt
        return transfer.receive(
            self.group,
            source,
            rank=source,
            step=step,
            target=lambda: self.node.rank_storage(step, source, create=True),
        )

    def _retain(self) -> None:
        try:
            everywhere = self._replicated_everywhere()
            _drop_older(self.node, self.rank, self.record.written, self.keep_local, everywhere)
            for source, steps in self.record.received.items():
                _drop_older(self.node, source, steps, self.keep_local, everywhere)
        except (CheckpointError, OSError) as e:
            warnings.warn(f"shardsafe: local retention failed: {e}", stacklevel=1)

    def _replicated_everywhere(self) -> int | None:
        """The newest step every rank has replicated (all its targets committed it), as
        the job's store counts them; without a store (one rank), this rank's newest."""
        if self.tally is None:
            return max(self.record.replicated, default=None)
        for step in sorted(self.record.written, reverse=True)[: self.keep_local + 2]:
            with contextlib.suppress(Exception):
                if self.tally.everywhere(step):
                    self.record.everywhere = max(self.record.everywhere or -1, step)
                    break
        return self.record.everywhere


class Tally:
    """Counts, in the job's store, the ranks that have replicated each step: retention
    keeps the newest step every rank replicated, so that a lost node never leaves only
    steps some rank lacks. Counting never blocks (a rank that never replicates a step
    simply leaves it uncounted). ``run`` (agreed at construction) keeps a restarted job's
    counts apart from an earlier attempt's in a store that outlived it."""

    def __init__(self, store: Any, prefix: str, world_size: int) -> None:
        self._store, self._prefix, self._world_size = store, prefix, world_size

    def mark(self, step: int) -> None:
        self._store.add(f"{self._prefix}/{step}", 1)

    def everywhere(self, step: int) -> bool:
        return int(self._store.add(f"{self._prefix}/{step}", 0)) >= self._world_size


def _drop_older(
    node: NodeDir, rank: int, written: list[int], keep: int, everywhere: int | None
) -> None:
    """Delete ``rank``'s checkpoints here but the ``keep`` newest of ``written`` (its steps
    this run wrote or received) and ``everywhere`` (the newest step every rank
    replicated), once there are ``keep`` of them: a replication that fails for good then
    still leaves at most ``keep + 1`` steps, and the last step complete on other nodes
    is never the one deleted."""
    if len(written) < keep:
        return
    kept = set(sorted(written)[-keep:])
    if everywhere is not None:
        kept.add(everywhere)
    newest = max(kept)
    for step in node.steps():
        if step not in kept and step < newest and rank in node.ranks_in(step):
            node.remove(step, rank, prune=True)


BACKGROUND_NICENESS = 10


def _yield_to_training() -> None:
    """Lower this background thread's scheduling priority (Linux: niceness is per thread),
    so that where cores are scarce the training loop's threads run first and the writes
    and transfers take the time left over."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICENESS)
        )
