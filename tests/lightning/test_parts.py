"""The strategy's pieces in one process: what a save holds, the fit-start check, removal."""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.checkpoint import LoadOptions, SaveOptions
from shardsafe.checkpoint.replacing import save_replacing
from shardsafe.checkpoint.storage import placement
from shardsafe.lightning import ShardsafeDDPStrategy, _namespace, checks, cleanup, restore, state


def lightning_dict(model_state: Any, optimizers: int = 1) -> dict[str, Any]:
    """The shape of what Lightning's dump_checkpoint returns."""
    return {
        "epoch": 0,
        "global_step": 5,
        "state_dict": model_state,
        "optimizer_states": [{}] * optimizers,
        "lr_schedulers": [{"last_epoch": 5}],
        "hyper_parameters": {"lr": 0.05},
    }


def test_the_module_and_every_optimizer_are_saved_as_objects() -> None:
    module = nn.Linear(2, 1)
    optimizers = [torch.optim.SGD(module.parameters(), lr=0.1) for _ in range(3)]
    record = state.StateDictRecord()
    checkpoint = lightning_dict(record.record(module.state_dict()), optimizers=3)
    saved = state.save_state(checkpoint, module, optimizers, record)
    assert list(saved) == ["model", "optimizer", "optimizer_1", "optimizer_2", "lightning"]
    assert saved["model"] is module
    assert [saved[n] for n in ("optimizer", "optimizer_1", "optimizer_2")] == optimizers
    assert saved["lightning"] == {
        "epoch": 0,
        "global_step": 5,
        "lr_schedulers": [{"last_epoch": 5}],
        "hyper_parameters": {"lr": 0.05},
    }


def test_a_state_dict_edited_by_a_hook_is_saved_as_edited(tmp_path: Path) -> None:
    module = nn.Linear(2, 1)
    record = state.StateDictRecord()
    model_state = record.record(module.state_dict())
    del model_state["bias"]  # e.g. on_save_checkpoint dropping a frozen part
    saved = state.save_state(lightning_dict(model_state), module, [], record)
    assert "model" not in saved
    assert saved["lightning"]["state_dict"] is model_state
    shardsafe.save(tmp_path / "ckpt", saved)
    loaded = shardsafe.load(tmp_path / "ckpt", {})["lightning"]["state_dict"]
    assert list(loaded) == ["weight"] and torch.equal(loaded["weight"], module.weight)


def test_an_edited_state_dict_beside_an_optimizer_saves_and_restores(tmp_path: Path) -> None:
    """The optimizer's state is keyed by the module's parameter names, so the module is
    saved too; on load the module is restored, but left for Lightning to load the edited
    dict into after on_load_checkpoint (``Restored.model`` false)."""
    module = nn.Linear(2, 1)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    module(torch.ones(3, 2)).sum().backward()
    optimizer.step()
    record = state.StateDictRecord()
    model_state = {f"renamed.{k}": v for k, v in record.record(module.state_dict()).items()}
    saved = state.save_state(lightning_dict(model_state), module, [optimizer], record)
    assert list(saved) == ["model", "optimizer", "lightning"]
    shardsafe.save(tmp_path / "ckpt", saved)
    fresh = nn.Linear(2, 1)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    checkpoint, restored = restore.load_directory(
        str(tmp_path / "ckpt"), fresh, [fresh_optimizer], LoadOptions()
    )
    assert restored == restore.Restored(model=False, optimizers=True)
    assert sorted(checkpoint["state_dict"]) == ["renamed.bias", "renamed.weight"]
    moments = [optimizer.state[p]["exp_avg"] for p in module.parameters()]
    assert all(
        torch.equal(fresh_optimizer.state[p]["exp_avg"], m)
        for p, m in zip(fresh.parameters(), moments)
    )


def test_an_evaluation_from_an_edited_state_dict_leaves_the_keys_it_dropped_alone(
    tmp_path: Path,
) -> None:
    """validate/test/predict (no optimizers) restored the module saved beside the edited
    dict, so a key the hook dropped came back with the checkpoint's value; Lightning
    loads the edited dict alone, and the live module keeps that key's value."""
    module = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    record = state.StateDictRecord()
    model_state = record.record(module.state_dict())
    del model_state["bias"]  # on_save_checkpoint dropping a part
    shardsafe.save(
        tmp_path / "ckpt",
        state.save_state(lightning_dict(model_state), module, [optimizer], record),
    )
    live = nn.Linear(2, 1)
    with torch.no_grad():
        live.bias.fill_(7.0)
    checkpoint, restored = restore.load_directory(str(tmp_path / "ckpt"), live, None, LoadOptions())
    assert restored == restore.Restored(model=False, optimizers=False)
    assert list(checkpoint["state_dict"]) == ["weight"]
    assert torch.equal(live.bias, torch.full((1,), 7.0))  # Lightning loads only "weight"


@pytest.mark.parametrize("lightning", [None, ["epoch", 3], "x"])
def test_a_checkpoint_without_lightnings_dict_is_refused_before_anything_loads(
    tmp_path: Path, lightning: Any
) -> None:
    """``fit(ckpt_path=...)`` (or ``validate``) with a checkpoint ``shardsafe.save`` wrote
    directly (no ``lightning`` entry) restored the module and optimizer, then ended in
    Lightning's bare ``KeyError: 'pytorch-lightning_version'``; with a ``lightning`` entry
    that is not a dict, in a bare ``ValueError`` from ``dict()``."""
    saved_module = nn.Linear(2, 1)
    saved: dict[str, Any] = {
        "model": saved_module,
        "optimizer": torch.optim.SGD(saved_module.parameters(), lr=0.1),
    }
    if lightning is not None:
        saved["lightning"] = lightning
    shardsafe.save(tmp_path / "c", saved)
    module = nn.Linear(2, 1)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    path = str(tmp_path / "c")
    expected: type[Exception] = shardsafe.CheckpointCorruptError
    message = (
        f"{path} holds a 'lightning' entry that is not Lightning's checkpoint dict (it is a "
        f"value of {type(lightning).__name__}), so a shardsafe Lightning strategy did not "
        "write it as it is; nothing was restored"
    )
    if lightning is None:
        expected = shardsafe.CheckpointMismatchError
        message = (
            f"{path} is a shardsafe checkpoint, but not one a Lightning strategy saved (it has "
            "no 'lightning' entry: no epoch, step or loops to resume). Load its weights with "
            "shardsafe.load(path, {'model': module}) instead, then call fit, validate, test or "
            "predict without ckpt_path"
        )
    for optimizers in ([optimizer], None):  # a fit, and validate/test/predict
        with pytest.raises(expected) as refused:
            restore.load_directory(path, module, optimizers, LoadOptions())
        assert str(refused.value) == message
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())


def test_a_weights_only_checkpoint_saves_no_optimizer() -> None:
    module = nn.Linear(2, 1)
    record = state.StateDictRecord()
    checkpoint = {"epoch": 0, "state_dict": record.record(module.state_dict())}
    saved = state.save_state(checkpoint, module, [torch.optim.SGD(module.parameters())], record)
    assert list(saved) == ["model", "lightning"]


class Holder:
    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value


def test_the_fit_start_check_names_a_nested_value() -> None:
    part = checks.Part(
        "the state_dict() of callback Holder",
        Holder({"a": [1, {"b": nn.ReLU()}]}).state_dict,
        "Fix it.",
    )
    assert checks._problem(part) == (
        "the state_dict() of callback Holder holds ['a'][1]['b'], a ReLU, which a checkpoint "
        f"cannot hold. Fix it. {checks._HINT}"
    )
    fine = checks.Part("x", Holder({"a": (1, 2.5, float("inf"), torch.ones(2))}).state_dict, "")
    assert checks._problem(fine) is None


def test_removal_deletes_only_what_shardsafe_wrote(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "old.ckpt", {"w": torch.ones(2)})
    shardsafe.save(tmp_path / "kept.ckpt", {"w": torch.ones(2)})
    (tmp_path / "kept.ckpt" / "notes.txt").write_text("mine")
    (tmp_path / "link.ckpt").symlink_to("kept.ckpt")
    (tmp_path / "file.ckpt").write_bytes(b"torch.save bytes")
    cleanup.remove(str(tmp_path / "old.ckpt"))
    cleanup.remove(str(tmp_path / "link.ckpt"))
    with pytest.warns(UserWarning, match=r"left .*kept.ckpt in place: it holds \['notes.txt'\]"):
        cleanup.remove(str(tmp_path / "kept.ckpt"))
    with pytest.warns(
        UserWarning, match=r"left .*file.ckpt in place: it is a file, not a checkpoint directory"
    ):
        cleanup.remove(str(tmp_path / "file.ckpt"))
    assert sorted(os.listdir(tmp_path)) == ["file.ckpt", "kept.ckpt"]
    assert sorted(os.listdir(tmp_path / "kept.ckpt")) == [
        "manifest.json",
        "notes.txt",
        "shard-00000-of-00001.safetensors",
    ]


def test_removal_stays_inside_the_checkpoint_callbacks_directories(tmp_path: Path) -> None:
    """``ModelCheckpoint`` removes the paths its state names (``best_k_models``,
    ``last_model_path``), state a resume loads from a checkpoint that may come from anyone.
    Lightning checks them by their text only, so ``ckpts/../elsewhere/...`` made
    ``save_top_k`` delete another run's checkpoint (and any empty directory) outside the
    run; with ``pl_hostile.py``'s crafted checkpoint, in a real resumed fit."""
    pl = _namespace.lightning()
    ckpts, elsewhere = tmp_path / "ckpts", tmp_path / "elsewhere"
    for name in ("old.ckpt", "sub/step.ckpt", "../exc/on_exception.ckpt"):
        shardsafe.save(ckpts / name, {"w": torch.ones(2)})
    for name in ("production.ckpt", "linked/step.ckpt"):
        shardsafe.save(elsewhere / name, {"w": torch.ones(2)})
    (elsewhere / "empty").mkdir()
    (ckpts / "through").symlink_to(elsewhere / "linked")
    trainer = pl.Trainer(
        strategy=ShardsafeDDPStrategy(),
        accelerator="cpu",
        devices=1,
        callbacks=[
            pl.callbacks.ModelCheckpoint(dirpath=ckpts),
            pl.callbacks.OnExceptionCheckpoint(tmp_path / "exc"),  # removed at on_train_end
        ],
        logger=False,
    )
    module = pl.LightningModule()
    module.trainer = trainer
    trainer.strategy.connect(module)
    outside = [
        f"{ckpts}/../elsewhere/production.ckpt",
        f"{ckpts}/../elsewhere/empty",
        f"{ckpts}/through/step.ckpt",
        "s3://bucket/ckpts/old.ckpt",
        str(ckpts),
    ]
    for path in outside:
        with pytest.warns(UserWarning, match="outside the checkpoint directories of this run"):
            trainer.strategy.remove_checkpoint(path)
    trainer.strategy.remove_checkpoint(ckpts / "old.ckpt")
    trainer.strategy.remove_checkpoint(ckpts / "sub" / "step.ckpt")
    trainer.strategy.remove_checkpoint(tmp_path / "exc" / "on_exception.ckpt")
    assert os.listdir(tmp_path / "exc") == []
    assert sorted(os.listdir(ckpts)) == ["sub", "through"] and os.listdir(ckpts / "sub") == []
    assert sorted(os.listdir(elsewhere)) == ["empty", "linked", "production.ckpt"]
    for kept in ("production.ckpt", "linked/step.ckpt"):
        assert torch.equal(shardsafe.load(elsewhere / kept, {})["w"], torch.ones(2))


def test_interrupted_saves_in_the_folders_a_filename_makes_are_cleared(tmp_path: Path) -> None:
    """``filename="{epoch}-{train/loss:.2f}"`` (a metric logged as ``train/loss``) saves
    ``epoch=0-train/loss=1.00.ckpt``: the staging directory of a save interrupted there
    (a whole checkpoint's size) was left when the next fit started, as only ``dirpath``
    itself was looked at."""
    from tests.unit.test_placement import _age, _Interrupted

    pl = _namespace.lightning()
    ckpts = tmp_path / "ckpts"
    kept = ckpts / "epoch=0-train" / "loss=2.00.ckpt"
    shardsafe.save(kept, {"w": torch.ones(3)})
    for name in ("epoch=0-train/loss=1.00.ckpt", "last.ckpt"):
        with pytest.raises(KeyboardInterrupt):
            save_replacing(
                str(ckpts / name), {"w": torch.ones(3)}, SaveOptions(storage=_Interrupted)
            )
    staged = [
        ckpts / "epoch=0-train" / ".loss=1.00.ckpt.shardsafe-partial",
        ckpts / ".last.ckpt.shardsafe-partial",
    ]
    for directory in staged:
        _age(directory, placement.QUIET_S + 1)
    callback = pl.callbacks.ModelCheckpoint(dirpath=ckpts, filename="{epoch}-{train/loss:.2f}")
    trainer = pl.Trainer(
        strategy=ShardsafeDDPStrategy(), accelerator="cpu", devices=1, callbacks=[callback]
    )
    cleanup.clear_interrupted(trainer)
    assert sorted(os.listdir(ckpts)) == ["epoch=0-train"]
    assert os.listdir(ckpts / "epoch=0-train") == ["loss=2.00.ckpt"]
    assert torch.equal(shardsafe.load(kept, {})["w"], torch.ones(3))


def test_the_folder_of_checkpoints_passed_as_ckpt_path_is_named_as_such(tmp_path: Path) -> None:
    """``fit(ckpt_path="ckpts")`` (ModelCheckpoint's ``dirpath``, not a checkpoint in it)
    said it "is a directory without manifest.json ... a save into it may have been
    interrupted", which sends the user looking for a crash."""
    ckpts = tmp_path / "ckpts"
    for step in (5, 10, 15, 20):
        shardsafe.save(ckpts / f"epoch=0-step={step}.ckpt", {"w": torch.ones(2)})
    (ckpts / "last.ckpt").symlink_to("epoch=0-step=20.ckpt")
    (ckpts / "empty.ckpt").mkdir()  # not a checkpoint: not named
    with pytest.raises(shardsafe.CheckpointNotFoundError) as refused:
        restore.load_file(str(ckpts))  # what fit(ckpt_path=...) calls for a non-shardsafe path
    assert str(refused.value) == (
        f"{ckpts} is a folder of checkpoints (it holds epoch=0-step=20.ckpt, "
        "epoch=0-step=5.ckpt, last.ckpt ...), not one checkpoint: pass one of them, or "
        "ckpt_path='last' for the newest one ModelCheckpoint saved"
    )


def test_a_lightning_outside_the_supported_range_is_refused() -> None:
    too_new = types.ModuleType("pytorch_lightning")
    too_new.__version__ = "3.0.0"  # type: ignore[attr-defined]
    with pytest.raises(ImportError) as info:
        _namespace._checked(too_new)
    assert str(info.value) == (
        "shardsafe.lightning supports Lightning >=2.2,<3; pytorch_lightning is 3.0.0. "
        "Install a supported version: pip install 'shardsafe[lightning]'"
    )


def test_options_are_checked_when_the_strategy_is_made() -> None:
    with pytest.raises(ValueError, match=r"layout='bogus' is not one of"):
        ShardsafeDDPStrategy(layout="bogus")
    with pytest.raises(ValueError, match="a checkpoint_io plugin would never be called"):
        ShardsafeDDPStrategy(checkpoint_io=object())
    for option in ({"local_every": 3}, {"keep_local": 1}):
        ((field, value),) = option.items()
        with pytest.raises(ValueError) as e:
            ShardsafeDDPStrategy(**option)
        assert str(e.value) == (
            f"{field}={value} applies to the local tier, which is off; pass "
            f"local_checkpoint_dir='/dev/shm/run1' (a node-local directory) too, or leave "
            f"{field} out"
        )
    with pytest.raises(ValueError, match=r"^keep_local=0 must be a positive int \(steps\)$"):
        ShardsafeDDPStrategy(local_checkpoint_dir="/dev/shm/x", keep_local=0)


def test_the_local_tier_directory_is_read_as_every_load_reads_it() -> None:
    """Found in review: ``file:/p`` was kept as written, so a resume's chosen path never
    matched the loaded one (``/p/step-...``), and the fit failed "without manifest.json"."""
    from shardsafe.lightning.local_tier import LocalTier

    for written in ("file:/dev/shm/x", "file:///dev/shm/x", "file://localhost/dev/shm/x"):
        assert LocalTier(written, 1, 2).directory == "/dev/shm/x"
    for refused in ("s3://b/x", "file://otherhost/x", "s3:/b/x"):
        with pytest.raises(ValueError, match=r"must be a directory on each node's own disk"):
            LocalTier(refused, 1, 2)


def test_the_model_parallel_strategy_says_what_a_path_is_before_refusing_a_file(
    tmp_path: os.PathLike[str],
) -> None:
    """Found in review: ``ShardsafeModelParallelStrategy`` (which reads no ``.ckpt``
    files) said "is not a shardsafe checkpoint" of a missing path, a folder of
    checkpoints and a background save's held name alike; ``ShardsafeDDPStrategy`` says
    which. A file is still refused as before."""
    from shardsafe.lightning import ShardsafeModelParallelStrategy

    strategy = ShardsafeModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    root = str(tmp_path)
    with pytest.raises(shardsafe.CheckpointNotFoundError, match=r"^no checkpoint at "):
        strategy._load_path(os.path.join(root, "nope.ckpt"), None, None, True)  # type: ignore[arg-type]
    shardsafe.save(os.path.join(root, "epoch=0-step=5.ckpt"), {"w": torch.ones(1)})
    with pytest.raises(shardsafe.CheckpointNotFoundError, match="is a folder of checkpoints"):
        strategy._load_path(root, None, None, True)  # type: ignore[arg-type]
    torch.save({"w": torch.ones(1)}, os.path.join(root, "plain.ckpt"))
    with pytest.raises(shardsafe.CheckpointError, match="is not a shardsafe checkpoint"):
        strategy._load_path(os.path.join(root, "plain.ckpt"), None, None, True)  # type: ignore[arg-type]
