"""Restoring a tiered manager's newest step, from the fastest tier that holds it.

``load_latest`` restores the newest step available in full (``recovery.py`` chooses): from
the node's own directory, else from a peer's replica (sent over first), else from the
persistent tier. A damaged local copy is deleted and passed over for the next source; a
local step that does not fit the run (other sharding at the same world size) sends the
restore to the persistent tier, which can reshard. After a restore, the local
checkpoints of later steps (of a run that no longer exists) are deleted.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from ..checkpoint import loading
from ..checkpoint.format.manifest import MANIFEST_NAME
from ..checkpoint.io.reader import CheckpointReader
from ..checkpoint.manager import LATEST, CheckpointManager, step_dir_name, step_of
from ..checkpoint.options import LoadKeywords, LoadOptions
from ..checkpoint.refusals import told_if_refused
from ..checkpoint.storage.locations import open_storage
from ..distributed import Phase, world
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from . import rank_checkpoint, recovery
from .deferred_warnings import DeferredWarnings
from .fetch import Fetcher
from .node_dir import NodeDir, Refused
from .ranks import CALLED_AS, Ranks
from .replication import Replicator
from .topology import Topology

REFUSED_REPORTED = 3
"""Refused copies a rank reports in a survey (only named in an error: a few suffice)."""
MAX_WHY_CHARS = 500
"""Characters of each refused copy's reason a rank reports."""


@dataclass(frozen=True)
class _Surveyed:
    """The ranks whose directories one rank checks in a survey: ``ranks``
    (``Topology.surveyed_by``) and, on the node's lowest rank (``beyond``: the world
    size), every rank outside this world, of checkpoints saved at a larger one: never
    restored, but named if they are all a silent fresh start would abandon
    (``recovery.Choice.stranded``)."""

    ranks: set[int]
    beyond: int | None

    def __contains__(self, rank: object) -> bool:
        outside = self.beyond is not None and isinstance(rank, int) and rank >= self.beyond
        return outside or rank in self.ranks


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


class Restorer:
    """The restore path of one tiered manager (see the module docstring); every method is
    collective, as the manager's are."""

    def __init__(
        self,
        ranks: Ranks,
        topology: Topology,
        node: NodeDir,
        persistent: CheckpointManager,
        storage_options: dict[str, Any] | None,
        replicator: Replicator,
        replicas: int,
    ) -> None:
        self.ranks, self.topology, self.node = ranks, topology, node
        self.persistent, self._options = persistent, storage_options
        self._replicator = replicator
        self.rank, self.world_size = ranks.rank, ranks.world_size
        lowest = self.rank == topology.nodes[topology.node_of[self.rank]][0]
        self._surveyed = _Surveyed(
            topology.surveyed_by(self.rank, replicas), self.world_size if lowest else None
        )
        """The rank directories of the node's this rank checks in a survey."""
        self.restored: Restored | None = None
        self._refused: list[Refused] = []
        """The copies the last survey refused, every rank's (a few of each)."""
        self._said = DeferredWarnings()
        """This restore's warnings, said as it ends (``deferred_warnings.py``)."""
        self._fetcher = Fetcher(ranks, topology, node, self._said)

    def latest(self) -> int | None:
        """The step :meth:`load_latest` would restore now, or ``None``."""
        self._replicator.drain()
        return self._survey(set()).step

    def start_afresh(self, why: str, instead: str) -> None:
        """For a caller starting afresh with nothing here to restore (Lightning with no
        checkpoint to resume from): raise as :meth:`load_latest` does where the only local
        checkpoints were saved at another world size or would not load, and warn as it
        does of copies that complete no step (collective; see :func:`_refuse_stranded`,
        :func:`_refuse_unloadable` and :meth:`_say_incomplete`)."""
        with self._said:
            choice = self._survey(set())
            if choice.step is None:
                _refuse_stranded(choice, self.world_size, why, instead)
                _refuse_unloadable(self._refused, [])
                self._say_incomplete(choice)

    def load_latest(self, state: Any, options: LoadKeywords) -> dict[str, Any] | None:
        """Restore the newest step that every rank can get; ``None`` if there is none in
        any tier. ``options`` are :func:`shardsafe.load`'s. Its warnings are said as it
        ends, on every rank's way out (``deferred_warnings.py``)."""
        with self._said:
            return self._restore(state, options)

    def _restore(self, state: Any, options: LoadKeywords) -> dict[str, Any] | None:
        started = time.monotonic()
        self._replicator.drain()
        # A failed load from a local copy is followed by a whole load from the next
        # source, which overwrites everything: one read ("inline") suffices there.
        opts = self._load_options(options)
        excluded: set[tuple[int, int, int]] = set()
        damaged: list[CheckpointError] = []
        unfetched: list[tuple[int, list[int]]] = []  # (step, ranks that could not receive it)
        persistent = True
        floor: int | None = None  # a persistent step that loaded, then was overwritten
        # Each pass that does not return rules a source out: a copy (excluded), the
        # persistent tier, or what loaded from it (floor). The passes end when every bad
        # copy is out, however many there are; a fixed number of them gave up with an
        # older complete step and the persistent tier still untried. A pass that ruled
        # nothing out would repeat itself: never seen, stopped all the same.
        ruled_out: tuple[int, bool, int | None] | None = None
        while ruled_out != (len(excluded), persistent, floor):
            ruled_out = (len(excluded), persistent, floor)
            choice = self._survey(excluded, persistent)
            if floor is not None and (choice.step is None or choice.step <= floor):
                break  # no local step newer than the persistent one that loaded is left
            if choice.step is None:
                _refuse_stranded(choice, self.world_size)
                _refuse_unloadable(self._refused, damaged)
                _or_damaged(None, damaged, unfetched)
                self._say_incomplete(choice)
                return None
            if recovery.PERSISTENT in choice.tiers:
                try:
                    values = self._from_persistent(state, options, started)
                except CheckpointCorruptError as e:  # every persistent step is damaged
                    if self._survey(excluded, persistent=False).step is None:
                        raise
                    self._warn_persistent_damaged(e)
                    damaged.append(e)
                    persistent = False
                    continue
                loaded = self.restored.step if values is not None and self.restored else None
                if persistent and (loaded is None or loaded < (choice.step or 0)):
                    # The survey's step was not validated, and it did not load (nothing
                    # there did, or an older one did): a complete local step newer than
                    # what was loaded is next, and overwrites it whole; if none loads,
                    # the persistent step that did is loaded again.
                    local = self._survey(excluded, persistent=False)
                    if local.step is not None and (loaded is None or local.step > loaded):
                        persistent, floor = False, loaded
                        continue
                if loaded is not None:
                    self.drop_newer(loaded)
                return _or_damaged(values, damaged, unfetched)
            failed = self._fetcher.fetch(choice, excluded)
            if failed:
                unfetched.append((choice.step, failed))
                continue
            try:
                values = self._from_local(choice, state, opts, excluded, damaged)
            except CheckpointMismatchError as e:
                return self._after_mismatch(e, choice.step, state, options, started)
            if values is not None:
                self.drop_newer(choice.step)
                self.restored = Restored(choice.step, choice.tiers, time.monotonic() - started)
                return values
        if floor is not None:  # load it again: a local load overwrote it, or began to
            values = self._from_persistent_step(floor, state, options, started)
            self.drop_newer(floor)
            return values
        raise CheckpointError("the local tiers kept failing; load from the persistent tier")

    def _load_options(self, options: LoadKeywords) -> LoadOptions:
        """The local loads' options; one refused on this rank alone (``read_threads=0``)
        is told to the others, at the entry of the survey they wait in (``refusals``, as
        ``shardsafe.load`` does): they waited there for the manager's timeout, or for
        ever (found in review)."""
        return told_if_refused(
            "tiers", self.ranks.tag, lambda: LoadOptions.of(**{**self._local_defaults(), **options})
        )

    def _local_defaults(self) -> dict[str, Any]:
        """What a load from the local tier does unless the caller says otherwise: one
        read (``"inline"``), and the manager's ``timeout`` for the ranks' waits, as in its
        own agreements (at the entry, at most ``shardsafe.load``'s default), instead of
        ``shardsafe.load``'s 1800 s: a node-local read is quick, and a manager made with
        ``timeout=30`` waited up to 60 s for a rank missing at the load and 1800 s for one
        hung in it. The persistent tier's load keeps ``shardsafe.load``'s defaults: a
        large checkpoint on an object store may take longer."""
        entry = min(LoadOptions.entry_timeout, self.ranks.timeout)
        return {"verify": "inline", "timeout": self.ranks.timeout, "entry_timeout": entry}

    def _warn_persistent_damaged(self, e: CheckpointCorruptError) -> None:
        if self.rank == 0:
            self._said.warn(
                f"shardsafe: no checkpoint of the persistent tier would load ({e}); "
                "restoring the newest complete local step"
            )

    def _after_mismatch(
        self,
        e: CheckpointMismatchError,
        step: int,
        state: Any,
        options: LoadKeywords,
        started: float,
    ) -> dict[str, Any] | None:
        """Same world size, other sharding (or other objects): only the persistent tier
        can reshard; if the objects are wrong it says so too."""
        if self.rank == 0:
            self._said.warn(
                f"shardsafe: the local checkpoints of step {step} do not fit "
                f"this run ({e}); loading from the persistent tier"
            )
        values = self._from_persistent(state, options, started)
        if values is None or self.restored is None:  # the mismatch is the answer
            raise e
        self.drop_newer(self.restored.step)
        return values

    def _survey(
        self, excluded: set[tuple[int, int, int]], persistent: bool = True
    ) -> recovery.Choice:
        def report() -> dict[str, Any]:
            refused: list[Refused] = []
            held = [
                [h.step, h.rank, h.world_size, h.run]
                for h in self.node.held(self._surveyed, refused)
            ]
            persisted = self._persisted_step() if self.rank == 0 and persistent else None
            bad = [[r.step, r.rank, r.why[:MAX_WHY_CHARS]] for r in refused[:REFUSED_REPORTED]]
            return {"held": held, "persistent": persisted, "refused": bad}

        payloads = self.ranks.exchange(Phase.SURVEY, report)
        self._refused = [Refused(*r) for p in payloads for r in p["refused"]]
        choice = recovery.choose(
            [[(c[0], c[1], c[2], c[3]) for c in p["held"]] for p in payloads],
            self.topology,
            payloads[0]["persistent"],
            excluded,
        )
        return choice

    def _persisted_step(self) -> int | None:
        """The persistent tier's newest step, cheaply: its ``latest`` pointer (one small
        read) if it names a committed step, unless a newer step directory is committed
        (one listing): a save killed between its commit and the pointer's move left
        ``latest`` one step behind, and the restore chose an older local step, after which
        every save of the run refused the newer persistent one, restart after restart.
        Not validated here (``CheckpointManager.latest`` opens every data file's header, a
        round trip each on an object store, which a restore from the local tier would pay
        for nothing); ``load_latest`` validates it if it is chosen, and passes over a
        damaged one as ``CheckpointManager`` does."""
        pointed = None
        with (
            contextlib.suppress(CheckpointError, OSError, UnicodeDecodeError),
            open_storage(self.persistent.root, storage_options=self._options) as root,
        ):
            named = root.read_small(LATEST, 64).decode("ascii").strip()
            step = step_of(named)
            if step is not None:
                with root.child(named) as step_dir:
                    if step_dir.kind(MANIFEST_NAME) == "file":
                        pointed = step
        newer = self.persistent.newest_committed_step(above=pointed)
        return newer if newer is not None else pointed

    def _from_local(
        self,
        choice: recovery.Choice,
        state: Any,
        opts: LoadOptions,
        excluded: set[tuple[int, int, int]],
        damaged: list[CheckpointError],
    ) -> dict[str, Any] | None:
        """Load this rank's checkpoint of the chosen step from the node's directory; on a
        damaged copy (anywhere), or one gone since the survey (its manifest or its step
        directory deleted: not found), ``None``, the bad copies deleted and excluded, the
        error added to ``damaged``. The directory is opened inside the load, and the copy
        judged inside the exchange that follows a failed one: an error of either on one
        rank is every rank's (raised alone, the others waited for this rank until the
        timeout)."""
        step = choice.step
        assert step is not None
        try:
            return loading.load_opening(
                lambda: self.node.rank_storage(step, self.rank, create=False),
                f"{self.ranks.tag}/step-{step}",
                lambda manifest: state,
                opts,
                view=rank_checkpoint.view(state, rank=self.rank, world_size=self.world_size),
                warn=self._said.warn,
                called_as=CALLED_AS,
            )
        except (CheckpointCorruptError, CheckpointNotFoundError) as e:

            def judged() -> bool:
                bad = not self._verifies(step, state)
                if bad:  # excluded below either way; never raised on this rank alone
                    what = f"its damaged copy of step {step}"
                    self._remove(step, self.rank, what, prune=False)
                return bad

            flags = self.ranks.exchange(Phase.FETCH, judged)
            for rank, was_bad in enumerate(flags):
                if was_bad:
                    excluded.add((self.topology.node_of[rank], step, rank))
            if not any(flags):
                raise e
            damaged.append(e)
            if self.rank == 0:
                self._said.warn(
                    f"shardsafe: a local checkpoint of step {step} was damaged ({e}); trying "
                    "the next copy"
                )
            return None

    def _verifies(self, step: int, state: Any) -> bool:
        """Whether this rank's copy of ``step`` is sound: its manifest as its load views
        it (a well-formed manifest whose placements or metadata the load refuses was
        judged sound by its checksums alone, and chosen again at every restart), every
        data file whole, every checksum right. A mismatch with ``state`` is the state's,
        not the copy's: the copy is judged by its bytes."""
        view = rank_checkpoint.view(state, rank=self.rank, world_size=self.world_size)
        with (
            contextlib.suppress(CheckpointError, OSError),
            self.node.rank_storage(step, self.rank, create=False) as storage,
        ):
            manifest = loading.read_manifest_from(storage)
            with contextlib.suppress(CheckpointMismatchError):
                view(manifest)
            with CheckpointReader(storage, manifest) as reader:
                return not reader.check_files() and not reader.verify_all()
        return False

    def _from_persistent(
        self, state: Any, options: LoadKeywords, started: float
    ) -> dict[str, Any] | None:
        values = self.persistent.load_latest(state, **options)
        step = self.persistent._resumed_from
        if values is not None and step is not None:
            self._restored_persistent(step, started)
        return values

    def _from_persistent_step(
        self, step: int, state: Any, options: LoadKeywords, started: float
    ) -> dict[str, Any] | None:
        """Load the persistent tier's ``step`` (one that loaded before in this restore), its
        directory opened inside the load (an object store's that cannot be opened on one
        rank is every rank's error)."""
        name = step_dir_name(step)
        values = loading.load_opening(
            lambda: self.persistent._open(name),
            self.persistent.path_for_name(name),
            lambda manifest: state,
            LoadOptions.of(**options),
            warn=self._said.warn,
        )
        self.persistent._resumed_from = step
        self._restored_persistent(step, started)
        return values

    def _restored_persistent(self, step: int, started: float) -> None:
        self.restored = Restored(
            step, [recovery.PERSISTENT] * self.world_size, time.monotonic() - started
        )

    def drop_newer(self, step: int) -> None:
        """After restoring ``step``, the local checkpoints of later steps are of a run that
        no longer exists: delete those this rank surveys (the ones it owns; on the node's
        lowest rank also those no rank of the node owns, left by another node layout; and
        their step directories once empty, as one a failed fetch emptied already), so
        that they never mix with the steps this run writes next (a rank whose node lost
        its copy of such a step would be sent the old run's). Then retention learns of
        the restored step (never to be deleted before a newer one is complete everywhere)
        and of the older ones here (``Replicator.resumed_from``). Its warnings are said as
        it ends (or as the restore that called it does)."""
        with self._said:
            self._say_passed_over(step)
            self._drop_newer(step)

    def _say_incomplete(self, choice: recovery.Choice) -> None:
        """Nothing to restore, but some ranks hold copies of a step (of this world size)
        that others hold nowhere: a job killed in its first local save leaves that, and
        so does a node lost together with every replica of its ranks. The run starts
        afresh (raising would make a job killed in its first save unable to restart);
        in silence, the user could not tell the second case from a new run. The same
        words on every rank (one survey)."""
        if choice.incomplete is None:
            return
        step, missing = choice.incomplete
        ranks = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        self._said.warn(
            f"shardsafe: nothing was restored, and the run starts afresh: the newest local "
            f"checkpoints, of step {step}, are complete for some ranks only (no node holds "
            f"a copy of rank(s) {ranks}: a job stopped in its first local save, or a node "
            "lost with every replica of its ranks), and the persistent tier holds no "
            "checkpoint. To go on from earlier work instead, stop this run and load a "
            "checkpoint you kept elsewhere"
        )

    def _say_passed_over(self, step: int) -> None:
        """Say which copies of later steps the survey refused (a data file cut short, a
        rank's directory holding another rank's copy), before they go with the other
        copies of later steps: the restore went back to ``step`` over them in silence,
        and deleted the only trace. The same words on every rank (one survey). A copy
        found damaged while loading is said where it is found."""
        newer = sorted((r for r in self._refused if r.step > step), key=lambda r: (-r.step, r.rank))
        if not newer:
            return
        named = "; ".join(f"step {r.step} of rank {r.rank}: {r.why}" for r in newer[:3])
        self._said.warn(
            f"shardsafe: restored step {step}, passing over local checkpoints of later steps "
            f"that would not load ({named}{'; ...' if len(newer) > 3 else ''}); they are "
            "deleted with the other copies of later steps"
        )

    def _drop_newer(self, step: int) -> None:
        """See :meth:`drop_newer`. Every rank has restored when this runs: a failure here
        is a warning, raised on this rank alone it would fail this rank alone, and the
        others would wait for it at their next collective (a training step's
        all-reduce)."""
        try:
            for later in self.node.steps():
                if later > step:
                    for rank in self.node.ranks_in(later):
                        if rank in self._surveyed:
                            what = f"rank {rank}'s copy of step {later}, a later step"
                            self._remove(later, rank, what, prune=True)
                    with contextlib.suppress(CheckpointError, OSError):
                        self.node.prune(later)
            self._replicator.resumed_from(step)
        except (CheckpointError, OSError) as e:
            self._said.warn(
                f"shardsafe: restored step {step}, but rank {self.rank} could not look for the "
                f"local checkpoints of later steps in {self.node.root} to delete them ({e}); "
                "delete any step after it there yourself before this node restores again"
            )

    def _remove(self, step: int, rank: int, what: str, *, prune: bool) -> None:
        """Delete ``rank``'s copy of ``step`` here (``what``, to name it); a failure is a
        warning, and the restore goes on: raised on this rank alone, it left the others
        waiting for this one until the timeout, or failed this rank alone after every
        rank had restored. The copy is passed over either way: excluded, or (a later step)
        no longer committed where its manifest could be removed (``NodeDir.remove``), so
        that the copies this run writes of that step never complete it. A warning of the
        deletion's that the user's filter raised is said as the restore ends, as is."""
        try:
            with self._said.keeping():
                self.node.remove(step, rank, prune=prune)
        except (CheckpointError, OSError) as e:
            self._said.warn(
                f"shardsafe: restoring: rank {self.rank} could not delete {what} ({e}); "
                "delete it yourself"
            )


def _refuse_stranded(
    choice: recovery.Choice,
    world_size: int,
    why: str = "the persistent tier holds no checkpoint to reshard from",
    instead: str = "",
) -> None:
    """Nothing to restore at this world size, but local checkpoints saved at another
    (``choice.stranded``) and no persistent checkpoint to reshard from: returning ``None``
    would start the run afresh, silently abandoning it (the same decision on every rank:
    they all see the same survey). ``why`` and ``instead``: the caller's own words for
    what else there is (Lightning: its ``ModelCheckpoint`` checkpoints)."""
    if choice.stranded is None:
        return
    step, saved_world = choice.stranded
    raise CheckpointMismatchError(
        f"the local tier holds checkpoints of step {step} saved at world size {saved_world}, "
        f"but this run's world size is {world_size}: local checkpoints load only at the world "
        f"size that saved them, and {why}. Relaunch with {saved_world} ranks to resume from "
        f"them, {instead}or give this run a local directory of its own to start afresh"
    )


def _refuse_unloadable(refused: list[Refused], damaged: list[CheckpointError]) -> None:
    """Nothing to restore, but the local tiers hold copies that the survey refused (a
    manifest that is damaged or names another rank, a placement the load would refuse):
    returning ``None`` would start the run afresh and silently abandon them, as it did.
    The same decision on every rank: they all read the same survey. (After a copy found
    damaged while loading, ``_or_damaged`` says so instead.)"""
    if not refused or damaged:
        return
    newest = sorted(refused, key=lambda r: (-r.step, r.rank))
    named = "; ".join(f"step {r.step} of rank {r.rank}: {r.why}" for r in newest[:3])
    raise CheckpointCorruptError(
        f"nothing was restored, but the local tiers hold rank checkpoints that would not "
        f"load ({named}), and no other step or persistent checkpoint was left to restore. "
        "Returning nothing would start the run afresh and abandon them: repair or delete "
        "them (or give this run a local directory of its own) and restart"
    )


def _or_damaged(
    values: dict[str, Any] | None,
    damaged: list[CheckpointError],
    unfetched: list[tuple[int, list[int]]],
) -> dict[str, Any] | None:
    """``values``; but ``None`` ("nothing to restore") after a damaged local copy was found
    while restoring (``verify="inline"`` copies each tensor into its object as it is read)
    would hide that the objects may hold part of it, and that no other source overwrote
    them: raise instead. So too after a step could not be received (``unfetched``: each
    step, and the ranks whose copy did not arrive): the local tiers hold it, and a fresh
    start would silently abandon it (a replaced node's full disk, a damaged replica)."""
    if values is None and unfetched and not damaged:
        step, ranks = unfetched[0]
        raise CheckpointError(
            f"nothing was restored, but the local tiers hold step {step}: rank(s) "
            f"{', '.join(map(str, ranks))} could not receive their copy of it from another "
            "node (their local directory full or not writable, or the copy sent damaged), "
            "and no older step or persistent checkpoint was left to "
            "restore. Returning nothing would start the run afresh and abandon it: make "
            "room in (or repair) those ranks' local directory and restart"
        )
    if values is None and damaged:
        raise CheckpointCorruptError(
            f"no complete step is left in any tier to restore after a damaged local "
            f"checkpoint: {damaged[-1]}"
        ) from damaged[-1]
    return values
