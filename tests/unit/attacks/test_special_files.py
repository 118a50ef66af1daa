"""FIFOs and device nodes are refused without being opened for reading."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import shardsafe
from shardsafe import CheckpointCorruptError, CheckpointError, CheckpointManager
from shardsafe.checkpoint.loading import read_manifest
from shardsafe.checkpoint.verifying import find_problems
from tests.unit.attacks.common import (
    _small_state,
    assert_clean_failure,
    data_file,
    fifo_reader_probe,
    make_model,
    opens_with_flags,
    run_cli,
)

pytestmark = pytest.mark.timeout(60)


def _place_special(path: Path, kind: str, stack: contextlib.ExitStack) -> str:
    """Put a non-regular file at ``path``; return how the refusal names it."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        return "a named pipe (FIFO)"
    if kind == "socket":
        sock = stack.enter_context(socket.socket(socket.AF_UNIX))
        cwd = os.getcwd()
        os.chdir(path.parent)  # a socket's path is limited to 108 bytes: bind a short one
        try:
            sock.bind(path.name)
        finally:
            os.chdir(cwd)
        return "a socket"
    major, minor, mode, what = {
        "null device": (1, 3, stat.S_IFCHR, "a character device"),
        "zero device": (1, 5, stat.S_IFCHR, "a character device"),
        "block device": (7, 0, stat.S_IFBLK, "a block device"),
    }[kind]
    try:
        os.mknod(path, 0o666 | mode, os.makedev(major, minor))
    except PermissionError:
        pytest.skip("os.mknod is not permitted here")
    return what


def _commands_on(ckpt: Path, which: str) -> list[tuple[str, Callable[[], Any]]]:
    manifest = read_manifest(ckpt) if which == "data" else None
    ops: list[tuple[str, Callable[[], Any]]] = [
        ("load", lambda: shardsafe.load(ckpt, {"model": make_model(1)})),
        ("verify", lambda: run_cli("verify", str(ckpt))),
        ("inspect", lambda: run_cli("inspect", str(ckpt))),
        ("inspect --json", lambda: run_cli("inspect", "--json", str(ckpt))),
    ]
    if manifest is not None:
        ops.append(("find_problems", lambda: find_problems(str(ckpt), manifest)))
    return ops


def _expect_refusal(op: str, result: Any, which: str, fragment: str) -> None:
    if isinstance(result, BaseException):
        assert type(result) is CheckpointCorruptError, repr(result)
        assert fragment in str(result), str(result)
    elif op == "find_problems":
        assert len(result) == 1 and fragment in result[0], result
    elif op.startswith("inspect") and which == "data":
        assert result[0] == 0, result  # inspect reads manifest.json only
    elif op == "verify" and which == "data":
        rc, out, _ = result
        assert rc == 1 and fragment in out and out.splitlines()[-1].startswith("FAILED"), result
    else:
        assert_clean_failure(*result)
        assert fragment in result[2], result


def _run(op: Callable[[], Any]) -> Any:
    try:
        return op()
    except CheckpointError as e:
        return e


@pytest.mark.parametrize("which", ["data", "manifest"])
def test_a_fifo_is_never_opened_for_reading(copy_of: Any, which: str) -> None:
    ckpt = copy_of("sharded")
    path = data_file(ckpt) if which == "data" else ckpt / "manifest.json"
    ops = _commands_on(ckpt, which)
    with contextlib.ExitStack() as stack:
        what = _place_special(path, "fifo", stack)
        fragment = f"{path.name} is not a regular file ({what})"
        with fifo_reader_probe(path) as probe:
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                for name, op in ops:
                    _expect_refusal(name, _run(op), which, fragment)
        assert probe["attempts"] >= 50 and probe["readers_seen"] == 0, probe


def test_the_fifo_probe_sees_a_reader(tmp_path: Path) -> None:
    """The probe above can fail: it notices anyone holding the FIFO open for reading."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with fifo_reader_probe(fifo) as probe:
            time.sleep(0.2)
    finally:
        os.close(fd)
    assert probe["readers_seen"] >= 5


@pytest.mark.parametrize("which", ["data", "manifest"])
@pytest.mark.parametrize("kind", ["null device", "zero device", "block device", "socket"])
def test_a_device_node_or_socket_is_only_ever_opened_with_o_path(
    copy_of: Any, which: str, kind: str
) -> None:
    ckpt = copy_of("sharded")
    path = data_file(ckpt) if which == "data" else ckpt / "manifest.json"
    ops = _commands_on(ckpt, which)
    with contextlib.ExitStack() as stack:
        what = _place_special(path, kind, stack)
        fragment = f"{path.name} is not a regular file ({what})"
        with opens_with_flags() as flagged:
            for name, op in ops:
                _expect_refusal(name, _run(op), which, fragment)
    mine = [flags for p, flags in flagged if os.path.basename(p) == path.name]
    # data: load, verify, find_problems (inspect never looks); manifest: load, verify, inspects
    expected_looks = {"data": 3, "manifest": 4}[which]
    assert len(mine) == expected_looks, mine
    assert all(flags != -1 and flags & os.O_PATH for flags in mine), mine


@pytest.mark.parametrize("kind", ["fifo", "null device"])
def test_the_manager_passes_over_a_special_manifest_without_opening_it(
    tmp_path: Path, kind: str
) -> None:
    manager = CheckpointManager(tmp_path / "root")
    manager.save(1, _small_state(1))
    newest = Path(manager.save(2, _small_state(2)))
    with contextlib.ExitStack() as stack:
        what = _place_special(newest / "manifest.json", kind, stack)
        probe_ctx = (
            fifo_reader_probe(newest / "manifest.json")
            if kind == "fifo"
            else contextlib.nullcontext({"attempts": 0, "readers_seen": 0})
        )
        with opens_with_flags() as flagged, probe_ctx as probe:
            pattern = f"passing over .*step-000000002.*{re.escape(what)}"
            deadline, calls = time.monotonic() + 0.3, 0
            while time.monotonic() < deadline or calls < 20:
                with pytest.warns(UserWarning, match=pattern):
                    assert manager.latest() == str(tmp_path / "root" / "step-000000001")
                calls += 1
        assert probe["readers_seen"] == 0
    manager.close()
    mine = [flags for p, flags in flagged if p == "manifest.json"]
    assert mine and all(flags & os.O_PATH for flags in mine)


def test_a_fifo_as_the_root_lock_is_refused_without_being_opened(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    lock = root / ".shardsafe.lock"
    os.mkfifo(lock)
    manager = CheckpointManager(root)
    with fifo_reader_probe(lock) as probe:
        for _ in range(5):
            with pytest.raises(CheckpointError, match=r"is damaged: .*a named pipe \(FIFO\)"):
                manager.save(1, _small_state(1))
        time.sleep(0.1)
    assert probe["readers_seen"] == 0
    assert os.listdir(root) == [".shardsafe.lock"] and stat.S_ISFIFO(os.lstat(lock).st_mode)


def test_a_symlinked_root_lock_is_never_written_through(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    precious = elsewhere / "precious.json"
    precious.write_text('{"pid": 1, "host": "elsewhere"}')
    lock = root / ".shardsafe.lock"
    os.symlink(precious, lock)
    manager = CheckpointManager(root)
    with pytest.raises(CheckpointError, match=r"is damaged: .*is a symbolic link"):
        manager.save(1, _small_state(1))  # not a lock shardsafe writes: damaged
    old = time.time() - 3600
    os.utime(lock, (old, old), follow_symlinks=False)
    with pytest.raises(CheckpointError, match=r"is damaged: .*is a symbolic link"):
        manager.save(1, _small_state(1))  # however old: a damaged lock is never taken over
    assert precious.read_text() == '{"pid": 1, "host": "elsewhere"}'
    lock.unlink()  # what the message says to do: the link itself, never what it names
    manager.save(1, _small_state(1))
    assert precious.read_text() == '{"pid": 1, "host": "elsewhere"}'
    assert not lock.is_symlink() and json.loads(lock.read_text())["pid"] == os.getpid()
    manager.close()
    assert not lock.exists() and precious.exists()
