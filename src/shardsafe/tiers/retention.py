"""What local retention keeps: the counts of the ranks that replicated each step, in the
job's store (:class:`Tally`), and the steps of one rank's checkpoints kept on a node
(:func:`retained`, pure); the replicator (``replication.py``) applies them after each
step's replication.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .node_dir import NodeDir


class Tally:
    """Counts, in the job's store, the ranks that have replicated each step: retention
    keeps the newest step every rank replicated, so that a lost node never leaves only
    steps some rank lacks (and, while no step is replicated everywhere yet, the newest
    step every rank has written, counted apart). Counting never blocks (a rank that
    never replicates a step simply leaves it uncounted). ``run`` (agreed at
    construction) keeps a restarted job's counts apart from an earlier attempt's in a
    store that outlived it. Each local save
    ``save`` (its number, the same on every rank) is counted apart: a step saved again
    replaces its earlier copies, so the ranks that replicated those do not count for it
    (nor does one rank, twice)."""

    def __init__(self, store: Any, prefix: str, world_size: int) -> None:
        self._store, self._prefix, self._world_size = store, prefix, world_size

    def mark(self, step: int, save: int) -> None:
        self._store.add(f"{self._prefix}/{step}/{save}", 1)

    def everywhere(self, step: int, save: int) -> bool:
        return int(self._store.add(f"{self._prefix}/{step}/{save}", 0)) >= self._world_size

    def mark_written(self, step: int, save: int) -> None:
        """This rank committed its own checkpoint of ``save`` (not yet replicated)."""
        self._store.add(f"{self._prefix}/w/{step}/{save}", 1)

    def written_everywhere(self, step: int, save: int) -> bool:
        """Whether every rank committed its own checkpoint of ``save``: the job restarted
        with every node kept restores it, replicated or not."""
        return int(self._store.add(f"{self._prefix}/w/{step}/{save}", 0)) >= self._world_size

    def withdraw(self, step: int, save: int) -> bool:
        """This rank is about to delete its checkpoint of ``save``, newer than the newest
        step it saw counted everywhere: take back its counts, unless the step has just
        become complete (then they are put back, and ``False`` says keep it).

        The counts this rank read lag behind the other ranks': without this, it deleted a
        step another rank had meanwhile seen counted everywhere, and that rank deleted the
        older complete step on the strength of it, so that no step was whole on any node.
        Taken back atomically (``add`` returns the count it leaves), the step either was
        complete (kept here) or can never be counted complete again, so no rank deletes
        an older step because of it. Should this rank not have counted it (its count
        failed), the step is not whole without its copy either."""
        taken: list[str] = []
        for key in (f"{self._prefix}/{step}/{save}", f"{self._prefix}/w/{step}/{save}"):
            left = int(self._store.add(key, -1))
            taken.append(key)
            if left + 1 >= self._world_size:
                for back in taken:
                    self._store.add(back, 1)
                return False
        return True

    def forget(self, step: int, save: int) -> None:
        """Delete the counts of ``save`` (every rank that held it does: the first deletes)."""
        self._store.delete_key(f"{self._prefix}/{step}/{save}")
        self._store.delete_key(f"{self._prefix}/w/{step}/{save}")


def retained(
    steps: Iterable[int], keep: int, everywhere: int | None, *, upto: int
) -> set[int] | None:
    """The steps of one rank's checkpoints that retention keeps here: the ``keep`` newest
    of ``steps`` (its steps this run wrote or received, and those found at a restore)
    up to ``upto`` (the step just replicated: a later one the writer has done is not
    replicated yet, and must not push a replicated one out) and ``everywhere`` (the
    newest step every rank replicated, or the restored one), once there are ``keep`` of
    them; ``None`` (keep everything) before. A replication that fails for good then
    still leaves at most ``keep + 1`` steps, and the last step complete on other nodes
    is never the one deleted."""
    window = sorted(s for s in set(steps) if s <= upto)
    if len(window) < keep:
        return None
    kept = set(window[-keep:])
    if everywhere is not None:
        kept.add(everywhere)
    return kept


def drop_older(
    node: NodeDir, rank: int, kept: set[int], may_delete: Callable[[int], bool] | None = None
) -> None:
    """Delete ``rank``'s checkpoints here older than the newest of ``kept`` but those,
    oldest first; ``may_delete`` is asked about each just before, and one it refuses is
    added to ``kept`` instead (the record of what this rank holds is pruned by it)."""
    newest = max(kept)
    for step in node.steps():
        if step not in kept and step < newest and rank in node.ranks_in(step):
            if may_delete is not None and not may_delete(step):
                kept.add(step)
                continue
            node.remove(step, rank, prune=True)
