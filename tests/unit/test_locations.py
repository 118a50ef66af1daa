"""How a location given by the user is read: ``file://`` URLs as RFC 8089 writes them, a
URL that ``pathlib.Path`` collapsed, a URL given for the local tier, and a relative path
when the working directory changes under an asynchronous save.

Each case once wrote a checkpoint somewhere other than where the user named, without a
word: ``./localhost/tmp/x`` for ``file://localhost/tmp/x``, ``./s3:/bucket/run`` for
``Path("s3://bucket/run")``, the new working directory for an ``async_save`` followed by
``os.chdir``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe import CheckpointError, CheckpointManager, TieredCheckpointManager
from shardsafe.trainer import TrainerConfig


def state(value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    ("written", "named"),
    [
        ("file://localhost{dir}/a", "a"),
        ("file://LOCALHOST{dir}/a", "a"),
        ("file://{dir}/with%20space", "with space"),
        ("file://{dir}/%C3%BCn%C3%AF", "ünï"),
        ("file://{dir}/100%25", "100%"),
        ("file:{dir}/minimal", "minimal"),  # RFC 8089 without an authority
        ("FILE:{dir}/upper%20case", "upper case"),
    ],
)
def test_a_file_url_is_the_local_path_rfc_8089_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str, named: str
) -> None:
    monkeypatch.chdir(tmp_path)
    url = written.format(dir=tmp_path / "ck")
    shardsafe.save(url, state(2.0))
    target = state(0.0)
    shardsafe.load(tmp_path / "ck" / named, target)  # the path itself finds it
    assert torch.equal(target["w"], torch.full((4,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert (tmp_path / "ck" / named / "manifest.json").is_file()


def test_a_path_as_uri_round_trips(tmp_path: Path) -> None:
    where = tmp_path / "a b" / "ünï"
    shardsafe.save(where.as_uri(), state(3.0))
    assert (where / "manifest.json").is_file()
    assert shardsafe.inspect(where.as_uri()).path == str(where)
    # What pathlib makes of the URL (one slash) names the same directory.
    collapsed = Path(where.as_uri())
    assert str(collapsed).startswith("file:/") and not str(collapsed).startswith("file://")
    assert shardsafe.inspect(collapsed).path == str(where)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "file://otherhost/tmp/x",
            "file://otherhost/tmp/x names a file on the host 'otherhost'; shardsafe reads "
            "this machine's files only: write file:///tmp/x (three slashes) or the path itself",
        ),
        ("file:///tmp/x?v=1", "has a query or a fragment ('?' or '#')"),
        ("file:///tmp/x#frag", "has a query or a fragment ('?' or '#')"),
        ("file:///tmp/a%00b", "decodes to a path with a NUL byte (%00)"),
    ],
)
def test_a_file_url_that_names_no_local_path_is_refused_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as e:
        shardsafe.save(url, state())
    assert message in str(e.value)
    assert files_under(tmp_path) == []


COLLAPSED = (
    "'s3:/bucket/run' looks like a s3:// URL whose '//' became '/', which pathlib.Path does "
    "to a URL (str(Path('s3://bucket/run')) is 's3:/bucket/run'); pass the URL as a str (a "
    "local directory of that name: write ./s3:/bucket/run)"
)


def test_a_url_that_pathlib_collapsed_is_refused_everywhere_and_makes_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    collapsed = Path("s3://bucket/run")
    assert str(collapsed) == "s3:/bucket/run"
    with pytest.raises(CheckpointError) as e:
        shardsafe.save(collapsed, state())
    assert str(e.value) == COLLAPSED
    with pytest.raises(CheckpointError) as e:
        shardsafe.load(collapsed, state())
    assert str(e.value) == COLLAPSED
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(collapsed)
    assert str(e.value) == COLLAPSED
    with pytest.raises(ValueError) as v:
        TrainerConfig(max_steps=1, run_dir=collapsed)
    assert str(v.value) == COLLAPSED
    with pytest.raises(ValueError) as v:
        TieredCheckpointManager(persistent=tmp_path / "p", local=collapsed)
    assert str(v.value) == f"local='s3:/bucket/run': {COLLAPSED}"
    assert files_under(tmp_path) == []
    shardsafe.save("./s3:/bucket/run", state())  # the way to that directory, as said
    assert (tmp_path / "s3:" / "bucket" / "run" / "manifest.json").is_file()


def test_the_local_tier_reads_a_file_url_and_refuses_an_object_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        TieredCheckpointManager(persistent=tmp_path / "p", local="s3://bucket/local")
    assert str(e.value) == (
        "local='s3://bucket/local' is a URL; the local tier is a directory on each node's "
        "own disk (e.g. '/dev/shm/run1'); an object store belongs in persistent=..."
    )
    with pytest.raises(CheckpointError, match="are the same directory"):
        TieredCheckpointManager(persistent=tmp_path / "p", local=f"file://{tmp_path}/p")
    assert files_under(tmp_path) == []
    with pytest.warns(UserWarning, match="runs on 1 node"):
        tiers = TieredCheckpointManager(persistent=tmp_path / "p", local=f"file://{tmp_path}/l")
    tiers.save(1, state(5.0))
    tiers.close()
    assert (tmp_path / "l").is_dir() and not (tmp_path / "file:").exists()


def two_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """``first`` (made the working directory) and ``second``, both empty."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    return first, second


def test_an_async_save_writes_where_the_call_named_after_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = two_directories(tmp_path, monkeypatch)
    handle = shardsafe.async_save("ck", state(7.0))
    os.chdir(second)
    handle.wait()
    assert (first / "ck" / "manifest.json").is_file()
    assert files_under(second) == []


def test_a_manager_with_a_relative_root_refuses_to_go_on_after_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its async save's ``latest`` moved in the new directory, its steps in the first."""
    first, second = two_directories(tmp_path, monkeypatch)
    manager = CheckpointManager("ckpts")
    manager.save(1, state(1.0))
    handle = manager.async_save(2, state(2.0))
    os.chdir(second)
    handle.wait()
    refusal = (
        f"the working directory changed from {first} to {second} since "
        f"CheckpointManager('ckpts') was made, and its checkpoints are in {first}/ckpts: "
        "give the manager that absolute root, or change back"
    )
    for verb in (
        lambda: manager.save(3, state(3.0)),
        lambda: manager.load_latest(state(0.0)),
        manager.latest,
        manager.complete_steps,
    ):
        with pytest.raises(ValueError) as e:
            verb()
        assert str(e.value) == refusal
    assert files_under(second) == []
    manager.close()
    os.chdir(first)
    assert CheckpointManager("ckpts").complete_steps() == [1, 2]
    assert CheckpointManager("ckpts").latest() == os.path.join("ckpts", "step-000000002")
