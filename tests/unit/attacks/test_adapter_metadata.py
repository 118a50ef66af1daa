"""Hostile adapter metadata is corruption, raised before anything is restored."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch

import shardsafe
from tests import forge
from tests.unit.attacks.common import (
    LAYOUTS,
    load_refused,
    make_model,
    make_optimizer,
    manifest_doc,
)

pytestmark = pytest.mark.timeout(60)


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        node = doc["values"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _python_words(change: Callable[[list[Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        python = doc["values"]["rng"]["meta"]["per_rank"][0]["python"]["__tuple__"]
        words = python[1]["__tuple__"]
        result = change(words)
        if result is not None:
            python[1]["__tuple__"] = result

    return edit


OPT = ("optimizer", "meta")
RNG0 = ("rng", "meta", "per_rank", 0)
HOSTILE_META: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "module meta is a list": (_set(("model", "meta"), [1, 2]), "is not valid module metadata"),
    "module tensors not a list": (
        _set(("model", "meta", "tensors"), "0.weight"),
        "'tensors' is not a list of names",
    ),
    "module tensors named twice": (
        _set(("model", "meta", "tensors"), ["0.weight", "0.weight", "0.bias"]),
        "is not valid module metadata: 'tensors' names '0.weight' twice (a save lists each "
        "tensor once)",
    ),
    "module extra is a list": (_set(("model", "meta", "extra"), []), "'extra' is not an object"),
    "param_shapes are ints": (
        _set((*OPT, "param_shapes"), {"0.weight": 8, "0.bias": 8, "2.weight": 4, "2.bias": 4}),
        "the shape of parameter '0.weight' is not a list of non-negative ints",
    ),
    "param shape negative": (
        _set((*OPT, "param_shapes", "0.bias"), [-8]),
        "the shape of parameter '0.bias' is not a list",
    ),
    "state entry is a list": (
        _set((*OPT, "state", "0.weight"), [1, 2]),
        "the state of parameter '0.weight' is not an object",
    ),
    "state entry is a float tag": (
        _set((*OPT, "state", "0.weight"), {"__float__": "inf"}),
        "the state of parameter '0.weight' is not an object of named entries",
    ),
    "state entry is a tensor tag": (
        _set((*OPT, "state", "0.weight"), {"__tensor__": "x"}),
        "the state of parameter '0.weight' is not an object of named entries",
    ),
    "optimizer step is a string": (
        _set((*OPT, "state", "2.bias", "step"), "abc"),
        "the optimizer state in the manifest entry for 'optimizer' is not valid state for the "
        "live Adam: ValueError: could not convert string to float: 'abc'",
    ),
    "optimizer step missing": (
        lambda doc: doc["values"]["optimizer"]["meta"]["state"]["2.bias"].pop("step"),
        "is not valid state for the live Adam: KeyError: 'step'",
    ),
    "param group names not strings": (
        _set((*OPT, "param_groups", 0, "params"), [0, 1, 2, 3]),
        "param group 0 has no list of parameter names",
    ),
    "hyperparameters are a list": (
        _set((*OPT, "param_groups", 0, "hyper"), [1]),
        "param group 0 holds no valid hyperparameters",
    ),
    "hyperparameters hold a bad tuple": (
        _set((*OPT, "param_groups", 0, "hyper", "betas"), {"__tuple__": 0.9}),
        "malformed __tuple__ value",
    ),
    "optimizer class is a list": (
        _set((*OPT, "class"), ["Adam"]),
        "is not valid optimizer metadata: its optimizer class is not a name",
    ),
    "rng per_rank not a list": (_set(("rng", "meta", "per_rank"), {}), "is not RNG state"),
    "rng torch is a float tensor": (
        _set((*RNG0, "torch"), {"__tensor__": "x"}),
        "the torch generator state is not a uint8 tensor",
    ),
    "rng torch is a short uint8 tensor": (
        _set((*RNG0, "torch"), {"__tensor__": "mask"}),
        "is not valid: RuntimeError",
    ),
    "rng torch missing": (
        _set((*RNG0, "torch"), None),
        "the torch generator state is not a uint8 tensor",
    ),
    "rng python word negative": (
        _python_words(lambda w: w.__setitem__(3, -1)),
        "Python's generator state is not 624 words of 32 bits",
    ),
    "rng python word 2**64": (
        _python_words(lambda w: w.__setitem__(3, 2**64)),
        "Python's generator state is not 624 words of 32 bits",
    ),
    "rng python position past the end": (
        _python_words(lambda w: w.__setitem__(624, 10**6)),
        "is not valid: ValueError",
    ),
    "rng python too few words": (_python_words(lambda w: w[:10]), "is not valid: ValueError"),
    "rng python not a triple": (_set((*RNG0, "python"), 5), "is not valid: TypeError"),
    # setstate takes any cached gauss: the user's next random.gauss() failed instead
    "rng python gauss a string": (
        _set((*RNG0, "python", "__tuple__", 2), "not a float"),
        "Python's generator state is not one of this Python's (version 3, cached gauss "
        "'not a float')",
    ),
    "rng python gauss huge": (
        _set((*RNG0, "python", "__tuple__", 2), 10**400),
        "Python's generator state is not one of this Python's (version 3, cached gauss 1000",
    ),
    "rng python gauss infinite": (
        _set((*RNG0, "python", "__tuple__", 2), {"__float__": "inf"}),
        "(version 3, cached gauss inf)",
    ),
    "rng python version 2": (
        _set((*RNG0, "python", "__tuple__", 0), 2),
        "Python's generator state is not one of this Python's (version 2, cached gauss None)",
    ),
    "rng numpy keys too few": (
        _set((*RNG0, "numpy", "keys"), {"__tensor__": "mask"}),
        "numpy's generator keys are not a 1-d int64 tensor",
    ),
    "rng numpy keys not a tensor": (
        _set((*RNG0, "numpy", "keys"), [1, 2]),
        "numpy's generator keys are not a 1-d int64 tensor",
    ),
    "rng cuda not tensors": (
        _set((*RNG0, "cuda"), [1]),
        "the CUDA generator states are not uint8 tensors",
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(HOSTILE_META))
def test_hostile_adapter_metadata_restores_nothing(copy_of: Any, layout: str, case: str) -> None:
    ckpt = copy_of(layout)
    edit, fragment = HOSTILE_META[case]
    doc = manifest_doc(ckpt)
    edit(doc)
    forge.write_manifest(ckpt, doc)
    model = make_model(1)
    opt = make_optimizer(model)
    err = load_refused(ckpt, {"model": model, "optimizer": opt, "rng": shardsafe.RNGState()})
    assert fragment in str(err), str(err)
    assert opt.state_dict()["state"] == {}


def test_a_module_tensor_forged_as_extra_state_is_refused_before_anything_is_restored(
    copy_of: Any,
) -> None:
    """``load_state_dict`` refused the string after every tensor had been filled."""
    ckpt = copy_of("sharded")
    doc = manifest_doc(ckpt)
    meta = doc["values"]["model"]["meta"]
    meta["tensors"].remove("2.bias")
    meta["extra"]["2.bias"] = "not a tensor"
    forge.write_manifest(ckpt, doc)
    model = make_model(1)
    opt = make_optimizer(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(shardsafe.CheckpointMismatchError) as caught:
        shardsafe.load(ckpt, {"model": model, "optimizer": opt})
    assert str(caught.value) == (
        "model: the checkpoint holds '2.bias' as a value that is not a tensor, but the live "
        "module's is a parameter or buffer; load it into the module it was saved from"
    )
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert opt.state_dict()["state"] == {}


def test_an_rng_python_word_of_2_to_the_32_is_refused(copy_of: Any) -> None:
    ckpt = copy_of("sharded")
    doc = manifest_doc(ckpt)
    _python_words(lambda w: w.__setitem__(3, 2**32))(doc)
    forge.write_manifest(ckpt, doc)
    err = load_refused(ckpt, {"model": make_model(1), "rng": shardsafe.RNGState()})
    assert "python's generator state is not 624 words of 32 bits" in str(err).lower()


NUMPY_POSITION_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import shardsafe
    try:
        shardsafe.load(sys.argv[1], {"rng": shardsafe.RNGState()})
    except shardsafe.CheckpointCorruptError as e:
        print("REFUSED", e)
        sys.exit(0)
    print("LOADED", flush=True)
    np.random.random(1 << 16)  # draws from key[pos], key[pos + 1], ...
    print("DREW", flush=True)
    sys.exit(3)
    """
)


def test_an_out_of_range_numpy_position_is_refused(copy_of: Any) -> None:
    ckpt = copy_of("sharded")
    doc = manifest_doc(ckpt)
    doc["values"]["rng"]["meta"]["per_rank"][0]["numpy"]["pos"] = 10**6
    forge.write_manifest(ckpt, doc)
    proc = subprocess.run(
        [sys.executable, "-c", NUMPY_POSITION_SCRIPT, str(ckpt)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("REFUSED"), (
        proc.returncode,
        proc.stdout,
        proc.stderr[-500:],
    )
    assert "numpy" in proc.stdout or "pos" in proc.stdout


def test_verify_reports_a_module_tensor_named_twice(copy_of: Any) -> None:
    """A load said the name pushed out was missing, with a hint to pass strict=False, and
    ``verify`` and ``inspect`` called the checkpoint fine (found in review)."""
    ckpt = copy_of("sharded")
    doc = manifest_doc(ckpt)
    doc["values"]["model"]["meta"]["tensors"] = ["0.weight", "0.weight", "0.bias"]
    forge.write_manifest(ckpt, doc)
    report = shardsafe.verify(ckpt)
    assert not report.ok
    assert report.problems[0].endswith(
        "is not valid module metadata: 'tensors' names '0.weight' twice (a save lists each "
        "tensor once)"
    ), report.problems
