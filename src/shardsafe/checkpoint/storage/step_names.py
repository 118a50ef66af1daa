"""The names of a :class:`~shardsafe.CheckpointManager`'s step directories (``step-000000020``).

Apart from the manager so that a load can tell a manager's root from a checkpoint
(``loading.read_manifest_from``) without importing the manager, which imports the load.
"""

from __future__ import annotations

import re

_STEP_DIR = re.compile(r"step-([0-9]{9,})", re.ASCII)


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def step_of(name: str) -> int | None:
    """The step of a directory name the manager writes, else ``None`` (``step-1``,
    ``step-0000000001`` and non-ASCII digits are not its names)."""
    match = _STEP_DIR.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dir_name(step) == name else None
