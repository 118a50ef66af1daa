"""Loading in bounded memory (issue 17): a load reads straight into the live tensors, so a
rank's peak extra memory is about one buffer, whatever its state, in both verify modes,
for DDP, ZeRO, OSS and FSDP2, sharded and consolidated; the state it restores is
bitwise the saved one; and a corrupt byte leaves the live objects in the state the
README's Guarantees table documents for each mode.

Memory is the process's RSS sampled every millisecond during ``load``, above its value
just before (after ``malloc_trim``), in fresh processes (the save runs in others), so
no freed heap hides an allocation. The state is sized so that the old behaviour (a full
copy of the rank's state held while verifying: 49 to 96 MiB here) exceeds the bound.
"""

from __future__ import annotations

import ctypes
import gc
import json
import re
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import shardsafe
from shardsafe.errors import CheckpointCorruptError
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)

WIDTH, LAYERS = 1024, 8
"""4 MiB weights: per rank 32 MiB of parameters and 64 MiB of Adam state under DDP."""
LARGEST = WIDTH * WIDTH * 4
BUFFER = 4 << 20
SLACK = 16 << 20
"""Python objects, the manifest, the sampler thread: what a load needs besides buffers."""
FAMILIES = ["ddp", "zero", "oss", "fsdp"]
LAYOUTS = ["sharded", "consolidated"]
MODES = ["first", "inline"]


def build(family: str, seed: int, width: int = WIDTH, layers: int = LAYERS) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    if family == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = DDP(model)
    if family == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: Any = ZeroRedundancyOptimizer(
            wrapped.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3
        )
    elif family == "oss":
        from fairscale.optim import OSS

        opt = OSS(wrapped.parameters(), optim=torch.optim.Adam, lr=1e-3)
    else:
        opt = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
    return wrapped, opt


def train(wrapped: Any, opt: Any, steps: int, width: int = WIDTH) -> None:
    for i in range(steps):
        wrapped(torch.full((2, width), 0.01 * (i + 1))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return (to_local() if callable(to_local) else t).detach().clone()


def snapshot(wrapped: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Every live tensor this rank holds, by a stable name (local shards for DTensors)."""
    module = wrapped.module if isinstance(wrapped, DDP) else wrapped
    names = {id(p): n for n, p in module.named_parameters()}
    out = {f"model/{k}": _local(v) for k, v in module.state_dict().items()}
    local = getattr(opt, "optim", opt)
    for p, state in local.state.items():
        for name, value in state.items():
            out[f"optimizer/{names[id(p)]}/{name}"] = _local(value)
    return out


def save_run(rank: int, world: int, family: str, path: str, layout: str, steps: int) -> Any:
    wrapped, opt = build(family, 0)
    train(wrapped, opt, steps)
    shardsafe.save(path, {"model": wrapped, "optimizer": opt}, layout=layout)
    return snapshot(wrapped, opt)


class PeakRSS:
    """This process's resident memory, sampled every millisecond in a thread."""

    def __init__(self) -> None:
        self.page = 4096
        self.peak = self.base = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def __enter__(self) -> PeakRSS:
        gc.collect()
        # Hand freed heap back to the system first (FSDP frees its all-gather buffers
        # after each step): a load reusing it would otherwise not show in RSS.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.base = self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def load_run(rank: int, world: int, family: str, path: str) -> Any:
    """Load in each mode into its own freshly built, stepped target; extra RSS of each."""
    targets = {mode: build(family, 1) for mode in MODES}
    for wrapped, opt in targets.values():
        train(wrapped, opt, 1)  # existing optimizer state, as a resumed run has
    extra, got = {}, {}
    for mode, (wrapped, opt) in targets.items():
        torch.distributed.barrier()
        with PeakRSS() as rss:
            shardsafe.load(
                path, {"model": wrapped, "optimizer": opt}, verify=mode, buffer_bytes=BUFFER
            )
        extra[mode] = rss.extra
        got[mode] = snapshot(wrapped, opt)
    return extra, got


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_load_holds_one_buffer_and_restores_bitwise(
    tmp_path: Path, family: str, layout: str
) -> None:
    if family == "oss":
        pytest.importorskip("fairscale")
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_run, 2, family, path, layout, 2, timeout=200)
    loaded = run_ranks(load_run, 2, family, path, timeout=200)
    bound = LARGEST + BUFFER + SLACK
    for rank, (extra, got) in enumerate(loaded):
        state_bytes = sum(t.numel() * t.element_size() for t in saved[rank].values())
        assert state_bytes >= 2 * bound, "the state must be big enough for a full copy to fail"
        for mode in MODES:
            assert extra[mode] <= bound, (rank, mode, extra[mode] >> 20, "MiB")
            assert_bitwise(got[mode], saved[rank])


# ------------------------------------------------------------------- a corrupt byte


def corrupt_middle_of_largest_tensor(path: Path) -> None:
    """Flip one byte in the middle of the largest tensor of the first data file."""
    data = sorted(path.glob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])

    header = {k: v for k, v in json.loads(raw[8 : 8 + n]).items() if k != "__metadata__"}
    begin, end = max((v["data_offsets"] for v in header.values()), key=lambda o: o[1] - o[0])
    raw[8 + n + (begin + end) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def corrupt_load_run(rank: int, world: int, path: str, mode: str) -> Any:
    wrapped, opt = build("ddp", 1, width=64, layers=4)
    train(wrapped, opt, 1, width=64)  # step 1 live, step 2 saved: every tensor differs
    before = snapshot(wrapped, opt)
    try:
        shardsafe.load(path, {"model": wrapped, "optimizer": opt}, verify=mode)
    except CheckpointCorruptError as e:
        return str(e), before, snapshot(wrapped, opt)
    raise AssertionError("a corrupt checkpoint loaded")


def small_save_run(rank: int, world: int, path: str) -> Any:
    wrapped, opt = build("ddp", 0, width=64, layers=4)
    train(wrapped, opt, 2, width=64)
    shardsafe.save(path, {"model": wrapped, "optimizer": opt})
    return snapshot(wrapped, opt)


@pytest.mark.parametrize("mode", MODES)
def test_a_corrupt_byte_leaves_the_documented_state(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "ckpt"
    saved = run_ranks(small_save_run, 2, str(path))[0]
    corrupt_middle_of_largest_tensor(path)
    for message, before, after in run_ranks(corrupt_load_run, 2, str(path), mode):
        match = re.search(r"checksum mismatch in \S+, tensor '([^']+)'", message)
        assert match, message
        bad = match.group(1)
        new = {k for k in after if torch.equal(after[k], saved[k])}
        old = {k for k in after if torch.equal(after[k], before[k])}
        mixed = set(after) - new - old
        assert not new & old, "every tensor must differ between the live and saved state"
        if mode == "first":
            assert "while restoring" not in message, message
            assert old == set(after), "verify='first' restores nothing from a corrupt file"
            continue
        found = re.search(r"On rank \d, (\d+) of the (\d+) tensors loaded in place", message)
        assert found, message
        assert f"{bad!r} is partly overwritten" in message
        assert "no object's restore step had run" in message
        assert mixed == {bad}, (mixed, bad)  # its bytes came from the corrupt file
        assert len(new) == int(found.group(1)), (sorted(new), message)
        assert len(new) + len(old) + 1 == int(found.group(2)) == len(after)
