"""What one GPU can show: CUDA state saved and loaded, staged to host without aliasing live
tensors, no GPU memory growth during a save or a load (read into the live tensors through
one pinned host buffer), and a CPU-saved checkpoint loaded onto the GPU.

Skipped without CUDA (see conftest.py); run them with ``pytest -m cuda`` on a GPU machine.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]


def _trained(device: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for _ in range(3):
        model(torch.randn(16, 64, device=device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(x.cpu(), y.cpu())
        for x, y in zip(a.state_dict().values(), b.state_dict().values())
    )


@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_cuda_state_round_trips_onto_the_gpu(tmp_path: Path, layout: str) -> None:
    model, opt = _trained("cuda")
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": opt}, layout=layout)
    fresh, fresh_opt = _trained("cuda", seed=1)
    shardsafe.load(tmp_path / "ckpt", {"model": fresh, "optimizer": fresh_opt})
    assert _same(model, fresh)
    assert all(p.is_cuda for p in fresh.parameters())
    for p, q in zip(model.parameters(), fresh.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            assert fresh_opt.state[q][name].is_cuda
            assert torch.equal(opt.state[p][name], fresh_opt.state[q][name])


def test_saved_bytes_do_not_alias_live_tensors(tmp_path: Path) -> None:
    model, _ = _trained("cuda")
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    shardsafe.save(tmp_path / "ckpt", {"model": model})
    with torch.no_grad():  # training goes on and overwrites the live tensors
        for p in model.parameters():
            p.add_(1.0)
    fresh, _ = _trained("cuda", seed=1)
    shardsafe.load(tmp_path / "ckpt", {"model": fresh})
    assert all(torch.equal(fresh.state_dict()[k].cpu(), v) for k, v in expected.items())


def test_gpu_memory_does_not_grow_during_a_save(tmp_path: Path) -> None:
    model, opt = _trained("cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for i, layout in enumerate(("sharded", "consolidated")):
        shardsafe.save(tmp_path / f"ckpt{i}", {"model": model, "optimizer": opt}, layout=layout)
    torch.cuda.synchronize()
    # Contiguous state is copied to host piece by piece; nothing is staged on the GPU.
    assert torch.cuda.max_memory_allocated() - before <= 1 << 20
    assert torch.cuda.memory_allocated() == before


def test_cpu_saved_checkpoint_loads_onto_the_gpu(tmp_path: Path) -> None:
    model, opt = _trained("cpu")
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    fresh, fresh_opt = _trained("cuda", seed=1)
    shardsafe.load(tmp_path / "ckpt", {"model": fresh, "optimizer": fresh_opt})
    assert _same(model, fresh) and all(p.is_cuda for p in fresh.parameters())
    state = next(iter(fresh_opt.state.values()))
    assert state["exp_avg"].is_cuda


@pytest.mark.parametrize("mode", ["first", "inline"])
@pytest.mark.parametrize("layout", ["sharded", "consolidated"])
def test_gpu_memory_does_not_grow_during_a_load(tmp_path: Path, layout: str, mode: str) -> None:
    model, opt = _trained("cuda")
    shardsafe.save(tmp_path / "ckpt", {"model": model, "optimizer": opt}, layout=layout)
    fresh, fresh_opt = _trained("cuda", seed=1)
    live = [p.data_ptr() for p in fresh.parameters()]
    live += [s["exp_avg"].data_ptr() for s in fresh_opt.state.values()]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    shardsafe.load(tmp_path / "ckpt", {"model": fresh, "optimizer": fresh_opt}, verify=mode)
    torch.cuda.synchronize()
    # Read into the live tensors through a pinned host buffer: no GPU allocation at all.
    assert torch.cuda.max_memory_allocated() - before <= 1 << 20
    assert torch.cuda.memory_allocated() == before
    assert _same(model, fresh)
    for p, q in zip(model.parameters(), fresh.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][name], fresh_opt.state[q][name])
    after = [p.data_ptr() for p in fresh.parameters()]
    after += [s["exp_avg"].data_ptr() for s in fresh_opt.state.values()]
    assert after == live, "the live tensors must be filled, not replaced"


def _reader_of(path: Path) -> Any:
    from shardsafe.checkpoint.io.reader import CheckpointReader
    from shardsafe.checkpoint.loading import read_manifest_from
    from shardsafe.checkpoint.storage.local import LocalStorage

    storage = LocalStorage(str(path))
    return CheckpointReader(storage, read_manifest_from(storage), piece_bytes=4096)


def test_cuda_targets_are_filled_through_a_few_reused_pinned_pieces(tmp_path: Path) -> None:
    from shardsafe.checkpoint.io.pinned_ring import SLOTS

    model, _ = _trained("cuda")
    shardsafe.save(tmp_path / "ckpt", {"model": model})
    with _reader_of(tmp_path / "ckpt") as reader:
        out = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
        seen = set()
        for name, target in out.items():
            reader.read_into(f"model/{name}", None, None, target)
            buffers = reader._pinned.buffers
            assert buffers and all(b.is_pinned() for b in buffers)
            assert all(b.numel() <= 4096 for b in buffers)  # pieces, never a whole tensor
            seen |= {id(b) for b in buffers}
    assert len(seen) <= SLOTS  # reused from one tensor to the next
    assert all(torch.equal(out[k], v) for k, v in model.state_dict().items())


def test_the_copies_run_after_the_callers_queued_work_and_before_the_read_returns(
    tmp_path: Path,
) -> None:
    """The copies are queued on the destination's current stream, asynchronously: after a
    slow kernel the caller queued before (and a fill that follows it), and all of them
    run by the time ``read_into`` returns; a transposed (non-contiguous) destination too."""
    model, _ = _trained("cuda")
    shardsafe.save(tmp_path / "ckpt", {"model": model})
    weight = model.state_dict()["0.weight"]
    with _reader_of(tmp_path / "ckpt") as reader:
        for target in (torch.empty_like(weight), torch.empty_like(weight.t()).t()):
            torch.cuda._sleep(200_000_000)  # type: ignore[attr-defined]  # ~0.1 s queued
            target.fill_(7.0)
            reader.read_into("model/0.weight", None, None, target)
            assert torch.cuda.current_stream().query(), "the read returned before its copies ran"
            assert torch.equal(target, weight)


def test_a_damaged_piece_refuses_the_read_with_every_queued_copy_run(tmp_path: Path) -> None:
    """A flipped byte mid-tensor: the read raises the checksum error, and the copies of
    the pieces before it, queued asynchronously, have all run by then (the pinned
    buffers are free; nothing is still writing into the tensor)."""
    from shardsafe.errors import CheckpointCorruptError

    weight = torch.randn(1024, 1024, device="cuda")  # 4 MiB: many 4 KiB pieces
    shardsafe.save(tmp_path / "ckpt", {"t": {"w": weight}})
    data = next((tmp_path / "ckpt").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1000] ^= 0xFF  # near the end: most pieces' copies are queued before it
    data.write_bytes(bytes(raw))
    with _reader_of(tmp_path / "ckpt") as reader:
        target = torch.zeros_like(weight)
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            reader.read_into("t/w", None, None, target)
        assert torch.cuda.current_stream().query(), "a queued copy outlived the error"
    assert torch.equal(target[:512], weight[:512])  # the copies before the damage landed


def test_a_row_larger_than_a_piece_goes_through_one_pinned_buffer(tmp_path: Path) -> None:
    """Pinned memory stays one row where a row exceeds a piece, as before the ring, not
    one row per slot."""
    wide = torch.randn(4, 4096, device="cuda")  # 16 KiB rows, 4 KiB pieces
    shardsafe.save(tmp_path / "ckpt", {"t": {"w": wide}})
    with _reader_of(tmp_path / "ckpt") as reader:
        target = torch.empty_like(wide)
        reader.read_into("t/w", None, None, target)
        assert [b.numel() for b in reader._pinned.buffers] == [4096 * 4]
    assert torch.equal(target, wide)


def test_a_non_contiguous_target_is_read_in_host_sized_pieces(tmp_path: Path) -> None:
    """torch copies into a non-contiguous CUDA tensor through a device copy of the piece:
    such a target gets the host's small pieces, never the ring's larger ones."""
    from shardsafe.checkpoint.io.reader import CheckpointReader
    from shardsafe.checkpoint.loading import read_manifest_from
    from shardsafe.checkpoint.storage.local import LocalStorage

    weight = torch.randn(512, 512, device="cuda")  # 1 MiB
    shardsafe.save(tmp_path / "ckpt", {"t": {"w": weight}})
    storage = LocalStorage(str(tmp_path / "ckpt"))
    manifest = read_manifest_from(storage)
    with CheckpointReader(storage, manifest, piece_bytes=8192, cuda_piece_bytes=1 << 20) as r:
        target = torch.empty_like(weight.t()).t()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        r.read_into("t/w", None, None, target)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before <= 64 << 10
        assert all(b.numel() <= 8192 for b in r._pinned.buffers)
    assert torch.equal(target, weight)


# --------------------------------------------------------------------- async save


def _staged_from_the_gpu(stager: object) -> list[torch.Tensor]:
    """The staging buffers of CUDA tensors (their key ends with ``is_cuda``): AdamW's
    ``step`` counters are CPU scalars, staged in ordinary memory."""
    buffers = stager._buffers  # type: ignore[attr-defined]
    return [b for key, b in buffers.items() if key[-1]]


def test_async_save_stages_into_pinned_host_memory(tmp_path: Path) -> None:
    from shardsafe.checkpoint.background import async_save
    from shardsafe.checkpoint.io.staging import Stager
    from shardsafe.checkpoint.options import SaveOptions

    model, opt = _trained("cuda")
    stager = Stager()
    async_save(
        str(tmp_path / "a"), {"model": model, "optimizer": opt}, SaveOptions(), stager
    ).wait()
    buffers = _staged_from_the_gpu(stager)
    assert len(buffers) == 4 + 8  # 2 weights and 2 biases, 2 moments of each
    assert all(b.device.type == "cpu" and b.is_pinned() for b in buffers)
    # Reused, not reallocated, by the next save of the same state.
    ids = {id(b) for b in stager._buffers.values()}
    async_save(
        str(tmp_path / "b"), {"model": model, "optimizer": opt}, SaveOptions(), stager
    ).wait()
    assert {id(b) for b in stager._buffers.values()} == ids


def test_gpu_memory_does_not_grow_during_an_async_save(tmp_path: Path) -> None:
    model, opt = _trained("cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    shardsafe.async_save(tmp_path / "ckpt", {"model": model, "optimizer": opt}).wait()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= 1 << 20
    assert torch.cuda.memory_allocated() == before


def test_the_snapshot_is_right_while_the_next_step_runs_on_the_default_stream(
    tmp_path: Path,
) -> None:
    """With ``overlap`` the copies run on a side stream while the next forward and backward
    run; the optimizer step waits for them (``wait_staged``), as the Trainer does."""
    from shardsafe.checkpoint.background import async_save
    from shardsafe.checkpoint.options import SaveOptions

    model, opt = _trained("cuda")
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    handle = async_save(str(tmp_path / "ckpt"), {"model": model}, SaveOptions(), overlap=True)
    model(torch.randn(4096, 64, device="cuda")).pow(2).mean().backward()  # overlaps the copies
    handle.wait_staged()
    opt.step()  # changes the parameters: only after the copies landed
    handle.wait()
    fresh, _ = _trained("cuda", seed=1)
    shardsafe.load(tmp_path / "ckpt", {"model": fresh})
    assert all(torch.equal(fresh.state_dict()[k].cpu(), v) for k, v in expected.items())


# ------------------------------------------------------------------ tiered manager


def _tiers(tmp_path: Path, **options: object) -> shardsafe.TieredCheckpointManager:
    kwargs: dict[str, Any] = {"local_every": 1, "persist_every": None, "replicas": 0, **options}
    return shardsafe.TieredCheckpointManager(tmp_path / "persistent", tmp_path / "local", **kwargs)


def _cuda_state(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model, opt = _trained("cuda", seed)
    return model, opt, {"model": model, "optimizer": opt}


def _live_pointers(model: nn.Module, opt: torch.optim.Optimizer) -> list[int]:
    found = [p.data_ptr() for p in model.parameters()]
    return found + [s[k].data_ptr() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and moment, copied to the host, in a fixed order."""
    found = [p.detach().cpu().clone() for p in model.parameters()]
    moments = [opt.state[p][k] for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
    return found + [m.detach().cpu().clone() for m in moments]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_tiered_local_step_of_cuda_state_restores_in_place_with_no_gpu_memory(
    tmp_path: Path,
) -> None:
    model, opt, state = _cuda_state(0)
    manager = _tiers(tmp_path)
    manager.save(4, state)
    manager.close()
    fresh, fresh_opt, fresh_state = _cuda_state(1)
    live = _live_pointers(fresh, fresh_opt)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    restarted = _tiers(tmp_path)
    restarted.load_latest(fresh_state)
    torch.cuda.synchronize()
    assert restarted.restored is not None and restarted.restored.tiers == ["local"]
    restarted.close()
    assert torch.cuda.max_memory_allocated() - before <= 1 << 20
    assert torch.cuda.memory_allocated() == before
    assert _live_pointers(fresh, fresh_opt) == live, "the live tensors must be filled"
    assert all(p.is_cuda for p in fresh.parameters())
    assert _equal(_snapshot(model, opt), _snapshot(fresh, fresh_opt))


def test_a_tiered_async_save_stages_to_pinned_host_memory_not_aliasing_the_gpu(
    tmp_path: Path,
) -> None:
    model, opt, state = _cuda_state(0)
    expected = _snapshot(model, opt)  # what the snapshot must hold
    manager = _tiers(tmp_path)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert manager.async_save(1, state) == ["local"]
    with torch.no_grad():  # training goes on while the step is written
        for p in model.parameters():
            p.add_(1.0)
        for s in opt.state.values():
            s["exp_avg"].mul_(-1.0)
    manager.wait()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= 1 << 20
    buffers = _staged_from_the_gpu(manager._stager)
    assert len(buffers) == 4 + 8  # 2 weights and 2 biases, 2 moments of each
    assert all(b.device.type == "cpu" and b.is_pinned() for b in buffers)
    manager.close()
    fresh, fresh_opt, fresh_state = _cuda_state(1)
    restarted = _tiers(tmp_path)
    restarted.load_latest(fresh_state)
    restarted.close()
    assert _equal(expected, _snapshot(fresh, fresh_opt))


def test_a_persistent_step_saved_on_cpu_restores_onto_the_gpu_through_the_tiers(
    tmp_path: Path,
) -> None:
    model, opt = _trained("cpu")
    manager = _tiers(tmp_path, persist_every=1)
    manager.save(2, {"model": model, "optimizer": opt})
    manager.close()
    shutil.rmtree(tmp_path / "local")  # the node was replaced: only the persistent tier
    fresh, fresh_opt, fresh_state = _cuda_state(1)
    restarted = _tiers(tmp_path)
    restarted.load_latest(fresh_state)
    assert restarted.restored is not None and restarted.restored.tiers == ["persistent"]
    restarted.close()
    assert all(p.is_cuda for p in fresh.parameters())
    assert all(s["exp_avg"].is_cuda for s in fresh_opt.state.values())
    assert _equal(_snapshot(model, opt), _snapshot(fresh, fresh_opt))


def test_threaded_load_fills_cuda_targets_on_the_callers_thread_and_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With read_threads=2, CPU targets go to a helper thread and every CUDA target is read
    by the calling thread, its copies queued on the caller's current stream (torch's
    current stream is per thread): queued after the caller's slow kernel on a side stream,
    and all run by the time the load returns."""
    import threading

    from shardsafe.checkpoint.io.reader import CheckpointReader

    gpu, _ = _trained("cuda")
    cpu, _ = _trained("cpu", seed=2)
    shardsafe.save(tmp_path / "ckpt", {"gpu": gpu, "cpu": cpu})
    fresh_gpu, _ = _trained("cuda", seed=1)
    fresh_cpu, _ = _trained("cpu", seed=3)
    threads_of: dict[str, set[str]] = {"cuda": set(), "cpu": set()}
    original = CheckpointReader.read_into

    def spy(
        self: CheckpointReader, key: str, offsets: Any, shape: Any, out: torch.Tensor, **kw: Any
    ) -> None:
        threads_of[out.device.type].add(threading.current_thread().name)
        original(self, key, offsets, shape, out, **kw)

    monkeypatch.setattr(CheckpointReader, "read_into", spy)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # type: ignore[attr-defined]  # ~0.1 s queued
        for p in fresh_gpu.parameters():
            p.data.fill_(7.0)
        shardsafe.load(tmp_path / "ckpt", {"gpu": fresh_gpu, "cpu": fresh_cpu}, read_threads=2)
        assert side.query(), "the load returned before its copies ran"
    assert _same(gpu, fresh_gpu) and _same(cpu, fresh_cpu)
    assert threads_of["cuda"] == {"MainThread"}
    assert any(name.startswith("shardsafe-read") for name in threads_of["cpu"])


_FEATURES = 1 << 20


class _Normalized(shardsafe.TrainingModule):
    """BatchNorm, whose forward updates its running statistics in place, behind 256 MiB of
    parameters that an async save stages first: the buffers' copy to host is queued late,
    while the next step's forward is already updating them."""

    def __init__(self) -> None:
        super().__init__()
        self.ballast = nn.Parameter(torch.zeros(1 << 26))
        self.norm = nn.BatchNorm1d(_FEATURES)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        # The statistics as this step begins: what the previous step's checkpoint holds.
        self.seen.append(self.norm.running_mean.detach().clone())
        return self.norm(x.repeat(1, _FEATURES // x.shape[1])).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_async_trainer_checkpoint_holds_its_own_steps_buffers(tmp_path: Path) -> None:
    """``Trainer(async_save=True)`` overlaps the copies to host with the next step; a
    forward that updates buffers in place must wait for them (``Saving.before_forward``),
    or a checkpoint holds one step's parameters beside the next step's statistics."""
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.randn(64, 16, generator=torch.Generator().manual_seed(0)))
    module = _Normalized()
    trainer = shardsafe.Trainer(
        max_steps=6, run_dir=tmp_path, checkpoint_every=1, async_save=True, batch_size=8
    )
    trainer.fit(module, data)
    for step in range(1, 6):
        saved = _Normalized()
        shardsafe.load(tmp_path / f"checkpoints/step-{step:09d}", {"model": saved}, strict=False)
        assert torch.equal(saved.norm.running_mean, module.seen[step].cpu()), step


def test_cuda_generator_states_of_more_devices_than_seen_restore_those_seen() -> None:
    """Saved by a process that saw more GPUs than this one: ``set_rng_state_all`` raised
    an ``IndexError`` for the first device missing, after the rest was restored."""
    import warnings

    from shardsafe.adapters import rng

    torch.cuda.init()
    saved = rng.capture()
    count = torch.cuda.device_count()
    saved["cuda"] = [*saved["cuda"], saved["cuda"][0].clone()]  # one device more
    rng.check_state(saved)
    torch.cuda.manual_seed_all(12345)  # moved on since
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        rng.restore_state(saved)
    assert [str(w.message) for w in said] == [
        f"shardsafe: the checkpoint holds the CUDA generator states of {count + 1} devices, "
        f"but this process sees {count}: restored those of the first {count}"
    ]
    assert torch.equal(torch.cuda.get_rng_state(0), saved["cuda"][0])


def test_a_cuda_generator_state_of_another_size_is_refused_before_anything_is_restored() -> None:
    from shardsafe.adapters import rng

    torch.cuda.init()
    saved = rng.capture()
    size = torch.cuda.get_rng_state().numel()
    saved["cuda"] = [torch.zeros(size + 1, dtype=torch.uint8)]
    with pytest.raises(ValueError) as refused:
        rng.check_state(saved)
    assert str(refused.value) == f"the CUDA generator states are not {size} bytes each"
