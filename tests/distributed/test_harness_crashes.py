"""The harness's one rerun after a native crash: the crash is reported, a second fails."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.harness import RanksCrashed, run_ranks

pytestmark = pytest.mark.timeout(60)


def _crash_first_time(rank: int, world: int, marker: str) -> int:
    """Rank 1 dies of SIGSEGV while ``marker`` exists (the undo removes it)."""
    if rank == 1 and os.path.exists(marker):
        os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def test_a_native_crash_is_run_once_more_after_the_undo_with_a_warning(tmp_path: Path) -> None:
    marker = tmp_path / "crash"
    marker.touch()
    with pytest.warns(RuntimeWarning, match=r"_crash_first_time: rank\(s\) \[1\] died without"):
        got = run_ranks(
            _crash_first_time,
            2,
            str(marker),
            init_process_group=False,
            rerun_after_native_crash=marker.unlink,
        )
    assert got == [0, 1]


def test_a_second_crash_or_no_undo_fails(tmp_path: Path) -> None:
    marker = tmp_path / "crash"
    marker.touch()
    with pytest.raises(RanksCrashed, match=r"exit codes \[-11\]"):
        run_ranks(_crash_first_time, 2, str(marker), init_process_group=False)
    with pytest.raises(RanksCrashed), pytest.warns(RuntimeWarning):
        run_ranks(
            _crash_first_time,
            2,
            str(marker),
            init_process_group=False,
            rerun_after_native_crash=lambda: None,
        )
