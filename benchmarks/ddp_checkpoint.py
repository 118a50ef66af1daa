"""Plain DDP checkpoint save/load: shardsafe against torch.distributed.checkpoint.

Setup: N ranks (2 by default), an MLP of ``--layers`` 1024x1024 Linear layers in DDP
with a plain Adam, one step taken: 16 layers is about 67 MB of weights + 134 MB of
optimizer state, replicated on every rank. DCP's path: ``get_state_dict`` ->
``dcp.save`` (which writes each replicated tensor once), and ``get_state_dict`` ->
``dcp.load`` -> ``set_state_dict``. There is no target; the ratios are shown. What
else is timed: see _dcp_compare.py.

Run:  python benchmarks/ddp_checkpoint.py [--layers 16] [--ranks 2] [--repeat 3] [--dir D]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dcp_compare import cli

if __name__ == "__main__":
    cli("ddp", __doc__)
