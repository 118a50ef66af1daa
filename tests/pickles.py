"""Hostile pickles built opcode by opcode, and the files that carry them.

Each builder returns the raw bytes of a pickle (protocol 2 opcodes, which both CPython's
unpickler and torch's ``weights_only`` unpickler read, unless said otherwise), so a test
states exactly what the attacker wrote. :func:`torch_archive` wraps a pickle into the zip
layout ``torch.save`` writes (``<name>/data.pkl`` plus version records), so the same bomb
can be served as a ``.pt``, a Lightning ``.ckpt`` or a DCP item.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile

PROTO2 = b"\x80\x02"
STOP = b"."
MARK = b"("
EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE = b"}", b"]", b")"
TUPLE, TUPLE1, TUPLE2 = b"t", b"\x85", b"\x86"
SETITEM, SETITEMS, APPEND, APPENDS = b"s", b"u", b"a", b"e"
REDUCE, BUILD, NEWOBJ, NONE, POP = b"R", b"b", b"\x81", b"N", b"0"


def s(text: str) -> bytes:
    """BINUNICODE ``text``."""
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def i(value: int) -> bytes:
    """BININT ``value``."""
    return b"J" + struct.pack("<i", value)


def put(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)


def get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)


def glob(module: str, name: str) -> bytes:
    """GLOBAL ``module.name`` (protocol 0 text form, read by every unpickler)."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def deep_tuple(depth: int) -> bytes:
    """Opcodes that push a tuple nested ``depth`` deep: ((((1,),),),)."""
    return i(1) + TUPLE1 * depth


def shared_tuple(levels: int) -> bytes:
    """Opcodes that push a tuple of 2**levels leaves in ~12*levels bytes: each level is a
    pair of the previous one, fetched twice from the memo. Every level is also appended
    to a list (torch's unpickler has no POP), so this pushes ``[t0, t1, ...]`` and leaves
    level ``levels`` in memo slot ``levels`` for :func:`get`."""
    out = EMPTY_LIST + i(7) + put(0) + APPEND
    for level in range(levels):
        out += get(level) + get(level) + TUPLE2 + put(level + 1) + APPEND
    return out


def sharing_bomb_as_key(levels: int) -> bytes:
    """``{"pieces": [...], t: 1}`` where ``t`` has 2**levels leaves (hashed as it is set)."""
    pieces = s("pieces") + shared_tuple(levels) + SETITEM
    return PROTO2 + EMPTY_DICT + pieces + get(levels) + i(1) + SETITEM + STOP


def sharing_bomb_as_value(levels: int) -> bytes:
    """``{"state": t}`` where ``t`` has 2**levels leaves (walked by whoever reads it)."""
    return PROTO2 + EMPTY_DICT + s("state") + shared_tuple(levels) + SETITEM + STOP


def dict_with_key(key_opcodes: bytes) -> bytes:
    """A pickle of ``{key: 1}`` (the key hashed as it is set)."""
    return PROTO2 + EMPTY_DICT + key_opcodes + i(1) + SETITEM + STOP


def dict_with_value(value_opcodes: bytes) -> bytes:
    """A pickle of ``{"state": value}``."""
    return PROTO2 + EMPTY_DICT + s("state") + value_opcodes + SETITEM + STOP


def self_containing_list() -> bytes:
    """``l = []; l.append(l)``."""
    return PROTO2 + EMPTY_LIST + put(0) + get(0) + APPEND + STOP


def build_on_global(module: str, name: str, state: dict[str, bytes], slots: bool) -> bytes:
    """``BUILD`` applied to the global itself (a class or a function), with ``state`` as
    its ``__dict__`` update or (``slots``) as setattr calls: what pickle does to an
    instance, done to the class."""
    items = b"".join(s(k) + v for k, v in state.items())
    state_ops = EMPTY_DICT + MARK + items + SETITEMS
    if slots:
        state_ops = NONE + state_ops + TUPLE2
    return PROTO2 + glob(module, name) + state_ops + BUILD + STOP


def torch_archive(
    pickled: bytes, name: str = "archive", storages: dict[str, bytes] | None = None
) -> bytes:
    """A zip laid out as ``torch.save`` lays it out, holding ``pickled`` as its
    ``data.pkl`` (records stored, not compressed, as torch writes them)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{name}/data.pkl", pickled)
        zf.writestr(f"{name}/.format_version", b"1")
        zf.writestr(f"{name}/byteorder", b"little")
        for key, data in (storages or {}).items():
            zf.writestr(f"{name}/data/{key}", data)
        zf.writestr(f"{name}/version", b"3\n")
    return out.getvalue()


def deflated_archive(pickled: bytes, padding: int) -> bytes:
    """A torch-like zip whose ``data.pkl`` is the pickle plus ``padding`` zero bytes,
    deflated: a record that unpacks to far more than the file holds."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data.pkl", pickled + b"\0" * padding)
        zf.writestr("archive/version", b"3\n")
    return out.getvalue()


def colliding_ints(count: int) -> list[int]:
    """Distinct integers that all hash alike (``hash(k)`` is ``k mod 2**61 - 1``)."""
    return [k * (2**61 - 1) + 5 for k in range(count)]


def call(module: str, name: str, *args: bytes) -> bytes:
    """Opcodes that push ``module.name(*args)`` (REDUCE with a tuple of ``args``)."""
    return glob(module, name) + MARK + b"".join(args) + TUPLE + REDUCE


def long1(value: int) -> bytes:
    """LONG1 ``value`` (any size up to 255 bytes)."""
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def many_deflated_records(records: int, each: int) -> bytes:
    """A torch-like zip whose records are each ``each`` zero bytes, deflated: none larger
    than the file, but together many times larger."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data.pkl", pickled({"a": 1}))
        for k in range(records):
            zf.writestr(f"archive/data/{k}", b"\0" * each)
        zf.writestr("archive/version", b"3\n")
    return out.getvalue()


def pickled(value: object, protocol: int = 2) -> bytes:
    return pickle.dumps(value, protocol=protocol)
