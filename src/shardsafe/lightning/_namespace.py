"""Which PyTorch Lightning: the ``pytorch_lightning`` package or ``lightning.pytorch``.

Both ship the same classes under two names, and a Trainer only accepts a strategy built
on its own package's ``Strategy``. The one the user's script has already imported wins
(``pytorch_lightning`` first, if it has imported both); otherwise whichever is installed,
``pytorch_lightning`` first. Everything else in ``shardsafe.lightning`` reaches Lightning
through :func:`lightning`, never by importing a package name directly.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

PACKAGES = ("pytorch_lightning", "lightning.pytorch")
SUPPORTED = ((2, 2), (3, 0))
"""Lightning versions ``[from, to)`` the strategy is written against (its hooks are not
a stable API, so a new major version is refused rather than half-working)."""


def lightning() -> ModuleType:
    """The Lightning package to build on, checked to be a supported version."""
    for name in PACKAGES:
        if name in sys.modules:
            return _checked(sys.modules[name])
    for name in PACKAGES:
        try:
            return _checked(importlib.import_module(name))
        except ModuleNotFoundError:
            continue
    raise ImportError(
        "shardsafe.lightning needs PyTorch Lightning 2.x: pip install 'shardsafe[lightning]' "
        "(installs pytorch-lightning), or install the 'lightning' package"
    )


def _checked(module: ModuleType) -> ModuleType:
    version = str(getattr(module, "__version__", "0"))
    major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if not SUPPORTED[0] <= major_minor < SUPPORTED[1]:
        raise ImportError(
            f"shardsafe.lightning supports Lightning >=2.2,<3; {module.__name__} is {version}. "
            "Install a supported version: pip install 'shardsafe[lightning]'"
        )
    return module
