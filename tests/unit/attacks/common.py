"""What the attack modules share: constants, the swapping thread, the FIFO probe, the
record of open flags (an audit hook), ``run_cli`` and the checks of a refused load."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import shardsafe
from shardsafe import CheckpointCorruptError, CheckpointError, cli
from tests import forge
from tests.opens import outside, recorded_opens

LAYOUTS = ("sharded", "consolidated")
SHARD = "shard-00000-of-00001.safetensors"
X = torch.arange(4096, dtype=torch.float32)  # a plain tensor value, 16 KiB
MASK = torch.arange(10, dtype=torch.uint8)  # a uint8 tensor of the wrong size for an RNG
CFG = {"lr": 0.001, "step": 5, "name": "run"}
RACE_SECONDS = 1.2


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.001)


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model(seed)
    opt = make_optimizer(model)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {
        f"{index}/{name}": v.detach().clone()
        for index, state in opt.state_dict()["state"].items()
        for name, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        got = actual[key]
        assert (got.dtype, tuple(got.shape)) == (value.dtype, tuple(value.shape)), key
        assert bits(got) == bits(value), key


def global_rng() -> tuple[bytes, Any, bytes]:
    algorithm, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    numpy_state = (algorithm, keys.tobytes(), pos, has_gauss, cached)
    return bits(torch.get_rng_state()), random.getstate(), repr(numpy_state).encode()


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(args))
    return rc, out.getvalue(), err.getvalue()


def assert_clean_failure(rc: int, out: str, err: str) -> None:
    """What `inspect`/`verify` print when they refuse a checkpoint: one error line."""
    assert rc == 1, (rc, out, err)
    assert err.startswith("shardsafe: error: "), err
    assert "unexpectedly" not in err, err  # the line for a bug in shardsafe
    assert err.count("\n") == 1, err


def strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def manifest_doc(ckpt: Path) -> dict[str, Any]:
    return forge.read_manifest(ckpt)


def header_span(path: Path) -> int:
    """Length of a data file's 8-byte prefix and JSON header."""
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + n


def listing(directory: Path) -> dict[str, Any]:
    """Every entry below ``directory`` (links not followed): its kind and content."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, directory)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(mode):
                out[rel] = ("file", Path(path).read_bytes())
            else:
                out[rel] = ("other", stat.S_IFMT(mode))
    return out


def private_copy(path: str) -> bool:
    """A path inside verify's private temporary directory (the safetensors cross-check)."""
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(tempfile.gettempdir()))
    return rel.split(os.sep)[0].startswith("shardsafe-verify-")


def outside_but_private(opened: list[str], directory: Path) -> list[str]:
    return [p for p in outside(opened, directory) if not private_copy(p)]


# Opens with their flags: the "open" audit event carries (path, mode, flags).
_FLAG_RECORDS: list[list[tuple[str, int]]] = []


def _flags_hook(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _FLAG_RECORDS and isinstance(args[0], (str, bytes)):
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else -1
        for record in _FLAG_RECORDS:
            record.append((os.fsdecode(args[0]), flags))


sys.addaudithook(_flags_hook)


@contextlib.contextmanager
def opens_with_flags() -> Iterator[list[tuple[str, int]]]:
    record: list[tuple[str, int]] = []
    _FLAG_RECORDS.append(record)
    try:
        yield record
    finally:
        _FLAG_RECORDS.remove(record)


@contextlib.contextmanager
def fast_switching() -> Iterator[None]:
    """Let threads interleave every 50 us, so that races happen often."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class Swapper:
    """A thread that keeps replacing ``target`` by what each maker puts at a staging name,
    in turn, with ``os.replace`` (atomic: the name always exists). Makers link or
    symlink; nothing is opened. On exit the first maker's object is put back."""

    def __init__(self, target: Path, stage: Path, makers: list[Callable[[Path], None]]) -> None:
        self.target, self.stage, self.makers = target, stage, makers
        self.swaps = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _put(self, maker: Callable[[Path], None]) -> None:
        tmp = self.stage / f"swap-{self.swaps}"
        maker(tmp)
        os.replace(tmp, self.target)
        self.swaps += 1

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for maker in self.makers:
                    self._put(maker)
                    time.sleep(0)
        except BaseException as e:  # reported by __exit__
            self.error = e

    def __enter__(self) -> Swapper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()
        self._put(self.makers[0])
        if self.error is not None:
            raise self.error


def linker(master: Path) -> Callable[[Path], None]:
    return lambda tmp: os.link(master, tmp)


def symlinker(target: Path | str) -> Callable[[Path], None]:
    return lambda tmp: os.symlink(target, tmp)


def staged_fifo(stage: Path) -> Path:
    """One FIFO that every swap links into place: a probe on this name sees (and, by
    opening it for writing, unblocks) anyone who opens any of its placements for reading,
    so a regression fails the test instead of hanging it."""
    fifo = stage / "the.fifo"
    os.mkfifo(fifo)
    return fifo


PROBE_SCRIPT = textwrap.dedent(
    """
    import errno, os, signal, sys, time
    fifo, attempts, seen, stop = sys.argv[1], 0, 0, []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("ready", flush=True)
    while not stop:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:
                print("error", e, flush=True)
                sys.exit(2)
        else:
            seen += 1
            os.close(fd)
        attempts += 1
        time.sleep(0.0005)
    print(attempts, seen, flush=True)
    """
)


@contextlib.contextmanager
def fifo_reader_probe(fifo: Path) -> Iterator[dict[str, int]]:
    """Count how often anyone has ``fifo`` open for reading: a non-blocking open for
    writing succeeds only then (ENXIO otherwise). The probe is another process, so it
    also unblocks a reader stuck in ``open`` while holding this process's GIL: a
    regression fails the test instead of hanging it. Counts are filled in on exit."""
    counts = {"attempts": 0, "readers_seen": 0}
    probe = subprocess.Popen(
        [sys.executable, "-I", "-c", PROBE_SCRIPT, str(fifo)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert probe.stdout is not None and probe.stdout.readline() == "ready\n"
        yield counts
    finally:
        probe.terminate()
        out, _ = probe.communicate(timeout=10)
    assert probe.returncode == 0, out
    counts["attempts"], counts["readers_seen"] = map(int, out.split())


def flip_bit(path: Path, pos: int, bit: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 1 << bit
    path.write_bytes(bytes(raw))


def fresh() -> dict[str, Any]:
    model = make_model(1)
    return {"model": model, "optimizer": make_optimizer(model)}


def data_file(ckpt: Path, layout: str = "sharded", which: str = "model") -> Path:
    return ckpt / (SHARD if layout == "sharded" else f"{which}.safetensors")


def load_refused(ckpt: Path, state: dict[str, Any] | None = None) -> CheckpointCorruptError:
    """A CheckpointCorruptError (exactly), nothing restored, nothing outside opened."""
    state = state if state is not None else fresh()
    model_before = weights(state["model"]) if "model" in state else {}
    opt_before = optimizer_tensors(state["optimizer"]) if "optimizer" in state else {}
    rng_before = global_rng()
    with recorded_opens() as opened, pytest.raises(CheckpointError) as info:
        shardsafe.load(ckpt, state)
    assert type(info.value) is CheckpointCorruptError, f"{type(info.value).__name__}: {info.value}"
    assert outside(opened, ckpt) == []
    if "model" in state:
        assert_bitwise(weights(state["model"]), model_before)
    if "optimizer" in state:
        assert_bitwise(optimizer_tensors(state["optimizer"]), opt_before)
    assert global_rng() == rng_before
    return info.value


def _small_state(seed: int) -> dict[str, Any]:
    return {"model": make_model(seed), "step": seed}
