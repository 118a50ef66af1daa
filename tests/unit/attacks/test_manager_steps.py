"""CheckpointManager: only its own names, and only checkpoints that would load."""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardsafe
from shardsafe import CheckpointCorruptError, CheckpointManager
from shardsafe.checkpoint.manager import step_of
from tests.unit.attacks.common import (
    SHARD,
    _small_state,
    assert_bitwise,
    flip_bit,
    header_span,
    listing,
    make_model,
    weights,
)

pytestmark = pytest.mark.timeout(60)


IGNORED_NAMES = [
    "step-" + "\u0660" * 8 + "\u0663",  # Arabic-Indic digits: int() reads them as 3
    "step-1",
    "step-0000000005",
    "step-00000000\u0667",
    "step-0000_0009",
    "step-000000009 ",
    "step-+00000008",
    "Step-000000009",
    "step-000000009.tmp",
]


def test_the_manager_ignores_names_it_does_not_write(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manager = CheckpointManager(root, keep_last=1)
    manager.save(1, _small_state(1))
    p2 = manager.save(2, _small_state(2))
    for name in IGNORED_NAMES:
        assert step_of(name) is None, name
        shutil.copytree(p2, root / name)
    assert manager.complete_steps() == [2]
    assert manager.latest() == p2 and os.path.isdir(p2)
    state = {"model": make_model(0)}
    assert manager.load_latest(state) == {"step": 2}
    assert_bitwise(weights(state["model"]), weights(make_model(2)))
    before = {name: listing(root / name) for name in IGNORED_NAMES}
    p3 = manager.save(3, _small_state(3))  # not "older than" a 10-digit step 5
    manager.close()
    assert manager.latest() == p3
    assert {name: listing(root / name) for name in IGNORED_NAMES} == before
    assert not os.path.exists(p2)


def _break_manifest_symlink(step: Path, elsewhere: Path) -> str:
    shutil.copyfile(step / "manifest.json", elsewhere / "manifest.json")
    (step / "manifest.json").unlink()
    os.symlink(elsewhere / "manifest.json", step / "manifest.json")
    return "manifest.json is a symbolic link"


def _break_manifest_fifo(step: Path, elsewhere: Path) -> str:
    (step / "manifest.json").unlink()
    os.mkfifo(step / "manifest.json")
    return "manifest.json is not a regular file (a named pipe (FIFO))"


def _break_manifest_byte(step: Path, elsewhere: Path) -> str:
    flip_bit(step / "manifest.json", 100, 2)
    return "does not match its CRC32"


def _break_missing_data(step: Path, elsewhere: Path) -> str:
    (step / SHARD).unlink()
    return f"data file {SHARD} is missing"


def _break_truncated_data(step: Path, elsewhere: Path) -> str:
    os.truncate(step / SHARD, (step / SHARD).stat().st_size - 1)
    return "bytes but the manifest recorded"


def _break_data_header(step: Path, elsewhere: Path) -> str:
    flip_bit(step / SHARD, 20, 0)
    return "damaged safetensors header"


@pytest.mark.parametrize(
    "damage",
    [
        _break_manifest_symlink,
        _break_manifest_fifo,
        _break_manifest_byte,
        _break_missing_data,
        _break_truncated_data,
        _break_data_header,
    ],
    ids=["manifest symlink", "manifest fifo", "manifest byte", "data missing", "truncated", "hdr"],
)
def test_a_broken_newest_checkpoint_is_passed_over(
    tmp_path: Path, damage: Callable[[Path, Path], str]
) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    manager = CheckpointManager(root)
    p1 = manager.save(1, _small_state(1))
    p2 = Path(manager.save(2, _small_state(2)))
    why = damage(p2, elsewhere)
    pattern = f"passing over .*step-000000002: .*{re.escape(why)}"
    with pytest.warns(UserWarning, match=pattern):
        assert manager.latest() == p1
    state = {"model": make_model(0)}
    with pytest.warns(UserWarning, match=pattern):
        assert manager.load_latest(state) == {"step": 1}
    manager.close()
    assert_bitwise(weights(state["model"]), weights(make_model(1)))
    assert os.path.isdir(p1)


def test_damaged_tensor_bytes_make_load_latest_fall_back(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manager = CheckpointManager(root)
    p1 = manager.save(1, _small_state(1))
    p2 = Path(manager.save(2, _small_state(2)))
    path = p2 / SHARD
    start, size = header_span(path), path.stat().st_size
    flip_bit(path, (start + size) // 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # latest()'s cheap checks pass: no warning at all
        assert manager.latest() == str(p2)
    state = {"model": make_model(0)}
    pattern = (
        r"could not load .*step-000000002, looking for the newest checkpoint that loads: "
        r"checksum mismatch"
    )
    with pytest.warns(UserWarning, match=pattern):
        assert manager.load_latest(state) == {"step": 1}
    assert_bitwise(weights(state["model"]), weights(make_model(1)))
    # Both damaged: the newest one's error, and nothing restored.
    path = Path(p1) / SHARD
    flip_bit(path, (header_span(path) + path.stat().st_size) // 2, 3)
    state = {"model": make_model(0)}
    with pytest.warns(UserWarning), pytest.raises(CheckpointCorruptError, match="checksum"):
        manager.load_latest(state)
    manager.close()
    assert_bitwise(weights(state["model"]), weights(make_model(0)))


def test_a_save_behind_a_step_load_latest_passed_over_says_to_move_it(tmp_path: Path) -> None:
    """After load_latest passed over a damaged step 3 and resumed from step 1, a save of
    step 2 was told to "resume from the newest (CheckpointManager.load_latest(state) ...)",
    which the run had just done (found in review)."""
    root = tmp_path / "root"
    manager = CheckpointManager(root)
    manager.save(1, _small_state(1))
    path = Path(manager.save(3, _small_state(3))) / SHARD
    flip_bit(path, (header_span(path) + path.stat().st_size) // 2, 3)
    with pytest.warns(UserWarning, match="looking for the newest checkpoint that loads"):
        assert manager.load_latest({"model": make_model(0)}) == {"step": 1}
    with pytest.raises(shardsafe.CheckpointError) as refused:
        manager.save(2, _small_state(2))
    assert str(refused.value) == (
        f"{root} holds step 3, newer than step 2 that this run is at, which would not load, "
        "so latest() and load_latest pass over it (checksum mismatch in "
        f"{SHARD}, tensor 'model/0.weight' (chunk at offsets [0, 0], block 0): the data file "
        "is damaged), resuming from step 1. To continue from step 1, move step-000000003 out "
        "of the root (or delete it); shardsafe will not delete checkpoints for you. Nothing "
        "was written."
    )
    shutil.rmtree(path.parent)  # as told
    assert Path(manager.save(2, _small_state(2))).name == "step-000000002"
    manager.close()


def test_a_save_behind_a_step_latest_passed_over_in_another_object_says_to_move_it(
    tmp_path: Path,
) -> None:
    """The Trainer resumes through ``latest()`` in one process and saves through another
    manager in its workers: after a damaged step 20 was passed over and step 10 resumed,
    the save of step 11 told the user to resume with resume='latest', which the run had
    just done (found in review)."""
    root = tmp_path / "root"
    writer = CheckpointManager(root)
    writer.save(10, _small_state(10))
    path = Path(writer.save(20, _small_state(20))) / SHARD
    writer.close()
    with open(path, "r+b") as data:
        data.truncate(path.stat().st_size - 4)
    with pytest.warns(UserWarning, match="passing over"):
        assert CheckpointManager(root).latest() == str(root / "step-000000010")
    manager = CheckpointManager(root)
    with pytest.raises(shardsafe.CheckpointError) as refused:
        manager.save(11, _small_state(11))
    message = str(refused.value)
    assert message.startswith(
        f"{root} holds step 20, newer than step 11 that this run is at, which would not "
        "load, so latest() and load_latest pass over it ("
    ), message
    assert "truncated" in message or "size" in message, message
    assert message.endswith(
        "). To continue, move step-000000020 out of the root (or delete it); shardsafe will "
        "not delete checkpoints for you. Nothing was written."
    ), message
    manager.close()


@pytest.fixture(scope="module")
def one_good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("one-good") / "ckpt"
    shardsafe.save(path, _small_state(4))
    return path


ENTRY_KINDS = ["good", "no manifest", "bad manifest", "symlink", "fifo manifest", "file"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    entries=st.dictionaries(
        st.integers(0, 40), st.sampled_from(ENTRY_KINDS), min_size=0, max_size=6
    ),
    extra=st.lists(st.sampled_from(IGNORED_NAMES), max_size=3, unique=True),
)
def test_latest_is_the_newest_loadable_step_and_exists(
    one_good: Path, tmp_path_factory: pytest.TempPathFactory, entries: dict[int, str], extra: list
) -> None:
    root = tmp_path_factory.mktemp("latest")
    for step, kind in entries.items():
        path = root / f"step-{step:09d}"
        if kind == "symlink":
            os.symlink(one_good, path)
        elif kind == "file":
            path.write_text("not a directory")
        else:
            shutil.copytree(one_good, path)
            if kind == "no manifest":
                (path / "manifest.json").unlink()
            elif kind == "bad manifest":
                flip_bit(path / "manifest.json", 10, 0)
            elif kind == "fifo manifest":
                (path / "manifest.json").unlink()
                os.mkfifo(path / "manifest.json")
    for name in extra:
        shutil.copytree(one_good, root / name)
    good = [s for s, kind in entries.items() if kind == "good"]
    manager = CheckpointManager(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = manager.latest()
    if not good:
        assert found is None
        return
    assert found == str(root / f"step-{max(good):09d}")
    assert os.path.isdir(found) and not os.path.islink(found)
    assert (Path(found) / "manifest.json").is_file()


class _SavesWhenAsked(torch.nn.Sequential):
    """A module whose ``state_dict`` (asked for once the manifest is read, before any
    tensor byte is) first has the writer commit step 3, so that ``keep_last=1`` deletes
    the step 2 the reader is loading: a reader racing a writer's retention, made exact."""

    def __init__(self, writer: CheckpointManager, in_flight: Path | None = None) -> None:
        super().__init__(*make_model(0))  # the same layers, seed 0's values
        self.writer: CheckpointManager | None = writer
        self.in_flight = in_flight

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            if self.in_flight is not None:  # the save in flight goes on into its directory
                self.in_flight.rmdir()
            writer.save(3, _small_state(3))
        return super().state_dict(*args, **kwargs)


@pytest.mark.parametrize("in_flight", [False, True], ids=["after", "in flight"])
def test_load_latest_looks_again_when_retention_deletes_the_step_it_reads(
    tmp_path: Path, in_flight: bool
) -> None:
    """A reader's load_latest raised "data file ... is missing" when a writer committed a
    newer step and its retention deleted the one being read; it now lists the steps again
    and loads the newer one. Also when that step's directory was there, without its
    manifest, at the first listing: the second passed over it as looked at already (found
    in review)."""
    root = tmp_path / "root"
    writer = CheckpointManager(root, keep_last=1)
    writer.save(2, _small_state(2))
    reader = CheckpointManager(root)
    placeholder = root / "step-000000003" if in_flight else None
    if placeholder is not None:
        placeholder.mkdir()  # the writer's save of step 3 has made its directory
    state = {"model": _SavesWhenAsked(writer, placeholder)}
    pattern = (
        r"could not load .*step-000000002, looking for the newest checkpoint that loads: "
        r"data file .* is missing"
    )
    with pytest.warns(UserWarning, match=pattern):
        assert reader.load_latest(state) == {"step": 3}
    assert sorted(os.listdir(root)) == [".shardsafe.lock", "latest", "step-000000003"]
    assert_bitwise(weights(state["model"]), weights(make_model(3)))
    writer.close()


@pytest.mark.parametrize("found_by", ["load", "listing"])
def test_retention_does_not_count_a_step_load_latest_passed_over(
    tmp_path: Path, found_by: str
) -> None:
    """keep_last=2, step 2 damaged, resumed from step 1, and the next save past step 2
    (Accelerate's automatic naming saves there): retention counted the damaged step 2
    among the two it keeps and deleted step 1, the run's only good fallback (found in
    review). The damaged step is left in place until it falls out of the window."""
    root = tmp_path / "root"
    first = CheckpointManager(root, keep_last=2)
    first.save(1, _small_state(1))
    damaged = Path(first.save(2, _small_state(2))) / SHARD
    first.close()
    if found_by == "load":  # the tensor bytes: found only while loading
        flip_bit(damaged, (header_span(damaged) + damaged.stat().st_size) // 2, 3)
    else:  # the file gone: found by the listing's cheap checks
        damaged.unlink()
    manager = CheckpointManager(root, keep_last=2)
    with pytest.warns(UserWarning, match="step-000000002"):
        assert manager.load_latest({"model": make_model(0)}) == {"step": 1}
    manager.save(3, _small_state(3))
    steps = ["step-000000001", "step-000000002", "step-000000003"]
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == steps
    manager.save(4, _small_state(4))
    left = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    assert left == ["step-000000003", "step-000000004"]
    manager.close()


def test_a_folder_reached_through_a_link_keeps_its_error_with_the_hint(tmp_path: Path) -> None:
    """A link to a folder without a manifest: the hint's own look refused the link ("is a
    symbolic link, not a directory"), a CheckpointCorruptError in place of the load's
    CheckpointNotFoundError (found in review). A link to a folder of Lightning
    checkpoints gets the hint."""
    (tmp_path / "empty").mkdir()
    shardsafe.save(tmp_path / "ckpts" / "epoch=0-step=10.ckpt", _small_state(1))
    for target, hint in (("empty", ""), ("ckpts", "It looks like a folder of Lightning")):
        link = tmp_path / f"to-{target}"
        link.symlink_to(tmp_path / target)
        with pytest.raises(shardsafe.CheckpointNotFoundError) as raised:
            shardsafe.load(link, {"model": make_model(0)})
        said = str(raised.value)
        assert said.startswith(f"{link} has no manifest.json, so it is not a committed"), said
        assert hint in said and said.endswith("interrupted)" if not hint else "one of them")


def _only_damaged(rank: int, world: int, root: str) -> list[str]:
    """``load_latest`` of a fresh manager whose every committed step lost a data file,
    on each rank: what it raised, and whether the model was left as it was."""
    model = make_model(7)
    before = weights(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            CheckpointManager(root).load_latest({"model": model})
            raised = ["nothing"]
        except CheckpointCorruptError as e:
            raised = [type(e).__name__, str(e)]
    after = weights(model)
    unchanged = before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) for k in before
    )
    return [*raised, str(unchanged)]


@pytest.mark.parametrize("world", [1, 2])
def test_load_latest_raises_when_every_checkpoint_is_damaged(tmp_path: Path, world: int) -> None:
    """Steps whose data file is missing were passed over with a warning, and with none
    left ``load_latest`` returned ``None``, "no checkpoint yet": a training loop started
    afresh beside them (found in review). Its docstring promised the newest one's error;
    raised now, on every rank, with nothing restored."""
    from tests.harness import run_ranks

    root = tmp_path / "root"
    manager = CheckpointManager(root)
    manager.save(1, _small_state(1))
    p2 = Path(manager.save(2, _small_state(2)))
    manager.close()
    for step in (root / "step-000000001", p2):
        (step / SHARD).unlink()
    said = (
        f"no checkpoint under {root} would load, and so none was restored: the newest, "
        f"{p2}: data file {SHARD} is missing. Repair it (or load an older step by its "
        "path); to start afresh, delete the damaged steps or use another root"
    )
    if world == 1:
        got = [_only_damaged(0, 1, str(root))]
    else:  # rank 0 looks, and its error is every rank's
        got = run_ranks(_only_damaged, 2, str(root), timeout=60)
        said = f"load failed on rank 0: {said}"
    assert got == [["CheckpointCorruptError", said, "True"]] * world
    assert CheckpointManager(tmp_path / "empty").load_latest({"x": 1}) is None  # no step: None


def test_load_latest_looks_again_before_raising_that_every_step_is_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another run commits step 2 while this load looks at step 1, which it finds
    damaged (that run's retention deleting it): the load lists the steps once more and
    loads step 2, rather than raise that none would load."""
    from shardsafe.checkpoint import manager as manager_module

    root = tmp_path / "root"
    writer = CheckpointManager(root)
    writer.save(1, _small_state(1))
    (root / "step-000000001" / SHARD).unlink()
    real = manager_module.problem_with

    def meanwhile(storage: Any) -> str | None:
        if not (root / "step-000000002").exists():
            writer.save(2, _small_state(2))  # committed while step 1 is looked at
        return real(storage)

    monkeypatch.setattr(manager_module, "problem_with", meanwhile)
    state = {"model": make_model(0)}
    with pytest.warns(UserWarning, match="passing over .*step-000000001"):
        assert CheckpointManager(root).load_latest(state) == {"step": 2}
    writer.close()
    assert_bitwise(weights(state["model"]), weights(make_model(2)))
