"""A full disk during a save: the error names the file being written; a background
save's error, raised by a later call, names the step and the path of the save that failed.

Real mechanisms, no faked ``OSError``: a 1 MiB tmpfs mounted in a user namespace
(``unshare -rm``, where the kernel lets an unprivileged user do that: a real ENOSPC), and
a file-size limit (``RLIMIT_FSIZE`` with SIGXFSZ ignored: EFBIG from the very same
``os.write`` and ``fsync`` calls), which works everywhere. Every ``OSError`` raised while
a file is written is named the same way, so EFBIG stands for ENOSPC (and EIO, EDQUOT)
where no tmpfs can be mounted.
"""

from __future__ import annotations

import contextlib
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe import CheckpointError, CheckpointManager

BIG = {"weights": {"w": torch.zeros(1 << 20)}}  # 4 MiB: more than the 1 MiB allowed
SMALL = {"weights": {"w": torch.zeros(16)}}
SHARD = "shard-00000-of-00001.safetensors"
UNSHARE = ["unshare", "--map-root-user", "--mount", "sh", "-c"]
"""A shell in a mount namespace of its own, where mounting a tmpfs needs no privilege."""


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Writing past ``nbytes`` of any file fails with EFBIG (instead of SIGXFSZ)."""
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, ignored)


FULL_DISK = """
import sys, torch, shardsafe
try:
    shardsafe.save(sys.argv[1] + "/ckpt", {"weights": {"w": torch.zeros(1 << 20)}})
except shardsafe.CheckpointError as e:
    print(e)
    sys.exit(3)
"""


def test_a_full_disk_names_the_file_being_written(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = 'mount -t tmpfs -o size=1m tmpfs "$0"'
    if (
        shutil.which("unshare") is None
        or subprocess.run([*UNSHARE, mount, str(disk)], capture_output=True).returncode
    ):
        pytest.skip("no tmpfs can be mounted here (unshare -rm); EFBIG tests the same path")
    done = subprocess.run(
        [*UNSHARE, f'{mount} && exec "$1" -c "$2" "$0"', str(disk), sys.executable, FULL_DISK],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr[-3000:]
    assert (
        f"OSError: [Errno 28] No space left on device: '{disk / 'ckpt' / SHARD}'" in done.stdout
    ), done.stdout


def test_a_file_size_limit_names_the_file_being_written(tmp_path: Path) -> None:
    with file_size_limit(1 << 20), pytest.raises(CheckpointError) as info:
        shardsafe.save(tmp_path / "ckpt", BIG)
    assert f"OSError: [Errno 27] File too large: '{tmp_path / 'ckpt' / SHARD}'" in str(info.value)
    assert not (tmp_path / "ckpt").exists()  # the failed save cleaned up after itself


def test_a_background_error_names_the_step_and_path_of_the_save_that_failed(
    tmp_path: Path,
) -> None:
    manager = CheckpointManager(tmp_path)
    with file_size_limit(1 << 20):
        manager.async_save(7, BIG)  # fails in the background; nobody waits for it
        with pytest.raises(CheckpointError) as by_next_save:
            manager.save(8, SMALL)
        manager.save(8, SMALL)  # seen once: the next save goes on
        manager.async_save(9, BIG)
        with pytest.raises(CheckpointError) as by_close:
            manager.close()
        handle = shardsafe.async_save(tmp_path / "plain", BIG)
        with pytest.raises(CheckpointError) as by_wait:
            handle.wait()
    for info, step in ((by_next_save, 7), (by_close, 9)):
        path = tmp_path / f"step-{step:09d}"
        assert str(info.value).startswith(
            f"the background save of step {step} to {path} failed: OSError: [Errno 27] "
            f"File too large: '{path / SHARD}'"
        ), str(info.value)
    assert str(by_wait.value).startswith(
        f"the background save to {tmp_path / 'plain'} failed: OSError: [Errno 27] File too "
        f"large: '{tmp_path / 'plain' / SHARD}'"
    ), str(by_wait.value)
    assert CheckpointManager(tmp_path).complete_steps() == [8]


ENDS_WITHOUT_WAITING = """
import resource, signal, sys, torch, shardsafe
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
manager = shardsafe.CheckpointManager(sys.argv[1])
if sys.argv[2] == "waited":
    manager.async_save(6, {"weights": {"w": torch.zeros(16)}}).wait()
manager.async_save(7, {"weights": {"w": torch.zeros(1 << 20)}})  # fails in the background
print("the script ends", flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("before", ["first save", "waited"])
def test_a_background_error_nobody_waited_for_is_written_to_stderr_at_exit(
    tmp_path: Path, before: str
) -> None:
    """A script whose last async_save failed ended silently, as if it had saved."""
    done = subprocess.run(
        [sys.executable, "-c", ENDS_WITHOUT_WAITING, str(tmp_path), before],
        capture_output=True,
        text=True,
        timeout=50,
    )
    path = tmp_path / "step-000000007"
    assert done.stdout == "the script ends\n"
    assert done.stderr.startswith(
        f"shardsafe: the background save of step 7 to {path} failed: OSError: [Errno 27] "
        f"File too large: '{path / SHARD}'"
    ), done.stderr
    assert done.stderr.count("shardsafe: ") == 1
    assert "nobody waited for: call handle.wait(), or manager.close()" in done.stderr
    assert CheckpointManager(tmp_path).complete_steps() == ([6] if before == "waited" else [])
