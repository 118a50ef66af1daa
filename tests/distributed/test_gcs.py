"""Checkpoints on a real Google Cloud Storage API server (gcp-storage-emulator, on
loopback) through gcsfs: the ``gs://`` half of "object storage" that the S3 tests do not
reach. Round trips of DDP + Adam and FSDP2 saved on 2 ranks and loaded at other world
sizes, bitwise; the manager's ``latest``, retention and lock; a flipped byte refused
before anything is restored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from tests.distributed import test_fsdp, zero_setup
from tests.distributed.test_object_storage import assert_loaded_as_saved
from tests.distributed.zero_setup import assert_same_optimizer_state, build, train
from tests.gcsserver import GcsServer
from tests.harness import run_ranks
from tests.s3server import with_env

pytestmark = pytest.mark.timeout(300)


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_ddp(rank: int, world: int, url: str, options: dict[str, Any], layout: str) -> Any:
    model, wrapped, opt = build("plain", seed=0)
    train(wrapped, opt, 0, 3, rank)
    state = {"model": wrapped, "optimizer": opt, "step": 3}
    shardsafe.save(url, state, layout=layout, storage_options=options)
    return zero_setup.torch_consolidated(opt, rank), model_state(model)


def load_ddp(rank: int, world: int, url: str, options: dict[str, Any]) -> Any:
    model, wrapped, opt = build("plain", seed=1)  # everything must come from the store
    state = {"model": wrapped, "optimizer": opt, "step": 0}
    extra = shardsafe.load(url, state, storage_options=options)
    return zero_setup.torch_consolidated(opt, rank), model_state(model), extra


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_ddp_round_trip_on_gcs_at_1_and_3_ranks(
    gcs_server: GcsServer, gcs_bucket: str, layout: str
) -> None:
    url = f"gs://{gcs_bucket}/run/step-3"
    env, options = gcs_server.env, gcs_server.options
    reference, weights = run_ranks(with_env, 2, env, save_ddp, url, options, layout)[0]
    keys = gcs_server.keys(gcs_bucket)
    assert "run/step-3/manifest.json" in keys
    assert all(k.startswith("run/step-3/") for k in keys), keys
    assert not any(".shardsafe-incomplete" in k for k in keys), keys
    for world in (1, 3):
        loaded = run_ranks(with_env, world, env, load_ddp, url, options)[0]
        assert_loaded_as_saved(loaded, reference, weights)


def save_fsdp(rank: int, world: int, url: str, options: dict[str, Any]) -> Any:
    model = test_fsdp.fsdp(0)
    opt = test_fsdp.adamw(model)
    test_fsdp.train(model, opt, 0, 3, rank)
    shardsafe.save(url, {"model": model, "optimizer": opt}, storage_options=options)
    return test_fsdp.full_state(model, opt)


def load_fsdp(rank: int, world: int, url: str, options: dict[str, Any]) -> Any:
    model = test_fsdp.fsdp(1)
    opt = test_fsdp.adamw(model)
    shardsafe.load(url, {"model": model, "optimizer": opt}, storage_options=options)
    return test_fsdp.full_state(model, opt)


def test_fsdp2_round_trip_on_gcs_at_3_ranks(gcs_server: GcsServer, gcs_bucket: str) -> None:
    url = f"gs://{gcs_bucket}/fsdp/step-3"
    env, options = gcs_server.env, gcs_server.options
    msd, osd = run_ranks(with_env, 2, env, save_fsdp, url, options)[0]
    got_msd, got_osd = run_ranks(with_env, 3, env, load_fsdp, url, options)[0]
    test_fsdp.assert_same_model(got_msd, msd)
    want = test_fsdp.fqn_optimizer_state(osd)
    assert_same_optimizer_state(test_fsdp.fqn_optimizer_state(got_osd), want)


def test_manager_on_gcs_keeps_latest_and_retention_and_locks_the_root(
    gcs_server: GcsServer, gcs_bucket: str
) -> None:
    root = f"gs://{gcs_bucket}/runs/exp"
    options = gcs_server.options
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    manager = shardsafe.CheckpointManager(root, keep_last=2, storage_options=options)
    for step in (1, 2, 3):
        manager.save(step, {"values": {"w": weights * step}})
    assert manager._lock.conditional is True  # the create carried ifGenerationMatch=0
    # The emulator ignores ifGenerationMatch (real GCS honours it), so a second run from
    # another host takes the lock over; the first run finds out at its next save and
    # stops before it writes anything.
    other = shardsafe.CheckpointManager(
        root, keep_last=2, storage_options=options, warn_if_not_empty=False
    )
    other._lock.me["host"] = "elsewhere"
    other.save(4, {"values": {"w": weights * 4}})
    with pytest.raises(
        shardsafe.CheckpointError, match=r"now names another run \(pid \d+ on host elsewhere\)"
    ):
        manager.save(5, {"values": {"w": weights * 5}})
    assert not gcs_server.keys(gcs_bucket, "runs/exp/step-000000005")
    other.close()
    manager = shardsafe.CheckpointManager(
        root, keep_last=2, storage_options=options, warn_if_not_empty=False
    )
    latest = manager.latest()
    assert latest == f"{root}/step-000000004"
    got = shardsafe.load(latest, {}, storage_options=options)
    assert torch.equal(got["values"]["w"], weights * 4)
    manager.save(5, {"values": {"w": weights * 5}})
    keys = gcs_server.keys(gcs_bucket, "runs/exp/")
    assert {k.split("/")[2] for k in keys if "/step-" in k} == {"step-000000004", "step-000000005"}
    assert "runs/exp/.shardsafe.lock" in keys and "runs/exp/latest" in keys
    manager.close()
    assert "runs/exp/.shardsafe.lock" not in gcs_server.keys(gcs_bucket, "runs/exp/")


def test_a_flipped_byte_in_a_gcs_object_is_refused_before_anything_is_restored(
    gcs_server: GcsServer, gcs_bucket: str
) -> None:
    url = f"gs://{gcs_bucket}/bad/step-1"
    options = gcs_server.options
    shardsafe.save(url, {"model": torch.nn.Linear(64, 64)}, storage_options=options)
    fs = gcs_server.fs()
    (data,) = [k for k in gcs_server.keys(gcs_bucket, "bad/step-1/") if k.endswith(".safetensors")]
    raw = bytearray(fs.cat_file(f"{gcs_bucket}/{data}"))
    raw[-7] ^= 0x10  # inside the last tensor's bytes (the weight)
    fs.pipe_file(f"{gcs_bucket}/{data}", bytes(raw))
    torch.manual_seed(5)
    model = torch.nn.Linear(64, 64)
    before = model_state(model)
    with pytest.raises(shardsafe.CheckpointCorruptError) as caught:
        shardsafe.load(url, {"model": model}, storage_options=options)
    assert data.rsplit("/", 1)[-1] in str(caught.value)
    assert all(torch.equal(v, before[k]) for k, v in model_state(model).items())


def broken_node(rank: int, world: int, where: dict[str, str], options: dict[str, Any]) -> Any:
    """Save, load and a manager's load_latest, with rank 1's credentials file broken."""
    if rank == 1:  # a node whose image holds a credentials file that is not one
        options = {**options, "token": where["token"]}
    opts: dict[str, Any] = {"storage_options": options, "entry_timeout": 20}
    said = []
    calls = [
        lambda: shardsafe.save(where["save"], {"w": torch.ones(4)}, **opts),
        lambda: shardsafe.load(where["load"], {"w": torch.zeros(4)}, **opts),
        lambda: shardsafe.CheckpointManager(where["root"], storage_options=options).load_latest(
            {"w": torch.zeros(4)}, entry_timeout=20
        ),
    ]
    for call in calls:
        try:
            call()
            said.append("no error")
        except shardsafe.CheckpointError as e:
            said.append(str(e))
    return said


def test_a_node_whose_credentials_file_is_broken_fails_every_ranks_save_and_load_at_once(
    gcs_server: GcsServer, gcs_bucket: str, tmp_path: Path
) -> None:
    """gcsfs reads its credentials file when its client is made, which shardsafe does
    when it opens the store: that open now comes after the ranks have met, so the node
    whose file is broken fails the operation on every rank, naming why. (It raised on that
    rank alone, before the others: they waited out ``entry_timeout`` and then said it
    never called ``save``/``load``.)"""
    token = tmp_path / "creds.json"
    token.write_text('{"type": "authorized_user"}')  # no refresh_token: gcsfs's KeyError
    options = gcs_server.options
    where = {
        "save": f"gs://{gcs_bucket}/broken/new",
        "load": f"gs://{gcs_bucket}/broken/saved",
        "root": f"gs://{gcs_bucket}/broken/run",
        "token": str(token),
    }
    shardsafe.save(where["load"], {"w": torch.ones(4)}, storage_options=options)
    manager = shardsafe.CheckpointManager(where["root"], storage_options=options)
    manager.save(3, {"w": torch.ones(4)})
    manager.close()
    said = run_ranks(with_env, 2, gcs_server.env, broken_node, where, options, timeout=120)
    cause = (
        "the gs:// client could not be made from its storage_options and environment "
        "(KeyError: 'refresh_token'); check those options and any credentials they name on "
        "this machine"
    )
    for rank, errors in enumerate(said):
        assert len(errors) == 3, errors
        save_error, load_error, latest_error = errors
        for error, operation, url in (
            (save_error, "save", where["save"]),
            (load_error, "load", where["load"]),
            (latest_error, "load", f"{where['root']}/step-000000003"),
        ):
            assert f"{url}: {cause}" in error, (rank, error)
            if rank == 0:
                assert error.startswith(f"{operation} failed on rank 1"), error
    assert not gcs_server.keys(gcs_bucket, "broken/new")  # nothing written, nothing left
