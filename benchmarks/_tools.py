"""The tools being compared, as rows: how each one saves (and loads) a state in one rank.

A benchmark module builds its state lazily in a ``Case`` and turns tool names into
``Tool`` objects; ``run_tools`` measures them in the calling ranks and ``run_fresh``
gives each group of tools its own fresh processes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardsafe
from _common import Measurement, clean, disk_bytes, fsync_write, launch, measure

Results = dict[str, dict[str, Measurement]]  # tool -> "save"/"load" -> measurement


@dataclass
class Tool:
    """``save`` is timed ``repeat`` times, ``cleanup`` runs on rank 0 after each; for loads,
    ``prepare_load`` (untimed, every rank) writes what ``load`` reads, and ``finish`` (rank 0)
    removes it afterwards."""

    save: Callable[[], Any]
    cleanup: Callable[[], Any] | None = None
    load: Callable[[], Any] | None = None
    prepare_load: Callable[[], Any] | None = None
    finish: Callable[[], Any] | None = None
    path: str | None = None  # what a save writes, to report its size
    variants: Mapping[str, Callable[[], Any]] | None = None
    """Other ways to load the same files, measured as ``load <name>`` after ``load``."""


def run_tool(tool: Tool, repeat: int, loads: bool) -> dict[str, Measurement]:
    sizes: list[int] = []

    def cleanup() -> None:  # rank 0, after each save: note the size of the first
        if tool.path is not None and not sizes:
            sizes.append(disk_bytes(tool.path))
        if tool.cleanup is not None:
            tool.cleanup()

    out = {"save": measure(tool.save, repeat, cleanup)}
    out["save"].file_bytes = sizes[0] if sizes else 0
    if loads and tool.load is not None:
        if tool.prepare_load is not None:
            tool.prepare_load()
        dist.barrier()
        # Loads run after saves in the same processes: measured from a trimmed heap, so
        # memory the saves freed cannot hide what a load allocates.
        out["load"] = measure(tool.load, repeat, trim=True)
        for name, variant in (tool.variants or {}).items():
            out[f"load {name}"] = measure(variant, repeat, trim=True)
        if tool.finish is not None and dist.get_rank() == 0:
            tool.finish()
        dist.barrier()
    return out


def run_tools(
    names: Sequence[str], make: Callable[[str], Tool], repeat: int, loads: bool
) -> Results:
    """Build and measure each named tool in turn, in the calling ranks."""
    return {name: run_tool(make(name), repeat, loads) for name in names}


def run_fresh(
    bench: Callable[..., dict[str, Any]],
    world: int,
    groups: Sequence[Sequence[str]],
    *args: Any,
) -> tuple[Results, dict[str, Any]]:
    """Launch ``bench(rank, world, tools, *args)`` once per group of tools; merge the results
    and the ``info`` (state sizes) the launches report."""
    results: Results = {}
    info: dict[str, Any] = {}
    for group in groups:
        out = launch(bench, world, tuple(group), *args)[0]
        results.update(out["results"])
        info.update(out["info"])
    return results, info


def scratch_path(root: str, name: str) -> str:
    """``root/name``, with anything an earlier, interrupted run left there removed."""
    path = f"{root}/{name}"
    if dist.get_rank() == 0:
        clean(path)
    dist.barrier()
    return path


def state_nbytes(*state_dicts: Mapping[str, Any]) -> int:
    """Bytes of every tensor in (nested) state dicts, DTensors counted in full."""
    total = 0
    for sd in state_dicts:
        for value in sd.values():
            if isinstance(value, Mapping):
                total += state_nbytes(value)
            elif isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def write_floor(total_bytes: int, rank: int, root: str) -> Tool:
    """One buffered write of ``total_bytes`` from rank 0, then fsync."""
    payload = torch.ones(total_bytes, dtype=torch.uint8) if rank == 0 else None
    path = scratch_path(root, "floor.bin")

    def save() -> None:
        if payload is not None:
            fsync_write(path, memoryview(payload.numpy()))

    return Tool(save, lambda: clean(path), path=path)


def shardsafe_tool(
    layout: str,
    state: Mapping[str, Any],
    fresh: Callable[[], Mapping[str, Any]],
    root: str,
    verify_variants: Sequence[str] = (),
) -> Tool:
    """``shardsafe.save(path, state, layout=...)``; loads into a freshly built state (with
    the default ``verify``, then once per mode in ``verify_variants``)."""
    path = scratch_path(root, f"shardsafe-{layout}")
    target: dict[str, Mapping[str, Any]] = {}

    def prepare() -> None:
        shardsafe.save(path, state, layout=layout)
        target["state"] = fresh()

    return Tool(
        save=lambda: shardsafe.save(path, state, layout=layout),
        cleanup=lambda: clean(path),
        load=lambda: shardsafe.load(path, target["state"]),
        prepare_load=prepare,
        finish=lambda: clean(path),
        path=path,
        variants={mode: _load_with(path, target, mode) for mode in verify_variants} or None,
    )


def _load_with(path: str, target: Mapping[str, Any], verify: str) -> Callable[[], Any]:
    """``shardsafe.load(path, target["state"], verify=verify)``, once ``target`` is ready."""
    return lambda: shardsafe.load(path, target["state"], verify=verify)


def dcp_tool(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    fresh: Callable[[], tuple[nn.Module, torch.optim.Optimizer]],
    root: str,
) -> Tool:
    """The documented DCP path: get_state_dict -> dcp.save; get_state_dict -> dcp.load ->
    set_state_dict, into a freshly built model and optimizer that has taken a step (DCP
    loads into existing optimizer state)."""
    path = scratch_path(root, "dcp")
    target: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}

    def save() -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    def prepare() -> None:
        save()
        target["pair"] = fresh()

    def load() -> None:
        model2, opt2 = target["pair"]
        msd, osd = get_state_dict(model2, opt2)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    return Tool(save, lambda: clean(path), load, prepare, lambda: clean(path), path)
