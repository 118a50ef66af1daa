"""What ``convert`` takes, in one place: a keyword-only, validated dataclass.

``shardsafe.convert``'s keyword arguments are :class:`ConvertOptions`' fields, with the
defaults taken from here (written once), as ``shardsafe.save``'s are ``SaveOptions``'; the
steps of a conversion then take the one object. A wrong value fails here, before anything
is read, naming the field and what it accepts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from ..checkpoint.options import DEFAULT_UNTRUSTED_BYTES
from .hf import parse_size
from .hf_config import config_files
from .source import FORMATS, Format

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DcpLayout = Literal["nested", "flat"]
"""How ``convert(..., to="dcp")`` names the keys (see :func:`shardsafe.convert`)."""
DCP_LAYOUTS: tuple[DcpLayout, ...] = get_args(DcpLayout)


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """How to convert. See ``shardsafe.convert`` for what each field does."""

    to: Format = "shardsafe"
    only: Sequence[str] | None = None
    dtype: str | torch.dtype | None = None
    max_shard_size: str | int = "5GB"
    strip_prefix: str | None = None
    add_prefix: str | None = None
    dry_run: bool = False
    dcp_layout: DcpLayout = "nested"
    """``"nested"``: ``model.<fqn>``, ``optimizer.state.<fqn>.<name>`` (what ``dcp.save``
    makes of ``get_state_dict``'s dicts); ``"flat"``: torchtitan's, weights at the top
    level, optimizer state as ``flatten_optimizer_state_dict=True`` gives it."""
    progress: bool | None = None
    storage_options: Mapping[str, Any] | None = None
    untrusted_bytes_limit: int = DEFAULT_UNTRUSTED_BYTES
    """Tensors whose size only the source gives (an expanded view,
    ``torch.zeros(1).expand(n)``, which ``torch.save`` stores as one element; a DCP chunk
    declared larger than its bytes in the file) are materialized in full when written,
    and together they may take at most this many bytes. A source asking for more is
    refused with a ``CheckpointCorruptError`` before anything is read or written (also
    with ``dry_run``); pass a larger limit for a file you trust."""
    config: Any = None
    """``to="hf"``: the model's configuration, written as ``config.json`` beside the
    weights (a transformers config object, a dict, or the path of a ``.json`` file or of
    a folder holding ``config.json``; see ``hf_config.py``)."""
    generation_config: Any = None
    """``to="hf"``: written as ``generation_config.json`` (the same forms)."""

    def __post_init__(self) -> None:
        if self.to not in FORMATS:
            raise ValueError(f"to={self.to!r} is not one of {', '.join(FORMATS)}")
        limit = self.untrusted_bytes_limit
        if type(limit) is not int or limit < 0:
            raise ValueError(
                f"untrusted_bytes_limit={limit!r} must be a number of bytes, 0 or more"
            )
        if (self.config, self.generation_config) != (None, None):
            if self.to != "hf":
                raise ValueError(
                    f"config and generation_config are written beside Hugging Face weights: "
                    f"they apply to to='hf', not to={self.to!r}"
                )
            config_files(self.config, self.generation_config)  # refused before anything is read
        if self.dcp_layout not in DCP_LAYOUTS:
            raise ValueError(f"dcp_layout={self.dcp_layout!r} is not 'nested' or 'flat'")
        self._check_target_options()
        self._check_types()
        _torch_dtype(self.dtype)

    def _check_types(self) -> None:
        """Values of the wrong type are refused here, naming the field: ``only="model"``
        was read letter by letter (``--only m, o, d, e, l: ... holds no such entry``),
        ``dry_run="no"`` converted nothing, ``strip_prefix=1`` failed deep inside."""
        only = self.only
        if only is not None and (
            isinstance(only, (str, bytes))
            or not isinstance(only, Sequence)
            or not all(isinstance(name, str) for name in only)
        ):
            raise ValueError(
                f"only={self.only!r} must be a list of entry names, such as only=['model']"
            )
        for name in ("strip_prefix", "add_prefix"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a string or None")
        if not isinstance(self.dry_run, bool):
            raise ValueError(f"dry_run={self.dry_run!r} must be True or False")
        if not isinstance(self.progress, (bool, type(None))):
            raise ValueError(f"progress={self.progress!r} must be True, False or None")
        if isinstance(self.max_shard_size, bool) or not isinstance(self.max_shard_size, (int, str)):
            raise ValueError(
                f"max_shard_size={self.max_shard_size!r} is not a size: give bytes as an int "
                "or a string such as '5GB'"
            )
        parse_size(self.max_shard_size)

    def _check_target_options(self) -> None:
        """Options of one target format are refused for another, as ``config`` is: they
        were accepted and ignored (``--strip-prefix`` with ``--to shardsafe`` renamed
        nothing, ``--dcp-layout flat`` with ``--to hf`` changed nothing)."""
        if (self.strip_prefix, self.add_prefix) != (None, None) and self.to != "hf":
            raise ValueError(
                "strip_prefix and add_prefix rename Hugging Face weights: they apply to "
                f"to='hf', not to={self.to!r}"
            )
        if self.dcp_layout != "nested" and self.to != "dcp":
            raise ValueError(
                f"dcp_layout={self.dcp_layout!r} names DCP keys: it applies to to='dcp', "
                f"not to={self.to!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """``dtype`` as a ``torch.dtype`` (``None``: every tensor keeps its own)."""
        return _torch_dtype(self.dtype)


def _torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None:
        return dtype
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():  # torch.int8 wrapped 300.0 to 44, silently
            raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]
