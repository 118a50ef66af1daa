"""What one GPU can show: CUDA state saved and loaded, staged to host without aliasing live
tensors, no GPU memory growth during a save or a load (read into the live tensors through
one pinned host buffer), and a CPU-saved checkpoint loaded onto the GPU.

Skipped without CUDA (see conftest.py); run them with ``pytest -m cuda`` on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

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


def test_cuda_targets_are_filled_through_one_reused_pinned_buffer(tmp_path: Path) -> None:
    from shardsafe.checkpoint.io.reader import CheckpointReader
    from shardsafe.checkpoint.loading import read_manifest_from
    from shardsafe.checkpoint.storage.local import LocalStorage

    model, _ = _trained("cuda")
    shardsafe.save(tmp_path / "ckpt", {"model": model})
    with LocalStorage(str(tmp_path / "ckpt")) as storage:
        manifest = read_manifest_from(storage)
        with CheckpointReader(storage, manifest, piece_bytes=4096) as reader:
            out = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
            seen = set()
            for name, target in out.items():
                reader.read_into(f"model/{name}", None, None, target)
                assert reader._pinned is not None and reader._pinned.is_pinned()
                assert reader._pinned.numel() <= 4096  # one piece, never a whole tensor
                seen.add(id(reader._pinned))
    assert len(seen) == 1
    assert all(torch.equal(out[k], v) for k, v in model.state_dict().items())


# --------------------------------------------------------------------- async save


def test_async_save_stages_into_pinned_host_memory(tmp_path: Path) -> None:
    from shardsafe.checkpoint.background import async_save
    from shardsafe.checkpoint.io.staging import Stager
    from shardsafe.checkpoint.options import SaveOptions

    model, opt = _trained("cuda")
    stager = Stager()
    async_save(
        str(tmp_path / "a"), {"model": model, "optimizer": opt}, SaveOptions(), stager
    ).wait()
    buffers = list(stager._buffers.values())
    assert buffers and all(b.device.type == "cpu" and b.is_pinned() for b in buffers)
    # Reused, not reallocated, by the next save of the same state.
    ids = {id(b) for b in buffers}
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
