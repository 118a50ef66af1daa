"""FSDP2 checkpoint save/load: shardsafe against torch.distributed.checkpoint.

Setup (the FSDP issue): N ranks (2 by default), an MLP of ``--layers`` 1024x1024 Linear
layers, each layer and the root ``fully_shard``-ed, AdamW with one step taken: 16 layers
is about 67 MB of weights + 134 MB of optimizer state. DCP's path is the documented one:
``get_state_dict`` -> ``dcp.save``, and ``get_state_dict`` -> ``dcp.load`` ->
``set_state_dict``. Target: shardsafe's (sharded) save and load each at most 0.8x DCP's
time. What else is timed: see _dcp_compare.py.

Run:  python benchmarks/fsdp_checkpoint.py [--layers 16] [--ranks 2] [--repeat 3] [--dir D]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dcp_compare import cli

if __name__ == "__main__":
    cli("fsdp", __doc__)
