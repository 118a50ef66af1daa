"""The trainer's pure parts: config checks, the resumable data order, metrics, launching."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import shardsafe
from shardsafe import Trainer, TrainingModule
from shardsafe.strategies import STRATEGIES, Strategy
from shardsafe.trainer import TrainerConfig
from shardsafe.trainer.data import (
    DataPosition,
    DataStream,
    LoaderSpec,
    ResumableBatchSampler,
    loader_spec,
)
from shardsafe.trainer.launcher import current_environment, worker_environment
from shardsafe.trainer.metrics import MetricsLog, read_metrics

DATA = TensorDataset(torch.arange(20))


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"strategy": "dp"}, "strategy='dp'"),
        ({"devices": 0}, "devices=0"),
        ({"strategy": "single", "devices": 2}, "strategy='ddp'"),
        ({"checkpoint_every": 0}, "checkpoint_every=0"),
        ({"keep_last": -1}, "keep_last=-1"),
        ({"layout": "flat"}, "layout='flat'"),
        ({"max_steps": 0}, "max_steps=0"),
        ({"seed": -1}, "seed=-1"),
        ({"seed": 2**32}, "seed=4294967296 must be an int from 0 to 4294967295"),
        ({"strategy": "ddp", "devices": 2, "seed": 2**32 - 1}, "from 0 to 4294967294"),
        # Accepted and silently ignored by a run that saves nothing:
        ({"keep_last": 2}, r"keep_last=2 applies to checkpoints, but this run saves none"),
        ({"async_save": True}, r"async_save=True applies to checkpoints, but this run saves"),
        # Values a config file gives: os.fspath's and a set's bare TypeErrors named no field
        ({"run_dir": None}, "run_dir=None must be a path (a str or os.PathLike)"),
        ({"run_dir": 123}, "run_dir=123 must be a path (a str or os.PathLike)"),
        ({"strategy": ["ddp"]}, "strategy=['ddp'] is not a strategy; use one of"),
        (
            {"local_checkpoint_dir": 123},
            "local_checkpoint_dir=123 must be a path (a str or os.PathLike), or None for no "
            "local tier",
        ),
    ],
)
def test_config_errors_name_the_field(options: dict[str, object], named: str) -> None:
    settings: dict[str, object] = {"max_steps": 5, "run_dir": "r", **options}
    with pytest.raises(ValueError, match=re.escape(named)):
        TrainerConfig(**settings)  # type: ignore[arg-type]


def test_config_is_keyword_only_and_checkpoints_at_the_end() -> None:
    with pytest.raises(TypeError):
        TrainerConfig(5, "r")  # type: ignore[misc]
    config = TrainerConfig(max_steps=7, run_dir=Path("r"), checkpoint_every=3)
    assert config.run_dir == "r"
    assert [s for s in range(1, 8) if config.checkpoint_due(s)] == [3, 6, 7]
    assert not TrainerConfig(max_steps=7, run_dir="r").checkpoint_due(7)


def batches(spec: LoaderSpec, world: int, epoch: int, start: int) -> list[list[list[int]]]:
    """Every rank's batches of ``epoch`` from ``start``, as lists of sample indices."""
    return [
        list(
            ResumableBatchSampler(spec, rank=r, world_size=world, seed=5, epoch=epoch, start=start)
        )
        for r in range(world)
    ]


def test_consumed_samples_are_a_prefix_of_the_epoch_order_at_any_world_size() -> None:
    spec = LoaderSpec(DATA, batch_size=2, shuffle=True)
    order = ResumableBatchSampler(spec, rank=0, world_size=1, seed=5, epoch=0, start=0).order()
    two = batches(spec, world=2, epoch=0, start=0)
    assert len(two[0]) == 5  # 20 samples, 4 per step
    for step in range(5):  # step k of 2 ranks consumes order[4k : 4k+4]
        taken = sorted(two[0][step] + two[1][step])
        assert taken == sorted(order[4 * step : 4 * step + 4].tolist())
    # Resumed after 2 steps on 1 rank: the rest of the same order, split the new way.
    one = batches(spec, world=1, epoch=0, start=8)
    assert [i for b in one[0] for i in b] == order[8:].tolist()
    assert batches(spec, world=2, epoch=1, start=0) != two  # a new order each epoch


def test_an_epoch_remainder_smaller_than_a_step_is_dropped() -> None:
    spec = LoaderSpec(DATA, batch_size=3, shuffle=False)
    (only,) = batches(spec, world=1, epoch=0, start=0)
    assert only == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14], [15, 16, 17]]


def test_stream_crosses_epochs_and_records_its_position() -> None:
    spec = LoaderSpec(DATA, batch_size=4, shuffle=False)
    stream = DataStream(spec, DataPosition(0, 12), rank=1, world_size=2, seed=0)
    first, index = stream.next_batch()
    assert (first[0].tolist(), index) == ([13, 15, 17, 19], 1)
    assert stream.state() == {"epoch": 0, "position": 20}
    second, index = stream.next_batch()  # epoch 0 is used up: epoch 1 starts
    assert (second[0].tolist(), index) == ([1, 3, 5, 7], 0)
    assert stream.state() == {"epoch": 1, "position": 8}
    with pytest.raises(ValueError, match="fewer than one step"):
        DataStream(LoaderSpec(DATA, 16, False), DataPosition(), rank=0, world_size=2, seed=0)


def test_loader_spec_keeps_the_loader_settings_or_says_why_not() -> None:
    spec = loader_spec(DataLoader(DATA, batch_size=4, shuffle=True, num_workers=0), None)
    assert (spec.batch_size, spec.shuffle) == (4, True)
    assert not loader_spec(DataLoader(DATA, batch_size=4), None).shuffle
    assert loader_spec(DATA, 3).batch_size == 3
    with pytest.raises(ValueError, match="batch_size"):
        loader_spec(DATA, None)
    # batch_size=None has no batch_sampler, which was named as the cause.
    with pytest.raises(ValueError, match=r"built with batch_size=None; the trainer needs"):
        loader_spec(DataLoader(DATA, batch_size=None), None)
    weighted = WeightedRandomSampler([1.0] * 20, 20)
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        loader_spec(DataLoader(DATA, batch_size=4, sampler=weighted), None)
    # A RandomSampler of 8 of the 20 samples was taken as shuffle=True: epochs of 20.
    fewer = RandomSampler(DATA, num_samples=8)
    with pytest.raises(ValueError, match="uses a RandomSampler, which the trainer cannot"):
        loader_spec(DataLoader(DATA, batch_size=4, sampler=fewer), None)

    class Reversed(SequentialSampler):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(reversed(range(len(DATA))))

    with pytest.raises(ValueError, match="uses a Reversed, which the trainer cannot"):
        loader_spec(DataLoader(DATA, batch_size=4, sampler=Reversed(DATA)), None)

    class Stream(IterableDataset[int]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield 1

    with pytest.raises(ValueError, match="IterableDataset"):
        loader_spec(DataLoader(Stream(), batch_size=1), None)


def test_metrics_drop_the_steps_a_resumed_run_trains_again(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(str(path), after_step=0)
    for step in range(1, 8):
        log.log(step, step / 10)
    log.close()
    with open(path, "a") as f:
        f.write('{"step": 8, "lo')  # a line cut short by a kill
    log = MetricsLog(str(path), after_step=5)
    log.log(6, 0.25)
    log.close()
    assert [r["step"] for r in read_metrics(str(path))] == [1, 2, 3, 4, 5, 6]
    assert json.loads(path.read_text().splitlines()[-1]) == {"step": 6, "loss": 0.25}


def test_strategies_are_siblings() -> None:
    assert set(STRATEGIES) == {"single", "ddp", "zero", "fsdp"}
    for name, cls in STRATEGIES.items():
        assert cls.__bases__ == (Strategy,), name
        assert cls.name == name


def test_workers_get_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    env = worker_environment(1, 2, 29123)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")} == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_PORT": "29123",
    }
    assert env["MASTER_ADDR"] == "127.0.0.1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    assert current_environment(2) is None  # nobody started us: launch
    assert current_environment(1) is not None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    joined = current_environment(2)
    assert joined is not None and (joined.rank, joined.world_size, joined.launched) == (1, 2, True)
    with pytest.raises(ValueError, match="devices=4"):
        current_environment(4)


class Tiny(TrainingModule):
    """A linear model whose data comes from ``fit`` and whose optimizer comes alone."""

    def __init__(self, returns: str = "optimizer") -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, 1)
        self.returns = returns

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        return loss.repeat(2) if self.returns == "vector loss" else loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.returns == "plateau":
            return optimizer, torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer} if self.returns == "dict" else optimizer


@pytest.mark.timeout(60)
def test_fit_takes_a_dataset_and_a_lone_optimizer(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, generator=g), torch.randn(64, 1, generator=g))
    trainer = Trainer(max_steps=6, run_dir=tmp_path, checkpoint_every=3, batch_size=8)
    result = trainer.fit(Tiny(), data)
    assert (result.step, result.checkpoint) == (6, str(tmp_path / "checkpoints/step-000000006"))
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == list(range(1, 7))
    assert shardsafe.load(result.checkpoint, {})["trainer"] == {
        "step": 6,
        "seed": 0,
        "epoch": 0,
        "position": 48,
    }
    with pytest.raises(ValueError, match="batch_size"):
        Trainer(max_steps=1, run_dir=tmp_path / "b").fit(Tiny(), data)
    # With several devices the mistake is reported by the calling process itself, before
    # any worker is launched (a launch would end in SystemExit, not this ValueError).
    ddp = Trainer(strategy="ddp", devices=2, max_steps=1, run_dir=tmp_path / "c")
    with pytest.raises(ValueError, match=r"no batch size; pass Trainer\(batch_size=\.\.\.\)"):
        ddp.fit(Tiny(), data)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("returns", "message"),
    [
        ("dict", "configure_optimizers"),
        ("vector loss", "scalar tensor"),
        # It failed at step 1 with torch's "step() missing ... 'metrics'":
        ("plateau", "returned a ReduceLROnPlateau, whose step"),
    ],
)
def test_fit_says_what_the_module_returned_wrong(
    tmp_path: Path, returns: str, message: str
) -> None:
    loader = DataLoader(TensorDataset(torch.zeros(8, 3), torch.zeros(8, 1)), batch_size=4)
    with pytest.raises(TypeError, match=message):
        Trainer(max_steps=1, run_dir=tmp_path).fit(Tiny(returns), loader)


@pytest.mark.timeout(60)
def test_resuming_with_another_seed_is_refused_before_any_step(tmp_path: Path) -> None:
    """The seed fixes the data order the saved position counts samples of: a resume that
    forgot ``--seed 5`` trained on another order from mid-epoch on (the built-in
    example's loss jumped from 0.2 to 1.8), silently."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, generator=g), torch.randn(64, 1, generator=g))
    Trainer(max_steps=3, run_dir=tmp_path, checkpoint_every=3, batch_size=8, seed=5).fit(
        Tiny(), data
    )
    checkpoint = tmp_path / "checkpoints" / "step-000000003"
    refused = r"saved by a run with seed=5, but this run has seed=0.* \(--seed 5\)"
    for resume in ("latest", str(checkpoint)):
        again = Trainer(max_steps=6, run_dir=tmp_path, checkpoint_every=3, batch_size=8)
        with pytest.raises(shardsafe.CheckpointMismatchError, match=refused):
            again.fit(Tiny(), data, resume=resume)
    # Several devices: refused by the calling process itself, before any worker starts.
    ddp = Trainer(strategy="ddp", devices=2, max_steps=6, run_dir=tmp_path, batch_size=8)
    with pytest.raises(shardsafe.CheckpointMismatchError, match=refused):
        ddp.fit(Tiny(), data, resume="latest")
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3]
    same = Trainer(max_steps=6, run_dir=tmp_path, checkpoint_every=3, batch_size=8, seed=5)
    assert same.fit(Tiny(), data, resume="latest").step == 6


@pytest.mark.timeout(60)
def test_a_file_url_run_dir_is_that_local_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``file://`` is a local path; the Trainer wrote metrics under ``./file:/...`` and
    failed at the first save with a FileNotFoundError, after training the steps before it."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, generator=g), torch.randn(64, 1, generator=g))
    trainer = Trainer(max_steps=2, run_dir=f"file://{run}", checkpoint_every=2, batch_size=8)
    assert trainer.config.run_dir == str(run)
    result = trainer.fit(Tiny(), data)
    assert result.checkpoint == str(run / "checkpoints" / "step-000000002")
    assert [r["step"] for r in read_metrics(str(run / "metrics.jsonl"))] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    local = TrainerConfig(max_steps=1, run_dir=run, local_checkpoint_dir=f"file://{tmp_path}/t")
    assert local.local_checkpoint_dir == f"{tmp_path}/t"


@pytest.mark.timeout(60)
def test_resuming_an_older_checkpoint_is_refused_without_checkpoint_every(
    tmp_path: Path,
) -> None:
    """Without ``checkpoint_every`` a resume from an older checkpoint of the same run_dir
    was accepted, and cut the newer steps' losses from metrics.jsonl while their
    checkpoints stayed: the docs say such a resume is refused."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, generator=g), torch.randn(64, 1, generator=g))
    Trainer(max_steps=6, run_dir=tmp_path, checkpoint_every=3, batch_size=8).fit(Tiny(), data)
    older = str(tmp_path / "checkpoints" / "step-000000003")
    again = Trainer(max_steps=4, run_dir=tmp_path, batch_size=8)
    with pytest.raises(shardsafe.CheckpointError, match="already holds step 6, newer than step 3"):
        again.fit(Tiny(), data, resume=older)
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == list(range(1, 7))


@pytest.mark.timeout(60)
def test_the_last_line_of_a_run_that_saves_nothing_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run without checkpoint_every, forked from another run's checkpoint, ended with
    "checkpoint <the other run's> (all in <this run's checkpoints>)", which is untrue."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, generator=g), torch.randn(64, 1, generator=g))
    first = tmp_path / "first"
    Trainer(max_steps=2, run_dir=first, checkpoint_every=2, batch_size=8).fit(Tiny(), data)
    capsys.readouterr()
    fork = Trainer(max_steps=3, run_dir=tmp_path / "fork", batch_size=8)
    fork.fit(Tiny(), data, resume=str(first / "checkpoints" / "step-000000002"))
    last = capsys.readouterr().out.splitlines()[-1]
    assert ", no checkpoint saved (checkpoint_every is not set), losses in " in last, last
    assert "all in" not in last


def test_a_run_dir_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    """It failed in the workers, after they started, with a bare ``[Errno 17] File exists``."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for name, what in (("notes.txt", "a regular file"), ("gone", "a broken link")):
        path = str(tmp_path / name)
        with pytest.raises(ValueError, match=f"run_dir='{path}' is {what}, not a directory"):
            TrainerConfig(max_steps=1, run_dir=path)
        with pytest.raises(ValueError, match=f"local_checkpoint_dir='{path}' is {what}, not a"):
            TrainerConfig(max_steps=1, run_dir=str(tmp_path / "r"), local_checkpoint_dir=path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.timeout(60)
def test_a_damaged_newest_checkpoint_says_which_and_how_to_go_on(tmp_path: Path) -> None:
    """A flipped byte in the newest checkpoint failed the resume naming only a file inside
    it; resuming from the one before was refused (a newer step exists): two refusals."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, generator=g), torch.randn(64, 1, generator=g))
    settings: dict[str, Any] = {"run_dir": tmp_path, "checkpoint_every": 3, "batch_size": 8}
    Trainer(max_steps=6, **settings).fit(Tiny(), data)
    newest = tmp_path / "checkpoints" / "step-000000006"
    shard = newest / "shard-00000-of-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-4] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(shardsafe.CheckpointCorruptError) as refused:
        Trainer(max_steps=9, **settings).fit(Tiny(), data, resume="latest")
    message = str(refused.value)
    assert message.startswith(f"cannot resume from {newest}: checksum mismatch in "), message
    assert message.endswith(
        f"move {newest} out of {tmp_path / 'checkpoints'} (shardsafe deletes nothing for you) "
        "and resume with resume='latest' (--resume latest)"
    ), message
    newest.rename(tmp_path / "damaged")
    assert Trainer(max_steps=9, **settings).fit(Tiny(), data, resume="latest").step == 9


@pytest.mark.timeout(60)
def test_an_older_checkpoint_of_the_run_is_refused_before_launching(tmp_path: Path) -> None:
    """With several devices the refusal came from the workers, after each had built the
    model and loaded the checkpoint, as a worker's traceback."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, generator=g), torch.randn(64, 1, generator=g))
    Trainer(max_steps=6, run_dir=tmp_path, checkpoint_every=3, batch_size=8).fit(Tiny(), data)
    older = str(tmp_path / "checkpoints" / "step-000000003")
    ddp = Trainer(strategy="ddp", devices=2, max_steps=9, run_dir=tmp_path, batch_size=8)
    # A launch would end in SystemExit; the refusal is this process's own CheckpointError.
    with pytest.raises(shardsafe.CheckpointError, match="already holds step 6, newer than step 3"):
        ddp.fit(Tiny(), data, resume=older)


def test_two_url_runs_never_share_a_metrics_file() -> None:
    """``/`` and ``_`` both became ``_``: ``s3://b/exp_1`` and ``s3://b/exp/1`` shared
    ``metrics/s3-b_exp_1.jsonl``, and a new run of one cut the other's losses from it."""
    urls = ["s3://b/exp_1", "s3://b/exp/1", "s3://b/exp+1", "s3://b/exp%2F1", "gs://b/exp/1"]
    paths = [TrainerConfig(max_steps=1, run_dir=u).metrics_path for u in urls]
    assert len(set(paths)) == len(urls), paths
    assert paths[:2] == [
        os.path.join("metrics", n) for n in ("s3-b+exp_1.jsonl", "s3-b+exp+1.jsonl")
    ]
    assert TrainerConfig(max_steps=1, run_dir="s3://b/exp/1/").metrics_path == paths[1]


def test_a_trainer_batch_size_beside_a_loaders_own_is_refused(tmp_path: Path) -> None:
    """Trainer(batch_size=64) with a DataLoader(batch_size=4) trained on batches of 4."""
    loader = DataLoader(TensorDataset(torch.zeros(8, 3), torch.zeros(8, 1)), batch_size=4)
    trainer = Trainer(max_steps=1, run_dir=tmp_path, batch_size=64)
    with pytest.raises(ValueError, match=r"batch_size=64\) applies to a Dataset .* batch_size=4"):
        trainer.fit(Tiny(), loader)
    assert loader_spec(loader, 4).batch_size == 4  # the same value twice is no conflict


@pytest.mark.timeout(30)
def test_a_metrics_file_that_is_no_regular_file_is_refused(tmp_path: Path) -> None:
    """A FIFO named metrics.jsonl made the run wait forever before its first step (rank 0
    read it), a directory failed with a bare errno, and a link was followed."""
    (tmp_path / "elsewhere.txt").write_text("mine\n")
    makers = {
        "a named pipe (FIFO)": lambda p: os.mkfifo(p),
        "a directory": lambda p: p.mkdir(),
        "a symbolic link": lambda p: p.symlink_to(tmp_path / "elsewhere.txt"),
    }
    for number, (kind, make) in enumerate(makers.items()):
        path = tmp_path / f"run{number}" / "metrics.jsonl"
        path.parent.mkdir()
        make(path)
        with pytest.raises(shardsafe.CheckpointError, match=f"{path} is {re.escape(kind)}, not"):
            MetricsLog(str(path), after_step=0)
    assert (tmp_path / "elsewhere.txt").read_text() == "mine\n"


@pytest.mark.timeout(30)
def test_a_metrics_temporary_that_is_no_regular_file_is_refused_not_written_through(
    tmp_path: Path,
) -> None:
    """Resuming rewrites metrics.jsonl through metrics.jsonl.tmp, which was opened by name:
    a link there was written through, over a file outside the run's directory (and
    metrics.jsonl became a link to it); a FIFO made the run wait forever before step 1."""
    (tmp_path / "elsewhere.txt").write_text("mine\n")
    makers = {
        "a symbolic link": lambda p: p.symlink_to(tmp_path / "elsewhere.txt"),
        "a directory": lambda p: p.mkdir(),
        "a named pipe (FIFO)": lambda p: os.mkfifo(p),
    }
    for number, (kind, make) in enumerate(makers.items()):
        path = tmp_path / f"run{number}" / "metrics.jsonl"
        path.parent.mkdir()
        path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n')
        make(tmp_path / f"run{number}" / "metrics.jsonl.tmp")
        with pytest.raises(
            shardsafe.CheckpointError, match=f"{path}.tmp is {re.escape(kind)}, not"
        ):
            MetricsLog(str(path), after_step=1)
        assert path.read_text() == '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n'
        assert not path.is_symlink()
    assert (tmp_path / "elsewhere.txt").read_text() == "mine\n"
    # A regular one a crash left is reused.
    (tmp_path / "run0" / "metrics.jsonl.tmp").unlink()
    (tmp_path / "run0" / "metrics.jsonl.tmp").write_text("stale")
    MetricsLog(str(tmp_path / "run0" / "metrics.jsonl"), after_step=1).close()
    assert read_metrics(str(tmp_path / "run0" / "metrics.jsonl")) == [{"step": 1, "loss": 0.5}]


class FailsAtStep(Tiny):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise RuntimeError("the step failed")


@pytest.mark.timeout(60)
def test_a_failed_one_process_fit_leaves_no_process_group_behind(tmp_path: Path) -> None:
    """A one-process ``fit`` that made the default group and then failed left it behind:
    the caller's next ``init_process_group`` raised "initialize the default process group
    twice"."""
    loader = DataLoader(TensorDataset(torch.zeros(8, 3), torch.zeros(8, 1)), batch_size=4)
    with pytest.raises(RuntimeError, match="the step failed"):
        Trainer(strategy="ddp", max_steps=1, run_dir=tmp_path / "a").fit(FailsAtStep(), loader)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # a group the caller made is used and left alone, failure or not
        with pytest.raises(RuntimeError, match="the step failed"):
            Trainer(strategy="ddp", max_steps=1, run_dir=tmp_path / "b").fit(FailsAtStep(), loader)
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_a_checkpoint_whose_step_or_data_position_no_run_reaches_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each was trusted as it was, after the load: a negative position trained on an empty
    batch (torch's bare IndexError from collate), an epoch of 2**70 overflowed torch's
    seed ('Overflow when unpacking long long'), a negative step trained steps -1, 0, ..."""
    from shardsafe.trainer.example import ExampleModule
    from shardsafe.trainer.resuming import progress_of

    config = TrainerConfig(max_steps=4, run_dir=str(tmp_path / "unused"))
    for name, bad in [("position", -64), ("epoch", 2**70), ("step", -3), ("position", True)]:
        progress = {"step": 2, "seed": 0, "epoch": 0, "position": 64, name: bad}
        with pytest.raises(shardsafe.CheckpointMismatchError) as raised:
            progress_of({"trainer": progress}, "ckpt", config)
        assert str(raised.value) == (
            f"ckpt holds {name}={bad!r} in its 'trainer' entry, where a step and data "
            "position are whole numbers from 0 to 2**63 - 1: it is damaged or was not "
            "written by shardsafe.Trainer, so training cannot resume from it"
        )
    # As a run meets one: a checkpoint whose data position is negative.
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(DataStream, "state", lambda self: {"epoch": 0, "position": -64})
        Trainer(max_steps=2, checkpoint_every=2, run_dir=str(run)).fit(ExampleModule())
    with pytest.raises(shardsafe.CheckpointMismatchError, match="holds position=-64 in its"):
        Trainer(max_steps=4, run_dir=str(run)).fit(ExampleModule(), resume="latest")
    assert read_metrics(str(run / "metrics.jsonl"))[-1]["step"] == 2  # no step trained


@pytest.mark.timeout(60)
def test_a_checkpoint_root_that_cannot_be_saved_into_is_refused_before_step_one(
    tmp_path: Path,
) -> None:
    """A file, a FIFO or a broken link named run_dir/checkpoints, or a directory named
    latest in it, was found only by the first save, after checkpoint_every steps of
    training; a broken link then as a bare 'FileNotFoundError: [Errno 2] No such file or
    directory'."""
    from shardsafe.trainer.example import ExampleModule

    makers = {
        "a regular file": lambda p: p.write_text("mine"),
        "a named pipe (FIFO)": lambda p: os.mkfifo(p),
        "a broken link": lambda p: p.symlink_to(tmp_path / "nowhere"),
    }
    for number, (kind, make) in enumerate(makers.items()):
        run = tmp_path / f"run{number}"
        run.mkdir()
        make(run / "checkpoints")
        trainer = Trainer(max_steps=2, checkpoint_every=2, run_dir=str(run))
        with pytest.raises(shardsafe.CheckpointError) as raised:
            trainer.fit(ExampleModule())
        assert str(raised.value) == (
            f"{run}/checkpoints is {kind}, not a directory, where the checkpoints belong; "
            "shardsafe will not follow or delete it: move it away, or save into another "
            "root (run_dir)"
        )
        assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]  # no step ran
    assert (tmp_path / "run0" / "checkpoints").read_text() == "mine"
    # Nor a directory where the latest pointer belongs, which the first save refused.
    (tmp_path / "run3" / "checkpoints" / "latest").mkdir(parents=True)
    trainer = Trainer(max_steps=2, checkpoint_every=2, run_dir=str(tmp_path / "run3"))
    with pytest.raises(shardsafe.CheckpointError, match=r"latest is a directory, where Che"):
        trainer.fit(ExampleModule())
    assert sorted(p.name for p in (tmp_path / "run3").iterdir()) == ["checkpoints"]


@pytest.mark.timeout(10)
def test_the_report_of_an_exception_that_causes_itself_ends() -> None:
    """``raise e from e`` in a training_step: the failing rank followed __cause__ round
    forever before printing its report, so it never exited and the run hung, its peers
    waiting for it in the step's all-reduce (about 30 minutes, gloo's timeout)."""
    from shardsafe.trainer.failures import _where_and_what

    try:
        try:
            raise ValueError("a bad batch")
        except ValueError as e:
            raise e from e
    except ValueError as caught:
        itself = caught
    assert _where_and_what(itself).splitlines()[-1] == "ValueError: a bad batch"
    first, second = RuntimeError("first"), shardsafe.CheckpointError("second")
    first.__cause__, second.__cause__ = second, first  # a loop of two
    assert _where_and_what(second).splitlines() == [
        "RuntimeError: first",
        "shardsafe.errors.CheckpointError: second",
    ]


SECOND_SIGTERM = """
import os, signal, sys, threading, time
from shardsafe.trainer.launcher import launch

ready = sys.argv[1]
# A worker that takes two seconds to stop, as one finishing its step does; it says when
# its handler is in place (the launcher's own is in place before it starts).
worker = (
    "import signal, sys, time\\n"
    "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(2), sys.exit(143)))\\n"
    f"open({ready!r}, 'w').close()\\n"
    "time.sleep(60)\\n"
)
handler = signal.getsignal(signal.SIGTERM)
sent = []

def terminate_twice() -> None:
    deadline = time.monotonic() + 20
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)
    while signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:  # the launcher stopping
        if time.monotonic() > deadline:
            return
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGTERM)
    sent.append(2)

sender = threading.Thread(target=terminate_twice)
sender.start()
try:
    status = launch([sys.executable, "-c", worker], 1)
finally:
    sender.join()
print(status, sent == [2], signal.getsignal(signal.SIGTERM) == handler)
"""


@pytest.mark.timeout(60)
def test_a_second_sigterm_while_the_launcher_stops_its_workers_is_not_a_traceback(
    tmp_path: Path,
) -> None:
    """coreutils' ``timeout`` sends SIGTERM twice (to the launcher, then to its process
    group): the second one, during the workers' grace period, raised the launcher's
    private ``_Stop`` out of ``launch`` (a traceback, status 1, the workers' stop cut
    short), where the first one meant a clean stop with status 143. Run in a process of
    its own: the signals went to the pytest worker itself, and on a loaded machine the
    first one came before ``launch`` had its handler in place and killed the worker
    (xdist then waited for it forever)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", SECOND_SIGTERM, str(tmp_path / "ready")],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "143 True True\n", "")


def test_workers_are_launched_from_the_main_thread_only(tmp_path: Path) -> None:
    """``Trainer(devices=2).fit`` called from a thread failed in ``signal.signal`` with a bare
    'signal only works in main thread'; it now says why and what to do, before any worker
    starts."""
    import threading

    from shardsafe.trainer.launcher import launch

    marker = tmp_path / "started"
    caught: list[BaseException] = []

    def run() -> None:
        try:
            launch(["touch", str(marker)], 2)
        except BaseException as e:  # the test reads it below
            caught.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert len(caught) == 1 and type(caught[0]) is RuntimeError
    assert str(caught[0]) == (
        "devices=2 runs its workers from the main thread, which alone can stop them on "
        "SIGTERM or Ctrl-C; call Trainer.fit from the main thread, or start the script with "
        "`torchrun --nproc-per-node 2`"
    )
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_a_program_read_from_standard_input_is_refused_as_a_launcher() -> None:
    """``python - < train.py`` with ``devices=2``: each worker ran ``python -`` again with
    nothing left to read, so the run trained nothing and exited 0 (found in review)."""
    import subprocess
    import sys

    program = (
        "from shardsafe.trainer.launcher import script_command\n"
        "try:\n"
        "    script_command()\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    for named in ("-", "/dev/stdin"):  # a pipe named as a file is read up alike
        done = subprocess.run(
            [sys.executable, named], input=program, capture_output=True, text=True, timeout=50
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(
            "devices > 1 starts one process per device by running this program again, which "
            "needs a script: put the code in train.py and run `python train.py`"
        ), (named, done.stdout)


def test_resume_from_a_folder_of_checkpoints_names_the_newest(tmp_path: Path) -> None:
    """``fit --resume run/checkpoints`` (the folder, not a checkpoint in it) said only that
    it had no manifest.json, "a save into it may have been interrupted", which sent the
    user looking for a crash (found in review)."""
    from shardsafe.trainer.resuming import find_checkpoint

    old = tmp_path / "old"
    manager = shardsafe.CheckpointManager(old / "checkpoints")
    manager.save(20, {"w": torch.ones(2)})
    manager.close()
    config = TrainerConfig(max_steps=5, run_dir=str(tmp_path / "new"))
    newest = old / "checkpoints" / "step-000000020"
    root_looks = (
        f"It looks like a checkpoint root; the newest committed checkpoint in it is {newest}"
    )
    run_looks = (
        "It looks like a Trainer run directory: its checkpoints are under "
        f"{old / 'checkpoints'}; the newest is {newest}"
    )
    for given, looks in ((old / "checkpoints", root_looks), (old, run_looks)):
        with pytest.raises(shardsafe.CheckpointNotFoundError) as refused:
            find_checkpoint(config, str(given))
        assert str(refused.value) == (
            f"{given} has no manifest.json, so it is not a committed checkpoint (a save into "
            f"it may have been interrupted). {looks}"
        )


@pytest.mark.timeout(60)
def test_a_metrics_file_holding_lines_shardsafe_did_not_write_is_never_rewritten(
    tmp_path: Path,
) -> None:
    """A fresh run into a run_dir whose ``metrics.jsonl`` was another tool's log replaced
    it with its own two lines, without a word."""
    theirs = '{"epoch": 1, "acc": 0.9}\n{"step": 5, "loss": 0.1}\nnotes from last week\n'
    (tmp_path / "metrics.jsonl").write_text(theirs)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, generator=g), torch.randn(64, 1, generator=g))
    trainer = Trainer(max_steps=2, run_dir=tmp_path, batch_size=8)
    with pytest.raises(shardsafe.CheckpointError) as e:
        trainer.fit(Tiny(), data)
    assert str(e.value) == (
        f"{tmp_path}/metrics.jsonl holds a line shardsafe did not write (line 1: "
        """'{"epoch": 1, "acc": 0.9}'); it would be rewritten with this run's records. Move """
        "it away (or choose another run_dir) and start again"
    )
    assert (tmp_path / "metrics.jsonl").read_text() == theirs
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_a_metrics_line_cut_short_is_dropped_only_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    MetricsLog(str(path), after_step=1).close()
    assert path.read_text() == '{"step": 1, "loss": 0.5}\n'
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 0.5}\n')
    with pytest.raises(shardsafe.CheckpointError, match=re.escape("""line 1: '{"step": 1, "lo'""")):
        MetricsLog(str(path), after_step=1)
