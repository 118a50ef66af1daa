"""``shardsafe.accelerate``: an Accelerate script saved and resumed under ``accelerate
launch`` on 2 CPU processes (gloo), checked as Accelerate's own checkpoint tests check
``save_state``/``load_state``: the training continues with bitwise-equal losses; models,
optimizers, schedulers, registered objects and the dataloader's epoch come back; the
automatic naming keeps ``total_limit`` checkpoints and ``load_state()`` finds the newest;
an object that cannot be saved is refused. Beyond Accelerate: a ZeRO optimizer prepared
by Accelerate saves sharded, the save can run in the background, nothing is pickled, and
a checkpoint loads at another number of processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from tests import forge
from tests.harness import free_port

accelerate = pytest.importorskip("accelerate")
from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.timeout(240)

STEPS = 28  # three epochs and a half of 8 batches per process
SAVE_AT = 11  # inside the second epoch


def launch(tmp_path: Path, name: str, *args: str | Path, processes: int = 2) -> dict[str, Any]:
    """``accelerate launch`` of the script on ``processes`` CPU processes; what rank 0 wrote."""
    out = tmp_path / f"{name}.json"
    argv = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu" if processes > 1 else "--cpu",
        "--num_processes", str(processes), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
        "-m", "tests.hf_accelerate.accelerate_script",
        "--out", str(out), "--steps", str(STEPS), *map(str, args),
    ]  # fmt: skip
    root = Path(__file__).parents[2]
    # This checkout's src first: the shardsafe under test, not an installed one.
    paths = [str(root / "src"), str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HOME": str(tmp_path / "hf-home")}
    done = subprocess.run(
        argv, cwd=root, env=env, capture_output=True, text=True, timeout=200, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = done.stdout + done.stderr
    return result


def assert_continues(whole: dict[str, Any], resumed: dict[str, Any], after: int) -> None:
    """The resumed run's losses are the uninterrupted run's, bit for bit, for every step."""
    expected = {k: v for k, v in whole["losses"].items() if int(k) > after}
    assert resumed["losses"] == expected
    assert sorted(map(int, resumed["losses"])) == list(range(after + 1, STEPS + 1))


def assert_same_tensors(actual: Path, expected: Path) -> None:
    a, e = load_file(actual), load_file(expected)
    assert sorted(a) == sorted(e)
    for name in e:
        assert torch.equal(a[name], e[name]), name


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """An uninterrupted 2-process run with plain AdamW that saved at step 11."""
    root = tmp_path_factory.mktemp("plain")
    whole = launch(
        root, "whole", "--save-at", str(SAVE_AT), "--save-dir", root / "ckpts",
        "--dump", root / "saved.safetensors",
    )  # fmt: skip
    return root, whole


def test_a_resumed_run_continues_bitwise_and_nothing_is_pickled(
    plain_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, whole = plain_run
    path = root / "ckpts" / f"step-{SAVE_AT}"
    report = shardsafe.inspect(path)
    assert sorted(v.name for v in report.values) == sorted(
        [
            "model", "optimizer", "scheduler", "dataloader", "custom_checkpoint_0",
            "custom_checkpoint_1", "custom_checkpoint_2", "rng", "accelerator_step",
        ]
    )  # fmt: skip
    registered = [t for t in report.tensors if t.key.startswith("custom_checkpoint_")]
    assert len(registered) == 6 and {t.writers for t in registered} == {(0,)}
    assert not [p for p in path.iterdir() if p.suffix in {".bin", ".pkl", ".pt"}]
    assert shardsafe.verify(path).ok
    resumed = launch(
        tmp_path, "resumed", "--resume", path, "--dump", tmp_path / "loaded.safetensors"
    )
    assert_same_tensors(tmp_path / "loaded.safetensors", root / "saved.safetensors")
    assert_continues(whole, resumed, SAVE_AT)
    # Registered objects whose tensors differ per process (0.0 on process 0, 1.0 on
    # process 1) come back as the main process's on both, as with Accelerate's own
    # save_state; they came back as a mix of both processes' tensors, on both.
    held = sorted(re.findall(r"process \d: registered \[[^\]]*\]", resumed["log"]))
    assert held == ["process 0: registered [0.0]", "process 1: registered [0.0]"]


def test_a_two_process_checkpoint_loads_into_one_process(
    plain_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, _ = plain_run
    launch(
        tmp_path, "one", "--resume", root / "ckpts" / f"step-{SAVE_AT}",
        "--dump", tmp_path / "loaded.safetensors", "--steps", str(SAVE_AT), processes=1,
    )  # fmt: skip
    assert_same_tensors(tmp_path / "loaded.safetensors", root / "saved.safetensors")


def test_a_zero_optimizer_accelerate_prepared_saves_sharded_in_the_background(
    tmp_path: Path,
) -> None:
    whole = launch(
        tmp_path, "whole", "--zero", "--async-save", "--save-at", str(SAVE_AT),
        "--save-dir", tmp_path / "ckpts", "--dump", tmp_path / "saved.safetensors",
    )  # fmt: skip
    path = tmp_path / "ckpts" / f"step-{SAVE_AT}"
    report = shardsafe.inspect(path)
    moments = [t for t in report.tensors if t.key.startswith("optimizer/") and "exp_avg" in t.key]
    assert {t.writers for t in moments} == {(0,), (1,)}  # each wrote its own ZeRO partition
    resumed = launch(tmp_path, "resumed", "--zero", "--resume", path)
    assert_continues(whole, resumed, SAVE_AT)
    launch(
        tmp_path, "plain", "--resume", path, "--dump", tmp_path / "plain.safetensors",
        "--steps", str(SAVE_AT), processes=1,
    )  # fmt: skip
    assert_same_tensors(tmp_path / "plain.safetensors", tmp_path / "saved.safetensors")


def test_automatic_naming_keeps_total_limit_and_load_state_finds_the_newest(
    tmp_path: Path,
) -> None:
    """Also, with a sampler seeded per process (``set_seed(0, device_specific=True)``), so
    that the processes' dataloader positions differ and are saved per rank (they were
    refused as corrupt by every later load), and resumed twice: the second time from a save
    in the last batch of the epoch the first resume finished through
    ``skip_first_batches`` (its epoch counter was one behind, and the second resume
    replayed the finished epoch's shuffle)."""
    project = tmp_path / "project"
    options = ("--project-dir", project, "--total-limit", "2", "--seed-per-process")
    whole = launch(
        tmp_path, "whole", *options,
        *[a for step in (4, 8, SAVE_AT) for a in ("--save-at", str(step))],
    )  # fmt: skip
    checkpoints = project / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["latest", "step-000000001", "step-000000002"]
    saved = forge.read_manifest(checkpoints / "step-000000002")["values"]["dataloader"]
    assert list(saved["meta"]) == ["__per_rank__"]  # the two processes' seeds differ
    resumed = launch(tmp_path, "resumed", *options, "--resume", "auto", "--save-at", "16")
    assert f"resumed at step {SAVE_AT}" in resumed["log"]
    assert_continues(whole, resumed, SAVE_AT)
    assert sorted(os.listdir(checkpoints))[-2:] == ["step-000000002", "step-000000003"]
    again = launch(tmp_path, "again", *options, "--resume", "auto")
    assert "resumed at step 16" in again["log"]
    assert_continues(whole, again, 16)
    # At another number of processes, the per-process seeds have no process to go to:
    # refused, nothing restored; with strict=False, everything else loads. Every load at
    # 1 process was refused, strict=False or not, saying to leave 'dataloader' out of a
    # state load_state builds itself (found in review).
    newest = checkpoints / "step-000000003"
    refused = launch(tmp_path, "one", "--resume", newest, "--expect-load-error", processes=1)
    said = (
        "process 0: CheckpointMismatchError: the checkpoint holds 'dataloader' with a sampler "
        "seed of each of its 2 processes (seeded per process: no set_seed, or "
        "set_seed(seed, device_specific=True)), so it restores at 2 processes only, not at "
        "this run's 1: load at 2 processes, or pass strict=False to load everything else and "
        "start that dataloader from its first epoch; nothing was restored | state unchanged"
    )
    assert said in refused["log"], refused["log"][-3000:]
    loose = launch(tmp_path, "loose", "--resume", newest, "--not-strict", processes=1)
    assert "resumed at step 16" in loose["log"], loose["log"][-3000:]
    assert "loading everything else, and that dataloader starts from its first epoch" in (
        " ".join(loose["log"].split())
    )


def test_a_corrupted_checkpoint_is_refused_on_every_process_and_changes_nothing(
    plain_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """One byte flipped in one data file: ``load_state`` raises the same error on both
    processes, no process hangs, and the model and optimizer are as they were."""
    root, _ = plain_run
    corrupted = tmp_path / "corrupted"
    shutil.copytree(root / "ckpts" / f"step-{SAVE_AT}", corrupted)
    shard = sorted(corrupted.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # in the last tensor's bytes, past the header
    shard.write_bytes(bytes(data))
    got = launch(tmp_path, "refused", "--resume", corrupted, "--expect-load-error")
    # Per process, found wherever it is: the two processes' prints share one stream and
    # can land on one line.
    lines = sorted(re.findall(r"process \d: .*? \| state (?:unchanged|CHANGED)", got["log"]))
    assert len(lines) == 2, got["log"][-3000:]
    assert lines[0].replace("process 0", "process 1") == lines[1]  # the same error on both
    assert lines[0].startswith("process 0: CheckpointCorruptError: ")
    assert shard.name in lines[0] and "checksum" in lines[0].lower()
    assert lines[0].endswith("| state unchanged")


def test_fsdp2_through_accelerates_plugin_saves_shards_resumes_bitwise_and_reshards(
    tmp_path: Path,
) -> None:
    """``FullyShardedDataParallelPlugin(fsdp_version=2)``: Accelerate's own ``prepare``
    shards the model with ``fully_shard``; each process writes its own shards in the
    background; the run resumes bitwise under FSDP2, and the checkpoint loads into one
    plain process and into DDP on 2, the whole tensors equal to those saved."""
    whole = launch(
        tmp_path, "whole", "--fsdp2", "--async-save", "--save-at", str(SAVE_AT),
        "--save-dir", tmp_path / "ckpts", "--dump", tmp_path / "saved.safetensors",
    )  # fmt: skip
    path = tmp_path / "ckpts" / f"step-{SAVE_AT}"
    report = shardsafe.inspect(path)
    weight = [t for t in report.tensors if t.key == "model/0.weight"]
    assert [t.writers for t in weight] == [(0, 1)]  # each process its half of the rows
    assert shardsafe.verify(path).ok
    resumed = launch(
        tmp_path, "resumed", "--fsdp2", "--resume", path,
        "--dump", tmp_path / "loaded.safetensors",
    )  # fmt: skip
    assert_same_tensors(tmp_path / "loaded.safetensors", tmp_path / "saved.safetensors")
    assert_continues(whole, resumed, SAVE_AT)
    for name, processes in (("plain", 1), ("ddp", 2)):
        launch(
            tmp_path, name, "--resume", path, "--dump", tmp_path / f"{name}.safetensors",
            "--steps", str(SAVE_AT), processes=processes,
        )  # fmt: skip
        assert_same_tensors(tmp_path / f"{name}.safetensors", tmp_path / "saved.safetensors")
