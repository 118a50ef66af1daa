"""``TieredCheckpointManager``: frequent node-local checkpoints, replicated to peer nodes,
with an ordinary persistent checkpoint every so often as the last resort.

Tiers, fastest first:

1. **local**: every ``local_every``-th step each rank writes its own rank checkpoint
   (``rank_checkpoint.py``) into the node-local directory (a tmpfs such as ``/dev/shm``,
   or an NVMe path), in the background after staging, like ``async_save``;
2. **peer**: each rank's committed checkpoint is then sent to ``replicas`` ranks on other
   nodes (``replication.py``), which verify every byte before committing it;
3. **persistent**: every ``persist_every``-th step is also an ordinary shardsafe
   checkpoint under ``persistent`` (a path or an object-store URL), through a
   :class:`~shardsafe.CheckpointManager`.

``load_latest`` restores the newest step available in full (``recovery.py``): from the
node's own directory, else from a peer's replica (sent over first), else from the
persistent tier, and records which tier each rank used in :attr:`restored`.

Every method is collective (call it on every rank), as ``CheckpointManager``'s are.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..checkpoint import loading
from ..checkpoint.collecting import check_state, collect
from ..checkpoint.locations import open_storage
from ..checkpoint.manager import LATEST, CheckpointManager, step_of
from ..checkpoint.manifest import MANIFEST_NAME
from ..checkpoint.options import LoadOptions
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.staging import Stager
from ..distributed import Coordinator, Phase, clients, world
from ..distributed.group import default_store
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from . import budget, rank_checkpoint, recovery, transfer
from .node_dir import NodeDir
from .replication import Peers, Replicator, Tally
from .topology import Topology, node_name


@dataclass(frozen=True)
class Restored:
    """What :meth:`TieredCheckpointManager.load_latest` restored: the step, each rank's
    tier (``"local"``, ``"peer"`` or ``"persistent"``) and the seconds it took."""

    step: int
    tiers: list[str]
    seconds: float

    @property
    def tier(self) -> str:
        """This rank's tier."""
        return self.tiers[world()[0]]


class TieredCheckpointManager:
    """Node-local checkpoints replicated to peers, over a persistent tier (see the module
    docstring and docs/async-and-tiers.md, "Tiered checkpoints").

    ``local_every``/``persist_every``: which steps :meth:`save` writes to each tier
    (``None``: never); ``replicas``: how many other nodes keep a copy of each rank's
    local checkpoint (at most the number of other nodes); ``keep_local``: local steps
    kept per rank; ``keep_last``: persistent checkpoints kept. ``timeout``: seconds a
    rank waits for the others (and a transfer for its peer). ``name``: what the ranks
    agree under (default: the persistent root, which every rank spells the same).
    """

    def __init__(
        self,
        persistent: str | os.PathLike[str],
        local: str | os.PathLike[str],
        *,
        local_every: int | None = 1,
        persist_every: int | None = 100,
        replicas: int = 1,
        keep_local: int = 2,
        keep_last: int | None = None,
        timeout: float = 300.0,
        storage_options: dict[str, Any] | None = None,
        name: str | None = None,
    ) -> None:
        for field, value in (("local_every", local_every), ("persist_every", persist_every)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{field}={value!r} must be a positive int, or None for never")
        if not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"replicas={replicas!r} must be a non-negative int")
        if not isinstance(keep_local, int) or keep_local < 1:
            raise ValueError(f"keep_local={keep_local!r} must be at least 1")
        self.local_every, self.persist_every = local_every, persist_every
        self.keep_local, self.timeout = keep_local, timeout
        self._options = storage_options
        self.persistent = CheckpointManager(
            persistent, keep_last, warn_if_not_empty=False, storage_options=storage_options
        )
        self.node = NodeDir(os.fspath(local))
        self.rank, self.world_size = world()
        self._tag = f"tiers:{name if name is not None else self.persistent.root}"
        names = self._exchange(Phase.SURVEY, [node_name(), uuid.uuid4().hex])
        self.topology = Topology.of([str(n[0]) for n in names])
        self._store = clients.acquire(default_store()) if self.world_size > 1 else None
        tally = (
            Tally(self._store, f"shardsafe/{self._tag}/{names[0][1]}/replicated", self.world_size)
            if self._store is not None
            else None
        )
        self.replicas = min(replicas, self.topology.max_replicas())
        if self.replicas < replicas and self.rank == 0:
            warnings.warn(
                f"shardsafe: replicas={replicas}, but the job runs on "
                f"{len(self.topology.nodes)} node(s), so a replica on another node is possible "
                f"for {self.replicas}; a lost node loses its local checkpoints",
                stacklevel=2,
            )
        self._group: Any = None
        """The transfers' own gloo group, made on first need (:meth:`_transfers`), so that
        a restore from the local tier does not wait for it."""
        peers = Peers(
            self.topology.targets(self.rank, self.replicas),
            self.topology.sources(self.rank, self.replicas),
        )
        self._replicator = Replicator(
            self.node, self.rank, self.world_size, peers, self._group, keep_local, tally
        )
        self._stager = Stager()
        self._budget_checked = False
        self.budget: budget.Budget | None = None
        """The local tier's disk use per node, once the first local save has measured it."""
        self.restored: Restored | None = None

    # -- saving

    def due(self, step: int) -> tuple[bool, bool]:
        """Whether ``step`` goes to the local tier, and to the persistent tier."""
        return (
            self.local_every is not None and step % self.local_every == 0,
            self.persist_every is not None and step % self.persist_every == 0,
        )

    def save(self, step: int, state: Any) -> list[str]:
        """Save ``state`` as ``step`` to the tiers it is due in; return their names.

        The local checkpoint is on the node's disk when this returns (its replication
        goes on in the background); the persistent one is committed.
        """
        local, persist = self.due(step)
        if local:
            self._local_save(step, state)
            self._replicator.wait_written()
        if persist:
            self.persistent.save(step, state)
        return [name for name, due in (("local", local), ("persistent", persist)) if due]

    def async_save(self, step: int, state: Any) -> list[str]:
        """:meth:`save`, returning once the state is staged (copied): both tiers are
        written in the background. ``wait`` for them."""
        local, persist = self.due(step)
        if local:
            self._local_save(step, state)
        if persist:
            self.persistent.async_save(step, state)
        return [name for name, due in (("local", local), ("persistent", persist)) if due]

    def _local_save(self, step: int, state: Any) -> None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        check_state(state)
        self._replicator.wait_written()  # its staging buffers are about to be reused
        try:
            items = collect(state, self.rank, self.world_size)
            staged = self._stager.stage(items)
            staged.ready()
        except BaseException:
            if self._budget_checked:  # the others replicate this step: take part, empty
                self._replicator.submit(step, None)
            raise
        if not self._budget_checked:
            self._check_budget(budget.staged_bytes(staged.items))
            if self.replicas:
                self._replicator.group = self._transfers()
        self._replicator.submit(step, staged.items)

    def _transfers(self) -> Any:
        """The transfers' gloo group (collective the first time: every rank reaches this
        at the same point, the first local save or a restore that needs a peer)."""
        if self._group is None and self.world_size > 1:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        return self._group

    def _check_budget(self, own_bytes: int) -> None:
        """Before the first local write: every node must have room for its steps."""
        owned = {self.rank, *self._replicator.peers.sources}
        report = budget.Report(
            own_bytes, self.node.free_bytes(), self.node.used_bytes(owned)
        ).to_json()
        docs = self._exchange(Phase.SURVEY, {"report": report, "root": self.node.root})
        self.budget = budget.check(
            [budget.Report.from_json(d["report"]) for d in docs],
            self.topology,
            self.replicas,
            self.keep_local,
            [str(d["root"]) for d in docs],
        )
        self._budget_checked = True

    def wait(self) -> None:
        """Wait for every local write and replication, and for a persistent save in
        flight; raise the persistent save's error, or a local write's."""
        self._replicator.drain()
        self.persistent.wait()
        errors = self._replicator.record.errors
        if errors:
            error, errors[:] = errors[0], []
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"a local checkpoint failed: {error}") from error

    def close(self) -> None:
        """Finish everything in flight, then let go of the persistent root's lock."""
        try:
            self._replicator.close()
        finally:
            self.persistent.close()
            if self._store is not None:
                clients.release(default_store(), self._store)
                self._store = None

    # -- restoring

    def latest(self) -> int | None:
        """The step :meth:`load_latest` would restore now (collective), or ``None``."""
        self._replicator.drain()
        return self._survey(set()).step

    def load_latest(self, state: Any, **options: Any) -> dict[str, Any] | None:
        """Restore the newest step that every rank can get (see the module docstring);
        ``None`` if there is none in any tier. ``options`` are :func:`shardsafe.load`'s."""
        started = time.monotonic()
        self._replicator.drain()
        # A failed load from a local copy is followed by a whole load from the next
        # source, which overwrites everything: one read ("inline") suffices there.
        opts = LoadOptions.of(**{"verify": "inline", **options})
        excluded: set[tuple[int, int, int]] = set()
        damaged: list[CheckpointCorruptError] = []
        persistent = True
        for _ in range(3 * self.world_size + 3):
            choice = self._survey(excluded, persistent)
            if choice.step is None:
                return _or_damaged(None, damaged)
            if recovery.PERSISTENT in choice.tiers:
                values = self._from_persistent(state, options, started)
                loaded = self.restored.step if values is not None and self.restored else None
                if persistent and (loaded is None or loaded < (choice.step or 0)):
                    # The survey's step was not validated, and it did not load (nothing
                    # there did, or an older one did): a complete local step newer than
                    # what was loaded is next, and overwrites it whole.
                    local = self._survey(excluded, persistent=False)
                    if local.step is not None and (loaded is None or local.step > loaded):
                        persistent = False
                        continue
                if loaded is not None:
                    self._drop_newer(loaded)
                return _or_damaged(values, damaged)
            if not self._fetch(choice, excluded):
                continue
            try:
                values = self._from_local(choice, state, opts, excluded, damaged)
            except CheckpointMismatchError as e:
                # Same world size, other sharding (or other objects): only the persistent
                # tier can reshard; if the objects are wrong it says so too.
                if self.rank == 0:
                    warnings.warn(
                        f"shardsafe: the local checkpoints of step {choice.step} do not fit "
                        f"this run ({e}); loading from the persistent tier",
                        stacklevel=2,
                    )
                values = self._from_persistent(state, options, started)
                if values is None or self.restored is None:  # the mismatch is the answer
                    raise e
                self._drop_newer(self.restored.step)
                return values
            if values is not None:
                self._drop_newer(choice.step)
                self.restored = Restored(choice.step, choice.tiers, time.monotonic() - started)
                return values
        raise CheckpointError("the local tiers kept failing; load from the persistent tier")

    def _survey(
        self, excluded: set[tuple[int, int, int]], persistent: bool = True
    ) -> recovery.Choice:
        held = [[h.step, h.rank, h.world_size] for h in self.node.held()]
        persisted = self._persisted_step() if self.rank == 0 and persistent else None
        payloads = self._exchange(Phase.SURVEY, {"held": held, "persistent": persisted})
        choice = recovery.choose(
            [[(c[0], c[1], c[2]) for c in p["held"]] for p in payloads],
            self.topology,
            payloads[0]["persistent"],
            excluded,
        )
        return choice

    def _persisted_step(self) -> int | None:
        """The persistent tier's newest step, cheaply: its ``latest`` pointer (one small
        read) if it names a committed step, else the newest committed step directory.
        Not validated here (``CheckpointManager.latest`` opens every data file's header, a
        round trip each on an object store, which a restore from the local tier would pay
        for nothing); ``load_latest`` validates it if it is chosen, and passes over a
        damaged one as ``CheckpointManager`` does."""
        with (
            contextlib.suppress(CheckpointError, OSError, UnicodeDecodeError),
            open_storage(self.persistent.root, storage_options=self._options) as root,
        ):
            named = root.read_small(LATEST, 64).decode("ascii").strip()
            step = step_of(named)
            if step is not None:
                with root.child(named) as step_dir:
                    if step_dir.kind(MANIFEST_NAME) == "file":
                        return step
        steps = self.persistent.complete_steps()
        return steps[-1] if steps else None

    def _fetch(self, choice: recovery.Choice, excluded: set[tuple[int, int, int]]) -> bool:
        """Send the peers' copies to the ranks that need them; False (and the failed copies
        excluded) if one did not arrive whole."""
        step = choice.step
        assert step is not None
        if choice.sends:
            self._transfers()
        mine = [r for r, sender in choice.sends.items() if sender == self.rank]
        needed = choice.sends.get(self.rank)
        ok = True
        with ThreadPoolExecutor(max(1, len(mine) + 1)) as pool:
            jobs = [pool.submit(self._send_copy, step, r) for r in mine]
            if needed is not None:
                try:
                    self.node.remove(step, self.rank)
                    ok = transfer.receive(
                        self._group,
                        needed,
                        rank=self.rank,
                        step=step,
                        target=lambda: self.node.rank_storage(step, self.rank, create=True),
                    )
                except Exception as e:  # agreed below, as a copy that did not arrive
                    warnings.warn(f"shardsafe: receiving step {step} failed: {e}", stacklevel=3)
                    ok = False
            for job in jobs:
                with contextlib.suppress(Exception):  # the receiver reports it
                    job.result()
        outcomes = self._exchange(Phase.FETCH, ok)
        for rank, arrived in enumerate(outcomes):
            if not arrived:
                excluded.add((self.topology.node_of[choice.sends[rank]], step, rank))
        return all(outcomes)

    def _send_copy(self, step: int, rank: int) -> bool:
        with self.node.rank_storage(step, rank, create=False) as storage:
            return transfer.send(self._group, rank, storage)

    def _from_local(
        self,
        choice: recovery.Choice,
        state: Any,
        opts: LoadOptions,
        excluded: set[tuple[int, int, int]],
        damaged: list[CheckpointCorruptError],
    ) -> dict[str, Any] | None:
        """Load this rank's checkpoint of the chosen step from the node's directory; on a
        damaged copy (anywhere) ``None``, the bad copies deleted and excluded, the error
        added to ``damaged``."""
        step = choice.step
        assert step is not None
        storage = self.node.rank_storage(step, self.rank, create=False)
        try:
            with storage:
                return loading.load_chosen(
                    storage,
                    lambda manifest: state,
                    opts,
                    agree_as=f"{self._tag}/step-{step}",
                    view=rank_checkpoint.view(state, rank=self.rank, world_size=self.world_size),
                )
        except CheckpointCorruptError as e:
            bad = not self._verifies(step)
            if bad:
                self.node.remove(step, self.rank)
            flags = self._exchange(Phase.FETCH, bad)
            for rank, was_bad in enumerate(flags):
                if was_bad:
                    excluded.add((self.topology.node_of[rank], step, rank))
            if not any(flags):
                raise e
            damaged.append(e)
            if self.rank == 0:
                warnings.warn(
                    f"shardsafe: a local checkpoint of step {step} was damaged ({e}); trying "
                    "the next copy",
                    stacklevel=3,
                )
            return None

    def _verifies(self, step: int) -> bool:
        with (
            contextlib.suppress(CheckpointError, OSError),
            self.node.rank_storage(step, self.rank, create=False) as storage,
        ):
            manifest = loading.read_manifest_from(storage)
            with CheckpointReader(storage, manifest) as reader:
                return not reader.check_files() and not reader.verify_all()
        return False

    def _from_persistent(
        self, state: Any, options: dict[str, Any], started: float
    ) -> dict[str, Any] | None:
        values = self.persistent.load_latest(state, **options)
        step = self.persistent._resumed_from
        if values is not None and step is not None:
            self.restored = Restored(
                step, [recovery.PERSISTENT] * self.world_size, time.monotonic() - started
            )
        return values

    def _drop_newer(self, step: int) -> None:
        """After restoring ``step``, the local checkpoints this rank owns of later steps
        are of a run that no longer exists: delete them, so that they never mix with the
        steps this run writes next."""
        owned = {self.rank, *self._replicator.peers.sources}
        for later in self.node.steps():
            if later > step:
                for rank in set(self.node.ranks_in(later)) & owned:
                    self.node.remove(later, rank)

    # -- agreement

    def _exchange(self, phase: Phase, payload: Any) -> list[Any]:
        """Every rank's JSON ``payload`` (errors agreed, missing ranks named)."""
        coord = Coordinator("tiers", self._tag, timeout=self.timeout)
        coord.enter(self.timeout)
        try:
            with coord.phase(phase) as outcome:
                outcome.payload = payload
            # A rank deletes its payload when it leaves; a last phase without one keeps
            # the payloads until every rank has read them.
            with coord.phase(Phase.DONE):
                pass
            return outcome.payloads
        finally:
            coord.close()


def _or_damaged(
    values: dict[str, Any] | None, damaged: list[CheckpointCorruptError]
) -> dict[str, Any] | None:
    """``values``; but ``None`` ("nothing to restore") after a damaged local copy was found
    while restoring (``verify="inline"`` copies each tensor into its object as it is read)
    would hide that the objects may hold part of it, and that no other source overwrote
    them: raise instead."""
    if values is None and damaged:
        raise CheckpointCorruptError(
            f"no complete step is left in any tier to restore after a damaged local "
            f"checkpoint: {damaged[-1]}"
        ) from damaged[-1]
    return values
