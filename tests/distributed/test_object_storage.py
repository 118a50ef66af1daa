"""Checkpoints on a real S3 API server (moto, on loopback): DDP, ZeRO, OSS and FSDP2, both
layouts, saved on 2 ranks and loaded on 1 and 3, bitwise; only objects under the
checkpoint's prefix are written, and the manifest is among them only once committed."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import shardsafe
from tests.distributed import test_fsdp, zero_setup
from tests.distributed.zero_setup import assert_same_optimizer_state, build, train
from tests.harness import run_ranks
from tests.s3server import S3Server, with_env

pytestmark = pytest.mark.timeout(300)

LAYOUTS = ["sharded", "consolidated"]


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_zero_like(rank: int, world: int, kind: str, url: str, layout: str) -> Any:
    model, wrapped, opt = build(kind, seed=0)
    train(wrapped, opt, 0, 3, rank)
    shardsafe.save(url, {"model": wrapped, "optimizer": opt, "step": 3}, layout=layout)
    return zero_setup.torch_consolidated(opt, rank), model_state(model)


def load_zero_like(rank: int, world: int, kind: str, url: str) -> Any:
    model, wrapped, opt = build(kind, seed=1)  # different init: everything comes from S3
    extra = shardsafe.load(url, {"model": wrapped, "optimizer": opt, "step": 0})
    return zero_setup.torch_consolidated(opt, rank), model_state(model), extra


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["plain", "zero", "oss"])
def test_ddp_zero_oss_round_trip_on_s3_at_1_and_3_ranks(
    s3_server: S3Server, s3_bucket: str, kind: str, layout: str
) -> None:
    if kind == "oss":
        pytest.importorskip("fairscale")
    url = f"s3://{s3_bucket}/run/step-3"
    env = s3_server.env
    saved = run_ranks(with_env, 2, env, save_zero_like, kind, url, layout)
    reference, weights = saved[0]
    assert reference["state"]
    keys = s3_server.keys(s3_bucket)
    assert "run/step-3/manifest.json" in keys
    assert all(k.startswith("run/step-3/") for k in keys), keys
    assert not any(".shardsafe-incomplete" in k for k in keys), keys
    for world in (1, 3):
        loaded = run_ranks(with_env, world, env, load_zero_like, kind, url)[0]
        assert_loaded_as_saved(loaded, reference, weights)


def assert_loaded_as_saved(loaded: Any, reference: Any, weights: dict[str, Any]) -> None:
    """A load's ``(optimizer state, weights, plain values)`` are the save's, bitwise."""
    state, got_weights, extra = loaded
    assert extra == {"step": 3}
    assert_same_optimizer_state(state, reference)
    assert got_weights.keys() == weights.keys()
    assert all(torch.equal(got_weights[k], w) for k, w in weights.items())


def save_fsdp(rank: int, world: int, url: str, layout: str) -> Any:
    model = test_fsdp.fsdp(0)
    opt = test_fsdp.adamw(model)
    test_fsdp.train(model, opt, 0, 3, rank)
    shardsafe.save(url, {"model": model, "optimizer": opt}, layout=layout)
    return test_fsdp.full_state(model, opt)


def load_fsdp(rank: int, world: int, url: str) -> Any:
    model = test_fsdp.fsdp(1)
    opt = test_fsdp.adamw(model)
    shardsafe.load(url, {"model": model, "optimizer": opt})
    return test_fsdp.full_state(model, opt)


def load_plain(rank: int, world: int, url: str) -> Any:
    model = test_fsdp.net(1)
    opt = test_fsdp.adamw(model)
    shardsafe.load(url, {"model": model, "optimizer": opt})
    return model_state(model), zero_setup._clone(opt.state_dict())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp2_round_trip_on_s3_at_1_and_3_ranks(
    s3_server: S3Server, s3_bucket: str, layout: str
) -> None:
    url = f"s3://{s3_bucket}/fsdp/step-3"
    env = s3_server.env
    msd, osd = run_ranks(with_env, 2, env, save_fsdp, url, layout)[0]
    got_msd, got_osd = run_ranks(with_env, 3, env, load_fsdp, url)[0]
    test_fsdp.assert_same_model(got_msd, msd)
    want = test_fsdp.fqn_optimizer_state(osd)
    assert_same_optimizer_state(test_fsdp.fqn_optimizer_state(got_osd), want)
    weights, plain = run_ranks(with_env, 1, env, load_plain, url, init_process_group=False)[0]
    test_fsdp.assert_same_model(weights, msd)
    assert_same_optimizer_state(plain, want)


def fit_run(rank: int, world: int, run_dir: str, cwd: str, steps: int, resume: str | None) -> Any:
    import os

    from shardsafe import Trainer
    from shardsafe.trainer.example import ExampleModule

    os.chdir(cwd)  # where a URL run's metrics.jsonl goes (objects cannot be appended to)
    torch.manual_seed(0)
    trainer = Trainer(
        strategy="ddp",
        devices=world,
        max_steps=steps,
        checkpoint_every=3,
        run_dir=run_dir,
        keep_last=2,
    )
    return trainer.fit(ExampleModule(), resume=resume).checkpoint


def test_trainer_with_an_s3_run_dir_saves_and_resumes_with_identical_losses(
    s3_server: S3Server, s3_bucket: str, tmp_path: Any
) -> None:
    from tests.e2e.trainer_helpers import losses

    env = s3_server.env
    whole = tmp_path / "whole"
    run_ranks(with_env, 2, env, fit_run, str(whole), str(tmp_path), 8, None)
    url = f"s3://{s3_bucket}/runs/exp"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    first = run_ranks(with_env, 2, env, fit_run, url, str(cwd), 4, None)
    assert first[0] == f"{url}/checkpoints/step-000000004"
    final = run_ranks(with_env, 2, env, fit_run, url, str(cwd), 8, "latest")
    assert final[0] == f"{url}/checkpoints/step-000000008"
    steps = {k.split("/")[3] for k in s3_server.keys(s3_bucket, "runs/exp/checkpoints/step-")}
    assert steps == {"step-000000006", "step-000000008"}  # keep_last=2
    (log,) = (cwd / "metrics").iterdir()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["step"]: r["loss"] for r in records} == losses(whole)


BLOCK = 16 << 10
"""A read-ahead block small enough that the test model's shard files span many."""


def load_fsdp_counting_gets(rank: int, world: int, url: str, verify: str) -> Any:
    """Load with small read-ahead blocks, recording the bytes fetched from each object."""
    from shardsafe.checkpoint.storage import object_reader

    fetched: dict[str, int] = {}
    get, get_parallel = (
        object_reader.FsspecFileReader._get,
        object_reader.FsspecFileReader._get_parallel,
    )

    def counted_get(self: Any, start: int, end: int) -> bytes:
        fetched[self.name] = fetched.get(self.name, 0) + end - start
        return get(self, start, end)

    def counted_parallel(self: Any, offset: int, view: memoryview) -> None:
        fetched[self.name] = fetched.get(self.name, 0) + view.nbytes
        get_parallel(self, offset, view)

    object_reader.READ_AHEAD_BYTES = BLOCK
    object_reader.FsspecFileReader._get = counted_get  # type: ignore[method-assign]
    object_reader.FsspecFileReader._get_parallel = counted_parallel  # type: ignore[method-assign]
    model = _wide_fsdp(1)
    opt = test_fsdp.adamw(model)
    shardsafe.load(url, {"model": model, "optimizer": opt}, verify=verify)
    return fetched, test_fsdp.full_state(model, opt)


def save_wide_fsdp(rank: int, world: int, url: str) -> Any:
    model = _wide_fsdp(0)
    opt = test_fsdp.adamw(model)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    shardsafe.save(url, {"model": model, "optimizer": opt})
    return test_fsdp.full_state(model, opt)


@pytest.mark.parametrize("verify", ["first", "inline"])
def test_an_fsdp2_rank_reads_only_its_own_shard_file_and_the_head_of_the_others(
    s3_server: S3Server, s3_bucket: str, verify: str
) -> None:
    """Each file holds its whole (replicated) tensors first, and a load reads in file
    order: a rank reading back its shards fetches its own file once, and of the other
    rank's file only the first block (header and the AdamW step scalars kept there),
    instead of walking it for step scalars spread among that rank's shards."""
    url = f"s3://{s3_bucket}/wide/step-1"
    env = s3_server.env
    msd, osd = run_ranks(with_env, 2, env, save_wide_fsdp, url)[0]
    sizes = {
        key.rsplit("/", 1)[-1]: len(s3_server.get(s3_bucket, key))
        for key in s3_server.keys(s3_bucket, "wide/step-1/")
    }
    shard_files = sorted(n for n in sizes if n.startswith("shard-"))
    assert len(shard_files) == 2 and all(sizes[n] > 8 * BLOCK for n in shard_files), sizes
    results = run_ranks(with_env, 2, env, load_fsdp_counting_gets, url, verify)
    passes = 2 if verify == "first" else 1  # the check pass, then the restore
    for rank, (fetched, _) in enumerate(results):
        own, other = shard_files[rank], shard_files[1 - rank]
        # A pass may fetch a block beyond what it needs where it jumps: reading the fresh
        # optimizer state, then (restoring in place) the parameters before it.
        assert fetched[own] <= passes * sizes[own] + 4 * BLOCK, (rank, fetched, sizes)
        assert fetched.get(other, 0) <= passes * BLOCK, (rank, fetched, sizes)
    _, (got_msd, got_osd) = results[0]  # torch's full state is gathered on rank 0
    test_fsdp.assert_same_model(got_msd, msd)
    want = test_fsdp.fqn_optimizer_state(osd)
    assert_same_optimizer_state(test_fsdp.fqn_optimizer_state(got_osd), want)


def _wide_fsdp(seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def replace_three_times(rank: int, world: int, url: str) -> list[float]:
    """``save_replacing`` of the same name three times on every rank (Lightning's
    ``last.ckpt``): the placement agreed each time (rank 0 decides)."""
    from shardsafe.checkpoint import SaveOptions
    from shardsafe.checkpoint.replacing import save_replacing

    seen = []
    for value in (1.0, 2.0, 3.0):
        save_replacing(url, {"w": torch.full((4,), value)}, SaveOptions())
        seen.append(float(shardsafe.load(url, {})["w"][0]))
    return seen


def placement_fails_on_rank_0(rank: int, world: int, url: str) -> str:
    """Rank 0 cannot read the store while deciding where the save goes."""
    from shardsafe.checkpoint import SaveOptions
    from shardsafe.checkpoint.replacing import save_replacing
    from shardsafe.checkpoint.storage import object_placement

    save_replacing(url, {"w": torch.ones(4)}, SaveOptions())
    if rank == 0:

        def unreachable(*args: object, **kwargs: object) -> object:
            raise OSError("the store is unreachable")

        object_placement.ObjectPlacement.of = unreachable  # type: ignore[method-assign]
    try:
        save_replacing(url, {"w": torch.zeros(4)}, SaveOptions(entry_timeout=20))
    except shardsafe.CheckpointError as e:
        return str(e)
    return "no error"


def test_replacing_a_name_on_2_ranks_agrees_where_each_save_goes(
    s3_server: S3Server, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"
    seen = run_ranks(with_env, 2, s3_server.env, replace_three_times, url)
    assert seen == [[1.0, 2.0, 3.0]] * 2
    keys = s3_server.keys(s3_bucket)
    assert all(k.startswith("ckpts/last.ckpt/") for k in keys), keys  # no staged copy left
    expected = {"manifest.json", *shardsafe.read_manifest(url).files}
    assert {k.rsplit("/", 1)[1] for k in keys} == expected  # exactly what the manifest names


def test_a_placement_rank_0_cannot_decide_is_every_ranks_error_and_writes_nothing(
    s3_server: S3Server, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/ckpts/last.ckpt"
    errors = run_ranks(with_env, 2, s3_server.env, placement_fails_on_rank_0, url)
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("save failed on rank 0: OSError: the store is unreachable")
    keys = s3_server.keys(s3_bucket)
    assert not any("shardsafe-partial" in k for k in keys), keys
    assert torch.equal(shardsafe.load(url, {})["w"], torch.ones(4))  # the old one stands


def _cut_off(port: int) -> None:
    """This rank's endpoint is a port nothing listens on (its node cannot reach the
    store), and its client tries once: botocore's retries, with their backoff, only
    delayed the same error by about 10 s."""
    import os

    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
    os.environ["AWS_MAX_ATTEMPTS"] = "1"


def save_with_rank_1_cut_off(rank: int, world: int, url: str, port: int) -> str:
    """Rank 1 cannot reach the store (:func:`_cut_off`)."""
    if rank == 1:
        _cut_off(port)
    try:
        shardsafe.save(url, {"w": torch.ones(4)}, entry_timeout=30)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_store_one_rank_cannot_reach_is_every_ranks_error_at_once(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """Before, the first look at the target came before the entry barrier: rank 1 raised
    botocore's own EndpointConnectionError, and rank 0 waited out entry_timeout to blame
    rank 1 for not calling save at all."""
    from tests.harness import free_port

    url = f"s3://{s3_bucket}/run/step-1"
    errors = run_ranks(with_env, 2, s3_server.env, save_with_rank_1_cut_off, url, free_port())
    assert errors[0] == errors[1], errors
    assert errors[0].startswith(
        f"CheckpointError: save failed on rank 1: the object store failed at {url}: "
        "EndpointConnectionError: Could not connect to the endpoint URL"
    ), errors
    assert s3_server.keys(s3_bucket) == []


def load_latest_with_a_rank_cut_off(rank: int, world: int, root: str, cut: int, port: int) -> str:
    """Rank ``cut``'s endpoint is a port nothing listens on."""
    if rank == cut:
        _cut_off(port)
    manager = shardsafe.CheckpointManager(root)
    try:
        manager.load_latest({"w": torch.zeros(4)}, entry_timeout=30)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("cut", [0, 1])
def test_load_latest_with_a_store_one_rank_cannot_reach_is_every_ranks_error_at_once(
    s3_server: S3Server, s3_bucket: str, cut: int
) -> None:
    """Each rank looked for the newest checkpoint on its own, before the load's entry
    barrier: the rank cut off raised botocore's own error, and the other waited out
    entry_timeout to blame it for not calling load (or lost its store)."""
    from tests.harness import free_port

    root = f"s3://{s3_bucket}/run"
    shardsafe.CheckpointManager(root).save(1, {"w": torch.ones(4)})
    errors = run_ranks(
        with_env, 2, s3_server.env, load_latest_with_a_rank_cut_off, root, cut, free_port()
    )
    assert errors[0] == errors[1], errors
    # Rank 0 looks for the newest step for every rank: cut off, its listing fails.
    where = root if cut == 0 else f"{root}/step-000000001"
    doing = f"the object store failed at {where}: "
    assert errors[0].startswith(
        f"CheckpointError: load failed on rank {cut}: {doing}EndpointConnectionError: Could "
        "not connect to the endpoint URL"
    ), errors


def manager_save_with_rank_0_cut_off(rank: int, world: int, root: str, port: int) -> str:
    if rank == 0:
        _cut_off(port)
    try:
        shardsafe.CheckpointManager(root).save(2, {"w": torch.ones(4)}, entry_timeout=30)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_managers_save_with_a_store_rank_0_cannot_reach_is_every_ranks_error(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """A fresh manager's first save looks for older checkpoints (to warn) on rank 0 before
    the save's entry barrier: rank 0 raised botocore's own error there, alone, and rank 1
    waited at the barrier for a rank that had left."""
    from tests.harness import free_port

    root = f"s3://{s3_bucket}/run"
    shardsafe.CheckpointManager(root).save(1, {"w": torch.zeros(4)})
    errors = run_ranks(
        with_env, 2, s3_server.env, manager_save_with_rank_0_cut_off, root, free_port()
    )
    assert errors[0] == errors[1], errors
    assert errors[0].startswith(
        f"CheckpointError: save failed on rank 0: the object store failed at {root}/"
        "step-000000002: EndpointConnectionError: Could not connect to the endpoint URL"
    ), errors
    assert [k for k in s3_server.keys(s3_bucket) if "step-000000002" in k] == []


def fit_with_rank_1_cut_off(rank: int, world: int, run_dir: str, cwd: str, port: int) -> str:
    if rank == 1:
        _cut_off(port)
    try:
        fit_run(rank, world, run_dir, cwd, 8, "latest")
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_trainer_resuming_from_a_store_one_rank_cannot_reach_fails_alike_on_every_rank(
    s3_server: S3Server, s3_bucket: str, tmp_path: Any
) -> None:
    """Every rank looked for the newest checkpoint on its own: rank 1 raised botocore's
    own error there, and rank 0 went on to build DDP and died in gloo ('Connection closed
    by peer'). Rank 0 now looks; rank 1's failure is the load's, agreed."""
    from tests.harness import free_port

    url = f"s3://{s3_bucket}/runs/exp"
    run_ranks(with_env, 2, s3_server.env, fit_run, url, str(tmp_path), 4, None)
    errors = run_ranks(
        with_env, 2, s3_server.env, fit_with_rank_1_cut_off, url, str(tmp_path), free_port()
    )
    assert errors[0] == errors[1], errors
    assert errors[0].startswith(
        f"CheckpointError: load failed on rank 1: the object store failed at {url}/"
        "checkpoints/step-000000004: EndpointConnectionError: Could not connect to the "
        "endpoint URL"
    ), errors
