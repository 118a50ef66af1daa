"""Lossless, pickle-free encoding of state trees (what ``state_dict()`` returns) as JSON.

Tensors are cut out of the tree and replaced by references (``{"__tensor__": key}``);
they travel in safetensors files. Everything else must be plain data. JSON alone loses
information a resume depends on (tuples become lists, ``inf`` is not JSON, dict keys
become strings), so those cases are tagged and restored exactly. Anything else (a
function, an arbitrary object) is refused with the path of the offending value, because
the only way to store it would be pickle.
"""

from __future__ import annotations

import base64
import collections
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import _names, dtypes
from .checkpoint.format.strict_json import MAX_INT_DIGITS
from .errors import CheckpointCorruptError, CheckpointError

JSON = Any
TensorSink = Callable[[tuple[str, ...], torch.Tensor], str]
"""Called with the path of a tensor inside the tree; stores it and returns its key. Dict
keys that are not strings arrive as :class:`~shardsafe._names.DictKey` s (so ``1`` and
``"1"`` are different paths); make the key with ``_names.join`` (``ctx.key``)."""

PER_RANK = "__per_rank__"
"""Wraps one encoded tree per rank (``adapters.values.merge_per_rank``); not decoded here."""
TAGS = (
    "__tensor__", "__tuple__", "__float__", "__dict__", "__bytes__", "__dtype__", PER_RANK,
)  # fmt: skip
"""Keys ``encode`` never leaves in a plain dict (such dicts become ``__dict__`` pairs).
``__per_rank__`` is not decoded here: it wraps one encoded tree per rank
(``adapters.values.merge_per_rank``)."""


COUNTER = "__counter__"
"""Marks a ``collections.Counter``: ``{"__dict__": pairs, "__counter__": true}``."""

_TOO_MANY_DIGITS = 10**MAX_INT_DIGITS
"""The smallest integer ``encode`` refuses: one more digit than a manifest's reader accepts
(``strict_json.MAX_INT_DIGITS``). Compared, not converted to text: Python's own limit on
that conversion would fail the save deep in ``json`` with advice to raise the limit, which
would only make the checkpoint unloadable."""

MAX_DEPTH = 80
"""Deepest nesting ``encode`` accepts: tags add levels, and a manifest holds at most 100."""

MAX_LEVELS = 90
"""Deepest nesting ``encode`` accepts in JSON levels as stored (a tuple takes two, a dict
whose keys are not all strings three: their tags): a manifest holds at most 100, and the
manifest's and the adapters' records around a value take up to ten."""


def encode(
    value: Any, where: str, sink: TensorSink, path: tuple[str, ...] = (), *, levels: int = 0
) -> JSON:
    """Encode ``value`` as JSON, handing every tensor to ``sink``.

    ``where`` names the value for error messages (e.g. ``state['scheduler']``);
    ``levels``: how many JSON containers its encoding sits in. Nesting is measured as
    stored too, not only by ``path``: else 40 dicts with int keys passed here, and the
    save failed reading its own manifest back ("nested too deeply; the file is damaged")."""
    _refuse_too_deep(where, len(path), levels)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if abs(value) >= _TOO_MANY_DIGITS:
            raise CheckpointError(
                f"cannot save {where}{_format_path(path)}: an integer of more than "
                f"{MAX_INT_DIGITS} digits, more than a checkpoint holds (its manifest is read "
                "as hostile input, whatever the interpreter's own limit). Save it as a string "
                "or split it into smaller numbers (nothing was written)"
            )
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"__float__": repr(float(value))}
    if isinstance(value, torch.Tensor):
        return {"__tensor__": sink(path, value)}
    if isinstance(value, torch.dtype):
        if dtypes.any_from_name(dtypes.dtype_name(value)) is not value:
            raise CheckpointError(f"cannot save {where}{_format_path(path)}: unknown dtype {value}")
        return {"__dtype__": dtypes.dtype_name(value)}
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode("ascii")}
    if isinstance(value, tuple):
        items = [
            encode(v, where, sink, (*path, str(i)), levels=levels + 2) for i, v in enumerate(value)
        ]
        return {"__tuple__": items}
    if isinstance(value, list):
        return [
            encode(v, where, sink, (*path, str(i)), levels=levels + 1) for i, v in enumerate(value)
        ]
    if isinstance(value, collections.Counter):
        # A Counter's methods are its point: MultiStepLR's milestones, a plain dict after
        # a resume, failed in SequentialLR's hand-over (no ``elements()``). Its pairs
        # beside a COUNTER mark: an object no earlier encoding could hold (a "__dict__"
        # key never stays in a plain dict), so no older checkpoint reads as a Counter.
        pairs = _encode_pairs(value, where, sink, path, levels)
        return {"__dict__": pairs, COUNTER: True}
    if isinstance(value, Mapping):
        return _encode_mapping(value, where, sink, path, levels)
    # Arrays are refused below, and so is a scalar whose item() is no Python number
    # (np.longdouble's is another np.longdouble: the call recursed until Python's limit).
    if is_numpy_scalar(value) and not is_numpy_scalar(item := value.item()):
        return encode(item, where, sink, path, levels=levels)
    raise CheckpointError(
        f"cannot save {where}{_format_path(path)}: a value of type {type(value).__qualname__} is "
        "neither a tensor nor JSON-able data, and shardsafe never pickles. Convert it to "
        "numbers, strings, lists or dicts (or a tensor) in state_dict(), or leave it out."
    )


def _refuse_too_deep(where: str, depth: int, levels: int) -> None:
    if depth > MAX_DEPTH or levels > MAX_LEVELS:
        raise CheckpointError(
            f"cannot save {where}: it is nested more than {MAX_DEPTH} levels deep (or more "
            f"than {MAX_LEVELS} as stored: a tuple takes two levels, a dict with keys that are "
            "not strings three), more than a checkpoint holds (it may contain itself)"
        )


def is_tag(name: str) -> bool:
    """Whether ``name`` is spelled like one of the encoding's tags (``__tensor__``)."""
    return name in TAGS


def is_numpy_scalar(value: Any) -> bool:
    """Whether ``value`` is a numpy scalar (``np.float32(0.25)``, what a metric often is),
    which :func:`encode` saves as the Python number it equals."""
    item = getattr(value, "item", None)
    return callable(item) and type(value).__module__ == "numpy" and getattr(value, "ndim", 1) == 0


def _encode_mapping(
    value: Mapping[Any, Any], where: str, sink: TensorSink, path: tuple[str, ...], levels: int
) -> JSON:
    plain = all(isinstance(k, str) and k not in TAGS for k in value)
    if plain:
        return {k: encode(v, where, sink, (*path, k), levels=levels + 1) for k, v in value.items()}
    return {"__dict__": _encode_pairs(value, where, sink, path, levels)}


def _encode_pairs(
    value: Mapping[Any, Any], where: str, sink: TensorSink, path: tuple[str, ...], levels: int
) -> list[list[JSON]]:
    """``value``'s items as encoded ``[key, value]`` pairs (keys of any plain type).

    What a load refuses in a ``__dict__`` is refused here first (a save commits only what
    loads back): more than :data:`MAX_SAME_HASH` keys of one hash value."""
    pairs = []
    per_hash: dict[int, int] = {}
    for k, v in value.items():
        if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
            raise CheckpointError(
                f"cannot save {where}{_format_path(path)}: dict key {k!r} of type "
                f"{type(k).__qualname__} is not a string, number or tuple."
            )
        # Encoded first: its checks (an int of more than 4300 digits) say what is wrong
        # in shardsafe's words, where making the path's text raised Python's own advice.
        # The key's own text names what is refused in it (a tuple's item: an int too
        # long, a set), not the dict's path with the tuple's index appended.
        where_key = f"{where}{_format_path(path)}: dict key {_shown(k)}"
        _refuse_too_deep(where, len(path) + 1, levels + 3)  # the value's, said as the value's
        key = encode(k, where_key, _no_tensor_in_key(where_key), levels=levels + 3)
        seen = per_hash[hash(k)] = per_hash.get(hash(k), 0) + 1
        if seen > MAX_SAME_HASH:
            raise CheckpointError(
                f"cannot save {where}{_format_path(path)}: more than {MAX_SAME_HASH} of its "
                f"dict keys share one hash value (such as {_shown(k)}), which a load refuses "
                "(building that dict takes time quadratic in their number); key it by "
                "strings or by smaller ints"
            )
        part = k if isinstance(k, str) else _names.DictKey(k)  # 1 and "1": two paths
        pairs.append([key, encode(v, where, sink, (*path, part), levels=levels + 3)])
    return pairs


def _shown(key: Any) -> str:
    """``key``'s repr, cut short; an int too long for ``repr`` (Python refuses more than
    4300 digits) is named so, and encoding it then says what is wrong."""
    try:
        text = repr(key)
        return text if len(text) <= 80 else text[:77] + "..."
    except ValueError:
        return "(an integer too long to show)"


def _no_tensor_in_key(where: str) -> TensorSink:
    """The sink for a dict key's tuple: a tensor there is refused, as a tensor key is. Its
    path would be the dict's own with the tuple's index (a string key ``"0"`` beside it
    has that path too), and it would come back as a new tensor, which finds nothing."""

    def refuse(path: tuple[str, ...], tensor: torch.Tensor) -> str:
        raise CheckpointError(
            f"cannot save {where}: it holds a tensor, and a dict key must be a string, "
            "number or tuple of them. Key the dict by name or index instead."
        )

    return refuse


def decode(obj: JSON, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Invert :func:`encode`, taking tensors from ``tensors`` by key."""
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        ((tag, payload),) = obj.items()
        if tag == "__tensor__":
            if _expect(payload, str, tag) not in tensors:
                raise CheckpointCorruptError(
                    f"the manifest refers to tensor {payload!r}, which no data file holds"
                )
            return tensors[payload]
        if tag == "__tuple__":
            return tuple(decode(v, tensors) for v in _expect(payload, list, tag))
        if tag == "__float__":
            return _parse(float, _expect(payload, str, tag), tag)
        if tag == "__bytes__":
            return _parse(_b64decode, _expect(payload, str, tag), tag)
        if tag == "__dtype__":
            dtype = dtypes.any_from_name(_expect(payload, str, tag))
            if dtype is None:
                raise CheckpointCorruptError(f"unknown dtype {payload!r:.80} in the manifest")
            return dtype
        if tag == "__dict__":
            return _decode_pairs(_checked_pairs(payload, tag), tensors)
    if len(obj) == 2 and obj.get(COUNTER) is True and "__dict__" in obj:
        return collections.Counter(_decode_pairs(_checked_pairs(obj["__dict__"], COUNTER), tensors))
    return {k: decode(v, tensors) for k, v in obj.items()}


def _checked_pairs(payload: Any, tag: str) -> list[list[Any]]:
    pairs: list[list[Any]] = _expect(payload, list, tag)
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise CheckpointCorruptError(f"malformed {tag} pair in the manifest: {pair!r:.80}")
    return pairs


MAX_SAME_HASH = 16
"""Most keys of one ``__dict__`` that may share a hash value. Python's int hash is the
value modulo 2**61 - 1, so a crafted manifest can give every key one hash, and a dict of
n such keys takes n**2 / 2 comparisons to build (20,000 keys in half a megabyte: 1.5 s;
a million: hours). A saved dict has keys like 1 and 2**61 (one hash) only by chance."""


def _decode_pairs(pairs: list[list[Any]], tensors: Mapping[str, torch.Tensor]) -> dict[Any, Any]:
    """A ``__dict__`` tag's pairs as a dict, in time linear in their number: a key that
    appears twice (``1`` and ``1``, or ``1`` and ``True``, which no saved dict holds) would
    make one pair silently overwrite another, and keys sharing a hash beyond
    :data:`MAX_SAME_HASH` would take quadratic time; both are refused."""
    out: dict[Any, Any] = {}
    per_hash: dict[int, int] = {}  # a hash's own hash is itself: no collisions here
    for k, v in pairs:
        key = _hashable(decode(k, tensors))
        seen = per_hash[hash(key)] = per_hash.get(hash(key), 0) + 1
        if seen > MAX_SAME_HASH:
            raise CheckpointCorruptError(
                f"malformed __dict__ value in the manifest: more than {MAX_SAME_HASH} of its "
                "keys share one hash value, which no saved dict holds (checking them would "
                "take time quadratic in their number)"
            )
        if key in out:
            raise CheckpointCorruptError(
                f"malformed __dict__ value in the manifest: the key {key!r:.80} appears twice"
            )
        out[key] = decode(v, tensors)
    return out


class _AnyTensor(Mapping[str, Any]):
    """Stands in for the tensors when only the structure of a tree is checked."""

    def __getitem__(self, key: str) -> Any:
        return None

    def __contains__(self, key: object) -> bool:
        return True

    def __iter__(self) -> Any:
        return iter(())

    def __len__(self) -> int:
        return 0


ANY_TENSOR: Mapping[str, Any] = _AnyTensor()
"""Tensors for :func:`decode` when only a tree's structure is wanted (each one ``None``)."""


def check_structure(obj: JSON, where: str) -> None:
    """Raise :class:`CheckpointCorruptError` unless ``obj`` decodes (tensors aside)."""
    try:
        decode(obj, _AnyTensor())
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"{where} is malformed: {e}") from None


def describe(obj: JSON) -> str:
    """What an encoded value is, in a word, for mismatch messages."""
    if isinstance(obj, dict) and len(obj) == 1:
        tag: str = next(iter(obj))
        if tag in TAGS:
            return tag.strip("_")
    names = {dict: "dict", list: "list", str: "string", bool: "bool", int: "int"}
    return names.get(type(obj), type(obj).__name__)


def tensor_refs(obj: JSON) -> list[str]:
    """Every tensor key referenced anywhere inside an encoded tree."""
    found: list[str] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if len(item) == 1 and isinstance(item.get("__tensor__"), str):
                found.append(item["__tensor__"])
            else:
                stack.extend(item.values())
    return found


def rename_refs(obj: JSON, rename: Callable[[str], str]) -> JSON:
    """A copy of an encoded tree whose every tensor key ``k`` is ``rename(k)``."""
    if isinstance(obj, list):
        return [rename_refs(v, rename) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1 and isinstance(obj.get("__tensor__"), str):
        return {"__tensor__": rename(obj["__tensor__"])}
    return {k: rename_refs(v, rename) for k, v in obj.items()}


def _expect(payload: Any, kind: type, tag: str) -> Any:
    if not isinstance(payload, kind):
        raise CheckpointCorruptError(f"malformed {tag} value in the manifest: {payload!r:.80}")
    return payload


def _parse(parser: Callable[[str], Any], payload: str, tag: str) -> Any:
    try:
        return parser(payload)
    except ValueError:
        raise CheckpointCorruptError(
            f"malformed {tag} value in the manifest: {payload!r:.80}"
        ) from None


def _b64decode(payload: str) -> bytes:
    return base64.b64decode(payload, validate=True)


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise CheckpointCorruptError(
            f"malformed dict key in the manifest: a {type(key).__name__}"
        ) from None
    return key


def _format_path(path: tuple[str, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path)
