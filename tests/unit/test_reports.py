"""``shardsafe.verify`` and ``shardsafe.inspect`` as a library: typed reports of real
checkpoints, the same ones the command line prints, and the layering that lets the
engine and the converters use them without the command line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import cli
from tests import forge
from tests.s3server import S3Server

SRC = Path(shardsafe.__file__).parent
LAYOUTS = ("sharded", "consolidated")
META = {"step": 3, "tags": ["a", "b"]}


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.half()
    opt = torch.optim.Adam(model.parameters(), eps=1e-4)
    model(torch.randn(2, 8, dtype=torch.float16)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "meta": META, "ids": torch.arange(6).view(2, 3)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for layout in LAYOUTS:
        out[layout] = tmp_path_factory.mktemp("ck") / layout
        shardsafe.save(out[layout], _state(), layout=layout)
    return out


def _flip_a_byte_of(path: Path, key: str) -> Path:
    """Flip the first byte of tensor ``key``'s data; the data file it is in."""
    (chunk,) = shardsafe.read_manifest(path).tensors[key].chunks
    file = path / chunk.file
    raw = bytearray(file.read_bytes())
    length = int.from_bytes(raw[:8], "little")
    start = 8 + length + json.loads(raw[8 : 8 + length])[chunk.name]["data_offsets"][0]
    raw[start] ^= 0xFF
    file.write_bytes(bytes(raw))
    return file


@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_passes_a_fresh_checkpoint_and_counts_what_it_checked(
    saved: dict[str, Path], layout: str
) -> None:
    report = shardsafe.verify(saved[layout])
    data = sorted(saved[layout].glob("*.safetensors"))
    assert isinstance(report, shardsafe.VerifyReport)
    assert report.ok and report.problems == () and report.notes == () and report.unchecked == ()
    assert report.path == str(saved[layout])
    assert report.data_files == len(data) == (1 if layout == "sharded" else 3)
    assert report.data_bytes == sum(f.stat().st_size for f in data)
    assert report.tensors == len(shardsafe.read_manifest(saved[layout]).tensors)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_flipped_byte_fails_verify_naming_the_file_and_the_tensor(
    saved: dict[str, Path], layout: str, tmp_path: Path
) -> None:
    path = Path(shutil.copytree(saved[layout], tmp_path / "ck"))
    file = _flip_a_byte_of(path, "model/2.weight")
    report = shardsafe.verify(path)
    assert not report.ok
    (problem,) = report.problems
    assert "checksum mismatch" in problem
    assert f"{file.name}, tensor 'model/2.weight'" in problem
    assert report.data_files == (1 if layout == "sharded" else 3)  # the others were checked


def _forged(saved: Path, tmp_path: Path, edit: Any) -> Path:
    return forge.forged_copy(saved, tmp_path / "forged", edit)


def test_verify_names_entries_that_refer_to_tensors_the_checkpoint_lacks(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    """Every byte intact, and yet a load would fail: metadata written wrong (or edited,
    checksums recomputed) must not verify."""

    def dangle(doc: dict[str, Any]) -> None:
        doc["values"]["ids"]["meta"] = {"__tensor__": "ids/elsewhere"}
        doc["values"]["model"]["meta"]["tensors"].append("3.weight")

    report = shardsafe.verify(_forged(saved["sharded"], tmp_path, dangle))
    assert report.problems == (
        "state entry 'ids' refers to 1 tensor: 'ids/elsewhere' that the checkpoint does not hold",
        "state entry 'model' refers to 1 tensor: 'model/3.weight' that the checkpoint does "
        "not hold",
    )


def test_verify_bounds_a_forged_record_of_per_rank_copies_by_the_table(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    def per_rank(doc: dict[str, Any]) -> None:
        doc["world_size"] = 10**9  # own copies for each of a billion ranks: not listed
        shared = {"t": {"__tensor__": "ids"}}
        doc["values"]["ids"]["meta"] = {"__per_rank__": {"shared": shared, "own": ["ids"]}}

    report = shardsafe.verify(_forged(saved["sharded"], tmp_path, per_rank))
    assert report.problems == (
        "state entry 'ids': it records own copies of 1 tensor: 'ids' for each of 1000000000 "
        f"saving ranks, more than the {len(shardsafe.read_manifest(saved['sharded']).tensors)}"
        " tensors the checkpoint holds",
    )


@pytest.mark.timeout(30)
def test_verify_refuses_a_forged_record_of_no_own_copies_at_once(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    """An empty list of own copies passed the bound above (0 per rank), and verify then
    looped over every one of 10**18 saving ranks: a hang of about 1,000 years (found in
    review). No save records an empty list."""

    def none_own(doc: dict[str, Any]) -> None:
        doc["world_size"] = 10**18
        doc["values"]["ids"]["meta"] = {"__per_rank__": {"shared": {"a": 1}, "own": []}}

    report = shardsafe.verify(_forged(saved["sharded"], tmp_path, none_own))
    assert report.problems == (
        "state entry 'ids': the manifest entry for 'ids' holds a malformed record of per-rank "
        "copies",
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_reports_what_was_saved(saved: dict[str, Path], layout: str) -> None:
    path = saved[layout]
    report = shardsafe.inspect(path)
    assert isinstance(report, shardsafe.InspectReport)
    assert (report.path, report.layout, report.world_size) == (str(path.resolve()), layout, 1)
    assert (report.format, report.format_version) == ("shardsafe", 2)
    assert report.shardsafe_version == shardsafe.__version__
    assert report.torch_version == torch.__version__
    assert report.created is not None and report.created_unix is not None
    state = _state()
    expected = {f"model/{k}": v for k, v in state["model"].state_dict().items()}
    for i, (name, _) in enumerate(state["model"].named_parameters()):
        for what, value in state["optimizer"].state_dict()["state"][i].items():
            expected[f"optimizer/{name}/{what}"] = value
    expected["ids"] = state["ids"]
    tensors = {t.key: t for t in report.tensors}
    assert set(tensors) == set(expected)
    for key, tensor in expected.items():
        t = tensors[key]
        assert (t.dtype, t.shape) == (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        assert (t.numel, t.bytes) == (tensor.numel(), tensor.numel() * tensor.element_size())
        assert t.writers == (0,) and t.chunks == 1 and t.value == key.split("/")[0]
    assert [t.key for t in report.tensors][:3] == ["ids", "model/0.bias", "model/0.weight"]
    values = {v.name: v for v in report.values}
    assert {n: v.kind for n, v in values.items()} == {
        "ids": "value",
        "meta": "value",
        "model": "module",
        "optimizer": "optimizer",
    }
    assert values["meta"].value == META and values["model"].value is None
    assert values["model"].tensors == 4
    on_disk = {f.name: f.stat().st_size for f in path.glob("*.safetensors")}
    assert {f.name: f.bytes for f in report.files} == on_disk
    assert [(w.rank, w.files) for w in report.writers] == [(0, tuple(sorted(on_disk)))]
    totals = report.totals
    assert (totals.data_files, totals.data_bytes) == (len(on_disk), sum(on_disk.values()))
    assert totals.bytes == sum(f.stat().st_size for f in path.iterdir())
    assert (totals.tensors, totals.values) == (len(expected), 4)


def test_the_cli_prints_the_librarys_reports(
    saved: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(saved["sharded"])
    assert cli.main(["inspect", "--json", path]) == 0
    assert json.loads(capsys.readouterr().out) == shardsafe.inspect(path).to_dict()
    assert cli.main(["verify", path]) == 0
    report = shardsafe.verify(path)
    assert capsys.readouterr().out.startswith(
        f"OK: 1 data file, {report.tensors} tensors, {report.data_bytes} bytes"
    )


def test_reports_are_frozen(saved: dict[str, Path]) -> None:
    report = shardsafe.inspect(saved["sharded"])
    with pytest.raises(AttributeError):
        report.layout = "consolidated"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        report.tensors[0].shape = ()  # type: ignore[misc]


def test_a_checkpoint_root_is_not_a_checkpoint_but_the_error_names_the_newest(
    tmp_path: Path,
) -> None:
    manager = shardsafe.CheckpointManager(tmp_path)
    newest = manager.save(1, {"meta": {"a": 1}})
    manager.close()
    for read in (shardsafe.verify, shardsafe.inspect):
        with pytest.raises(shardsafe.CheckpointNotFoundError, match=r"has no manifest\.json") as e:
            read(tmp_path)
        assert str(e.value).endswith(f"the newest committed checkpoint in it is {newest}")


def test_storage_options_are_for_urls_as_in_load(saved: dict[str, Path]) -> None:
    for read in (shardsafe.verify, shardsafe.inspect):
        with pytest.raises(ValueError, match="apply to object-store URLs"):
            read(saved["sharded"], storage_options={"anon": True})  # type: ignore[operator]


@pytest.mark.timeout(120)
def test_verify_and_inspect_on_s3_use_the_storage_options_given(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{s3_bucket}/ck"
    shardsafe.save(url, {"model": torch.nn.Linear(4, 2)})
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing there: a wrong store
    options = {"endpoint_url": s3_server.endpoint, "skip_instance_cache": True}
    assert shardsafe.verify(url, storage_options=options).ok
    report = shardsafe.inspect(url, storage_options=options)
    assert report.path == url and {t.key for t in report.tensors} == {"model/weight", "model/bias"}
    (name,) = (f.name for f in report.files)
    raw = bytearray(s3_server.get(s3_bucket, f"ck/{name}"))
    raw[-1] ^= 0xFF
    s3_server.put(s3_bucket, f"ck/{name}", bytes(raw))
    (problem,) = shardsafe.verify(url, storage_options=options).problems
    assert "checksum mismatch" in problem and name in problem and "'model/" in problem
