"""Hyper-parameters kept as an OmegaConf ``DictConfig`` (Hydra's ``save_hyperparameters(cfg)``).

Lightning puts the config and its class (``hparams_type``) in every checkpoint. Before,
the fit-start check passed and every save failed at the first checkpoint on the class;
now they are saved as plain data and the class's name, and ``load_from_checkpoint``
hands ``__init__`` a ``DictConfig`` again, as Lightning's loader does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

import shardsafe
from shardsafe.lightning import checks, load_from_checkpoint, state

omegaconf = pytest.importorskip("omegaconf")
pytestmark = pytest.mark.timeout(60)


class Configured(pl.LightningModule):
    """A module built from one Hydra config, attribute access and interpolation included."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.save_hyperparameters(cfg)
        self.net = torch.nn.Linear(cfg.model.width, cfg.model.out)


def config() -> Any:
    return omegaconf.OmegaConf.create(
        {"model": {"width": 3, "out": "${model.width}"}, "layers": [8, 8], "lr": 0.1}
    )


def dumped(module: pl.LightningModule) -> dict[str, Any]:
    """What Lightning's ``dump_checkpoint`` puts in for such a module (its lines for
    ``hparams``: the config itself, its name and its class)."""
    return {
        "epoch": 0,
        "global_step": 4,
        "state_dict": module.state_dict(),
        "hparams_name": module._hparams_name,
        "hyper_parameters": module.hparams,
        "hparams_type": type(module.hparams),
    }


def test_a_dict_config_is_saved_and_comes_back_as_one(tmp_path: Path) -> None:
    trained = Configured(config())
    assert isinstance(trained.hparams, omegaconf.DictConfig)  # as Lightning keeps it
    to_save = state.save_state(dumped(trained), trained, [], state.StateDictRecord())
    shardsafe.save(tmp_path / "last.ckpt", to_save)
    module = load_from_checkpoint(Configured, tmp_path / "last.ckpt")
    assert isinstance(module.hparams, omegaconf.DictConfig)
    assert module.hparams == trained.hparams
    assert omegaconf.OmegaConf.to_yaml(module.hparams) == omegaconf.OmegaConf.to_yaml(
        trained.hparams
    )  # the interpolation kept as written
    for name, tensor in trained.state_dict().items():
        assert torch.equal(module.state_dict()[name], tensor), name


def test_the_fit_start_check_passes_a_config_holding_lists() -> None:
    module = Configured(config())
    problems = [checks._problem(part) for part in checks._hyper_parameters(module)]
    assert problems == [None, None, None]


class Hydra(pl.LightningModule):
    """Hydra's other pattern: several configs as ``__init__``'s arguments, saved by
    ``save_hyperparameters()``: ``hparams`` is a dict whose values are configs."""

    def __init__(self, model_cfg: Any, optim_cfg: Any, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(model_cfg.width, 1)


def test_a_dict_of_configs_is_saved_and_each_comes_back_as_a_config(tmp_path: Path) -> None:
    """Only ``hparams`` that was itself a config was converted: the fit-start check refused
    the lists inside these (``hyper-parameter 'model_cfg' of Hydra holds ['hidden'], a
    ListConfig, which a checkpoint cannot hold``), and a run could not start."""
    model_cfg = omegaconf.OmegaConf.create({"width": 4, "hidden": [8, 8], "act": "${name}"})
    optim_cfg = omegaconf.OmegaConf.create({"lr": 0.1, "betas": [0.9, 0.99]})
    trained = Hydra(model_cfg, optim_cfg, seed=3)
    problems = [checks._problem(part) for part in checks._hyper_parameters(trained)]
    assert problems == [None, None, None]
    dump = dumped(trained)
    del dump["hparams_type"]  # Lightning's AttributeDict: no class of its own to name
    to_save = state.save_state(dump, trained, [], state.StateDictRecord())
    shardsafe.save(tmp_path / "last.ckpt", to_save)
    module = load_from_checkpoint(Hydra, tmp_path / "last.ckpt")
    for name, config in (("model_cfg", model_cfg), ("optim_cfg", optim_cfg)):
        back = module.hparams[name]
        assert isinstance(back, omegaconf.DictConfig), name
        assert omegaconf.OmegaConf.to_yaml(back) == omegaconf.OmegaConf.to_yaml(config)
    assert module.hparams["seed"] == 3
    for name, tensor in trained.state_dict().items():
        assert torch.equal(module.state_dict()[name], tensor), name
