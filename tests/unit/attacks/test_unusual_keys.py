"""Unusual keys work end to end; what load would refuse, save refuses first."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe import CheckpointError
from tests.unit.attacks.common import LAYOUTS, assert_bitwise, bits, run_cli, strict_json, weights

pytestmark = pytest.mark.timeout(60)


def terminal_safe_output(text: str) -> bool:
    return all(ch.isprintable() or ch == "\n" for ch in text)


DIGITS_5000 = "9" * 5000
SUPERSCRIPT = "x1\u00b2"
ARABIC_INDIC = "\u0663\u0664\u0665"
RTL = "\u202eexe.gnp"
RTL_PARAM = "\u202eevil"  # parameter names cannot hold "."


class WeirdNames(nn.Module):
    NAMES = (SUPERSCRIPT, "\u0663", RTL_PARAM, "9" * 3000, "10", "2", "e\u0301", "a\u200bb")

    def __init__(self, fill: bool) -> None:
        super().__init__()
        for i, name in enumerate(self.NAMES):
            value = torch.full((3,), float(i)) if fill else torch.zeros(3)
            self.register_parameter(name, nn.Parameter(value))


def weird_state(fill: bool) -> dict[str, Any]:
    tensor = (lambda n: torch.arange(n, dtype=torch.float32)) if fill else torch.zeros
    return {
        "model": WeirdNames(fill),
        SUPERSCRIPT: tensor(3),
        ARABIC_INDIC: tensor(4),
        RTL: tensor(5),
        "n" + DIGITS_5000: 7,
        "cfg": {
            SUPERSCRIPT: 1,
            "\u0663": 2,
            DIGITS_5000: 3,
            RTL: "rtl",
            "10": torch.ones(2),
            "2": torch.zeros(2),
            "\u0664": {"\u0665": [1, 2]},
        },
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unusual_keys_save_load_inspect_and_verify(tmp_path: Path, layout: str) -> None:
    ckpt = tmp_path / "weird"
    saved = weird_state(fill=True)
    shardsafe.save(ckpt, saved, layout=layout)
    live = weird_state(fill=False)
    out = shardsafe.load(ckpt, live)
    assert_bitwise(weights(live["model"]), weights(saved["model"]))
    for key in (SUPERSCRIPT, ARABIC_INDIC, RTL):
        assert bits(live[key]) == bits(saved[key]), key
    assert out["n" + DIGITS_5000] == 7
    cfg = out["cfg"]
    assert cfg[DIGITS_5000] == 3 and cfg[SUPERSCRIPT] == 1 and cfg["\u0664"] == {"\u0665": [1, 2]}
    assert bits(cfg["10"]) == bits(torch.ones(2)) and bits(cfg["2"]) == bits(torch.zeros(2))
    rc, text, err = run_cli("inspect", str(ckpt))
    assert (rc, err) == (0, "") and "\\u202eexe.gnp" in text
    assert terminal_safe_output(text)
    rc, raw, err = run_cli("inspect", "--json", str(ckpt))
    assert (rc, err) == (0, "")
    doc = strict_json(raw)
    assert {v["name"] for v in doc["values"]} == set(saved)
    keys = {t["key"] for t in doc["tensors"]}
    assert {f"model/{n}" for n in WeirdNames.NAMES} <= keys
    assert {SUPERSCRIPT, ARABIC_INDIC, RTL, "cfg/10", "cfg/2"} <= keys
    rc, text, err = run_cli("verify", str(ckpt))
    assert (rc, err) == (0, "") and text.startswith("OK: ")


def _long_attribute() -> dict[str, Any]:
    module = nn.Module()
    module.register_parameter("w" * 4000, nn.Parameter(torch.ones(2)))
    return {"model": module}


def _nested(depth: int, wrap: Callable[[Any], Any]) -> dict[str, Any]:
    value: Any = 1
    for _ in range(depth):
        value = wrap(value)
    return {"deep": value}


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (_long_attribute, CheckpointError, "characters long; a checkpoint holds keys of at most"),
        (lambda: {"t" * 3100: torch.ones(2)}, CheckpointError, "characters long"),
        (lambda: _nested(200, lambda v: [v]), CheckpointError, "nested more than 80 levels"),
        (lambda: _nested(200, lambda v: {"k": v}), CheckpointError, "nested more than 80"),
        (lambda: _nested(60, lambda v: (v,)), CheckpointError, "more than 90 as stored"),
        (lambda: _nested(40, lambda v: {1: v}), CheckpointError, "more than 90 as stored"),
        (lambda: {"big": 10**5000, "t": torch.ones(1)}, CheckpointError, "4300 digits"),
        (lambda: {"a/b": 1}, ValueError, "must be a non-empty string without '/'"),
        (lambda: {"@x": 1}, ValueError, "does not start with '@'"),
        (lambda: {"f": print}, CheckpointError, "which shardsafe does not know how to save"),
        (lambda: {"cfg": {"f": print}}, CheckpointError, "shardsafe never pickles"),
    ],
    ids=[
        "4000-char attribute",
        "3100-char value name",
        "list 200 deep",
        "dict 200 deep",
        "tuple 60 deep",
        "int-keyed dict 40 deep",
        "int of 5001 digits",
        "slash in name",
        "at sign",
        "function",
        "function in a dict",
    ],
)
def test_save_refuses_first_what_load_would_refuse(
    tmp_path: Path, make: Callable[[], dict[str, Any]], error: type, fragment: str
) -> None:
    ckpt = tmp_path / "refused"
    with pytest.raises(error) as info:
        shardsafe.save(ckpt, make())
    assert fragment in str(info.value), str(info.value)
    assert not (ckpt / "manifest.json").exists()
    assert not ckpt.exists() or os.listdir(ckpt) == []
    shardsafe.save(ckpt, {"ok": 1})  # nothing left behind blocks the next save
    assert shardsafe.load(ckpt, {}) == {"ok": 1}


def test_nesting_right_at_the_limit_round_trips(tmp_path: Path) -> None:
    state = _nested(80, lambda v: [v])
    shardsafe.save(tmp_path / "c", state)
    assert shardsafe.load(tmp_path / "c", {}) == state
    assert run_cli("verify", str(tmp_path / "c"))[0] == 0


@pytest.mark.parametrize(
    ("wrap", "limit"),
    [(lambda v: {1: v}, 30), (lambda v: (v,), 45)],
    ids=["int-keyed dicts", "tuples"],
)
def test_nesting_that_tags_deepen_is_refused_by_its_entry_before_anything_is_written(
    tmp_path: Path, wrap: Callable[[Any], Any], limit: int
) -> None:
    """Tags make a level of nesting several in the manifest: 31 dicts with int keys
    passed the 80-level limit and the save failed reading its own manifest back, as
    "manifest.json is nested too deeply (over 100 levels); the file is damaged"."""
    state = _nested(limit, wrap)
    shardsafe.save(tmp_path / "ok", state)
    assert shardsafe.load(tmp_path / "ok", {}) == state
    with pytest.raises(CheckpointError) as caught:
        shardsafe.save(tmp_path / "deep", _nested(limit + 1, wrap))
    assert str(caught.value) == (
        "cannot save state['deep']: it is nested more than 80 levels deep (or more than 90 "
        "as stored: a tuple takes two levels, a dict with keys that are not strings three), "
        "more than a checkpoint holds (it may contain itself)"
    )
    assert not (tmp_path / "deep").exists()
