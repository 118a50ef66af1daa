"""``shardsafe.lightning.load_from_checkpoint``: Lightning's way to get a trained module
back, on the directories the shardsafe strategies save, in one process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed.checkpoint as dcp

import shardsafe
from shardsafe.lightning import load_from_checkpoint, restore
from tests.lightning.lightning_script import Regression

pytestmark = pytest.mark.timeout(120)


def newest(root: Path) -> Path:
    """The step-15 checkpoint of the uninterrupted run: a shardsafe directory."""
    (path,) = (root / "ckpts").glob("epoch=*-step=15.ckpt")
    assert path.is_dir()
    return path


def saved_weights(path: Path) -> dict[str, torch.Tensor]:
    """The weights in the checkpoint, read by shardsafe into a module built by hand."""
    reference = Regression("plain")
    shardsafe.load(path, {"model": reference})
    return reference.state_dict()


def assert_same(module: torch.nn.Module, weights: dict[str, Any]) -> None:
    state = module.state_dict()
    assert list(state) == list(weights)
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name


class Recording(Regression):
    """Records what ``on_load_checkpoint`` saw."""

    seen: dict[str, Any] = {}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        Recording.seen = dict(checkpoint)


def test_a_module_comes_back_with_its_hyper_parameters_and_weights(
    uninterrupted: Callable[[str], Path],
) -> None:
    path = newest(uninterrupted("plain"))
    module = load_from_checkpoint(Recording, path)
    assert isinstance(module, Recording)
    assert dict(module.hparams) == {
        "optimizer": "plain",
        "lr": 0.05,
        "activation": None,
        "fsdp": False,
    }
    assert_same(module, saved_weights(path))
    assert not torch.equal(module.net[0].weight, Regression("plain").net[0].weight)
    assert Recording.seen["global_step"] == 15
    assert Recording.seen["hyper_parameters"]["lr"] == 0.05
    assert set(Recording.seen["state_dict"]) == set(module.state_dict())
    # One placeholder per optimizer, as Lightning's own load_from_checkpoint gives the
    # hook (it had no such key: a hook reading it raised KeyError here only).
    assert Recording.seen["optimizer_states"] == [{}]


def test_keyword_arguments_override_the_saved_hyper_parameters(
    uninterrupted: Callable[[str], Path],
) -> None:
    path = newest(uninterrupted("plain"))
    module = load_from_checkpoint(Regression, path, lr=0.5)
    assert module.hparams["lr"] == 0.5
    assert_same(module, saved_weights(path))


def test_strict_loading_refuses_a_module_that_does_not_match(
    uninterrupted: Callable[[str], Path],
) -> None:
    class Wider(Regression):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.extra = torch.nn.Linear(2, 2)

    path = newest(uninterrupted("plain"))
    with pytest.raises(shardsafe.CheckpointMismatchError, match=r"model/extra\.weight"):
        load_from_checkpoint(Wider, path)
    with pytest.warns(UserWarning) as said:
        module = load_from_checkpoint(Wider, path, strict=False)
    assert torch.equal(module.net[2].bias, saved_weights(path)["net.2.bias"])
    # Lightning's warning (shardsafe's load said nothing of the keys that did not match)
    assert [str(w.message) for w in said if "Found keys" in str(w.message)] == [
        "Found keys that are in the model state dict but not in the checkpoint: "
        "['extra.weight', 'extra.bias']"
    ]

    class Insisting(Wider):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.strict_loading = True

    with pytest.raises(ValueError) as refused:  # Lightning's error, as its loader raises
        load_from_checkpoint(Insisting, path, strict=False)
    assert str(refused.value) == (
        "You set `.load_from_checkpoint(..., strict=False)` which is in conflict with "
        "`Insisting.strict_loading=True. Please set the same value for both of them."
    )


def test_an_ordinary_ckpt_file_goes_to_lightnings_own_loader(tmp_path: Path) -> None:
    trained = Regression("plain", lr=0.2)
    with torch.no_grad():
        trained.net[0].weight.add_(1.0)
    checkpoint = {
        "state_dict": trained.state_dict(),
        "hyper_parameters": dict(trained.hparams),
        "pytorch-lightning_version": pl.__version__,
    }
    torch.save(checkpoint, tmp_path / "plain.ckpt")
    module = load_from_checkpoint(Regression, tmp_path / "plain.ckpt")
    assert module.hparams["lr"] == 0.2
    assert_same(module, trained.state_dict())


def test_a_shardsafe_checkpoint_that_lightning_did_not_save_is_named(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "plain", {"model": Regression("plain")})
    with pytest.raises(shardsafe.CheckpointError) as refused:
        load_from_checkpoint(Regression, tmp_path / "plain")
    assert str(refused.value) == (
        f"{tmp_path / 'plain'} is a shardsafe checkpoint, but not one a Lightning strategy "
        "saved (it has no 'lightning' entry); load it with shardsafe.load(path, "
        "{'model': module})"
    )


@pytest.mark.filterwarnings("ignore:.*the result is a pickle")
def test_convert_to_torch_gives_a_ckpt_that_lightning_itself_loads_and_resumes(
    uninterrupted: Callable[[str], Path], tmp_path: Path
) -> None:
    path = newest(uninterrupted("plain"))
    out = tmp_path / "converted.ckpt"
    shardsafe.convert(path, out, to="torch")
    ckpt = torch.load(out, weights_only=True)
    assert ckpt["pytorch-lightning_version"] == pl.__version__
    assert ckpt["global_step"] == 15 and "model" not in ckpt and "lightning" not in ckpt

    module = Regression.load_from_checkpoint(out)  # Lightning's own classmethod
    assert_same(module, saved_weights(path))
    assert module.hparams["lr"] == 0.05

    # The optimizer state in torch's numbered form, as Adam itself reads it.
    model = Regression("plain")
    adam = torch.optim.Adam(model.parameters(), lr=0.05)
    adam.load_state_dict(ckpt["optimizer_states"][0])
    reference = Regression("plain")
    expected = torch.optim.Adam(reference.parameters(), lr=0.05)
    shardsafe.load(path, {"model": reference, "optimizer": expected})
    got, want = adam.state_dict(), expected.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"]) == list(range(4))
    for i, state in want["state"].items():
        for name, value in state.items():
            assert torch.equal(got["state"][i][name], value), (i, name)

    # Lightning's default strategy resumes from it at step 15 and trains on.
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=17,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Regression("plain"), ckpt_path=out)
    assert trainer.global_step == 17


@pytest.mark.filterwarnings("ignore:.*the result is a pickle")
def test_a_ckpt_converted_to_shardsafe_and_back_is_a_lightning_ckpt_again(tmp_path: Path) -> None:
    trained = Regression("plain", lr=0.2)
    with torch.no_grad():
        trained.net[0].weight.add_(1.0)
    original = {
        "epoch": 1,
        "global_step": 7,
        "pytorch-lightning_version": pl.__version__,
        "state_dict": trained.state_dict(),
        "hyper_parameters": dict(trained.hparams),
    }
    torch.save(original, tmp_path / "a.ckpt")
    shardsafe.convert(tmp_path / "a.ckpt", tmp_path / "dir", to="shardsafe")
    shardsafe.convert(tmp_path / "dir", tmp_path / "b.ckpt", to="torch")
    back = torch.load(tmp_path / "b.ckpt", weights_only=True)
    assert sorted(back) == sorted(original)
    module = Regression.load_from_checkpoint(tmp_path / "b.ckpt")
    assert_same(module, trained.state_dict())


class Renaming(Regression):
    """Saved its weights under other names (an ``on_save_checkpoint`` edit) and renames
    them back when loading, as a module migrating its checkpoints does."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["state_dict"]
        checkpoint["state_dict"] = {k.removeprefix("old."): v for k, v in state.items()}


def test_a_state_dict_a_hook_edited_is_loaded_after_on_load_checkpoint(tmp_path: Path) -> None:
    trained = Regression("plain", lr=0.2)
    with torch.no_grad():
        trained.net[0].weight.add_(1.0)
    edited = {f"old.{k}": v for k, v in trained.state_dict().items()}
    lightning_part = {"hyper_parameters": dict(trained.hparams), "state_dict": edited}
    shardsafe.save(tmp_path / "c", {"lightning": lightning_part})
    module = load_from_checkpoint(Renaming, tmp_path / "c")
    assert_same(module, trained.state_dict())
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "old\.net'):
        load_from_checkpoint(Regression, tmp_path / "c")  # no hook to rename them back


class ReplacedMeanwhile(Regression):
    """Sees the step of the dict it is given; then the checkpoint's name is replaced, as a
    training job's save replaces ``last.ckpt`` (step 20 committed beside, then renamed in)
    while an evaluation job loads it: the moment that exchange can land between reads."""

    seen_step: Any = None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        ReplacedMeanwhile.seen_step = checkpoint["global_step"]
        last = Path(checkpoint["last"])
        last.rename(last.with_name("old"))
        last.with_name("new").rename(last)


def test_the_weights_come_from_the_checkpoint_the_dict_came_from(tmp_path: Path) -> None:
    """The path was opened three times (the dict, the weights' names, the weights): a
    name replaced meanwhile gave ``on_load_checkpoint`` step 10's dict and the module
    step 20's weights, without a word."""
    for name, step, value in (("last.ckpt", 10, 1.0), ("new", 20, 2.0)):
        saved = Regression("plain")
        torch.nn.init.constant_(saved.net[0].weight, value)
        part = {"hyper_parameters": dict(saved.hparams), "global_step": step}
        part["last"] = str(tmp_path / "last.ckpt")
        shardsafe.save(tmp_path / name, {"model": saved, "lightning": part})
    module = load_from_checkpoint(ReplacedMeanwhile, tmp_path / "last.ckpt")
    assert ReplacedMeanwhile.seen_step == 10
    weight = module.net[0].weight
    assert torch.equal(weight, torch.full_like(weight, 1.0))


class Grouped(pl.LightningModule):
    """Keeps its hyper-parameters as one argument (``hparams_name`` = "config")."""

    def __init__(self, config: dict[str, Any], width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(2, width)


def test_keyword_arguments_reach_init_beside_hyper_parameters_kept_as_one(
    tmp_path: Path,
) -> None:
    saved = Grouped({"lr": 0.1}, width=3)
    lightning_part = {
        "hyper_parameters": {"lr": 0.1},
        "hparams_name": "config",
    }
    shardsafe.save(tmp_path / "c", {"model": saved, "lightning": lightning_part})
    module = load_from_checkpoint(Grouped, tmp_path / "c", width=3)
    assert module.layer.out_features == 3
    assert module.hparams["config"]["lr"] == 0.1
    assert torch.equal(module.layer.weight, saved.layer.weight)


class BuiltInConfigureModel(pl.LightningModule):
    """Makes its layers in ``configure_model``, as Lightning advises for large models."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: torch.nn.Linear | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = torch.nn.Linear(self.hparams["width"], 1)


@pytest.mark.parametrize("strict", [True, False])
def test_layers_made_in_configure_model_get_the_saved_weights(tmp_path: Path, strict: bool) -> None:
    trained = BuiltInConfigureModel(width=3)
    trained.configure_model()
    lightning = {"hyper_parameters": dict(trained.hparams), "global_step": 4}
    shardsafe.save(tmp_path / "last.ckpt", {"model": trained, "lightning": lightning})
    module = load_from_checkpoint(BuiltInConfigureModel, tmp_path / "last.ckpt", strict=strict)
    assert module.net is not None
    assert_same(module, trained.state_dict())


class ShardedInConfigureModel(pl.LightningModule):
    """Makes its layers in ``__init__`` and shards them in ``configure_model`` with the
    strategy's device mesh (FSDP2 under ModelParallelStrategy): no mesh in one process."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def configure_model(self) -> None:
        self.device_mesh["data_parallel"]  # TypeError without a strategy, as in FSDP2 code


def test_a_module_that_only_shards_in_configure_model_loads_in_one_process(
    tmp_path: Path,
) -> None:
    trained = ShardedInConfigureModel()
    shardsafe.save(tmp_path / "last.ckpt", {"model": trained, "lightning": {"global_step": 4}})
    module = load_from_checkpoint(ShardedInConfigureModel, tmp_path / "last.ckpt")
    assert_same(module, trained.state_dict())


def test_a_directory_without_a_manifest_is_named_not_opened_as_a_file(tmp_path: Path) -> None:
    interrupted = tmp_path / "epoch=0-step=4.ckpt"
    interrupted.mkdir()
    (interrupted / "shard-00000-of-00002.safetensors").write_bytes(b"partial")
    with pytest.raises(shardsafe.CheckpointNotFoundError) as refused:
        load_from_checkpoint(Regression, interrupted)
    assert str(refused.value) == (
        f"{interrupted} is a directory without manifest.json, so it is not a committed "
        "shardsafe checkpoint (a save into it may have been interrupted)"
    )


class Data(pl.LightningDataModule):
    """A datamodule with hyper-parameters and state of its own."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seen = state_dict["seen"]


def test_a_datamodule_comes_back_with_its_own_hyper_parameters_and_state(
    tmp_path: Path,
) -> None:
    module, data = BuiltInConfigureModel(width=3), Data(batch_size=16)
    module.configure_model()
    data.seen = 7
    lightning = {  # what Lightning's dump_checkpoint holds for both
        "hyper_parameters": dict(module.hparams),
        "datamodule_hyper_parameters": dict(data.hparams),
        "Data": data.state_dict(),
    }
    shardsafe.save(tmp_path / "last.ckpt", {"model": module, "lightning": lightning})
    loaded = load_from_checkpoint(Data, tmp_path / "last.ckpt")
    assert isinstance(loaded, Data)
    assert dict(loaded.hparams) == {"batch_size": 16}
    assert loaded.seen == 7


def test_a_dcp_directory_lightnings_own_strategies_save_is_named_as_such(
    tmp_path: Path,
) -> None:
    """Not "a save into it may have been interrupted", which sends a user switching from
    Lightning's FSDP or ModelParallel strategy looking for a crash."""
    saved = tmp_path / "epoch=0-step=4.ckpt"
    module = BuiltInConfigureModel()
    module.configure_model()
    dcp.save({"state_dict": module.state_dict()}, checkpoint_id=saved)
    expected = (
        f"{saved} is a torch.distributed.checkpoint (DCP) directory (it holds .metadata and no "
        "manifest.json), as Lightning's own FSDP and ModelParallel strategies save, not a "
        "shardsafe checkpoint: resume from it with the strategy that saved it; the shardsafe "
        "strategies resume from the checkpoint directories they write"
    )
    with pytest.raises(shardsafe.CheckpointNotFoundError) as refused:
        load_from_checkpoint(BuiltInConfigureModel, saved)
    assert str(refused.value) == expected
    with pytest.raises(shardsafe.CheckpointNotFoundError) as resumed:
        restore.load_file(str(saved))  # what fit(ckpt_path=...) calls for a non-shardsafe path
    assert str(resumed.value) == expected
