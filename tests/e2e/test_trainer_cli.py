"""``shardsafe fit`` as the README shows it: train the example on 2 processes, then resume."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe import cli
from shardsafe.commands import fit
from shardsafe.strategies import STRATEGIES
from tests.e2e.trainer_helpers import losses, run

SHARDSAFE = Path(sys.executable).parent / "shardsafe"


README = Path(__file__).resolve().parents[2] / "README.md"


def readme_commands() -> list[list[str]]:
    """The ``shardsafe fit ...`` steps of the README's main command, exactly as written."""
    text = README.read_text()
    block = text.split("**Run the main job**", 1)[1]
    line = next(ln for ln in block.splitlines() if ln.startswith("python3 -m venv"))
    steps = [shlex.split(step) for step in line.split(" && ")]
    return [step[1:] for step in steps if step[:2] == ["shardsafe", "fit"]]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    text = README.read_text().split("**Run the tests:**", 1)[1]
    command = next(ln for ln in text.splitlines() if ln.startswith("python3 -m venv"))
    ci = (README.parent / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == command


@pytest.mark.timeout(150)
def test_readme_main_command_then_resume(tmp_path: Path) -> None:
    command = [SHARDSAFE] if SHARDSAFE.exists() else [sys.executable, "-m", "shardsafe"]
    train, resume = readme_commands()
    first = run(*command, *train, cwd=tmp_path)
    assert re.search(
        r"done: step 60 .*final loss [0-9.e-]+, checkpoint "
        r"runs/example/checkpoints/step-000000060 \(all in runs/example/checkpoints\), "
        r"losses in runs/example/metrics.jsonl$",
        first.stdout,
        re.M,
    ), first.stdout

    second = run(*command, *resume, cwd=tmp_path)
    assert "resuming from runs/example/checkpoints/step-000000060 (step 60)" in second.stdout
    assert "done: step 100 (40 steps" in second.stdout
    assert "checkpoint runs/example/checkpoints/step-000000100" in second.stdout

    loss = losses(tmp_path / "runs" / "example")
    assert sorted(loss) == list(range(1, 101))
    first_ten = sum(loss[s] for s in range(1, 11)) / 10
    last_ten = sum(loss[s] for s in range(91, 101)) / 10
    assert last_ten < first_ten / 5, (first_ten, last_ten)  # the loss visibly falls


def fit_example(run_dir: Path, max_steps: int, *more: str) -> int:
    """``shardsafe fit`` on the built-in example, in this process, on one thread."""
    options = ["--max-steps", str(max_steps), "--checkpoint-every", "4", "--seed", "3"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # compared bit for bit: see trainer_helpers.ONE_THREAD
    try:
        return cli.main(["fit", *options, "--run-dir", str(run_dir), *more])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(60)
def test_extending_a_run_equals_one_longer_run(tmp_path: Path) -> None:
    """The example's LR schedule ignores --max-steps, so resuming past it continues exactly."""
    assert fit_example(tmp_path / "long", 12) == 0
    assert fit_example(tmp_path / "short", 8) == 0
    assert fit_example(tmp_path / "short", 12, "--resume", "latest") == 0
    assert losses(tmp_path / "short") == losses(tmp_path / "long")


@pytest.mark.timeout(60)
def test_fit_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["fit", "--max-steps", "2", "--run-dir", str(tmp_path)]
    assert cli.main([*base, "--strategy", "single", "--devices", "2"]) == 2
    assert "strategy='ddp'" in capsys.readouterr().err
    for strategy in ("single", "fsdp"):
        argv = [*base, "--strategy", strategy, "--example-optimizer", "zero"]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("shardsafe fit: error: --example-optimizer zero makes the")
        assert f"runs under --strategy ddp (not {strategy})" in err
    # A relative module path: importlib's TypeError, a traceback, before.
    assert cli.main([*base, "--module", ".mymodel:Net"]) == 2
    err = capsys.readouterr().err
    assert "--module '.mymodel:Net' must look like package.module:ClassName" in err
    # A module not there: exit 1 and "No module named 'nosuch'", naming no option, before.
    assert cli.main([*base, "--module", "nosuch.models:Net"]) == 2
    err = capsys.readouterr().err
    assert (
        "--module 'nosuch.models:Net': no module named 'nosuch' (run from the directory that "
        "holds it, or install it)"
    ) in err
    # A class that needs arguments: a traceback ending in TypeError, before.
    (tmp_path / "needs_args.py").write_text(
        "from shardsafe.trainer import TrainingModule\n"
        "class NeedsArgs(TrainingModule):\n"
        "    def __init__(self, width):\n"
        "        super().__init__()\n"
    )
    argv = [*base, "--module", "needs_args:NeedsArgs"]
    sys.path.insert(0, str(tmp_path))
    try:
        assert cli.main(argv) == 2
    finally:
        sys.path.remove(str(tmp_path))
    err = capsys.readouterr().err
    assert err.startswith(
        "shardsafe fit: error: --module 'needs_args:NeedsArgs' is built with no arguments, "
        "but NeedsArgs() needs some (missing a required argument: 'width'): give its "
        "parameters defaults, or write a subclass that sets them"
    ), err
    # A module without train_dataloader(): a traceback from every worker, after the launch.
    (tmp_path / "no_data.py").write_text(
        "from shardsafe.trainer import TrainingModule\nclass NoData(TrainingModule):\n    pass\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        assert cli.main([*base, "--module", "no_data:NoData"]) == 2
    finally:
        sys.path.remove(str(tmp_path))
    assert capsys.readouterr().err == (
        "shardsafe fit: error: --module 'no_data:NoData' has no train_dataloader(): shardsafe "
        "fit passes no data to fit(), so the module must return its DataLoader from "
        "train_dataloader()\n"
    )
    for option in (["--keep-last", "2"], ["--async-save"]):  # ignored by a run saving none
        assert cli.main([*base, *option]) == 2
        err = capsys.readouterr().err
        assert "applies to checkpoints, but this run saves none" in err
        assert "--checkpoint-every N" in err
    assert cli.main([*base, "--checkpoint-every", "2"]) == 0
    assert cli.main(base) == 1  # a second fresh run over the first one's checkpoints
    err = capsys.readouterr().err
    assert "already holds checkpoints" in err and "--resume latest" in err
    assert "Traceback" not in err


@pytest.mark.timeout(60)
def test_a_path_under_a_file_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--run-dir afile/sub``: "afile/sub/checkpoints is not a directory, not a
    directory; shardsafe does not follow it", exit 1 (found in review); inspect and
    verify said the same of ``afile/sub``."""
    (tmp_path / "afile").write_text("mine")
    under = str(tmp_path / "afile" / "sub")
    assert cli.main(["fit", "--max-steps", "2", "--run-dir", under]) == 2
    assert capsys.readouterr().err == (
        f"shardsafe fit: error: run_dir={under!r} is under {tmp_path / 'afile'}, which is a "
        "regular file, not a directory; name a directory\n"
    )
    for command in ("inspect", "verify"):
        assert cli.main([command, under]) == 1
        assert capsys.readouterr().err == (
            f"shardsafe: error: {under} is under {tmp_path / 'afile'}, which is a regular "
            "file, not a directory\n"
        )
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("rank", "said"),
    [
        ("1", "RANK=1 is not below WORLD_SIZE=1: a rank is 0 to WORLD_SIZE - 1"),
        ("-1", "RANK='-1' in the environment must be a whole number, at least 0"),
        ("x", "RANK='x' in the environment must be a whole number, at least 0"),
    ],
)
def test_a_rank_out_of_range_in_the_environment_is_refused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    rank: str,
    said: str,
) -> None:
    """``RANK=1 WORLD_SIZE=1`` trained and saved in silence (not rank 0: no output, not
    even the last line), ``RANK=-1`` failed in numpy's seeding (found in review)."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "1")
    run_dir = tmp_path / "run"
    assert cli.main(["fit", "--max-steps", "2", "--run-dir", str(run_dir)]) == 2
    assert capsys.readouterr().err == (
        f"shardsafe fit: error: {said} (set by the launcher: torchrun, or this Trainer's own)\n"
    )
    assert not run_dir.exists()


@pytest.mark.timeout(60)
def test_a_mismatch_prints_its_problems_one_per_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They came out as one line full of literal ``\\x0a`` (the whole message escaped)."""
    shardsafe.save(tmp_path / "other", {"model": torch.nn.Linear(2, 2)})
    argv = ["fit", "--max-steps", "2", "--run-dir", str(tmp_path / "run")]
    assert cli.main([*argv, "--resume", str(tmp_path / "other")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardsafe: error: the checkpoint does not match the objects being")
    assert "\\x0a" not in err and '\n  the checkpoint has no entry "optimizer"' in err


SAYING = """
import sys
from shardsafe.trainer.metrics import say
say("first")
sys.stdin.read()  # until the test has closed the pipe's reading end
for step in range(3):
    say(f"step {step}")
print("went on", file=sys.stderr)
"""


@pytest.mark.timeout(60)
def test_a_progress_line_to_a_reader_that_left_does_not_stop_the_run() -> None:
    """``shardsafe fit ... | head -1``: the next progress line raised BrokenPipeError in
    the training loop, which ended the run (a launched rank 0 with a traceback)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SAYING],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline() == "shardsafe: first\n"
    proc.stdout.close()  # the reader leaves
    _, err = proc.communicate(timeout=50)
    assert (proc.returncode, err) == (0, "went on\n")


def test_cli_lists_every_strategy_and_passes_every_option_on() -> None:
    assert set(fit.STRATEGY_NAMES) == set(STRATEGIES)
    parser = cli.build_parser(only="fit")
    argv = [
        "fit",
        "--strategy",
        "zero",
        "--devices",
        "2",
        "--max-steps",
        "5",
        "--run-dir",
        "r",
        "--checkpoint-every",
        "2",
        "--layout",
        "consolidated",
        "--resume",
        "latest",
        "--seed",
        "7",
        "--keep-last",
        "3",
        "--example-optimizer",
        "oss",
    ]
    args = parser.parse_args(argv)
    again = parser.parse_args(["fit", *fit.worker_arguments(args)])
    assert vars(again) == vars(args)
