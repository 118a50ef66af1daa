"""Every warning shardsafe gives names the user's line, not one of shardsafe's files.

Each used to count its ``stacklevel`` by hand; several counts had gone stale and pointed
into shardsafe (``manager.py``, ``values.py``, ``api.py``), where the line shown says
nothing to the user and a filter on the user's module (``-W error::UserWarning:train``)
never matched.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardsafe


def _warned(action: Callable[[], object], about: str = "shardsafe") -> list[tuple[str, str, int]]:
    """``(message, file, line)`` of each warning ``action`` gave that mentions ``about``."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        action()
    return [(str(w.message), w.filename, w.lineno) for w in seen if about in str(w.message)]


def _line_of(text: str) -> int:
    """The line of this file holding ``text`` (the call a warning must point at)."""
    lines = Path(__file__).read_text().splitlines()
    (number,) = [i for i, line in enumerate(lines, 1) if text in line and "_line_of" not in line]
    return number


def test_a_fresh_managers_warning_about_older_checkpoints_names_the_save(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    shardsafe.CheckpointManager(root).save(1, {"w": torch.ones(2)})
    later = shardsafe.CheckpointManager(root)
    warned = _warned(lambda: later.save(2, {"w": torch.ones(2)}))  # <- the save
    assert [w[1:] for w in warned] == [(__file__, _line_of("# <- the save"))], warned
    assert "already holds checkpoints up to step 1" in warned[0][0]


def test_a_damaged_newest_step_passed_over_names_the_call_of_latest(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    manager = shardsafe.CheckpointManager(root)
    manager.save(1, {"w": torch.ones(2)})
    manager.save(2, {"w": torch.ones(2)})
    Path(manager.path_for(2), "manifest.json").write_text("{")
    warned = _warned(lambda: shardsafe.CheckpointManager(root).latest())  # <- latest
    assert [w[1:] for w in warned] == [(__file__, _line_of("# <- latest"))], warned
    assert warned[0][0].startswith(f"shardsafe: passing over {manager.path_for(2)}: ")


def test_a_live_tree_no_checkpoint_holds_names_the_load(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    shardsafe.save(path, {"extra": {"t": torch.ones(2)}})
    live = {"extra": {"t": torch.zeros(2), "device": torch.device("cpu")}}
    warned = _warned(lambda: shardsafe.load(path, live, strict=False))  # <- the load
    assert [w[1:] for w in warned] == [(__file__, _line_of("# <- the load"))], warned
    assert "holds a value that no checkpoint can hold" in warned[0][0]


def test_an_entry_left_as_it_was_names_the_load(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    shardsafe.save(path, {"w": torch.ones(2)})
    live = {"w": torch.zeros(2), "other": torch.zeros(2)}
    warned = _warned(lambda: shardsafe.load(path, live, strict=False))  # <- strict=False
    assert [w[1:] for w in warned] == [(__file__, _line_of("# <- strict=False"))], warned


def test_converting_to_a_torch_file_names_the_call_of_convert(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    shardsafe.save(path, {"w": torch.ones(2)})
    target = str(tmp_path / "out.pt")
    warned = _warned(lambda: shardsafe.convert(path, target, to="torch"), "pickle")  # <- convert
    assert [w[1:] for w in warned] == [(__file__, _line_of("# <- convert"))], warned


@pytest.mark.parametrize("depth", [0, 5])
def test_the_frame_named_is_the_caller_of_the_outermost_shardsafe_frame(depth: int) -> None:
    """Called from outside shardsafe, a warning names that caller however deep it is."""
    from shardsafe import _warnings

    def nested(n: int) -> None:
        if n:
            nested(n - 1)
        else:
            _warnings.warn("shardsafe: here")

    warned = _warned(lambda: nested(depth))
    assert [w[1] for w in warned] == [__file__]
    assert os.path.basename(warned[0][1]) == "test_warnings_point_at_caller.py"
