"""``shardsafe.transformers.ShardsafeTrainer`` under ``torchrun`` on 2 CPU processes: the
Trainer's checkpoint folders, with the optimizer and scheduler in ``shardsafe/`` instead of
pickles; the run resumes with the losses of one never interrupted, bit for bit, and the
folder still loads with ``from_pretrained``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardsafe
from tests.harness import free_port

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


def train(out: Path, *args: str | Path) -> dict[str, float]:
    done = launch(out, *args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    losses: dict[str, float] = json.loads((out / "losses.json").read_text())
    return {int(k): v for k, v in losses.items()}  # type: ignore[misc]


def launch(out: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "-m", "tests.hf_transformers.trainer_script",
        "--out", str(out), *map(str, args),
    ]  # fmt: skip
    # This checkout's src first: the shardsafe under test, not an installed one.
    paths = [str(ROOT / "src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "HF_HOME": str(out.parent / "hf-home"),
    }
    return subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200, check=False
    )


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float]]:
    """A 12-step run of the plain Trainer (its checkpoints pickle the optimizer)."""
    out = tmp_path_factory.mktemp("plain") / "run"
    return out, train(out, "--trainer", "plain")


@pytest.fixture(scope="module")
def ten_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 10-step ShardsafeTrainer run; each test damages a copy of it (``copy_of``)."""
    out = tmp_path_factory.mktemp("ten") / "whole"
    train(out, "--steps", "10")
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    """A copy of a module fixture's run directory, for a test to change or resume into."""
    copied = tmp_path / run.name
    shutil.copytree(run, copied, symlinks=True)
    return copied


def test_a_resumed_run_continues_bitwise_and_the_optimizer_is_not_pickled(
    plain_run: tuple[Path, dict[str, float]], tmp_path: Path
) -> None:
    whole = train(tmp_path / "whole")
    assert whole == plain_run[1]  # training is unchanged
    folders = sorted(os.listdir(tmp_path / "whole"))
    assert [f for f in folders if f.startswith("checkpoint-")] == ["checkpoint-10", "checkpoint-12"]
    checkpoint = tmp_path / "whole" / "checkpoint-10"
    files = set(os.listdir(checkpoint))
    assert {"model.safetensors", "trainer_state.json", "shardsafe"} <= files
    assert not files & {"optimizer.pt", "scheduler.pt", "scaler.pt"}
    assert shardsafe.verify(checkpoint / "shardsafe").ok
    saved = {v.name for v in shardsafe.inspect(checkpoint / "shardsafe").values}
    assert saved == {"model", "optimizer", "scheduler", "trainer_step"}

    resumed = train(tmp_path / "whole", "--resume", checkpoint)
    assert {s: resumed[s] for s in (11, 12)} == {s: whole[s] for s in (11, 12)}

    loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    held = transformers.GPT2LMHeadModel(loaded.config)
    shardsafe.load(checkpoint / "shardsafe", {"model": held}, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), held.parameters()))


def test_a_folder_the_plain_trainer_wrote_resumes_through_its_own_code(
    plain_run: tuple[Path, dict[str, float]], tmp_path: Path
) -> None:
    run, whole = plain_run
    run = copy_of(run, tmp_path)
    checkpoint = run / "checkpoint-10"
    assert "optimizer.pt" in os.listdir(checkpoint)
    resumed = train(run, "--resume", checkpoint)  # ShardsafeTrainer
    assert {s: resumed[s] for s in (11, 12)} == {s: whole[s] for s in (11, 12)}


def test_a_corrupted_optimizer_checkpoint_stops_the_resume_on_every_rank(
    ten_steps: Path, tmp_path: Path
) -> None:
    """One byte flipped in the shardsafe part of ``checkpoint-10``: both ranks stop with
    shardsafe's error naming the file, none hangs, and the folder is left as it was."""
    part = copy_of(ten_steps, tmp_path) / "checkpoint-10" / "shardsafe"
    shard = sorted(part.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # in the last tensor's bytes, past the header
    shard.write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in part.iterdir()}
    done = launch(tmp_path / "whole", "--resume", part.parent, "--steps", "12")
    assert done.returncode != 0
    errors = [(tmp_path / "whole" / f"error-{r}.txt").read_text() for r in (0, 1)]
    assert errors[0] == errors[1], errors  # agreed: the same error on both ranks
    assert re.fullmatch(
        r"CheckpointCorruptError: load failed on rank ([01]) \(rank\(s\) (?!\1)[01] failed "
        rf"too\): checksum mismatch in {re.escape(shard.name)}, tensor "
        r"'optimizer/transformer\.wte\.weight/exp_avg' \(chunk at offsets \[0, 0\], block 0\): "
        r"the data file is damaged",
        errors[0],
    ), errors[0]
    assert {p.name: p.read_bytes() for p in part.iterdir()} == before


def test_a_resume_with_another_model_is_refused_with_a_way_a_trainer_user_has(
    ten_steps: Path, tmp_path: Path
) -> None:
    """A checkpoint of a 2-layer model resumed with 3 layers (the Trainer itself loads
    the weights it has): the error ended "Pass strict=False ...", which a Trainer takes
    nowhere (found in review)."""
    run = copy_of(ten_steps, tmp_path)
    done = launch(run, "--resume", run / "checkpoint-10", "--steps", "12", "--layers", "3")
    assert done.returncode != 0
    errors = [(run / f"error-{r}.txt").read_text() for r in (0, 1)]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("CheckpointMismatchError: "), errors[0]
    assert "strict=False to load" not in errors[0]
    assert errors[0].endswith(
        "ShardsafeTrainer resumes strictly (a Trainer takes no strict=False): resume with the "
        "optimizer and scheduler that saved this checkpoint, or train without "
        "resume_from_checkpoint."
    ), errors[0]


def test_a_shardsafe_folder_without_its_manifest_stops_the_resume_on_every_rank(
    ten_steps: Path, tmp_path: Path
) -> None:
    """``checkpoint-10/shardsafe/`` whose ``manifest.json`` is gone (lost in a copy): the
    resume stops on both ranks with shardsafe's error, instead of falling back to the
    Trainer's own loader, which finds no ``optimizer.pt`` and silently trains on with a
    fresh optimizer and the schedule back at step 0."""
    part = copy_of(ten_steps, tmp_path) / "checkpoint-10" / "shardsafe"
    (part / "manifest.json").unlink()
    done = launch(tmp_path / "whole", "--resume", part.parent, "--steps", "12")
    assert done.returncode != 0
    errors = [(tmp_path / "whole" / f"error-{r}.txt").read_text() for r in (0, 1)]
    assert errors[0] == errors[1], errors  # agreed: the same error on both ranks
    assert re.fullmatch(
        r"CheckpointNotFoundError: load failed on rank ([01]) \(rank\(s\) (?!\1)[01] failed "
        rf"too\): {re.escape(str(part))} has no manifest\.json, so it is not a committed "
        r"checkpoint \(a save into it may have been interrupted\)",
        errors[0],
    ), errors[0]


def test_a_symlinked_shardsafe_folder_is_refused_not_followed(
    ten_steps: Path, tmp_path: Path
) -> None:
    """``checkpoint-10/shardsafe`` replaced by a link to ``checkpoint-5/shardsafe``: the
    resume stops on both ranks, instead of restoring step 5's model, optimizer and
    scheduler under step 10's trainer state."""
    part = copy_of(ten_steps, tmp_path) / "checkpoint-10" / "shardsafe"
    shutil.rmtree(part)
    part.symlink_to(tmp_path / "whole" / "checkpoint-5" / "shardsafe")
    done = launch(tmp_path / "whole", "--resume", part.parent, "--steps", "12")
    assert done.returncode != 0
    errors = [(tmp_path / "whole" / f"error-{r}.txt").read_text() for r in (0, 1)]
    assert errors[0] == errors[1], errors
    assert re.fullmatch(
        r"CheckpointNotFoundError: load failed on rank ([01]) \(rank\(s\) (?!\1)[01] failed "
        r"too\): shardsafe is a symbolic link, not a directory; shardsafe does not follow it",
        errors[0],
    ), errors[0]


def test_the_others_wait_for_the_main_process_writing_a_big_model(tmp_path: Path) -> None:
    """The main process writes ``model.safetensors`` alone before the shardsafe save;
    taking 65 s (a model of several GB), the others waited for it only shardsafe's
    default 60 s and the run died at its first checkpoint. They now wait the Trainer's
    ``ddp_timeout``, as its own collectives do. Shown in seconds: shardsafe's default is
    shortened to 2 s in the workers (``--default-entry-timeout``) and the write takes 6 s,
    which the run survives only if the Trainer passes its own wait (as ``_arrival`` does;
    without it, this run dies at step 5)."""
    done = launch(
        tmp_path / "whole", "--steps", "5", "--slow-model-write", "6",
        "--default-entry-timeout", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert shardsafe.verify(tmp_path / "whole" / "checkpoint-5" / "shardsafe").ok


def test_a_run_resumed_with_a_gradient_scaler_it_did_not_save_gets_a_fresh_one(
    tmp_path: Path,
) -> None:
    """Saved without a scaler (bf16 or fp32), resumed with one (fp16: the accelerator
    makes a GradScaler, set here by hand as there is no GPU): the Trainer's own code
    resumes with a fresh scaler (no ``scaler.pt``); the strict load refused the resume
    with 'the checkpoint has no entry "scaler"'. In one process."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from shardsafe.transformers import ShardsafeTrainer

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 12))
    data = [{"input_ids": row, "labels": row} for row in ids]

    def trainer(steps: int) -> ShardsafeTrainer:
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=steps, save_steps=2, use_cpu=True,
            report_to=[], per_device_train_batch_size=4, disable_tqdm=True,
        )  # fmt: skip
        config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)
        return ShardsafeTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data)

    saving = trainer(2)
    saving.train()
    assert saving.accelerator.scaler is None
    resuming = trainer(4)
    resuming.create_optimizer_and_scheduler(num_training_steps=4)
    resuming.accelerator.scaler = torch.amp.GradScaler("cpu")
    resuming._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-2"))
    resuming._load_scaler(str(tmp_path / "checkpoint-2"))
    assert resuming.accelerator.scaler.state_dict() == torch.amp.GradScaler("cpu").state_dict()
    saved, loaded = saving.optimizer.state_dict(), resuming.optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for index, state in saved["state"].items():
        assert all(torch.equal(v, loaded["state"][index][k]) for k, v in state.items())
    assert resuming.lr_scheduler.state_dict() == saving.lr_scheduler.state_dict()


def test_a_shardsafe_folder_copied_in_from_another_checkpoint_is_refused(
    tmp_path: Path,
) -> None:
    """``checkpoint-2/shardsafe`` replaced by a copy (not a link) of
    ``checkpoint-4/shardsafe``: the resume restored step 4's model, optimizer and
    scheduler under step 2's trainer state, and trained on with the wrong learning rates,
    silently. The saved step is compared with ``trainer_state.json`` first; nothing is
    restored. In one process."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from shardsafe.transformers import ShardsafeTrainer

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 12))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, save_steps=2, use_cpu=True,
        report_to=[], per_device_train_batch_size=4, disable_tqdm=True,
    )  # fmt: skip
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)
    ShardsafeTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data).train()
    copied = tmp_path / "checkpoint-2" / "shardsafe"
    shutil.rmtree(copied)
    shutil.copytree(tmp_path / "checkpoint-4" / "shardsafe", copied)
    resuming = ShardsafeTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data)
    resuming.create_optimizer_and_scheduler(num_training_steps=4)
    before = [p.detach().clone() for p in resuming.model.parameters()]
    with pytest.raises(shardsafe.CheckpointMismatchError) as refused:
        resuming._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-2"))
    assert str(refused.value) == (
        f"{copied} holds the model, optimizer and scheduler of step 4, but "
        f"{tmp_path / 'checkpoint-2' / 'trainer_state.json'} is at step 2: the shardsafe "
        "folder comes from another checkpoint. Resume from the checkpoint of step 4, or put "
        "this checkpoint's own shardsafe folder back (nothing was restored)"
    )
    assert all(map(torch.equal, before, resuming.model.parameters()))
    assert resuming.lr_scheduler.last_epoch == 0
    # the folder where it belongs: restored
    resuming._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-4"))
    assert resuming.lr_scheduler.last_epoch == 4
