"""``shardsafe convert`` as a user runs it: a separate process, a progress bar only on a
terminal, the pickle note for ``--to torch``, exit statuses."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch

import shardsafe

pytestmark = pytest.mark.timeout(180)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def checkpoint(path: Path) -> None:
    torch.manual_seed(0)
    shardsafe.save(path, {"model": torch.nn.Linear(64, 64), "step": 1})


def run(*args: str, stderr: int | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardsafe", "convert", *args],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stderr is None else stderr,
        text=True,
        timeout=120,
        check=False,
    )


def test_progress_bar_on_a_terminal_only(tmp_path: Path) -> None:
    pytest.importorskip("tqdm")
    checkpoint(tmp_path / "ckpt")
    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    try:
        done = run(str(tmp_path / "ckpt"), str(tmp_path / "dcp"), "--to", "dcp", stderr=child)
        os.close(child)
        child = -1
        shown = b""
        while True:
            try:
                data = os.read(parent, 4096)
            except OSError:  # the terminal's other end is closed: all was read
                break
            if not data:
                break
            shown += data
    finally:
        os.close(parent)
        if child >= 0:
            os.close(child)
    assert done.returncode == 0, done.stdout
    assert b"shardsafe -> dcp" in shown and b"100%" in shown
    assert "wrote" in done.stdout

    piped = run(str(tmp_path / "ckpt"), str(tmp_path / "ss"))
    assert piped.returncode == 0 and piped.stderr == ""


def test_torch_output_carries_the_pickle_note_and_errors_exit_1(tmp_path: Path) -> None:
    checkpoint(tmp_path / "ckpt")
    done = run(str(tmp_path / "ckpt"), str(tmp_path / "model.pt"), "--to", "torch")
    assert done.returncode == 0
    assert "note: the result is a pickle" in done.stdout and "weights_only=True" in done.stdout
    assert done.stderr == ""  # the note once, with the result, not as a warning too
    assert torch.load(tmp_path / "model.pt", weights_only=True)["step"] == 1

    again = run(str(tmp_path / "ckpt"), str(tmp_path / "model.pt"), "--to", "torch")
    assert again.returncode == 1 and "Traceback" not in again.stderr
    assert again.stderr.startswith("shardsafe: error: ")
    usage = run(str(tmp_path / "ckpt"), str(tmp_path / "x"), "--to", "onnx")
    assert usage.returncode == 2


def test_a_warning_of_the_conversion_is_said_on_the_command_line(tmp_path: Path) -> None:
    """Found in review: the command silenced every warning with the pickle note's, so a
    conversion to DCP that turns an optimizer's numbered state into text keys (which a
    later ``load_state_dict`` no longer matches to its parameters: momentum lost) said
    nothing on the command line, where the API warns."""
    model = torch.nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 1)).sum().backward()
    opt.step()
    torch.save(
        {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]},
        tmp_path / "last.ckpt",
    )
    done = run(str(tmp_path / "last.ckpt"), str(tmp_path / "dcp"), "--to", "dcp")
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith(
        "shardsafe convert: warning: DCP stores every key as text, so the key 0 of "
        "['optimizer_states'][0]['state'][0] (and any other key that is no string) reads back "
        "as '0'"
    ), done.stderr
    assert len(done.stderr.splitlines()) == 1
