"""The engine's seams, each tested without processes: the load plan (the mirror of the
save plan), the options objects, typed offers, phase blocks over a store, the heartbeat,
and the messages a new user meets (a root with newer checkpoints, a run directory given
to ``inspect``)."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from shardsafe.checkpoint import LoadOptions, SaveHooks, SaveOptions
from shardsafe.checkpoint.loading import read_manifest
from shardsafe.checkpoint.plan.load_plan import plan_load
from shardsafe.checkpoint.plan.offer import ChunkOffer, Offer
from shardsafe.distributed import Coordinator, Phase
from shardsafe.distributed.heartbeat import Heartbeat
from shardsafe.protocol import Chunk, SaveItem
from tests.fake_store import FakeStore

# ----------------------------------------------------------------------- the load plan


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt, "step": 7, "table": torch.arange(6.0)}
    shardsafe.save(tmp_path / "c", state)
    return tmp_path / "c"


def _plan(path: Path, state: dict[str, Any], **kw: Any) -> Any:
    options = {"strict": True, "rank": 0, "world_size": 1, "untrusted_bytes_limit": 1 << 30}
    return plan_load(read_manifest(path), state, **{**options, **kw})


def test_the_load_plan_is_pure_and_names_every_region(saved: Path) -> None:
    model = nn.Linear(4, 3)
    plan = _plan(saved, {"model": model, "optimizer": torch.optim.Adam(model.parameters())})
    names = [e.saved.name for e in plan.entries]
    assert names == ["step", "table", "model", "optimizer"]  # plain values first, unasked
    keys = {r.key for r in plan.requests}
    assert {"model/weight", "model/bias", "optimizer/weight/exp_avg", "table"} <= keys
    weight = next(r for r in plan.requests if r.key == "model/weight")
    assert weight.checked_against_live and weight.global_shape == (3, 4)


def test_the_load_plan_collects_every_mismatch_at_once(saved: Path) -> None:
    model = nn.Linear(4, 5)  # both tensors differ in shape
    with pytest.raises(CheckpointMismatchError) as info:
        _plan(saved, {"model": model, "missing": 1})
    text = str(info.value)
    assert (
        'the checkpoint has no entry "missing" (it has: "model", "optimizer", "step", "table")\n'
        in text
    )
    assert "model/weight: checkpoint float32[3, 4], live float32[5, 4]" in text
    assert "model/bias: checkpoint float32[3], live float32[5]" in text


def test_the_load_plan_bounds_what_only_the_checkpoint_sizes(saved: Path) -> None:
    with pytest.raises(CheckpointCorruptError, match="untrusted_bytes_limit=0"):
        _plan(saved, {}, untrusted_bytes_limit=0)  # 'table' is 24 bytes nobody bounds
    assert _plan(saved, {}, untrusted_bytes_limit=24).entries


# ------------------------------------------------------------------- options objects


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"layout": "zip"}, "layout='zip' is not one of"),
        ({"buffer_bytes": 10}, "buffer_bytes=10 is too small"),
        ({"entry_timeout": 0}, "entry_timeout=0 must be a positive number of seconds"),
        ({"timeout": -1.0}, "timeout=-1.0 must be a positive number of seconds"),
        # Each of these was taken, or failed deep inside: inf on 2 ranks with a raw
        # OverflowError in a timer's thread, one rank saying the other had died.
        ({"timeout": math.inf}, "timeout=inf must be a positive number of seconds"),
        ({"entry_timeout": math.nan}, "entry_timeout=nan must be a positive number of seconds"),
        ({"timeout": 1e300}, r"timeout=1e\+300 is more than the 1e\+09 seconds \(about 31"),
        ({"buffer_bytes": "64MB"}, r"buffer_bytes='64MB' must be an int, a number of bytes \(1"),
        ({"buffer_bytes": 6.7e7}, r"buffer_bytes=67000000.0 must be an int, a number of bytes"),
        ({"verify_replicas": "yes"}, "verify_replicas='yes' must be True or False"),
    ],
)
def test_save_options_name_the_field_and_the_fix(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SaveOptions(**options)


def test_load_timeouts_that_cannot_be_waited_are_refused_by_name() -> None:
    for name in ("timeout", "entry_timeout"):
        with pytest.raises(ValueError, match=f"^{name}=inf must be a positive number"):
            LoadOptions(**{name: math.inf})


def test_a_manager_keeps_a_whole_number_of_checkpoints(tmp_path: Path) -> None:
    """keep_last=2.5 was taken: every save then committed, moved `latest` and raised a
    TypeError from its retention, which never ran; "3" raised a raw TypeError."""
    for keep in (2.5, "3", True, 0):
        with pytest.raises(ValueError) as caught:
            shardsafe.CheckpointManager(tmp_path, keep_last=keep)  # type: ignore[arg-type]
        assert (
            str(caught.value)
            == f"keep_last={keep!r} must be an int, at least 1 (or None to keep all)"
        )
    assert not os.listdir(tmp_path)


def test_options_are_keyword_only_and_unknown_names_are_refused() -> None:
    with pytest.raises(TypeError):
        SaveOptions("sharded")  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"unknown save option\(s\) \['layot'\]"):
        SaveOptions.of(layot="sharded")
    with pytest.raises(ValueError, match="untrusted_bytes_limit=-1 must be a number of bytes"):
        LoadOptions(untrusted_bytes_limit=-1)
    assert SaveOptions.of(SaveOptions(layout="consolidated"), timeout=5).layout == "consolidated"


def test_the_public_defaults_are_the_options_defaults() -> None:
    import inspect

    for fn, options in (
        (shardsafe.save, SaveOptions()),
        (shardsafe.load, LoadOptions()),
    ):
        for name, param in inspect.signature(fn).parameters.items():
            if param.kind is inspect.Parameter.KEYWORD_ONLY:
                assert param.default == getattr(options, name), (fn, name)


def test_save_hooks_run_on_rank_0_in_order_and_their_failure_commits_nothing(
    tmp_path: Path,
) -> None:
    calls: list[str] = []
    hooks = SaveHooks(before_write=lambda: calls.append("before"), after_commit=lambda: None)
    shardsafe.save(tmp_path / "ok", {"x": 1}, hooks=hooks)
    assert calls == ["before"] and (tmp_path / "ok" / "manifest.json").exists()

    def refuse() -> None:
        raise RuntimeError("not today")

    with pytest.raises(CheckpointError, match="RuntimeError: not today"):
        shardsafe.save(tmp_path / "no", {"x": 1}, hooks=SaveHooks(before_write=refuse))
    assert not (tmp_path / "no").exists()


# ----------------------------------------------------------------------- offers


def test_an_offer_round_trips_through_json_with_named_fields() -> None:
    item = SaveItem(
        "module",
        {"tensors": ["w"]},
        [Chunk("m/w", torch.zeros(2, 3, dtype=torch.bfloat16), (4, 3), (2, 0))],
    )
    offer = Offer.of(1, {"m": item})
    raw = json.loads(json.dumps(offer.to_json()))
    assert raw["chunks"] == [
        {
            "key": "m/w",
            "dtype": "bfloat16",
            "global_shape": [4, 3],
            "offsets": [2, 0],
            "shape": [2, 3],
            "replicated": False,
        }
    ]
    back = Offer.from_json(1, raw)
    assert back.chunks == [ChunkOffer(1, 0, "m/w", torch.bfloat16, (4, 3), (2, 0), (2, 3), False)]
    assert back.entries["m"].kind == "module" and back.entries["m"].meta == {"tensors": ["w"]}


# --------------------------------------------------------------- phases over a store


def test_a_phase_block_posts_its_payload_or_its_exception() -> None:
    store = FakeStore()
    rank1 = Coordinator("save", "/x", timeout=5, group=(1, 2, store))
    store.set("write/ok/0", json.dumps({"from": 0}))  # rank 0 already posted
    store.add("write/posted", 1)
    with rank1.phase(Phase.WRITE) as phase:
        phase.payload = {"from": 1}
    assert phase.payloads == [{"from": 0}, {"from": 1}]

    store2 = FakeStore()
    rank0 = Coordinator("save", "/y", timeout=5, group=(0, 2, store2))
    store2.set("commit/ok/1", "null")
    store2.add("commit/posted", 1)
    store2.add("commit/seen", 1)
    with pytest.raises(CheckpointError) as info, rank0.phase(Phase.COMMIT):
        raise OSError(28, "No space left on device")
    assert str(info.value).startswith(
        "save failed on rank 0: OSError: [Errno 28] No space left on device"
    )
    assert json.loads(store2.data["commit/error/0"])["type"] == "CheckpointError"


def test_a_dead_rank_is_named_with_what_the_engine_says_it_means() -> None:
    store = FakeStore()
    coord = Coordinator(
        "save", "/z", timeout=5, dead_after=0.0, group=(0, 2, store), aftermath={None: "AFTER."}
    )
    coord._heartbeat = Heartbeat(store, 0, 2, 0.0)
    coord._heartbeat.dead(0.0, lambda r: False)  # first look at rank 1's beat
    with pytest.raises(CheckpointError) as info:
        coord._check_heartbeats("write", 1.0)  # one second later it has not moved
    assert "rank(s) 1 stopped responding during the 'write' phase of save" in str(info.value)
    assert str(info.value).endswith("AFTER.")


def test_the_heartbeat_tells_a_beating_rank_from_a_dead_one() -> None:
    store = FakeStore()
    watch = Heartbeat(store, 0, 3, dead_after=10.0)
    assert watch.dead(0.0, lambda r: False) == []
    store.add("beat/1", 1)  # rank 1 beats, rank 2 does not
    assert watch.dead(11.0, lambda r: False) == [2]
    assert watch.dead(11.0, lambda r: r == 2) == []


# ----------------------------------------------------------- a new user's papercuts


def _shardsafe_warnings(seen: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in seen if str(w.message).startswith("shardsafe:")]


def test_the_resume_pattern_is_not_warned_and_a_save_behind_says_what_is_there(
    tmp_path: Path,
) -> None:
    first = shardsafe.CheckpointManager(tmp_path)
    first.save(50, {"x": 1})
    first.close()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resumed = shardsafe.CheckpointManager(tmp_path)  # the documented pattern:
        assert resumed.load_latest({}) == {"x": 1}  # load_latest on the next line
        resumed.save(60, {"x": 2})
        resumed.close()
        fresh = shardsafe.CheckpointManager(tmp_path)
    assert _shardsafe_warnings(seen) == []  # constructing a manager warns about nothing
    with warnings.catch_warnings(record=True) as seen, pytest.raises(CheckpointError) as info:
        warnings.simplefilter("always")
        fresh.save(10, {"x": 3})
    assert _shardsafe_warnings(seen) == []  # the error says it all
    text = str(info.value)
    assert "already holds step 60, newer than step 10 that this run is at" in text
    assert "this run did not resume from them" in text and "resumed from an older" not in text
    assert "load_latest(state)" in text and "save into another root" in text
    assert fresh.load_latest({}) == {"x": 2}
    fresh.save(70, {"x": 4})
    assert fresh.complete_steps() == [50, 60, 70]


def test_a_fresh_run_saving_into_a_used_root_is_warned_once(tmp_path: Path) -> None:
    first = shardsafe.CheckpointManager(tmp_path)
    first.save(5, {"x": 1})
    first.close()
    fresh = shardsafe.CheckpointManager(tmp_path)
    with pytest.warns(UserWarning) as seen:
        fresh.save(10, {"x": 2})
    assert _shardsafe_warnings(seen.list) == [
        f"shardsafe: {tmp_path} already holds checkpoints up to step 5 that this run did not "
        "resume from; saving step 10 beside them. To continue that run, call "
        "load_latest(state) before training; to start afresh, use another root"
    ]
    assert seen.list[0].filename == __file__  # points at the user's save, not at shardsafe
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        fresh.save(20, {"x": 3})  # once per manager
        fresh.close()
        looked = shardsafe.CheckpointManager(tmp_path)
        assert looked.latest() is not None  # looked for a checkpoint: not a fresh run
        looked.save(30, {"x": 4})
        looked.close()
        quiet = shardsafe.CheckpointManager(tmp_path, warn_if_not_empty=False)
        quiet.async_save(40, {"x": 5}).wait()
        quiet.close()
    assert _shardsafe_warnings(again) == []
    assert quiet.complete_steps() == [5, 10, 20, 30, 40]


def test_inspect_on_a_trainer_run_directory_names_the_newest_checkpoint(tmp_path: Path) -> None:
    manager = shardsafe.CheckpointManager(tmp_path / "run" / "checkpoints")
    manager.save(3, {"x": 1})
    manager.close()
    with pytest.raises(shardsafe.CheckpointNotFoundError) as info:
        shardsafe.inspect(tmp_path / "run")
    assert str(info.value).endswith(
        f"It looks like a Trainer run directory: its checkpoints are under "
        f"{tmp_path / 'run' / 'checkpoints'}; the newest is "
        f"{tmp_path / 'run' / 'checkpoints' / 'step-000000003'}"
    )


# ----------------------------------------------------------------- a background save's handle


@pytest.mark.timeout(60)
def test_a_handle_waits_without_limit_for_infinity_and_refuses_nan(tmp_path: Path) -> None:
    """``wait(math.inf)`` raised 'OverflowError: timestamp out of range for platform
    time_t' from threading; ``wait(nan)`` returned at once, as a timeout."""
    handle = shardsafe.async_save(tmp_path / "c", {"w": torch.arange(4.0)})
    with pytest.raises(ValueError) as raised:
        handle.wait(float("nan"))
    assert str(raised.value) == (
        "timeout=nan is not a number of seconds; pass seconds, or None to wait until the "
        "save has ended"
    )
    assert handle.wait(float("inf")) == str(tmp_path / "c")
    assert handle.wait(1e300) == str(tmp_path / "c")
