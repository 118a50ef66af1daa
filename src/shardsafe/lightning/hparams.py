"""Hyper-parameters kept in an OmegaConf config (Hydra's ``save_hyperparameters(cfg)``).

Lightning keeps such a ``DictConfig`` as the module's ``hparams`` and puts it in every
checkpoint together with its *class* (``hparams_type``), which its own loader uses to
rebuild the config. A shardsafe checkpoint holds JSON data, not classes or OmegaConf
objects, so every save of such a run failed, at its first checkpoint (the check when fit
starts saw only the values). Here the config is saved as the plain dicts and lists it
holds (interpolations such as ``${model.width}`` kept as written, as Lightning's pickle
keeps them), and its class by name; :func:`rebuild` makes the ``DictConfig`` again when
``load_from_checkpoint`` builds the module, as Lightning's loader does.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

HPARAMS_TYPES = ("hparams_type", "datamodule_hparams_type")
"""Where Lightning's checkpoint holds the class of the module's (datamodule's) hparams."""
HPARAMS = ("hyper_parameters", "datamodule_hyper_parameters")
DICT_CONFIG = "omegaconf.dictconfig.DictConfig"
CONFIG_ENTRIES = "shardsafe_config_hyper_parameters"
"""Where a shardsafe checkpoint names the hyper-parameters that were OmegaConf configs one
level down (``{"hyper_parameters": ["model_cfg", "optim_cfg"]}``): Hydra's other pattern,
``__init__(self, model_cfg: DictConfig, optim_cfg: DictConfig)`` with
``self.save_hyperparameters()``, whose ``hparams`` is a dict of configs."""


def plain(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint`` (Lightning's dict, or a part of it) with its hyper-parameters as
    plain data and their class as its name, so that a checkpoint can hold them."""
    result = dict(checkpoint)
    entries: dict[str, list[str]] = {}
    for key in HPARAMS:
        if key in result:
            result[key], configs = _plain_hparams(result[key])
            if configs:
                entries[key] = configs
    if entries:
        result[CONFIG_ENTRIES] = entries
    for key in HPARAMS_TYPES:
        kind = result.get(key)
        if isinstance(kind, type):
            result[key] = f"{kind.__module__}.{kind.__qualname__}"
    return result


def plain_hparams(value: Any) -> Any:
    """A module's ``hparams`` as plain data: a config, or a dict whose values may be."""
    return _plain_hparams(value)[0]


def _plain_hparams(value: Any) -> tuple[Any, list[str]]:
    """``value`` as plain data, and the names of its entries that were configs (a config
    itself is converted whole: its class is Lightning's ``hparams_type``)."""
    whole = plain_value(value)
    if whole is not value or not isinstance(value, Mapping):
        return whole, []  # a config (converted), or plain data
    converted = {key: plain_value(entry) for key, entry in value.items()}
    configs = [str(key) for key, entry in value.items() if converted[key] is not entry]
    return (converted, configs) if configs else (value, [])


def rebuild_entries(hparams: dict[str, Any], configs: Any) -> dict[str, Any]:
    """``hparams`` with the entries named in ``configs`` (``CONFIG_ENTRIES``'s list) made
    OmegaConf configs again, as ``__init__`` received them (if OmegaConf is installed)."""
    if not isinstance(configs, list) or not configs:
        return hparams
    try:
        omegaconf = importlib.import_module("omegaconf")
    except ImportError:
        return hparams
    rebuilt = dict(hparams)
    for name in configs:
        if isinstance(name, str) and isinstance(rebuilt.get(name), (dict, list)):
            rebuilt[name] = omegaconf.OmegaConf.create(rebuilt[name])
    return rebuilt


def plain_value(value: Any) -> Any:
    """An OmegaConf container as the dicts and lists it holds (unresolved); else ``value``."""
    if type(value).__module__.split(".")[0] != "omegaconf":
        return value
    omegaconf = importlib.import_module("omegaconf")
    if not isinstance(value, omegaconf.Container):
        return value
    return omegaconf.OmegaConf.to_container(value, resolve=False)


def rebuild(hparams: dict[str, Any], kind: object) -> Any:
    """The hyper-parameters as ``__init__`` received them when saved: a ``DictConfig`` if
    they were one (and OmegaConf is installed), else the dict."""
    if kind != DICT_CONFIG:
        return hparams
    try:
        omegaconf = importlib.import_module("omegaconf")
    except ImportError:
        return hparams
    return omegaconf.OmegaConf.create(hparams)
