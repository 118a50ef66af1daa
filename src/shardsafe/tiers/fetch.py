"""Sending a restore's copies to the ranks whose node lost them.

Once the ranks have chosen a step (``recovery.py``), each rank that must restore from
another node's replica receives it from the rank ``recovery.Choice.sends`` names, checked
as it arrives (``transfer.py``). Where several ranks of one node receive copies, a file
they all need alike is received by one of them and hard-linked by the others
(``fetch_plan.py``): the arrivals are exchanged first, then each rank links its
node-mates' files (the very inodes they reported) and commits its copy, then the ranks
agree who failed. A failed copy is excluded from the next choice (and deleted once its
node-mates are done with it); a copy that lacked only a node-mate's file is not.
"""

from __future__ import annotations

import contextlib
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..checkpoint.storage.local import LocalStorage
from ..distributed import Phase
from ..errors import CheckpointError
from . import fetch_plan, recovery, transfer
from .deferred_warnings import DeferredWarnings
from .node_dir import NodeDir
from .ranks import Ranks
from .topology import Topology


class Fetcher:
    """One rank's part in sending and receiving a restore's copies (collective); its
    warnings are the restore's, said as the restore ends (``said``)."""

    def __init__(
        self, ranks: Ranks, topology: Topology, node: NodeDir, said: DeferredWarnings
    ) -> None:
        self.ranks, self.topology, self.node = ranks, topology, node
        self.rank = ranks.rank
        self._said = said

    def fetch(self, choice: recovery.Choice, excluded: set[tuple[int, int, int]]) -> list[int]:
        """Send the peers' copies to the ranks that need them; the ranks whose copy did not
        arrive whole (the failed copies excluded), none if all did. Where several ranks of
        a node receive copies, a file they all need is received by one of them and linked
        by the others (``fetch_plan.py``)."""
        step = choice.step
        assert step is not None
        if not choice.sends:  # every rank restores from its own node (the same on all)
            return []
        self.ranks.transfers()
        mine = [r for r, sender in choice.sends.items() if sender == self.rank]
        needed = choice.sends.get(self.rank)
        together = fetch_plan.together(choice.sends, self.topology.node_of)
        elsewhere: dict[str, int] = {}  # files a node-mate receives for this rank
        if together:
            reports = self.ranks.exchange(
                Phase.FETCH,
                lambda: {"copies": self._copies(step, mine), "links": self._links(needed)},
            )
            # A receiver whose directory cannot hard-link receives its whole copy: nothing
            # is planned for it (else it could link no file of a node-mate's, nor a
            # node-mate one of its own, and the node's copies would never be whole).
            linking = {rank for rank, p in enumerate(reports) if p["links"]}
            copies = {
                int(r): fetch_plan.parse_files(files)
                for p in reports
                for r, files in p["copies"].items()
                if int(r) in linking
            }
            elsewhere = fetch_plan.delegate(copies, self.topology.node_of).get(self.rank, {})
        arrived = None
        with ThreadPoolExecutor(max(1, len(mine) + 1)) as pool:
            jobs = [pool.submit(self._send_copy, step, r) for r in mine]
            if needed is not None:
                arrived = self._receive_copy(step, needed, set(elsewhere))
            for job in jobs:
                with contextlib.suppress(Exception):  # the receiver reports it
                    job.result()
        # What follows the transfers runs inside the exchanges (the arrival's report, the
        # links and the commit): an error of theirs on one rank is every rank's, where
        # raised alone it left the others waiting for this rank until the timeout.
        arrivals: list[Any] = []
        committed = False

        def settled() -> list[str | None]:
            """This rank's fault (see below), its copy committed if it has none. (A
            list: a None payload would not be read.)"""
            nonlocal committed
            if arrived is None:
                return ["own" if needed is not None else None]
            fault = self._complete(step, arrived, elsewhere, arrivals) if together else None
            if fault is None:
                committed = arrived.commit()
                fault = None if committed else "own"
                if not committed:  # passed over in silence before: say why, as on arrival
                    self._said.warn(
                        f"shardsafe: restoring step {step}: rank {self.rank}'s copy from rank "
                        f"{needed} {arrived.problem}"
                    )
            return [fault]

        try:
            if together:
                report = functools.partial(self._arrival, arrived, needed is None)
                arrivals = self.ranks.exchange(Phase.FETCH, report)
            # "own": this rank's copy failed (excluded); "mate": a node-mate's, which
            # this one needed, did (the mate's is excluded; this one may be asked for
            # again).
            faults = [f for [f] in self.ranks.exchange(Phase.FETCH, settled)]
        finally:
            if arrived is not None:
                arrived.storage.close()
        # Nothing of a failed copy left behind, but only now that its node-mates have
        # linked what they received in it: removed before, a mate still to link a file
        # of it found it gone, and passed over its own copy, which had arrived whole.
        # Nor of one that did not arrive whole: the files that did would take the room
        # (a replaced node's disk) that the next choice's copies need.
        if needed is not None and not committed:
            with contextlib.suppress(CheckpointError, OSError), self._said.keeping():
                self.node.remove(step, self.rank)
        for rank, its in enumerate(faults):
            if its == "own":
                excluded.add((self.topology.node_of[choice.sends[rank]], step, rank))
        return [rank for rank, its in enumerate(faults) if its]

    def _copies(self, step: int, mine: list[int]) -> dict[str, Any]:
        """The data files (sizes and fingerprints) of the copies this rank sends, by
        receiving rank; a copy it cannot read: none (nothing is planned for it)."""
        found: dict[str, Any] = {}
        for rank in mine:
            with contextlib.suppress(CheckpointError, OSError):
                with self.node.rank_storage(step, rank, create=False) as storage:
                    manifest = transfer.manifest_of(storage)[1]
                if manifest is not None:
                    files = transfer.fingerprints(manifest)
                    found[str(rank)] = {name: list(entry) for name, entry in files.items()}
        return found

    def _links(self, needed: int | None) -> bool:
        """Whether this rank, if it receives a copy (``needed``: its sender), can hard-link
        files in its node's directory (probed as the node's saves probe it)."""
        if needed is None:
            return False
        with contextlib.suppress(CheckpointError, OSError):
            return self.node.links_work(self.rank)
        return False

    def _arrival(self, arrived: transfer.Arrived | None, sends_only: bool) -> dict[str, Any]:
        """What this rank's node-mates need to link what it received: whether it did, and
        each received file's identity, size and fingerprint (from its own manifest)."""
        if arrived is None:
            return {"ok": sends_only, "files": {}}
        files: dict[str, Any] = {}
        mine = arrived.fingerprints
        for name in arrived.received:
            with contextlib.suppress(OSError):
                found = os.stat(name, dir_fd=arrived.storage.fd, follow_symlinks=False)
                if name in mine:
                    files[name] = [found.st_dev, found.st_ino, *mine[name]]
        return {"ok": True, "files": files}

    def _complete(
        self,
        step: int,
        arrived: transfer.Arrived,
        elsewhere: dict[str, int],
        arrivals: list[Any],
    ) -> str | None:
        """Link into ``arrived`` the files node-mates received for it (``elsewhere``), each
        only if the mate reported it arrived with this copy's fingerprint; those linked go
        to ``arrived.linked`` (their bytes checked by the mate as they arrived). ``None``
        if all were; else whose copy failed: ``"mate"`` (its copy did not arrive), or
        ``"own"`` (any other problem: this copy is excluded)."""
        mine = arrived.fingerprints
        for name, mate in sorted(elsewhere.items()):
            if name not in arrived.skipped:  # not a file of this copy
                continue
            theirs = arrivals[mate]
            if not isinstance(theirs, dict) or not theirs.get("ok"):
                return "mate"
            reported = theirs.get("files", {}).get(name)
            why = None
            if name not in mine or not isinstance(reported, list) or len(reported) != 4:
                why = f"rank {mate}, which was to receive its file {name}, reported none"
            elif tuple(reported[2:]) != mine[name]:
                why = (
                    f"the file {name} that rank {mate} received for it is not the one its "
                    "manifest names (their sizes or checksums differ)"
                )
            if why is not None:  # passed over in silence before
                self._said.warn(
                    f"shardsafe: restoring step {step}: rank {self.rank}'s copy is passed "
                    f"over: {why}"
                )
                return "own"
            dev, ino, size, _ = reported
            try:
                self.node.link_reported(
                    step,
                    mate,
                    name,
                    arrived.storage,
                    reported=([dev, ino], size),
                    what=f"the file rank {mate} received for step {step}",
                    gone="its copy was removed since",
                )
            except (CheckpointError, OSError) as e:
                self._said.warn(f"shardsafe: restoring step {step}: {e}")
                return "own"
            arrived.linked.add(name)
        with contextlib.suppress(OSError):
            arrived.storage.sync_directory()
        return None

    def _receive_copy(self, step: int, sender: int, elsewhere: set[str]) -> transfer.Arrived | None:
        """This rank's checkpoint of ``step`` from ``sender`` but the files in
        ``elsewhere``, checked as it arrived, not committed; ``None`` if it did not arrive
        whole (warned, saying why; agreed by :meth:`fetch`)."""

        def target() -> LocalStorage:
            # A stale copy of the step is removed here, inside the protocol: a removal
            # that fails refuses the copy as a directory that cannot be made does.
            # Raised before the protocol, it left the sender waiting for this rank's
            # answer until the timeout, and every rank failed naming others as missing.
            return self.node.fresh_rank_storage(step, self.rank)

        try:
            return transfer.receive_uncommitted(
                self.ranks.group,
                sender,
                rank=self.rank,
                step=step,
                target=target,
                skip=elsewhere,
            )
        except Exception as e:  # agreed by the caller, as a copy that did not arrive
            self._said.warn(f"shardsafe: restoring step {step}: {e}")
            return None

    def _send_copy(self, step: int, rank: int) -> bool:
        def unopened(e: Exception) -> None:  # the receiver was told, and reports it
            self._said.warn(
                f"shardsafe: restoring step {step}: rank {self.rank} could not open rank "
                f"{rank}'s copy of it on this node to send it: {e}"
            )

        return transfer.send_from(
            self.ranks.group,
            rank,
            lambda: self.node.rank_storage(step, rank, create=False),
            step,
            unopened,
        )
