"""Keys of a checkpoint that a load writes into one live tensor (tied weights), checked
to hold the same values before anything is restored.

A model that ties its output layer to its embedding has one tensor under two names
(``embed.weight``, ``head.weight``); its state dict lists both. A checkpoint saved from
the same model untied holds two different tensors under those names, and a load writes
both into the one live tensor: the later write wins and the other key's values are
dropped, with no word (``torch.nn.Module.load_state_dict`` and DCP do the same). The
checkpoint's chunk checksums tell the two cases apart without reading a byte: keys
saved from one tied tensor have the same chunks with the same checksums, keys saved
untied differ in them. So a strict load refuses, in its plan phase (agreed on every
rank, nothing restored), and ``strict=False`` loads with a warning.

Keys whose chunks are laid out differently (saved by different tools or shardings)
cannot be compared from the manifest: they load as before, unchecked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ..format.manifest import Manifest, TensorRecord
from .memory_sharing import spans

_SHOWN = 3
"""How many pairs of differing keys a refusal names."""


def shared_targets(offered: Mapping[str, torch.Tensor | None]) -> list[list[str]]:
    """The groups (two or more keys, in ``offered``'s order) whose live tensors are one
    tensor: the same memory seen with the same dtype, shape and strides (and neither a
    conjugate nor a negative view of the other's). A tensor whose
    memory is unknown, or that has no strides (sparse), groups only with itself (the
    same object)."""
    by_view: dict[object, list[str]] = {}
    for key, target in offered.items():
        if not isinstance(target, torch.Tensor) or not target.numel():
            continue
        view: object = ("object", id(target))
        found = spans(target) if target.layout == torch.strided else None  # sparse: no strides
        if found is not None:
            seen_as = (target.dtype, target.is_conj(), target.is_neg())  # a conj view differs
            view = (tuple(found), seen_as, tuple(target.shape), tuple(target.stride()))
        by_view.setdefault(view, []).append(key)
    return [keys for keys in by_view.values() if len(keys) > 1]


def differing_pairs(groups: Iterable[list[str]], manifest: Manifest) -> list[tuple[str, str]]:
    """Each key of a group that the manifest proves to hold other values than the
    group's first key (same chunks, another checksum), as ``(first, key)``."""
    found = []
    for keys in groups:
        saved = [(key, manifest.tensors.get(key)) for key in keys]
        present = [(key, rec) for key, rec in saved if rec is not None]
        for key, rec in present[1:]:
            if _differ(present[0][1], rec):
                found.append((present[0][0], key))
    return found


def _differ(a: TensorRecord, b: TensorRecord) -> bool:
    """Whether the two records provably hold different values: the same dtype, shape
    and chunk boxes, and some chunk's checksums differ. ``False`` when they cannot be
    compared (other boxes: each chunk's checksum covers its own box)."""
    if a.dtype != b.dtype or a.shape != b.shape or len(a.chunks) != len(b.chunks):
        return False
    ours = sorted((c.offsets, c.shape, c.crc32) for c in a.chunks)
    theirs = sorted((c.offsets, c.shape, c.crc32) for c in b.chunks)
    if [box[:2] for box in ours] != [box[:2] for box in theirs]:
        return False
    return ours != theirs


def refusal(pairs: list[tuple[str, str]]) -> str:
    """The strict load's refusal of ``pairs`` (see the module docstring)."""
    return (
        f"the checkpoint holds different values for {_named(pairs)}, which the objects "
        "being loaded tie (one tensor under both names, as a tied embedding and output "
        "layer): the load would keep the values of one and drop the other's. The "
        "checkpoint was saved untied: load it into the model untied as it was saved, or "
        "pass strict=False to load it anyway, the tied tensor holding one of the two"
    )


def warning(pairs: list[tuple[str, str]]) -> str:
    """``strict=False``'s warning about ``pairs``."""
    return (
        f"shardsafe: strict=False loads {_named(pairs)} into one tied tensor although the "
        "checkpoint holds different values for them (it was saved untied): that tensor "
        "holds the values of one of them, and the other's are dropped"
    )


def _named(pairs: list[tuple[str, str]]) -> str:
    shown = "; ".join(f"{a!r} and {b!r}" for a, b in pairs[:_SHOWN])
    more = f" ... and {len(pairs) - _SHOWN} more pairs" if len(pairs) > _SHOWN else ""
    return shown + more
