"""The gate every untrusted pickle passes: shardsafe never pickles, but it reads what
others pickled (DCP's ``.metadata``, ``torch.save``/``.pt`` and Lightning ``.ckpt`` files,
the ``torch.save`` items inside ``.distcp`` files).

* ``policy.py``: what one kind of pickle may contain (fixed tables) and the limits;
* ``nodes.py``: the stand-ins the machine works on;
* ``machine.py``: the pickle machine run on stand-ins, opcode by opcode: its state, its
  stream and stack, its run loop;
* ``opcodes.py``: which handler each opcode runs; ``values.py`` (numbers, strings,
  containers, the memo), ``objects.py`` (globals, calls, ``BUILD``: the policy enforced)
  and ``hot.py`` (the common opcodes in one step) hold the handlers;
* ``calls.py``: what each allowed callable may be given;
* ``hashing.py``: keys crafted to share a hash;
* ``scan.py``: the verdict: the machine run to ``STOP``, its graph measured;
* ``gate.py``: ``torch.save`` archives: their pickle scanned, then ``torch.load``.
"""

from . import calls
from .gate import TORCH_POLICY, check_archive, load_torch, load_torch_mapped
from .policy import ANY_FIELDS, MAX_PICKLE_BYTES, Policy
from .scan import scan

__all__ = [
    "ANY_FIELDS",
    "MAX_PICKLE_BYTES",
    "TORCH_POLICY",
    "Policy",
    "calls",
    "check_archive",
    "load_torch",
    "load_torch_mapped",
    "scan",
]
