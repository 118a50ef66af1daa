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

``load_latest`` restores the newest step available in full (``recovery.py`` chooses,
``restore.py`` restores): from the node's own directory, else from a peer's replica (sent
over first), else from the persistent tier, and records which tier each rank used in
:attr:`restored`. The ranks agree and send through ``ranks.py``.

Every method is collective (call it on every rank), as ``CheckpointManager``'s are.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

from .. import _warnings
from ..checkpoint.io.staging import Stager
from ..checkpoint.manager import CheckpointManager, check_step, step_of
from ..checkpoint.options import LoadKeywords, check_seconds
from ..checkpoint.plan.collecting import Collected, check_state, collect
from ..checkpoint.storage.locations import is_url, local_path, path_text
from ..distributed import Phase, clients
from ..distributed.group import default_store
from ..errors import CheckpointError
from . import budget, node_share, rank_checkpoint
from .local_lock import LocalLock
from .node_dir import NodeDir
from .node_share import NodeShare
from .rank_checkpoint import Candidate
from .ranks import Ranks, steps_differ
from .replication import Peers, Replicator
from .restore import Restored, Restorer
from .retention import Tally
from .topology import Topology, directory_identity, node_name

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # a dependency of torch's
    from typing_extensions import Unpack


DEFAULT_TIMEOUT_S = 300.0
"""How long a rank waits for the others by default (and a rank whose own timeout was
refused waits, to hear the others' verdict on its settings)."""

LOCAL_DEFAULTS: dict[str, int] = {"local_every": 1, "keep_local": 2}
"""The local tier's settings as the manager takes them when left out; the Trainer and
the Lightning strategies pass them on, and refuse another value without a local tier
(:func:`refuse_without_local_tier`)."""


def refuse_without_local_tier(settings: dict[str, object]) -> None:
    """Refuse a local tier's setting other than its default where no tier is asked for
    (no local directory): accepted, it would silently do nothing."""
    for field, value in settings.items():
        if value != LOCAL_DEFAULTS[field]:
            raise ValueError(
                f"{field}={value!r} applies to the local tier, which is off; pass "
                "local_checkpoint_dir='/dev/shm/run1' (a node-local directory) too, or leave "
                f"{field} out"
            )


class TieredCheckpointManager:
    """Node-local checkpoints replicated to peers, over a persistent tier (see the module
    docstring and docs/async-and-tiers.md, "Tiered checkpoints").

    ``local_every``/``persist_every``: which steps :meth:`save` writes to each tier
    (``None``: never); ``replicas``: how many other nodes keep a copy of each rank's
    local checkpoint (at most the number of other nodes); ``keep_local``: local steps
    kept per rank; ``keep_last``: persistent checkpoints kept. ``timeout``: seconds a
    rank waits for the others (and a transfer for its peer; and, unless ``load_latest``
    is given its own, in a load from the local tier; the persistent tier's saves and
    loads keep ``shardsafe.save``'s and ``load``'s). ``name``: what the ranks
    agree under (default: the persistent root, which every rank spells the same).
    """

    def __init__(
        self,
        persistent: str | os.PathLike[str],
        local: str | os.PathLike[str],
        *,
        local_every: int | None = LOCAL_DEFAULTS["local_every"],
        persist_every: int | None = 100,
        replicas: int = 1,
        keep_local: int = LOCAL_DEFAULTS["keep_local"],
        keep_last: int | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        storage_options: dict[str, Any] | None = None,
        name: str | None = None,
    ) -> None:
        # Refused once every rank has seen every rank's (below): refused here, on one rank
        # only, the others waited for it in the exchange until the timeout, then said it
        # never called. So is a timeout, a root or a local directory this rank cannot use
        # (a rank with a bad timeout waits the default one for the others' verdict).
        problem = _problem(local_every, persist_every, replicas, keep_local, keep_last)
        bad_timeout = _refusal(lambda: _check_timeout(timeout))
        wait = DEFAULT_TIMEOUT_S if bad_timeout else timeout
        self.local_every, self.persist_every = local_every, persist_every
        self.keep_local, self.timeout = keep_local, wait
        made: list[CheckpointManager] = []
        bad_root = _refusal(
            lambda: made.append(
                CheckpointManager(
                    persistent,
                    None if problem else keep_last,
                    warn_if_not_empty=False,
                    storage_options=storage_options,
                )
            )
        )
        where: list[str] = []
        bad_local = _refusal(lambda: where.append(_local_directory(local)))
        problem = problem or bad_timeout or bad_root or bad_local
        root = made[0].root if made else _spelled(persistent)
        self.node = NodeDir(where[0] if where else os.devnull)  # refused below if so
        self._ranks = Ranks(f"tiers:{name if name is not None else root}", wait)
        self.rank, self.world_size = self._ranks.rank, self._ranks.world_size
        settings = {
            "local_every": _as_json(local_every),
            "persist_every": _as_json(persist_every),
            "replicas": _as_json(replicas),
            "keep_local": _as_json(keep_local),
        }

        self._lock: LocalLock | None = None
        self._made_local = False

        def identity() -> list[Any]:  # inside the exchange: a rank's refusal is everyone's
            if problem is None:
                _check_apart(self.node.root, root)
            mine = os.path.realpath(self.node.root)
            ours = rank_checkpoint.persistent_identity(root) if problem is None else ""
            place = directory_identity(mine) if problem is None else ""
            stamp = time.time_ns()
            return [node_name(), uuid.uuid4().hex, settings, problem, stamp, mine, ours, place]

        def lock() -> None:
            # Under this run's token, agreed above: the ranks of this job share their
            # byte, and a second job on the same roots (launched twice) holds another.
            if problem is None:
                # Rank 0's: every rank's checkpoints, replicas included, record one, however
                # each node spells or mounts the root (Lightning's is under the local one).
                run = _run(names[0])
                self._lock, self._made_local = self.node.lock(f"{self._ranks.tag}/{run}")
                self.node.persistent = str(names[0][6])
                _refuse_foreign(self.node)  # after the lock: a live one is said as such

        try:
            names = self._ranks.exchange(Phase.SURVEY, identity)
            _check_same([n[2] for n in names])
            _refuse([n[3] for n in names])
            self.persistent = made[0]  # made: no rank had a problem
            _check_node_mates_share([(str(n[0]), str(n[5])) for n in names])
            _check_nodes_apart([(str(n[0]), str(n[5]), str(n[7])) for n in names])
            self._ranks.exchange(Phase.SURVEY, lock)
            self.topology = Topology.of([str(n[0]) for n in names])
            self.replicas = self._possible_replicas(replicas)
        except (CheckpointError, ValueError):
            if made:
                made[0].close()
            if self._lock is not None:
                self._lock.release()
            if self._made_local:  # refused: nothing of it is left behind
                self.node.unmake()
            raise
        self._store = clients.acquire(default_store()) if self.world_size > 1 else None
        peers = Peers(
            self.topology.targets(self.rank, self.replicas),
            self.topology.sources(self.rank, self.replicas),
        )
        mates = list(self.topology.nodes[self.topology.node_of[self.rank]])
        self._replicator = Replicator(
            self.node,
            self.rank,
            self.world_size,
            peers,
            None,
            keep_local,
            self._tally(names),
            NodeShare(self.node, self.rank, mates) if len(mates) > 1 else None,
            _run(names[0]),
            self.node.persistent,
        )
        self._stager = Stager()
        self._budget_checked = False
        self._closed = False
        self._newest_local: int | None = None
        """The newest step saved locally since the manager was made or last restored."""
        self._resumed = False
        """Whether this manager has restored, or been told what was restored
        (:meth:`load_latest`, :meth:`_drop_newer`): else local steps of an earlier run
        at or after its first save are refused (:meth:`_check_budget`)."""
        self.budget: budget.Budget | None = None
        """The local tier's disk use per node, once the first local save has measured it."""
        self._restorer = Restorer(
            self._ranks,
            self.topology,
            self.node,
            self.persistent,
            storage_options,
            self._replicator,
            self.replicas,
        )

    def _possible_replicas(self, replicas: int) -> int:
        """``replicas``, or as many as the job's other nodes allow (rank 0 warns).

        Every rank knows it is fewer (the topology is every rank's), and rank 0 warns
        inside an exchange: under a filter that makes warnings errors (``-W error``,
        pytest's ``filterwarnings = error``) every rank raises the agreed error. Warned
        after the agreement, rank 0 raised alone from the constructor while the others
        returned with their managers and then waited for it in their next call until the
        timeout (300 s), saying it never called."""
        possible = min(replicas, self.topology.max_replicas())
        if possible < replicas:
            said = (
                f"shardsafe: replicas={replicas}, but the job runs on "
                f"{len(self.topology.nodes)} node(s), so a replica on another node is possible "
                f"for {possible}; a lost node loses its local checkpoints"
            )

            def warn() -> None:
                if self.rank == 0:
                    # At the caller of TieredCheckpointManager(...): this, the exchange,
                    # this method, the constructor, the caller.
                    _warnings.warn(said)

            self._ranks.exchange(Phase.SURVEY, warn)
        return possible

    def _tally(self, names: list[Any]) -> Tally | None:
        """The count, in the job's store, of the ranks that replicated each step (under
        rank 0's id for this manager, so that two managers never share one)."""
        if self._store is None:
            return None
        prefix = f"shardsafe/{self._ranks.tag}/{names[0][1]}/replicated"
        return Tally(self._store, prefix, self.world_size)

    # -- saving

    def due(self, step: int) -> tuple[bool, bool]:
        """Whether ``step`` goes to the local tier, and to the persistent tier."""
        check_step(step)
        return (
            self.local_every is not None and step % self.local_every == 0,
            self.persist_every is not None and step % self.persist_every == 0,
        )

    def save(self, step: int, state: Any) -> list[str]:
        """Save ``state`` as ``step`` to the tiers it is due in; return their names.

        The local checkpoint is on the node's disk when this returns (its replication
        goes on in the background); the persistent one is committed.
        """
        local, persist = self._due_open(step)
        if local:
            self._local_save(step, state)
            self._replicator.wait_written()
        if persist:
            self.persistent.save(step, state)
        return [name for name, due in (("local", local), ("persistent", persist)) if due]

    def async_save(self, step: int, state: Any) -> list[str]:
        """:meth:`save`, returning once the state is staged (copied): both tiers are
        written in the background. ``wait`` for them."""
        local, persist = self._due_open(step)
        if local:
            self._local_save(step, state)
        if persist:
            self.persistent.async_save(step, state)
        return [name for name, due in (("local", local), ("persistent", persist)) if due]

    def _due_open(self, step: int) -> tuple[bool, bool]:
        """:meth:`due`, once sure the manager is not closed: its background threads are
        gone and its store let go, so a save would fail half-way, after staging."""
        if self._closed:
            raise CheckpointError(
                f"this TieredCheckpointManager was closed, so it cannot save step {step}; "
                "make a new one (on every rank) to save again"
            )
        try:
            local, persist = self.due(step)
        except ValueError as e:
            if self.world_size > 1 and self.local_every == 1 and not self._budget_checked:
                # Every valid step is due locally, so the others wait in the first local
                # save's budget exchange: told there, every rank raises this rank's error
                # at once. Raised alone, the others waited for it until the timeout
                # (300 s) and then said it never came (found in review).
                failure = e
                self._ranks.exchange(Phase.SURVEY, lambda: _raise(failure))
            raise
        newest = self._newest_local
        if local and newest is not None and step < newest:
            # Every rank saves the same steps: refused on every rank alike. Retention after
            # the newer step deleted the older one while it was being written, on some
            # ranks (a race), and the others' copies were never complete.
            raise CheckpointError(
                f"step {step} is older than step {newest}, which this TieredCheckpointManager "
                "already saved locally: local steps must not go back. Save that step again "
                "to replace it, or load_latest(state) first to resume from an older step"
            )
        return local, persist

    def _local_save(self, step: int, state: Any) -> None:
        self._replicator.wait_written()  # its staging buffers are about to be reused
        items = self._collect(step, state)
        share = self._replicator.share
        if items is not None and not self._budget_checked:
            shared = node_share.candidates(items) if share is not None else {}
            self._check_budget(step, budget.staged_bytes(items), share, shared)
            # Collective: every rank asks, if any node shares (node_share.py) or replicates.
            if self.replicas or any(len(ranks) > 1 for ranks in self.topology.nodes):
                self._replicator.group = self._ranks.transfers()
        self._newest_local = step  # from here on every rank replicates it (empty if refused)
        if items is None:
            return
        try:
            staged = self._stager.stage(items, share.keep(items) if share is not None else None)
            staged.ready()
        except BaseException as e:
            # The others replicate this step: take part, empty.
            self._replicator.submit(step, None)
            if isinstance(e, Exception):
                # This rank's alone, as a failed write is: warned, raised by wait().
                # Raised here, it would leave the others waiting in the persistent save of
                # the step, where this state is refused on every rank at once.
                self._replicator.failed(step, e)
                return
            raise
        self._replicator.submit(step, staged.items)

    def _collect(self, step: int, state: Any) -> Collected | None:
        """``state``'s items; ``None`` if it is refused after the first local save (as a
        failed write: warned, raised by ``wait()``)."""
        try:
            # Inside: a state refused on one rank only must still take part in the
            # others' replication of this step (as "none"), or the pairs fall out of step.
            check_state(state)
            return collect(state, self.rank, self.world_size)
        except BaseException as e:
            if self._budget_checked:  # the others replicate this step: take part, empty
                self._replicator.submit(step, None)
                if isinstance(e, Exception):
                    self._replicator.failed(step, e)
                    return None
            elif isinstance(e, Exception) and self.world_size > 1:
                # The others wait in the budget's exchange: every rank raises the same
                # CheckpointError (from this one's error here).
                failure = e
                self._ranks.exchange(Phase.SURVEY, lambda: _raise(failure))
            raise

    def _check_budget(
        self,
        step: int,
        own_bytes: int,
        share: NodeShare | None,
        shared: dict[Candidate, int],
    ) -> None:
        """Before the first local write: every rank saves the same step (later steps are
        compared by replication's transfers, ``transfer.StepsDiffer``), every node has
        room for its steps, and the ranks of a node agree whether its first save shares
        their data-parallel tensors (``node_share.py``; the room is counted so)."""
        owned = {self.rank, *self._replicator.peers.sources}

        def report() -> dict[str, Any]:
            free, used = self.node.free_bytes(), self.node.used_bytes(owned)
            own = budget.Report(own_bytes, free, used).to_json()
            offer = share.offer(shared) if share is not None else None
            ahead = None if self._resumed else next(self.node.held(), None)
            return {
                "report": own,
                "root": self.node.root,
                "step": step,
                "share": offer,
                "ahead": ahead.step if ahead is not None and ahead.step >= step else None,
            }

        docs = self._ranks.exchange(Phase.SURVEY, report)
        _check_steps([d["step"] for d in docs])
        _refuse_ahead(step, [(d["ahead"], str(d["root"])) for d in docs])
        offers = [[docs[r]["share"] for r in ranks] for ranks in self.topology.nodes]
        if share is not None:
            share.start(shared, offers[self.topology.node_of[self.rank]])
        self.budget = budget.check(
            [budget.Report.from_json(d["report"]) for d in docs],
            self.topology,
            self.replicas,
            self.keep_local,
            [str(d["root"]) for d in docs],
            [o[0]["bytes"] if node_share.first_shares(o) else 0 for o in offers],
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
            if isinstance(error, (CheckpointError, Warning)):  # a Warning: made an error
                raise error  # by the user's filter (``Replicator._warn``)
            raise CheckpointError(f"a local checkpoint failed: {error}") from error

    def close(self) -> None:
        """Finish everything in flight, then let go of the persistent root's lock (and of
        the background threads: a closed manager does not save again)."""
        self._closed = True
        try:
            self._replicator.close()
        finally:
            self._let_go()
            if self._store is not None:
                clients.release(default_store(), self._store)
                self._store = None

    def _let_go(self) -> None:
        """Release the persistent root's lock and the local directory's."""
        try:
            self.persistent.close()
        finally:
            if self._lock is not None:
                self._lock.release()

    # -- restoring

    @property
    def restored(self) -> Restored | None:
        """What the last :meth:`load_latest` that restored something restored."""
        return self._restorer.restored

    def latest(self) -> int | None:
        """The step :meth:`load_latest` would restore now (collective), or ``None`` (also
        where it refuses local checkpoints saved at another world size, with nothing in
        the persistent tier: none of them can be restored)."""
        return self._restorer.latest()

    def load_latest(self, state: Any, **options: Unpack[LoadKeywords]) -> dict[str, Any] | None:
        """Restore the newest step that every rank can get (see the module docstring);
        ``None`` if there is none in any tier. ``options`` are :func:`shardsafe.load`'s."""
        loaded = self._restorer.load_latest(state, options)
        self._resumed = True
        if loaded is not None and self.restored is not None:  # later local steps are deleted
            self._newest_local = self.restored.step
        return loaded

    def _start_afresh(self, why: str, instead: str) -> None:
        """What :meth:`load_latest` does with nothing to restore, for a caller that has its
        own persistent checkpoints (Lightning's ``ModelCheckpoint``) and found none
        (collective): raise where the only local checkpoints were saved at another world
        size or would not load, in its words, and warn of copies that complete no step
        (``Restorer.start_afresh``). Then this run's first local save may replace such
        copies, as after :meth:`load_latest`: Lightning's fresh start after a job killed in
        its first local save was refused at that save, restart after restart ("hold step 5
        of an earlier run ... Call load_latest(state) first")."""
        self._restorer.start_afresh(why, instead)
        self._resumed = True

    def _drop_newer(self, step: int) -> None:
        """What :meth:`load_latest` does after any restore (``Restorer.drop_newer``)."""
        self._restorer.drop_newer(step)
        self._resumed = True


def _refuse_ahead(step: int, found: list[tuple[int | None, str]]) -> None:
    """Refuse a first local save at ``step`` into local directories that hold a committed
    step at or after it, which this manager did not restore from (``found``: each rank's
    newest such step, if any, and its directory). Every rank raises it (one exchange).

    An earlier run's local steps (the same directory given to a new run that did not
    call ``load_latest``) outlived this run's retention, which counts only its own
    steps, and the next restore took that run's newer step over this run's."""
    ahead = [(s, root) for s, root in found if s is not None]
    if not ahead:
        return
    newest = max(s for s, _ in ahead)
    roots = sorted({root for _, root in ahead})
    raise CheckpointError(
        f"the local directories ({', '.join(roots)}) hold step {newest} of an earlier run, "
        f"at or after step {step} that this TieredCheckpointManager saves first, and it "
        "did not restore from them: a later restore would take that run's step over this "
        "run's. Call load_latest(state) first to resume from them, or give this run local "
        "directories of its own; shardsafe will not delete them for you. Nothing was written"
    )


def _run(identity: list[Any]) -> str:
    """This run's token, from rank 0's identity (the same on every rank): its clock in
    nanoseconds (so a later run's token sorts after an earlier one's) and its random id.
    Every local checkpoint records it (``rank_checkpoint.run_of``)."""
    return f"{identity[4]:016x}{identity[1][:16]}"


def _problem(
    local_every: int | None,
    persist_every: int | None,
    replicas: int,
    keep_local: int,
    keep_last: int | None,
) -> str | None:
    """What is wrong with a value the manager cannot work with, naming the argument."""
    # bool is an int to isinstance: keep_last=True passed here, then CheckpointManager
    # refused it on that rank alone, and the others waited for it in the exchange.
    for field, value in (("local_every", local_every), ("persist_every", persist_every)):
        if value is not None and (not _whole(value) or value < 1):
            return f"{field}={value!r} must be a positive int, or None for never"
    if not _whole(replicas) or replicas < 0:
        return f"replicas={replicas!r} must be a non-negative int"
    if not _whole(keep_local) or keep_local < 1:
        return f"keep_local={keep_local!r} must be at least 1"
    if keep_last is not None and (not _whole(keep_last) or keep_last < 1):
        return f"keep_last={keep_last!r} must be an int, at least 1 (or None to keep all)"
    return None


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse(problems: list[str | None]) -> None:
    """Raise the first rank's problem with its settings (``_problem``) on every rank: as
    it is where every rank has it, else naming the rank."""
    found = [(rank, problem) for rank, problem in enumerate(problems) if problem is not None]
    if not found:
        return
    rank, problem = found[0]
    if len(found) == len(problems) and all(p == problem for _, p in found):
        raise ValueError(problem)
    raise ValueError(f"rank {rank}: {problem}; pass valid settings on every rank")


def _refusal(check: Callable[[], object]) -> str | None:
    """What ``check`` refuses (a value this rank alone may have), as text to tell the
    other ranks; ``None`` if it passes."""
    try:
        check()
    except (ValueError, TypeError, CheckpointError) as e:
        return str(e)
    return None


def _spelled(path: object) -> str:
    """A root that ``CheckpointManager`` refused on this rank (its ``storage_options``, say),
    as the ranks that made it name it (the name they meet under, to be told why): as the
    manager reads it where it can (``file://`` read, a URL's trailing ``/`` dropped), else
    its text, or its ``repr``."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        return repr(path)
    try:
        return path.rstrip("/") if is_url(path) else local_path(path)
    except CheckpointError:
        return path


def _refuse_foreign(node: NodeDir) -> None:
    """Refuse a local directory holding another run's steps (another ``run_dir`` or
    persistent root, the same local directory): a resume took them by their step number
    alone, another model's weights and optimizer, and a fresh run was told to resume."""
    found = node.foreign()
    if found is not None:
        step, theirs = found
        raise CheckpointError(
            f"the local directory {node.root} holds step {step} of another run, whose "
            f"persistent tier is {theirs} (this run's is {node.persistent}): give this run "
            "a local directory of its own, or delete that run's steps there if it is over; "
            "shardsafe will not delete them for you"
        )


def _check_node_mates_share(roots: list[tuple[str, str]]) -> None:
    """Refuse ranks of one node given different local directories (``/nvme/rank0``,
    ``/nvme/rank1``): each looks for its node-mates' files (the part of a step one of
    them writes for all, a replica one of them received) under its own, so their saves
    failed at every step, or a lost node's replicas, intact, were never found."""
    first: dict[str, tuple[int, str]] = {}
    for rank, (node, root) in enumerate(roots):
        mate, theirs = first.setdefault(node, (rank, root))
        if theirs != root:
            raise ValueError(
                f"ranks {mate} and {rank} run on the same node ({node}) but were given "
                f"different local directories ({theirs} and {root}); the ranks of a node "
                "share one (each writes its own rank-<r> directory in it): give them the "
                "same path"
            )


def _check_nodes_apart(roots: list[tuple[str, str, str]]) -> None:
    """Refuse two nodes given one local directory (two torchrun agents on one host with
    the same ``local=`` path): each node's ranks took the other's checkpoints for replicas
    they had received, and deleting those, emptied the tier at every step, in silence but
    for a warning that a replica "arrived damaged". ``roots``: each rank's node, local
    directory and :func:`directory_identity`. A directory shared between hosts (a network
    filesystem) is not seen here."""
    first: dict[str, tuple[int, str]] = {}
    for rank, (node, root, place) in enumerate(roots):
        mate, theirs = first.setdefault(place, (rank, node))
        if theirs != node:
            raise ValueError(
                f"ranks {mate} and {rank} run on different nodes ({theirs} and {node}) but "
                f"were given the same local directory ({root}): each node's local tier must "
                "be its own (node-local storage: a tmpfs or a local disk), or the nodes "
                "delete each other's checkpoints; give each node another path"
            )


def _as_json(value: Any) -> Any:
    """A setting as the ranks compare it: itself, or its ``repr`` if JSON cannot hold it."""
    return value if value is None or type(value) in (int, float, str, bool) else repr(value)


def _check_timeout(timeout: float) -> None:
    """Refuse a timeout the ranks cannot wait for each other with, as ``save`` does: deep
    inside, None or a string failed with a TypeError, a negative value with gloo's
    "Invalid timeout", 0 (gloo: no limit) let a rank wait for a dead one forever, and a
    huge one failed the first local save on every rank with a raw OverflowError."""
    check_seconds("timeout", timeout)


def _local_directory(local: str | os.PathLike[str]) -> str:
    """The local tier's directory: ``file://`` read as the path it names; an object-store
    URL refused. Taken as written, ``file:///r`` became ``./file:/r`` and ``s3://b/x``
    ``./s3:/b/x``, directories of the working directory, without a word (and the check
    that the tiers are apart compared ``./file:/r`` with ``/r``)."""
    if isinstance(local, bool) or not isinstance(local, (str, bytes, os.PathLike)):
        raise ValueError(f"local={local!r} must be a path (a str or os.PathLike)")
    text = path_text(local)
    if is_url(text):
        raise ValueError(
            f"local={text!r} is a URL; the local tier is a directory on each node's own disk "
            "(e.g. '/dev/shm/run1'); an object store belongs in persistent=..."
        )
    try:
        return local_path(text)
    except CheckpointError as e:  # a file URL of another host; a collapsed s3:/ URL
        raise ValueError(f"local={text!r}: {e}") from None


def _check_apart(local: str, persistent: str) -> None:
    """Refuse a local directory that is the persistent root, or a step directory of it (or
    the other way round): both tiers write ``step-<step>`` directories, so the persistent
    tier's saves would refuse (or its retention delete) the local tier's, and the other
    way round."""
    if is_url(persistent):
        return
    ours, theirs = os.path.realpath(local), os.path.realpath(local_path(persistent))
    for inner, outer in ((ours, theirs), (theirs, ours)):
        relative = os.path.relpath(inner, outer)
        if relative == os.curdir or step_of(relative.split(os.sep)[0]) is not None:
            raise CheckpointError(
                f"the local tier's directory {local} and the persistent root {persistent} "
                "are the same directory, or one is a step directory of the other: both "
                "tiers write step-<step> directories there. Give the local tier a directory "
                "of its own (on a tmpfs or an NVMe disk)"
            )


def _check_same(settings: list[dict[str, Any]]) -> None:
    """Refuse settings that differ between ranks (every rank sees every rank's, so each
    raises the same error): the ranks must save the same steps to each tier and pair
    their replicas the same way, or one waits in an exchange, or a transfer, that another
    never enters."""
    for field, first in settings[0].items():
        for rank, other in enumerate(s[field] for s in settings):
            if other != first:
                raise CheckpointError(
                    f"TieredCheckpointManager's settings differ between ranks: {field}="
                    f"{first!r} on rank 0 but {field}={other!r} on rank {rank}; pass the same "
                    f"{field} on every rank"
                )


def _check_steps(steps: list[int]) -> None:
    """Refuse a first local save whose step differs between ranks (every rank sees every
    rank's, so each raises the same error, before anything is written): a step is
    restorable only once every rank has a checkpoint of it."""
    for rank, step in enumerate(steps):
        if step != steps[0]:
            raise steps_differ(steps[0], 0, step, rank, same_save=False)


def _raise(error: Exception) -> NoReturn:
    """Raise ``error`` where an agreed exchange expects this rank's payload."""
    raise error
