"""One rank of a two-rank job whose other rank goes missing, dies or hangs during a save,
for ``test_quiet_failures.py``. The store is hosted outside the ranks (by the test, as
torchrun's agent hosts it), so that the surviving rank still reaches it when rank 0 dies;
but by rank 0 itself in mode ``host-dies`` (as ``shardsafe fit``'s launcher has it).

``python quiet_target.py RANK PORT ROOT MODE`` (``missing``: rank 1 never calls the
second save; ``dies``/``hangs``: rank 0 dies or hangs while it plans it; ``host-dies``:
rank 0, hosting the store, dies while it writes); prints the ``CheckpointError`` it gets
to stderr and exits 3, or exits 0 when it has none.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import shardsafe
from shardsafe.distributed import Coordinator


def main(rank: int, port: int, root: str, mode: str) -> int:
    hosts = mode == "host-dies" and rank == 0
    world = 2 if mode == "host-dies" else 3
    store = dist.TCPStore("127.0.0.1", port, world, hosts, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    # A dead rank is named after 3 s of silence instead of 15: the same code, sooner.
    Coordinator.__init__.__kwdefaults__["dead_after"] = 3.0
    state = {"values": {"w": torch.ones(4)}}
    shardsafe.save(os.path.join(root, "one"), state)  # both ranks, as a run would
    if mode == "missing" and rank == 1:
        time.sleep(6)  # never calls the second save (and outlives rank 0's entry wait)
        return 0
    if mode in ("dies", "hangs") and rank == 0:
        import shardsafe.checkpoint.saving as saving

        def plan_save(*args: object, **kwargs: object) -> object:
            if mode == "dies":
                os._exit(9)  # rank 0 dies while it decides the plan for every rank
            time.sleep(8)  # rank 0 hangs while it decides (longer than timeout)
            os._exit(0)

        saving.plan_save = plan_save  # type: ignore[assignment]
    if mode == "host-dies" and rank == 0:
        import shardsafe.checkpoint.saving as saving

        saving.write_plan = lambda *args, **kwargs: os._exit(9)  # type: ignore[assignment]
    try:
        shardsafe.save(os.path.join(root, "two"), state, entry_timeout=3, timeout=4)
    except shardsafe.CheckpointError as e:
        print(f"CheckpointError: {e}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    status = main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    # Without tearing the process group down: with its peer dead, gloo's teardown aborts
    # the process ("terminate called without an active exception"), after the message.
    os._exit(status)
