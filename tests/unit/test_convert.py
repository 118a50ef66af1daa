"""Converters in one process: every format in and out, hostile DCP metadata, --only,
--dtype, --dry-run, refusals, the command line, and an object-store source and
destination (moto on loopback)."""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe import cli
from shardsafe.converters.dcp_metadata import parse_metadata
from shardsafe.converters.hf import parse_size
from shardsafe.errors import CheckpointCorruptError, CheckpointError
from tests.s3server import S3Server

pytestmark = pytest.mark.timeout(120)


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    for _ in range(2):
        model(torch.randn(5, 6)).sum().backward()
        opt.step()
    return model, opt


def dcp_checkpoint(path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = trained()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
        dcp.save({"model": msd, "optimizer": osd, "step": 2}, checkpoint_id=str(path))
    return model, opt


def assert_same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, state in sa["state"].items():
        for name, value in state.items():
            assert torch.equal(value, sb["state"][i][name]), (i, name)


# -- DCP


def test_dcp_to_shardsafe_loads_and_verifies(tmp_path: Path) -> None:
    model, opt = dcp_checkpoint(tmp_path / "dcp")
    result = shardsafe.convert(tmp_path / "dcp", tmp_path / "out", progress=False)
    assert result.source_format == "dcp" and result.dry_run is False
    assert cli.main(["verify", str(tmp_path / "out")]) == 0
    fresh, fresh_opt = trained(seed=1)
    plain = shardsafe.load(tmp_path / "out", {"model": fresh, "optimizer": fresh_opt})
    assert plain == {"step": 2}
    assert_same(fresh, model)
    assert_same_optimizer(fresh_opt, opt)


def test_a_dcp_dict_of_scalar_tensors_comes_back_as_a_value(tmp_path: Path) -> None:
    """Older torchtitan saved ``train_state={"step": tensor}``: plain data, not a module."""
    import torch.distributed.checkpoint as dcp

    model, _ = trained()
    step, tokens = torch.tensor(5), torch.tensor(123456)
    state = {"model": model.state_dict(), "train_state": {"step": step, "tokens": tokens}}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    shardsafe.convert(tmp_path / "dcp", tmp_path / "out", progress=False)
    manifest = shardsafe.read_manifest(tmp_path / "out")
    assert [manifest.values[n].kind for n in ("model", "train_state")] == ["module", "value"]
    fresh, _ = trained(seed=1)
    plain = shardsafe.load(tmp_path / "out", {"model": fresh})
    assert list(plain) == ["train_state"]
    assert plain["train_state"] == {"step": step, "tokens": tokens}
    assert_same(fresh, model)


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_hostile_dcp_metadata_is_refused_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dcp_checkpoint(tmp_path / "dcp")
    marker = tmp_path / "pwned"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(CheckpointCorruptError, match=r"system, which is not part of DCP"):
        shardsafe.convert(tmp_path / "dcp", tmp_path / "out", progress=False)
    assert cli.main(["convert", str(tmp_path / "dcp"), str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardsafe: error: ") and "Traceback" not in err
    assert not marker.exists()
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


@pytest.mark.parametrize(
    "payload",
    [
        b"cbuiltins\neval\n(S'1'\ntR.",  # protocol 0 GLOBAL
        pickle.dumps(print),  # any function
        pickle.dumps({"a": io.BytesIO}),  # a class outside the allowlist
        b"\x80\x04not a pickle",
    ],
)
def test_dcp_metadata_outside_the_allowlist_or_damaged_is_corrupt(payload: bytes) -> None:
    with pytest.raises(CheckpointCorruptError):
        parse_metadata(payload, "x/.metadata")


def test_dcp_metadata_of_allowed_classes_but_wrong_types_is_corrupt(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    with pytest.raises(CheckpointCorruptError, match="state_dict_metadata"):
        parse_metadata(pickle.dumps(Metadata(state_dict_metadata=[])), "m")  # type: ignore[arg-type]
    with pytest.raises(CheckpointCorruptError, match="not a Metadata"):
        parse_metadata(pickle.dumps(torch.Size([1])), "m")


def test_only_model_keeps_the_model_alone(tmp_path: Path) -> None:
    model, _ = dcp_checkpoint(tmp_path / "dcp")
    shardsafe.convert(tmp_path / "dcp", tmp_path / "out", only=["model"], progress=False)
    manifest = shardsafe.read_manifest(tmp_path / "out")
    assert list(manifest.values) == ["model"]
    assert all(k.startswith("model/") for k in manifest.tensors)
    fresh, _ = trained(seed=3)
    shardsafe.load(tmp_path / "out", {"model": fresh})
    assert_same(fresh, model)
    with pytest.raises(CheckpointError, match="no such entry"):
        shardsafe.convert(tmp_path / "dcp", tmp_path / "o2", only=["nope"], progress=False)


# -- torch.save and Lightning


def test_lightning_ckpt_to_shardsafe_and_shardsafe_to_torch_file(tmp_path: Path) -> None:
    model, opt = trained()
    ckpt = {
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "epoch": 3,
        "global_step": 12,
        "pytorch-lightning_version": "2.2.0",
    }
    torch.save(ckpt, tmp_path / "last.ckpt")
    shardsafe.convert(tmp_path / "last.ckpt", tmp_path / "out", progress=False)
    fresh, _ = trained(seed=4)
    plain = shardsafe.load(tmp_path / "out", {"model": fresh})
    assert_same(fresh, model)
    assert plain["epoch"] == 3 and plain["global_step"] == 12
    saved_opt = plain["optimizer_states"][0]  # index-keyed state: kept as plain data
    assert saved_opt["param_groups"] == opt.state_dict()["param_groups"]
    assert torch.equal(saved_opt["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    with pytest.warns(UserWarning, match="pickle"):
        result = shardsafe.convert(tmp_path / "out", tmp_path / "back.pt", to="torch")
    assert result.notes and "weights_only=True" in result.notes[0]
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert (
        back["epoch"] == 3
        and back["optimizer_states"][0]["param_groups"] == (opt.state_dict()["param_groups"])
    )
    # A Lightning checkpoint goes back to Lightning's layout: state_dict, not model.
    assert sorted(back) == sorted(ckpt)
    for k, v in model.state_dict().items():
        assert torch.equal(back["state_dict"][k], v), k
    mapped = torch.load(tmp_path / "back.pt", weights_only=True, mmap=True)
    assert torch.equal(mapped["state_dict"]["0.weight"], model.state_dict()["0.weight"])


def test_shardsafe_to_torch_file_has_fqn_keyed_optimizer_state(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = trained()
    shardsafe.save(
        tmp_path / "ss", {"model": model, "optimizer": opt, "half": torch.ones(3).half()}
    )
    with pytest.warns(UserWarning):
        shardsafe.convert(tmp_path / "ss", tmp_path / "x.pt", to="torch", progress=False)
    raw = torch.load(tmp_path / "x.pt", weights_only=True)
    assert raw["half"].dtype == torch.float16
    assert set(raw["optimizer"]["state"]) == {n for n, _ in model.named_parameters()}
    fresh, fresh_opt = trained(seed=5)
    set_state_dict(
        fresh, fresh_opt, model_state_dict=raw["model"], optim_state_dict=raw["optimizer"]
    )
    assert_same(fresh, model)
    assert_same_optimizer(fresh_opt, opt)


def test_a_torch_file_with_custom_objects_is_refused_without_running_them(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"x": _Payload(str(marker))}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        shardsafe.convert(tmp_path / "bad.pt", tmp_path / "out", progress=False)
    assert not marker.exists()


# -- Hugging Face


def test_hf_single_file_in_and_out_with_prefixes(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model, _ = trained()
    save_file({f"model.{k}": v for k, v in model.state_dict().items()}, tmp_path / "w.safetensors")
    shardsafe.convert(tmp_path / "w.safetensors", tmp_path / "ss", progress=False)
    names = shardsafe.read_manifest(tmp_path / "ss").values["model"].meta["tensors"]
    assert all(n.startswith("model.") for n in names)
    shardsafe.convert(
        tmp_path / "ss", tmp_path / "hf", to="hf", strip_prefix="model.", add_prefix="net.",
        progress=False,
    )  # fmt: skip
    back = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(back) == sorted(f"net.{k}" for k in model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(back[f"net.{k}"], v)


def test_hf_index_directory_is_a_source_and_a_big_tensor_gets_its_own_shard(
    tmp_path: Path,
) -> None:
    state = {"a": torch.zeros(10), "big": torch.arange(100.0), "c": torch.ones(5)}
    shardsafe.save(tmp_path / "ss", {"model": state})  # a plain value, not a module
    with pytest.raises(CheckpointError, match="no model weights"):
        shardsafe.convert(tmp_path / "ss", tmp_path / "hf0", to="hf", progress=False)
    model = nn.Module()
    for k, v in state.items():
        model.register_buffer(k, v)
    shardsafe.save(tmp_path / "ss2", {"model": model})
    shardsafe.convert(
        tmp_path / "ss2", tmp_path / "hf", to="hf", max_shard_size="100B", progress=False
    )
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    big_file = index["weight_map"]["big"]
    assert [k for k, f in index["weight_map"].items() if f == big_file] == ["big"]
    shardsafe.convert(tmp_path / "hf", tmp_path / "again", progress=False)
    got = shardsafe.load(tmp_path / "again", {"model": nn.Module()}, strict=False)
    assert got == {}
    manifest = shardsafe.read_manifest(tmp_path / "again")
    assert sorted(manifest.values["model"].meta["tensors"]) == ["a", "big", "c"]


@pytest.mark.parametrize(
    ("text", "size"),
    [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("10KB", 10**4), ("1GiB", 2**30), (7, 7)],
)
def test_sizes_are_decimal_like_huggingface_hub(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["5XB", "", "-1GB", "0"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


# -- dry run, refusals, the command line


def test_dry_run_writes_nothing_and_sizes_the_data_file_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dcp_checkpoint(tmp_path / "dcp")
    dry = shardsafe.convert(tmp_path / "dcp", tmp_path / "out", dry_run=True)
    assert dry.dry_run and not (tmp_path / "out").exists()
    assert cli.main(["convert", str(tmp_path / "dcp"), str(tmp_path / "o"), "--dry-run"]) == 0
    assert "would write" in capsys.readouterr().out and not (tmp_path / "o").exists()
    real = shardsafe.convert(tmp_path / "dcp", tmp_path / "out", progress=False)
    assert dict(real.files)[dry.files[0][0]] == dry.files[0][1]


def test_destinations_are_never_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dcp_checkpoint(tmp_path / "dcp")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "model.safetensors").write_bytes(b"mine")
    for to in ("shardsafe", "dcp", "hf"):
        assert (
            cli.main(["convert", str(tmp_path / "dcp"), str(tmp_path / "taken"), "--to", to]) == 1
        )
        assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "taken" / "model.safetensors").read_bytes() == b"mine"
    (tmp_path / "f.pt").write_bytes(b"mine")
    assert (
        cli.main(["convert", str(tmp_path / "dcp"), str(tmp_path / "f.pt"), "--to", "torch"]) == 1
    )
    assert "exists" in capsys.readouterr().err and (tmp_path / "f.pt").read_bytes() == b"mine"


def test_a_name_in_a_file_cannot_forge_a_line_of_the_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A torch.save file whose storage key holds a newline: torch's reader quotes it, and
    the error printed a second line taken from the file (here, a forged success)."""
    import io
    import zipfile

    from tests import pickles as P

    made = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, made)
    with zipfile.ZipFile(io.BytesIO(made.getvalue())) as archive:
        pickled = archive.read("archive/data.pkl")
    key = "0\nshardsafe: converted OK, 0 problems"
    forged = pickled.replace(
        b"X\x01\x00\x00\x000", b"X" + len(key).to_bytes(4, "little") + key.encode()
    )
    assert forged != pickled
    source = tmp_path / "forged.pt"
    source.write_bytes(P.torch_archive(forged, storages={"0": bytes(16)}))
    assert cli.main(["convert", str(source), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "data/0\\x0ashardsafe: converted OK" in err, err


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert cli.main(["convert", str(tmp_path / "empty"), str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "no checkpoint shardsafe can convert" in err and err.count("\n") == 1
    assert cli.main(["convert", str(tmp_path / "missing"), str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err.startswith("shardsafe: error: ")
    dcp_checkpoint(tmp_path / "dcp")
    args = ["convert", str(tmp_path / "dcp"), str(tmp_path / "o"), "--to", "hf"]
    assert cli.main([*args, "--max-shard-size", "lots"]) == 2  # a usage error, as argparse's
    assert capsys.readouterr().err.endswith(
        "shardsafe convert: error: argument --max-shard-size: max shard size 'lots' is not a "
        "size such as 5GB, 500MB or 10KB\n"
    )
    huge = "9" * 400 + "GB"  # a float of it was infinity: a raw OverflowError before
    assert cli.main([*args, "--max-shard-size", huge]) == 2
    assert capsys.readouterr().err.endswith(
        f"shardsafe convert: error: argument --max-shard-size: max shard size {huge[:100]!r} "
        "is not a size such as 5GB, 500MB or 10KB\n"
    )
    assert cli.main([*args, "--max-shard-size", "9" * 30 + "GB"]) == 2
    assert capsys.readouterr().err.endswith(f"is too large: at most {2**63 - 1} bytes\n")
    assert cli.main([*args, "--untrusted-bytes-limit", huge]) == 2
    assert "is not a number of bytes or a size such as 512MiB" in capsys.readouterr().err
    assert cli.main([*args[:-1], "dcp", "--strip-prefix", "model."]) == 2
    assert capsys.readouterr().err == (
        "shardsafe convert: error: strip_prefix and add_prefix rename Hugging Face weights: "
        "they apply to to='hf', not to='dcp'\n"
    )
    assert not (tmp_path / "o").exists()


# -- object storage


def test_dcp_to_shardsafe_on_s3_and_back_to_hf(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    from safetensors.torch import load_file

    model, opt = dcp_checkpoint(tmp_path / "dcp")
    url = f"s3://{s3_bucket}/run/converted"
    shardsafe.convert(tmp_path / "dcp", url, progress=False)
    assert "run/converted/manifest.json" in s3_server.keys(s3_bucket)
    assert cli.main(["verify", url]) == 0
    fresh, fresh_opt = trained(seed=6)
    shardsafe.load(url, {"model": fresh, "optimizer": fresh_opt})
    assert_same(fresh, model)
    assert_same_optimizer(fresh_opt, opt)
    shardsafe.convert(url, tmp_path / "hf", to="hf", progress=False)
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    for k, v in model.state_dict().items():
        assert torch.equal(weights[k], v)


def test_progress_bar_counts_bytes_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tqdm")
    dcp_checkpoint(tmp_path / "dcp")
    shardsafe.convert(tmp_path / "dcp", tmp_path / "out", progress=True)
    err = capsys.readouterr().err
    assert "dcp -> shardsafe" in err and "100%" in err
    shardsafe.convert(tmp_path / "dcp", tmp_path / "quiet")  # stderr is no terminal here
    assert capsys.readouterr().err == ""


def test_dcp_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    dcp_checkpoint(tmp_path / "dcp")
    (tmp_path / "secret").write_bytes(b"x" * 4096)
    md = pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes())  # our own, trusted here
    for info in md.storage_data.values():
        info.relative_path = "../secret"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointCorruptError, match="not a plain file name"):
        shardsafe.convert(tmp_path / "dcp", tmp_path / "out", progress=False)
    for info in md.storage_data.values():
        info.relative_path, info.length = "__0_0.distcp", 10**9
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointCorruptError):
        shardsafe.convert(tmp_path / "dcp", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_dtype_casts_weights_and_keeps_optimizer_state(tmp_path: Path) -> None:
    model, _ = dcp_checkpoint(tmp_path / "dcp")
    shardsafe.convert(tmp_path / "dcp", tmp_path / "bf16", dtype="bfloat16", progress=False)
    tensors = shardsafe.read_manifest(tmp_path / "bf16").tensors
    assert tensors["model/0.weight"].dtype == torch.bfloat16
    assert tensors["model/1.num_batches_tracked"].dtype == torch.int64
    assert tensors["optimizer/0.weight/exp_avg"].dtype == torch.float32
    assert tensors["optimizer/0.weight/step"].dtype == torch.float32
    fresh = trained(seed=8)[0].to(torch.bfloat16)
    shardsafe.load(tmp_path / "bf16", {"model": fresh}, strict=False)
    for k, v in model.state_dict().items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert torch.equal(fresh.state_dict()[k], want), k


def test_a_failed_conversion_leaves_no_destination(tmp_path: Path) -> None:
    dcp_checkpoint(tmp_path / "dcp")
    md = pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes())
    for index, info in md.storage_data.items():
        if index.fqn == "model.2.bias":
            info.length = 10  # its tensor no longer reads
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(md))
    for to, dst in (("shardsafe", "a"), ("dcp", "b"), ("hf", "c"), ("torch", "d.pt")):
        with pytest.raises(CheckpointCorruptError, match=r"model\.2\.bias"):
            shardsafe.convert(tmp_path / "dcp", tmp_path / dst, to=to, progress=False)
        assert not (tmp_path / dst).exists(), to


@pytest.mark.parametrize("to", ["shardsafe", "dcp", "hf", "torch"])
def test_a_memory_mapped_torch_file_with_shared_storage_converts_exactly(
    tmp_path: Path, to: str
) -> None:
    """Pages of each tensor are dropped once it is written; a tensor sharing them (tied
    weights, a view) must still read the file's bytes, not zeros."""
    base = torch.randn(4096, 3)  # several pages
    state = {"a.weight": base, "b.weight": base, "c.weight": base[1:]}
    torch.save(state, tmp_path / "tied.pt")
    dst = tmp_path / ("out.pt" if to == "torch" else "out")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shardsafe.convert(tmp_path / "tied.pt", dst, to=to, progress=False)
    if to == "hf":
        from safetensors.torch import load_file

        got = load_file(dst / "model.safetensors")
    elif to == "torch":
        got = torch.load(dst, weights_only=True)["model"]
    else:
        back = tmp_path / "back.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shardsafe.convert(dst, back, to="torch", progress=False)
        got = torch.load(back, weights_only=True)["model"]
    for key, value in state.items():
        assert torch.equal(got[key], value), key


def test_hf_dry_run_sizes_every_file_exactly(tmp_path: Path) -> None:
    dcp_checkpoint(tmp_path / "dcp")
    args: dict[str, Any] = {"to": "hf", "max_shard_size": "200B", "progress": False}
    dry = shardsafe.convert(tmp_path / "dcp", tmp_path / "hf", dry_run=True, **args)
    assert not (tmp_path / "hf").exists()
    real = shardsafe.convert(tmp_path / "dcp", tmp_path / "hf", **args)
    assert dry.files == real.files and len(real.files) > 2
    assert all((tmp_path / "hf" / n).stat().st_size == size for n, size in real.files)


def test_a_checkpoint_root_is_refused_with_the_newest_checkpoint_named(tmp_path: Path) -> None:
    manager = shardsafe.CheckpointManager(tmp_path / "root")
    manager.save(3, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="step-000000003"):
        shardsafe.convert(tmp_path / "root", tmp_path / "out", progress=False)


def test_dcp_chunks_that_leave_holes_are_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    dcp_checkpoint(tmp_path / "dcp")
    md = pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes())
    item = md.state_dict_metadata["model.0.weight"]
    item.size = torch.Size([16, 6])  # one 8x6 chunk for a 16x6 tensor: half uninitialized
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(md))
    for to in ("shardsafe", "hf", "torch", "dcp"):
        with pytest.raises(CheckpointCorruptError, match="exactly once"):
            shardsafe.convert(tmp_path / "dcp", tmp_path / f"out-{to}", to=to, progress=False)
        assert not (tmp_path / f"out-{to}").exists()


def test_an_hf_index_that_does_not_match_its_files_is_refused(tmp_path: Path) -> None:
    model, _ = trained()
    shardsafe.save(tmp_path / "ss", {"model": model})
    shardsafe.convert(
        tmp_path / "ss", tmp_path / "hf", to="hf", max_shard_size="200B", progress=False
    )
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    name = next(k for k, f in index["weight_map"].items() if f == first)
    index["weight_map"][name] = second
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointCorruptError, match="does not match its files"):
        shardsafe.convert(index_path, tmp_path / "out", progress=False)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--strip-prefix", "model."], "apply to to='hf', not to='shardsafe'"),
        (["--add-prefix", "net.", "--to", "dcp"], "apply to to='hf', not to='dcp'"),
        (["--strip-prefix", "model.", "--to", "torch"], "apply to to='hf', not to='torch'"),
        (["--dcp-layout", "flat", "--to", "hf"], "applies to to='dcp', not to='hf'"),
        (["--dcp-layout", "flat"], "applies to to='dcp', not to='shardsafe'"),
    ],
)
def test_an_option_of_another_target_is_refused_not_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    """``--strip-prefix`` with ``--to shardsafe`` or ``--dcp-layout flat`` with ``--to hf``
    exited 0 having renamed nothing; ``--config`` was already refused so."""
    dcp_checkpoint(tmp_path / "dcp")
    assert cli.main(["convert", str(tmp_path / "dcp"), str(tmp_path / "o"), *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardsafe convert: error: ") and message in err
    assert err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_a_dry_run_refuses_every_destination_the_real_run_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The dry run said it "would write" into a taken destination that the real run then
    refused; it checked none."""
    dcp_checkpoint(tmp_path / "dcp")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "model.safetensors").write_bytes(b"mine")
    (tmp_path / "f.pt").write_bytes(b"mine")
    (tmp_path / "file").write_bytes(b"mine")
    cases = [("taken", "shardsafe", "is not empty"), ("taken", "dcp", "is not empty"),
             ("taken", "hf", "is not empty"), ("f.pt", "torch", "f.pt exists; nothing is ever"),
             ("file", "dcp", "exists and is not a directory")]  # fmt: skip
    for dst, to, message in cases:
        args = ["convert", str(tmp_path / "dcp"), str(tmp_path / dst), "--to", to]
        assert cli.main([*args, "--dry-run"]) == 1, (dst, to)
        assert message in capsys.readouterr().err, (dst, to)
        assert cli.main(args) == 1
        assert message in capsys.readouterr().err, (dst, to)
    assert (tmp_path / "taken" / "model.safetensors").read_bytes() == b"mine"
    new = shardsafe.convert(
        tmp_path / "dcp", tmp_path / "new" / "deep.pt", to="torch", dry_run=True
    )
    assert new.dry_run and not (tmp_path / "new").exists()


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.float64, torch.uint8])
def test_a_dtype_that_is_not_one_of_the_three_is_refused_as_a_torch_dtype_too(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """``torch.int8`` was let through where ``"int8"`` was refused, and 300.0 became 44."""
    dcp_checkpoint(tmp_path / "dcp")
    with pytest.raises(ValueError, match=r"is not one of bfloat16, float16, float32"):
        shardsafe.convert(tmp_path / "dcp", tmp_path / "o", dtype=dtype)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("size", [2e9, [1], None])
def test_a_max_shard_size_of_another_type_is_a_clear_error(tmp_path: Path, size: Any) -> None:
    dcp_checkpoint(tmp_path / "dcp")
    with pytest.raises(ValueError, match=r"max_shard_size=.* is not a size: give bytes as an int"):
        shardsafe.convert(tmp_path / "dcp", tmp_path / "o", to="hf", max_shard_size=size)


def test_every_file_a_conversion_writes_is_listed_with_its_size(tmp_path: Path) -> None:
    """DCP output listed its data file alone: `.metadata` was written but not reported."""
    dcp_checkpoint(tmp_path / "dcp")
    for to in ("shardsafe", "dcp", "hf"):
        out = tmp_path / f"to-{to}"
        result = shardsafe.convert(tmp_path / "dcp", out, to=to, progress=False)
        on_disk = {p.name: p.stat().st_size for p in out.iterdir()}
        assert dict(result.files) == on_disk, to
