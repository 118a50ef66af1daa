"""The Trainer's local tier in one process: its settings, its flags, and a resume from it.

(Several ranks, SIGKILL and torchrun restarts: ``tests/e2e/test_trainer_local_tier.py``.)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from shardsafe import Trainer
from shardsafe.commands import fit
from shardsafe.errors import CheckpointError
from shardsafe.tiers import Restored
from shardsafe.trainer import FitResult, TrainerConfig
from shardsafe.trainer.example import ExampleModule
from shardsafe.trainer.resuming import describe, interrupted_message
from tests.e2e.trainer_helpers import losses


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"local_checkpoint_dir": "l", "local_every": 0}, "local_every=0"),
        ({"local_every": 3}, "local_every=3 applies to the local tier"),
        ({"local_checkpoint_dir": "l", "keep_local": 0}, "keep_local=0 must be a positive int"),
        ({"keep_local": 1}, "keep_local=1 applies to the local tier, which is off"),
        ({"local_checkpoint_dir": ""}, "local_checkpoint_dir='' is empty"),
        ({"local_checkpoint_dir": "s3://b/l"}, "local_checkpoint_dir='s3://b/l' is a URL"),
        ({"local_checkpoint_dir": "r/checkpoints"}, "overlaps the persistent checkpoints"),
        ({"local_checkpoint_dir": "r"}, "overlaps the persistent checkpoints"),
        # Accepted and silently ignored by a run that writes only the local tier:
        (
            {"local_checkpoint_dir": "l", "keep_last": 1},
            "keep_last=1 applies to the checkpoints of checkpoint_every, but this run "
            "writes only the local tier",
        ),
        (
            {"local_checkpoint_dir": "l", "layout": "consolidated"},
            "layout='consolidated' applies to the checkpoints of checkpoint_every",
        ),
    ],
)
def test_local_tier_settings_are_checked(options: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        TrainerConfig(max_steps=5, run_dir="r", **options)  # type: ignore[arg-type]


def test_local_tier_settings_pass_through() -> None:
    config = TrainerConfig(
        max_steps=5,
        run_dir="r",
        local_checkpoint_dir=Path("/dev/shm/x"),  # type: ignore[arg-type]
        local_every=3,
    )
    assert config.local_checkpoint_dir == "/dev/shm/x" and config.local_every == 3
    # A URL run_dir cannot overlap a local directory.
    TrainerConfig(max_steps=5, run_dir="s3://b/r", local_checkpoint_dir="r/checkpoints")


def test_fit_flags_reach_the_workers_and_need_each_other(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    fit.add_arguments(parser)
    argv = ["--max-steps", "5", "--run-dir", "r", "--local-checkpoint-dir", "/dev/shm/r"]
    args = parser.parse_args([*argv, "--local-every", "2", "--keep-local", "1"])
    assert parser.parse_args(fit.worker_arguments(args)) == args
    assert "--keep-local=1" in fit.worker_arguments(args)
    for flag in ("--local-every", "--keep-local"):
        alone = parser.parse_args(["--max-steps", "5", "--run-dir", "r", flag, "2"])
        assert fit.run(alone) == 2
        assert f"{flag} applies to the local tier" in capsys.readouterr().err
    # A value starting with '-' (written --run-dir=-r) reached the workers as an option.
    dashed = ["--max-steps", "5", "--run-dir=-r", "--resume=-r/checkpoints/step-000000002"]
    args = parser.parse_args([*dashed, "--local-checkpoint-dir=-l"])
    assert parser.parse_args(fit.worker_arguments(args)) == args


def test_describe_names_each_ranks_tier() -> None:
    local = Restored(7, ["local"] * 2, 0.016)
    assert describe(local, "p") == "the local tier (every rank, 0.02 s)"
    mixed = Restored(7, ["local", "local", "peer", "local"], 1.0)
    assert describe(mixed, "p") == (
        "the local tier for rank(s) 0-1, 3 and the peer tier for rank(s) 2 (1.00 s)"
    )
    persistent = Restored(5, ["persistent"] * 2, 0.5)
    assert describe(persistent, "run/step-5") == "the persistent tier, run/step-5 (0.50 s)"


def fit_example(
    run_dir: Path, max_steps: int, resume: str | None = None, **options: Any
) -> FitResult:
    torch.manual_seed(0)
    trainer = Trainer(max_steps=max_steps, run_dir=str(run_dir), checkpoint_every=5, **options)
    return trainer.fit(ExampleModule(), resume=resume)


@pytest.mark.timeout(60)
def test_an_async_run_resumes_from_the_local_tier_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fit_example(tmp_path / "whole", 10)
    local: dict[str, Any] = {"local_checkpoint_dir": str(tmp_path / "local"), "async_save": True}
    fit_example(tmp_path / "run", 7, **local, local_every=2)  # persistent 5, 7; local 4, 6
    fit_example(tmp_path / "run", 10, "latest", **local, local_every=2)
    out = capsys.readouterr().out
    # Step 7 is in the persistent tier only (the last step is saved there, not locally).
    assert "resuming from step 7, from the persistent tier" in out, out
    assert losses(tmp_path / "run") == losses(tmp_path / "whole")

    (tmp_path / "run" / "checkpoints" / "step-000000010" / "manifest.json").unlink()
    fit_example(tmp_path / "run", 10, "latest", **local, local_every=2)
    out = capsys.readouterr().out
    assert "resuming from step 10, from the local tier (every rank" in out, out
    assert "nothing to train" in out


@pytest.mark.timeout(60)
def test_keep_local_is_how_many_steps_the_local_tier_keeps(tmp_path: Path) -> None:
    for keep in (1, 3):
        local = tmp_path / f"local{keep}"
        fit_example(tmp_path / f"run{keep}", 7, local_checkpoint_dir=str(local), keep_local=keep)
        kept = sorted(p.name for p in local.iterdir())
        assert kept == [f"step-{s:09d}" for s in range(8 - keep, 8)], kept


@pytest.mark.timeout(60)
def test_a_run_behind_the_local_tier_is_refused(tmp_path: Path) -> None:
    local: dict[str, Any] = {"local_checkpoint_dir": str(tmp_path / "local")}
    fit_example(tmp_path / "a", 7, **local)  # persistent 5, 7; local 6, 7
    # Another run_dir: another run, whose steps these are not (a resume took them by their
    # number alone), said before anything trains.
    another = (
        f"the local directory {tmp_path / 'local'} holds step 7 of another run, whose "
        f"persistent tier is {tmp_path / 'a' / 'checkpoints'} (this run's is "
        f"{tmp_path / 'b' / 'checkpoints'})"
    )
    with pytest.raises(CheckpointError, match=re.escape(another)):
        fit_example(tmp_path / "b", 7, **local)
    assert not (tmp_path / "b" / "metrics.jsonl").exists()
    step5 = str(tmp_path / "a" / "checkpoints" / "step-000000005")
    with pytest.raises(CheckpointError, match="holds step 7 of another run"):
        fit_example(tmp_path / "c", 7, step5, **local)
    with pytest.raises(CheckpointError, match="already holds step 7, newer than step 5"):
        fit_example(tmp_path / "a", 7, step5, **local)  # its own run: behind its steps
    fit_example(tmp_path / "d", 6, step5)  # without the local tier: a fork, as before


@pytest.mark.timeout(60)
def test_after_local_checkpoints_only_ctrl_c_says_resume_latest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the local tier's steps and none in run_dir, Ctrl-C said "running the same
    command again starts at step 0", but the same command is refused (the local tier is
    newer), and the run's last line said it saved nothing at all."""
    local = str(tmp_path / "local")
    torch.manual_seed(0)
    config: dict[str, Any] = {"run_dir": str(tmp_path / "run"), "local_checkpoint_dir": local}
    Trainer(max_steps=3, **config).fit(ExampleModule())
    last = capsys.readouterr().out.splitlines()[-1]
    assert f"(checkpoint_every is not set), only in the local tier {local}, losses" in last, last
    said = interrupted_message(TrainerConfig(max_steps=5, **config))
    assert "starts at step 0" not in said
    assert said.endswith(
        f"the local tier ({local}) may hold newer steps. To continue from them, run the same "
        "command with --resume latest (Trainer.fit: resume='latest')"
    ), said
    with pytest.raises(CheckpointError, match="holds step 3, but this is a new run"):
        Trainer(max_steps=5, **config).fit(ExampleModule())


class FailsOnce(ExampleModule):
    """The example module, raising once in its training step at call ``fail_at``."""

    calls = 0
    fail_at: int | None = None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        type(self).calls += 1
        if type(self).calls == self.fail_at:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tier", ["persistent", "local"])
def test_a_failed_fit_leaves_no_save_running_and_a_retry_resumes_the_newest_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tier: str
) -> None:
    """``fit`` raised while an async save was still written, and left it running: a
    ``fit(resume="latest")`` in the same process (a notebook's cell run again) found the
    step before it, and was refused once that save committed (``already holds step 7,
    newer than step 6``); with the local tier, the two runs' threads raced."""
    options: dict[str, Any] = {"async_save": True, "checkpoint_every": 1}
    if tier == "local":
        options = {"async_save": True, "local_checkpoint_dir": str(tmp_path / "local")}
    FailsOnce.calls, FailsOnce.fail_at = 0, 8
    run = Trainer(max_steps=12, run_dir=str(tmp_path / "run"), **options)
    with pytest.raises(RuntimeError, match="boom"):
        run.fit(FailsOnce())
    FailsOnce.fail_at = None
    capsys.readouterr()
    Trainer(max_steps=12, run_dir=str(tmp_path / "run"), **options).fit(
        FailsOnce(), resume="latest"
    )
    out = capsys.readouterr().out
    said = {
        "persistent": f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step-000000007'} "
        "(step 7)",
        "local": "resuming from step 7, from the local tier",
    }[tier]
    assert said in out, out


@pytest.mark.timeout(60)
def test_a_run_whose_local_steps_are_all_beyond_max_steps_says_it_saved_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "only in the local tier", which held nothing: a resume then started at 0."""
    local = tmp_path / "local"
    torch.manual_seed(0)
    run = {"run_dir": str(tmp_path / "run"), "local_checkpoint_dir": str(local)}
    Trainer(max_steps=5, local_every=10, **run).fit(ExampleModule())
    last = capsys.readouterr().out.splitlines()[-1]
    assert (
        "no checkpoint saved: checkpoint_every is not set, and no step from 1 to 5 is a "
        "multiple of local_every=10, losses"
    ) in last, last
    assert not local.exists() or not list(local.glob("step-*"))
