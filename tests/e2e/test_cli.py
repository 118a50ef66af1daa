"""The ``shardsafe`` command line as a user runs it: real processes on real checkpoints.

Every check runs ``python -m shardsafe`` (forked from a server that has imported torch
already, ``tests/forked_scripts.py``: otherwise the same process); the main ones also run
the installed ``shardsafe`` console script, a fresh interpreter, which is what the README
tells users to type. Checkpoints
are written once per layout by ``shardsafe.save`` and copied before being damaged.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import cli
from shardsafe._text import human_bytes
from tests import forge
from tests.forked_scripts import run_script

SRC = str(Path(__file__).resolve().parents[2] / "src")
SCRIPT = Path(sys.executable).parent / "shardsafe"
LAUNCHERS = {
    "module": [sys.executable, "-m", "shardsafe"],
    "script": [str(SCRIPT)],
}
LAYOUTS = ("sharded", "consolidated")
VALUE = {"step": 3, "name": "demo", "tags": ["a", "b"]}


def run_cli(*args: str | Path, launcher: str = "module") -> subprocess.CompletedProcess[str]:
    if launcher == "script" and not SCRIPT.exists():
        pytest.skip(f"the console script is not installed at {SCRIPT}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    argv = [*LAUNCHERS[launcher], *map(str, args)]
    if launcher == "module":  # ``python -m shardsafe``, forked with torch imported already
        proc = run_script(argv[1:], env, timeout=50)
    else:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=50, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


# ---------------------------------------------------------------------------- fixtures


def _train_one_step() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    model, opt = _train_one_step()
    state = {"model": model, "optimizer": opt, "rng": shardsafe.RNGState(), "meta": VALUE}
    out = {}
    for layout in LAYOUTS:
        path = tmp_path_factory.mktemp("ckpt") / layout
        shardsafe.save(path, state, layout=layout)
        out[layout] = path
    return out


@pytest.fixture
def damaged(pristine: dict[str, Path], tmp_path: Path) -> Callable[[str], Path]:
    """A fresh copy of the pristine checkpoint of a layout, free to corrupt."""

    def copy(layout: str) -> Path:
        return Path(shutil.copytree(pristine[layout], tmp_path / layout))

    return copy


def manifest(path: Path) -> dict[str, Any]:
    """The manifest's document, version 2's chunk table expanded (see ``tests/forge.py``)."""
    return forge.read_manifest(path)


def data_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def header(file: Path) -> tuple[int, dict[str, Any]]:
    """The safetensors header of ``file`` and its length in bytes."""
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return length, json.loads(raw[8 : 8 + length])


def key_of_last_tensor(path: Path, file: Path) -> str:
    """The manifest key of the tensor whose bytes end the data file."""
    _, head = header(file)
    last = max((n for n in head if n != "__metadata__"), key=lambda n: head[n]["data_offsets"][1])
    for key, rec in manifest(path)["tensors"].items():
        if any(c["file"] == file.name and c["name"] == last for c in rec["chunks"]):
            return str(key)
    raise AssertionError(f"no manifest key stored as {last!r} in {file.name}")


def flip_byte(file: Path, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def expected_tensors() -> dict[str, tuple[str, list[int]]]:
    """Key -> (dtype, shape) of the model and optimizer tensors the checkpoint must hold."""
    model, _ = _train_one_step()
    out = {}
    for name, p in model.state_dict().items():
        out[f"model/{name}"] = ("float32", list(p.shape))
        out[f"optimizer/{name}/exp_avg"] = ("float32", list(p.shape))
        out[f"optimizer/{name}/exp_avg_sq"] = ("float32", list(p.shape))
        out[f"optimizer/{name}/step"] = ("float32", [])
    return out


# ---------------------------------------------------------------------------- inspect


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("launcher", "layout"),
    [("module", "sharded"), ("module", "consolidated"), ("script", "sharded")],
)
def test_inspect_prints_every_key_with_dtype_and_shape(
    pristine: dict[str, Path], launcher: str, layout: str
) -> None:
    path = pristine[layout]
    proc = run_cli("inspect", path, launcher=launcher)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(rf"^layout\s+{layout}$", out, re.M)
    assert re.search(r"^world size\s+1 at save$", out, re.M)
    assert re.search(r"^format\s+shardsafe version 2$", out, re.M)
    assert re.search(r"^created\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC by shardsafe ", out, re.M)
    for key, (dtype, shape) in expected_tensors().items():
        shown = "[" + ", ".join(map(str, shape)) + "]"
        assert re.search(rf"^{re.escape(key)}\s+{dtype}\s+{re.escape(shown)}\s+\d", out, re.M), key
    for key in manifest(path)["tensors"]:  # every key, including RNG state
        assert re.search(rf"^{re.escape(key)}\s", out, re.M), key
    for name, kind in [("meta", "value"), ("model", "module"), ("optimizer", "optimizer")]:
        assert re.search(rf"^{name}\s+{kind}\s", out, re.M), name
    assert re.search(r"^rng\s+rng\s", out, re.M)
    assert '"name": "demo"' in out  # a JSON value is previewed
    files = data_files(path)
    total = sum(f.stat().st_size for f in path.iterdir())
    assert f"in {len(files)} data file" in out
    assert f"{total} bytes" in out
    for f in files:
        assert re.search(rf"^{re.escape(f.name)}\s", out, re.M)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_json_totals_match_the_files_on_disk(
    pristine: dict[str, Path], layout: str
) -> None:
    path = pristine[layout]
    proc = run_cli("inspect", "--json", path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["path"] == str(path.resolve())
    assert (doc["format"], doc["format_version"], doc["layout"]) == ("shardsafe", 2, layout)
    assert doc["world_size"] == 1
    assert isinstance(doc["created_unix"], float) and doc["created"].endswith("+00:00")
    assert doc["shardsafe_version"] == shardsafe.__version__
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert set(tensors) == set(manifest(path)["tensors"])
    for key, (dtype, shape) in expected_tensors().items():
        assert (tensors[key]["dtype"], tensors[key]["shape"]) == (dtype, shape)
        assert tensors[key]["value"] == key.split("/")[0]
    files = data_files(path)
    totals = doc["totals"]
    assert totals["data_files"] == len(files) == len(doc["files"])
    assert totals["data_bytes"] == sum(f.stat().st_size for f in files)
    assert totals["manifest_bytes"] == (path / "manifest.json").stat().st_size
    assert totals["bytes"] == sum(f.stat().st_size for f in path.iterdir())
    assert totals["tensors"] == len(tensors)
    assert totals["tensor_bytes"] == sum(t["bytes"] for t in doc["tensors"])
    assert {f["name"]: f["bytes"] for f in doc["files"]} == {
        f.name: f.stat().st_size for f in files
    }
    values = {v["name"]: v for v in doc["values"]}
    assert {n: v["kind"] for n, v in values.items()} == {
        "meta": "value",
        "model": "module",
        "optimizer": "optimizer",
        "rng": "rng",
    }
    assert values["meta"]["value"] == VALUE
    assert values["model"]["tensors"] == 4


@pytest.mark.timeout(60)
def test_inspect_imports_only_its_own_command(pristine: dict[str, Path]) -> None:
    code = (
        "import sys; from shardsafe.cli import main; rc = main(['inspect', sys.argv[1]]); "
        "print(sorted(m for m in sys.modules if m.startswith('shardsafe.commands.')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(pristine["sharded"])],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert "shardsafe.commands.inspect" in loaded
    assert not {"shardsafe.commands.verify", "shardsafe.commands.fit"} & set(loaded)


# ---------------------------------------------------------------------------- verify


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("launcher", "layout"),
    [("module", "sharded"), ("module", "consolidated"), ("script", "consolidated")],
)
def test_verify_passes_a_good_checkpoint(
    pristine: dict[str, Path], launcher: str, layout: str
) -> None:
    path = pristine[layout]
    proc = run_cli("verify", path, launcher=launcher)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = data_files(path)
    size = sum(f.stat().st_size for f in files)
    n_tensors = len(manifest(path)["tensors"])
    s = "" if len(files) == 1 else "s"
    assert proc.stdout.strip() == (
        f"OK: {len(files)} data file{s}, {n_tensors} tensors, {size} bytes "
        f"({human_bytes(size)}) verified in {path}"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_names_file_and_key_of_a_flipped_byte(
    damaged: Callable[[str], Path], layout: str
) -> None:
    path = damaged(layout)
    file = data_files(path)[0]
    key = key_of_last_tensor(path, file)
    flip_byte(file, file.stat().st_size - 1)
    proc = run_cli("verify", path)
    assert proc.returncode == 1
    problems = [line for line in proc.stdout.splitlines() if "checksum mismatch" in line]
    assert len(problems) == 1, proc.stdout
    assert file.name in problems[0] and repr(key) in problems[0]
    assert proc.stdout.splitlines()[-1].startswith("FAILED: 1 problem in ")


@pytest.mark.timeout(60)
def test_verify_reports_every_problem_not_just_the_first(damaged: Callable[[str], Path]) -> None:
    path = damaged("consolidated")
    model, opt, rng = (path / f"{n}.safetensors" for n in ("model", "optimizer", "rng"))
    keys = [key_of_last_tensor(path, f) for f in (model, opt)]
    flip_byte(model, model.stat().st_size - 1)
    flip_byte(opt, opt.stat().st_size - 1)
    os.truncate(rng, rng.stat().st_size - 100)
    proc = run_cli("verify", path)
    assert proc.returncode == 1
    out = proc.stdout
    for file, key in zip((model, opt), keys):
        assert re.search(rf"checksum mismatch in {file.name}, tensor {re.escape(repr(key))}", out)
    assert re.search(r"rng\.safetensors .*truncated.*'rng/rank-00000/torch'", out)
    assert "FAILED: 3 problems" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_fails_on_a_truncated_file(damaged: Callable[[str], Path], layout: str) -> None:
    path = damaged(layout)
    file = data_files(path)[-1]
    os.truncate(file, file.stat().st_size // 2)
    proc = run_cli("verify", path)
    assert proc.returncode == 1
    assert re.search(rf"data file {re.escape(file.name)} is \d+ bytes .*truncated", proc.stdout)


@pytest.mark.timeout(60)
def test_verify_fails_on_a_missing_data_file(damaged: Callable[[str], Path]) -> None:
    path = damaged("consolidated")
    (path / "model.safetensors").unlink()
    proc = run_cli("verify", path)
    assert proc.returncode == 1
    assert "data file model.safetensors is missing" in proc.stdout
    assert "'model/0.weight'" in proc.stdout
    assert "FAILED: 1 problem" in proc.stdout


@pytest.mark.timeout(60)
def test_verify_cross_checks_with_safetensors(damaged: Callable[[str], Path]) -> None:
    """A file whose CRCs pass but which safetensors refuses still fails verification.

    shardsafe ignores the header's ``__metadata__``; safetensors insists that it maps
    strings to strings. A number there keeps every tensor and checksum right, but the
    file no longer opens in other tools.
    """
    path = damaged("sharded")
    file = data_files(path)[0]
    length, head = header(file)
    head["__metadata__"] = {"format": 1}
    raw = json.dumps(head, separators=(",", ":")).encode()
    assert len(raw) <= length
    with open(file, "r+b") as f:
        f.seek(8)
        f.write(raw.ljust(length))
    proc = run_cli("verify", path)
    assert proc.returncode == 1
    assert f"{file.name} cannot be opened by safetensors.safe_open" in proc.stdout
    assert "checksum mismatch" not in proc.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_a_directory_without_manifest_is_not_a_checkpoint(
    damaged: Callable[[str], Path], command: str
) -> None:
    path = damaged("sharded")
    (path / "manifest.json").unlink()
    proc = run_cli(command, path)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith("shardsafe: error: ")
    assert "has no manifest.json" in proc.stderr and "interrupted" in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_a_newer_format_version_says_upgrade(damaged: Callable[[str], Path], command: str) -> None:
    path = damaged("sharded")
    doc = manifest(path)
    doc["version"] = 99
    forge.write_manifest(path, doc)
    proc = run_cli(command, path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("shardsafe: error: ")
    assert "version 99" in proc.stderr and "Upgrade shardsafe" in proc.stderr


# ---------------------------------------------------------------------------- usage


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("launcher", "args"),
    [
        ("module", []),
        ("script", []),
        ("module", ["frobnicate"]),
        ("module", ["verify"]),
        ("module", ["inspect", "--bogus", "x"]),
    ],
)
def test_usage_errors_exit_2(launcher: str, args: list[str]) -> None:
    proc = run_cli(*args, launcher=launcher)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: shardsafe")
    assert "error:" in proc.stderr


@pytest.mark.timeout(60)
def test_help_lists_the_commands() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0
    assert re.search(r"^\s+inspect\s+show what a checkpoint holds", proc.stdout, re.M)
    assert re.search(r"^\s+verify\s+check every data file", proc.stdout, re.M)


# ---------------------------------------------------------------------------- in process


def test_only_existing_command_modules_are_offered() -> None:
    names = cli.available()
    assert {"inspect", "verify"} <= set(names) <= set(cli.COMMANDS)
    for name in names:
        command = cli.load(name)
        assert isinstance(command.HELP, str) and callable(command.run)


def test_main_returns_the_status_instead_of_raising(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["inspect", str(tmp_path / "nowhere")]) == 1
    assert capsys.readouterr().err == f"shardsafe: error: {tmp_path / 'nowhere'} does not exist\n"
    assert cli.main([]) == 2
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"shardsafe {shardsafe.__version__}\n"


def test_a_checkpoint_root_error_names_the_newest_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manager = shardsafe.CheckpointManager(tmp_path)
    manager.save(1, {"meta": {"a": 1}})
    newest = manager.save(2, {"meta": {"a": 2}})
    assert cli.main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "has no manifest.json" in err and f"newest committed checkpoint in it is {newest}" in err
    assert cli.main(["verify", newest]) == 0


def test_a_malformed_manifest_is_a_clean_failure(
    damaged: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = damaged("consolidated")
    (path / "manifest.json").write_text('{"format": "shardsafe", "version": 1,')
    assert cli.main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardsafe: error: ") and "manifest.json is not valid JSON" in err


def test_inspect_escapes_control_characters_from_the_manifest(
    damaged: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = damaged("sharded")
    doc = manifest(path)
    doc["values"]["\x1b[2Jevil"] = doc["values"].pop("meta")
    forge.write_manifest(path, doc)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b[2Jevil" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["inspect", "verify", "fit"])
def test_an_object_store_without_credentials_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """botocore's NoCredentialsError is no OSError: inspect and verify called it "a bug in
    shardsafe", and fit showed its traceback."""
    pytest.importorskip("s3fs")
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no credentials from a VM
    monkeypatch.setenv("HOME", str(tmp_path))  # nor from ~/.aws
    url = "s3://shardsafe-no-such-bucket/run"
    args = ["--max-steps", "1", "--run-dir", url] if command == "fit" else [url]
    proc = run_cli(command, *args)
    assert proc.returncode == 1
    assert proc.stderr.startswith(
        "shardsafe: error: the object store refused or could not be reached: "
        "NoCredentialsError: Unable to locate credentials"
    ), proc.stderr
    assert "bug" not in proc.stderr


@pytest.mark.timeout(60)
def test_fit_with_a_run_dir_in_a_bucket_that_does_not_exist_is_refused_before_any_step(
    s3_server: Any, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run trained up to its first checkpoint, then failed in the lock's PUT with the
    client's bare 'FileNotFoundError: The specified bucket does not exist'."""
    monkeypatch.chdir(tmp_path)
    missing = f"{s3_bucket}-typo"
    proc = run_cli(
        "fit", "--max-steps", "30", "--checkpoint-every", "20", "--run-dir", f"s3://{missing}/exp"
    )
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stdout
    assert proc.stderr == (
        f"shardsafe: error: the bucket {missing!r} of s3://{missing}/exp/checkpoints does not "
        "exist (or these credentials cannot see it); shardsafe never creates a bucket: check "
        "the URL and the endpoint, or create the bucket first\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_a_path_that_is_no_directory_is_named_by_its_kind(tmp_path: Path) -> None:
    """A FIFO or a device passed as the checkpoint was called "a file"."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a named pipe (FIFO)"), ("/dev/null", "a character device")):
        for command in ("inspect", "verify"):
            proc = run_cli(command, path)
            assert (proc.returncode, proc.stderr) == (
                1,
                f"shardsafe: error: {path} is {kind}, not a directory; pass the checkpoint "
                "directory (the one holding manifest.json)\n",
            )
