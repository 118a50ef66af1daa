"""The model's configuration, written beside Hugging Face weights (``convert(to="hf",
config=...)``), so that ``AutoModelForCausalLM.from_pretrained(folder)`` loads the folder.

Weights alone do not say which model they belong to: ``from_pretrained`` needs
``config.json`` (its ``model_type`` picks the class) and reads ``generation_config.json``
when there is one. A conversion's destination must be new or empty, so they cannot be put
in first; they travel with the conversion instead. Each may be given as

* a ``transformers`` configuration object (anything with ``to_dict()``: ``model.config``,
  ``model.generation_config``),
* a mapping (the JSON object itself),
* the path of a ``.json`` file, or of a directory holding ``config.json`` (and, if there,
  ``generation_config.json``: a folder ``save_pretrained`` wrote, or a Hub snapshot).

A configuration is checked before anything is written: a JSON object (files are parsed
strictly, as every input), and for ``config.json`` one with a ``model_type``. No code runs
and nothing is downloaded: ``transformers`` itself is not needed to convert.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from ..checkpoint.format.strict_json import load_json_bytes
from ..checkpoint.storage.files import open_named_file
from ..errors import CheckpointError

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
MAX_CONFIG_BYTES = 16 << 20
"""A configuration is a few KiB; a larger file is refused rather than read."""


def config_files(config: Any, generation_config: Any) -> dict[str, bytes]:
    """The files to write beside the weights, by name, checked; raises ``ValueError``."""
    files: dict[str, bytes] = {}
    if config is not None:
        files.update(_as_files(config, CONFIG_NAME))
        doc = json.loads(files[CONFIG_NAME])
        if not isinstance(doc.get("model_type"), str) or not doc["model_type"]:
            raise ValueError(
                "config has no 'model_type', so from_pretrained could not tell which model "
                "the weights belong to: pass the model's own configuration (model.config, "
                "or the config.json that came with it)"
            )
    if generation_config is not None:
        files.update(_as_files(generation_config, GENERATION_CONFIG_NAME))
    return files


def _as_files(value: Any, name: str) -> dict[str, bytes]:
    if isinstance(value, (str, os.PathLike)):
        return _from_path(os.fspath(value), name)
    if isinstance(value, Mapping):
        return {name: _dumped(dict(value), name)}
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return {name: _dumped(to_dict(), name)}
    raise ValueError(
        f"{name.removesuffix('.json')}={value!r} is not a configuration: pass a "
        "transformers config object, a dict, or the path of a .json file or of a folder "
        "holding one"
    )


def _from_path(path: str, name: str) -> dict[str, bytes]:
    if not os.path.isdir(path):
        return {name: _read(path, name)}
    files = {name: _read(os.path.join(path, name), name)}
    extra = os.path.join(path, GENERATION_CONFIG_NAME)
    if name == CONFIG_NAME and os.path.isfile(extra):
        files[GENERATION_CONFIG_NAME] = _read(extra, GENERATION_CONFIG_NAME)
    return files


def _read(path: str, name: str) -> bytes:
    """The bytes of the configuration file the user named; any fault in it is a usage
    error (``ValueError``, exit status 2), as the rest of ``--config``'s are. Opened as a
    regular file only: a named pipe there blocked the conversion for ever (found in
    review)."""
    try:
        with os.fdopen(open_named_file(path), "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except (OSError, CheckpointError) as e:
        raise ValueError(f"cannot read the {name} to write beside the weights: {e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"{path} is over {MAX_CONFIG_BYTES} bytes: not a model configuration")
    try:
        doc = load_json_bytes(raw, path)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path} does not hold a JSON object, so it is not a {name}")
    return raw


def _dumped(doc: Any, name: str) -> bytes:
    if not isinstance(doc, dict):
        raise ValueError(f"the {name} to write is not a JSON object but {type(doc).__name__}")
    try:
        text = json.dumps(doc, indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the {name} to write is not JSON: {e}") from None
    return (text + "\n").encode()
