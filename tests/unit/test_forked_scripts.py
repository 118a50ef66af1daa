"""The tests' forked scripts (``tests/forked_scripts.py``) are what ``python script.py``
would be: their own process and session, arguments, environment, working directory and
streams, and their exit status or the signal that killed them."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.forked_scripts import run_script, start_script

SCRIPT = """
import json, os, sys
print(json.dumps({
    "argv": sys.argv, "orig_argv": sys.orig_argv, "cwd": os.getcwd(),
    "env": os.environ.get("FORKED_TEST"), "main": __name__, "pid": os.getpid(),
    "sid": os.getsid(0), "path0": sys.path[0], "stdin": sys.stdin.read(),
}))
print("to stderr", file=sys.stderr)
raise SystemExit(int(sys.argv[1]))
"""


@pytest.mark.timeout(60)
def test_a_forked_script_sees_what_python_script_py_would(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {"PATH": os.environ.get("PATH", ""), "FORKED_TEST": "yes"}
    done = run_script([str(script), "3", "x"], env, timeout=50, cwd=str(tmp_path / ".."))
    assert done.returncode == 3
    assert done.stderr == "to stderr\n"
    seen = json.loads(done.stdout)
    assert seen["argv"] == [str(script), "3", "x"]
    assert seen["orig_argv"] == [sys.executable, str(script), "3", "x"]
    assert seen["cwd"] == str(tmp_path.parent)
    assert seen["env"] == "yes" and seen["main"] == "__main__"
    assert seen["sid"] == seen["pid"] != os.getpid()  # a session of its own
    assert seen["path0"] == str(tmp_path) and seen["stdin"] == ""


@pytest.mark.timeout(60)
def test_a_forked_module_run_and_a_killed_script_answer_as_popen(tmp_path: Path) -> None:
    done = run_script(["-m", "json.tool", "--help"], dict(os.environ), timeout=50)
    assert done.returncode == 0 and "json.tool" in done.stdout
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    log = tmp_path / "log"
    log.touch()
    started = start_script([str(script)], dict(os.environ), str(log))
    while "up" not in log.read_text():
        assert started.poll() is None
        time.sleep(0.02)
    os.killpg(started.pid, signal.SIGKILL)
    assert started.wait(30) == -signal.SIGKILL == started.returncode
