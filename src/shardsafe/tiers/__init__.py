"""Tiered checkpoints: node-local rank checkpoints replicated to peer nodes, over a
persistent tier (``TieredCheckpointManager``).

``topology`` (nodes and replica peers), ``rank_checkpoint`` (one rank's state as an
ordinary checkpoint, and the view that loads it back), ``node_dir`` (the node-local
directory), ``transfer`` (one rank checkpoint sent over gloo, verified before commit),
``replication`` (the background writer and replicator, retention), ``budget`` (local
space), ``recovery`` (choosing the step and the sources), ``restore`` (restoring it),
``ranks`` (payloads agreed, the transfers' group), ``manager`` (the API).
"""

from __future__ import annotations

from .manager import TieredCheckpointManager
from .restore import Restored

__all__ = ["Restored", "TieredCheckpointManager"]
