"""Converters: checkpoints in and out of the formats users already have.

``shardsafe.convert(src, dst, to=...)`` (and ``shardsafe convert SRC DST``) reads a
shardsafe, DCP, Hugging Face or ``torch.save`` checkpoint and writes it as another, one
tensor at a time. One module per job::

    detect.py          which format a source is
    source.py          the format-neutral description every reader makes
    bounds.py          what a conversion may allocate: the input's bytes, untrusted_bytes_limit
    entries.py         nested state trees <-> shardsafe entries (module, optimizer, value)
    dcp_metadata.py    DCP's pickled .metadata, through an allowlisting unpickler
    dcp_read.py        DCP .distcp chunks by byte range
    dcp_write.py       a DCP checkpoint dcp.load reads, written chunk by chunk
    flat_layout.py     torchtitan's flat DCP layout (top-level weights, flat optimizer)
    hf.py              Hugging Face safetensors files and index
    torch_file.py      torch.save / Lightning .ckpt files
    shardsafe_format.py  shardsafe checkpoints (the engine's reader and streaming writer)
    options.py         ConvertOptions: what convert() takes, validated once
    api.py             convert(): source -> narrowed, cast -> destination
"""

from .api import Conversion, convert, describe, read_source
from .options import ConvertOptions, DcpLayout
from .source import Format

__all__ = [
    "Conversion",
    "ConvertOptions",
    "DcpLayout",
    "Format",
    "convert",
    "describe",
    "read_source",
]
