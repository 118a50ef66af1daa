"""Conversions at the edges: dtypes torch stores without a typed storage, and the like."""

from __future__ import annotations

import collections
import io
import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe import dtypes
from shardsafe.checkpoint.storage.files import LocalFileReader
from shardsafe.checkpoint.storage.local import LocalStorage
from shardsafe.checkpoint.storage.protocol import FileSink
from tests.s3server import S3Server

pytestmark = pytest.mark.timeout(120)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64]
)
def test_dtypes_without_a_typed_storage_convert_to_torch_save_bitwise(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """torch.save stores float8 and uint16/32/64 tensors (an fp8 model's weights) in an
    untyped storage rebuilt by ``_rebuild_tensor_v3``; ``--to torch`` refused them as
    having "no storage type", though torch.save itself writes them."""
    weights = {
        "w": torch.arange(-6, 6, dtype=torch.float32).reshape(3, 4).to(dtype),
        "b": torch.ones(3),
    }
    torch.save(weights, tmp_path / "src.pt")
    shardsafe.convert(tmp_path / "src.pt", tmp_path / "ss")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the pickle note
        shardsafe.convert(tmp_path / "ss", tmp_path / "out.pt", to="torch")
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert set(back) == {"model"} and set(back["model"]) == {"w", "b"}
    for name, t in weights.items():
        got = back["model"][name]
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(_bits(got), _bits(t)), name


@pytest.mark.parametrize("lightning", [False, True])
def test_a_file_with_both_state_dict_and_model_keeps_both(tmp_path: Path, lightning: bool) -> None:
    """``{"state_dict": weights, "model": "resnet50"}`` (the architecture's name beside the
    weights): ``state_dict`` was read as the entry ``model`` and then overwritten by the
    file's own ``model``, so the weights were dropped and 0 tensors converted, silently."""
    weights = {"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3)}
    raw: dict[str, object] = {"state_dict": weights, "model": "resnet50", "epoch": 3}
    if lightning:
        raw["pytorch-lightning_version"] = "2.4.0"
        raw["model"] = {"arch": torch.tensor([1.0, 2.0])}
    torch.save(raw, tmp_path / "last.ckpt")
    result = shardsafe.convert(tmp_path / "last.ckpt", tmp_path / "ss")
    assert result.tensors == len(weights) + (1 if lightning else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the pickle note
        shardsafe.convert(tmp_path / "ss", tmp_path / "back.ckpt", to="torch")
    back = torch.load(tmp_path / "back.ckpt", weights_only=True)
    assert set(back) == set(raw)
    assert set(back["state_dict"]) == set(weights)
    for name, t in weights.items():
        assert torch.equal(back["state_dict"][name], t), name
    if lightning:
        assert torch.equal(back["model"]["arch"], torch.tensor([1.0, 2.0]))
    else:
        assert back["model"] == "resnet50" and back["epoch"] == 3


def test_a_top_level_entry_named_like_one_of_lightnings_is_refused(tmp_path: Path) -> None:
    """A checkpoint holding ``lightning`` (as a shardsafe strategy saves it) and a
    top-level ``epoch`` too: written as a Lightning ``.ckpt``, whose entries are all at its
    top level, the top-level ``epoch`` was dropped in silence (found in review)."""
    source = tmp_path / "src.pt"
    lightning = {"pytorch-lightning_version": "2.4.0", "epoch": 1, "global_step": 10}
    torch.save({"lightning": lightning, "model": {"w": torch.ones(2)}, "epoch": 7}, source)
    with pytest.raises(shardsafe.CheckpointCorruptError) as refused:
        shardsafe.convert(source, tmp_path / "out.pt", to="torch")
    assert str(refused.value) == (
        f"{source}: the entry 'epoch' is both a top-level entry and an entry of 'lightning', "
        "and a Lightning checkpoint holds both at its top level: written as one, one of them "
        "would be lost. Leave one out with only=[...], or rename it"
    )
    assert not (tmp_path / "out.pt").exists()
    shardsafe.convert(source, tmp_path / "out.pt", to="torch", only=["lightning", "model"])
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["epoch"] == 1 and out["global_step"] == 10
    assert out["state_dict"]["w"].equal(torch.ones(2))


def test_a_top_level_dcp_tensor_beside_a_model_entry_is_kept(tmp_path: Path) -> None:
    """``dcp.save({"model": msd, "rng": torch.get_rng_state()})``: the reader of
    torchtitan's flat layout skipped every top-level tensor once *an* entry named
    ``model`` was in its output, the checkpoint's own included, so ``rng`` vanished from
    the conversion without a word (DCP's own ``dcp_to_torch_save`` keeps it)."""
    import torch.distributed.checkpoint as dcp

    rng = torch.get_rng_state()
    weights = {"fc.weight": torch.randn(3, 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
        dcp.save({"model": weights, "rng": rng}, checkpoint_id=str(tmp_path / "dcp"))
    result = shardsafe.convert(tmp_path / "dcp", tmp_path / "ss")
    assert result.tensors == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the pickle note
        shardsafe.convert(tmp_path / "ss", tmp_path / "out.pt", to="torch")
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert set(back) == {"model", "rng"}
    assert back["rng"].dtype == torch.uint8 and torch.equal(back["rng"], rng)
    assert torch.equal(back["model"]["fc.weight"], weights["fc.weight"])


def test_a_dcp_optimizer_without_state_converts_to_an_optimizer(tmp_path: Path) -> None:
    """SGD without momentum keeps no state: ``get_state_dict`` gives ``{"state": {},
    "param_groups": [...]}``, and DCP, which stores leaves, drops the empty ``state``. The
    converter then read the optimizer as plain data, so ``shardsafe.load`` of the converted
    checkpoint into the optimizer failed with a mismatch."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    msd, osd = get_state_dict(model, opt)
    assert osd["state"] == {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "dcp"))
    shardsafe.convert(tmp_path / "dcp", tmp_path / "ss")
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5)
    shardsafe.load(tmp_path / "ss", {"model": model2, "optimizer": opt2})
    assert opt2.param_groups[0]["lr"] == 0.01
    assert torch.equal(model2.weight, model.weight) and torch.equal(model2.bias, model.bias)


def _conj_and_neg() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "c": torch.randn(2, 3, dtype=torch.complex64, generator=g).conj(),
        "n": torch.randn(4, generator=g)._neg_view(),
    }


@pytest.mark.parametrize("source", ["torch", "dcp"])
def test_conjugate_and_negative_views_convert_to_their_values(tmp_path: Path, source: str) -> None:
    """``torch.save(x.conj())`` stores the storage plus a pending-conjugation bit (a
    negative view likewise); converting such a file (or a DCP chunk holding one) failed
    with torch's raw ``RuntimeError: torch.Tensor.view is not supported for conjugate
    view tensors`` from deep inside the writer."""
    import torch.distributed.checkpoint as dcp

    weights = _conj_and_neg()
    assert weights["c"].is_conj() and weights["n"].is_neg()
    src = tmp_path / "src"
    if source == "torch":
        torch.save(weights, src)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
            dcp.save({"model": weights}, checkpoint_id=str(src))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the pickle note
        shardsafe.convert(src, tmp_path / "out.pt", to="torch")
    back = torch.load(tmp_path / "out.pt", weights_only=True)["model"]
    for name, t in weights.items():
        want = t.resolve_conj().resolve_neg()
        assert not back[name].is_conj() and not back[name].is_neg()
        assert torch.equal(_bits(back[name]), _bits(want)), name


class _Counted(float):
    """A learning rate that counts how often it is compared."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        type(self).comparisons += 1
        return float(self) == other

    __hash__ = float.__hash__


def test_flat_dcp_param_groups_are_rebuilt_in_linear_time() -> None:
    """torchtitan's flat layout stores hyperparameters per parameter
    (``param_groups.<fqn>.lr``); groups were rebuilt by comparing each parameter's with
    every group found so far, so a checkpoint with a group per parameter (layer-wise
    learning rates, or a crafted ``.metadata`` of a few MB) took quadratic time: 8,000
    parameters 7.6 s, 32,000 about two minutes. Parameters with equal ones still share
    a group, in order."""
    from shardsafe.converters.flat_layout import unflatten

    n = 400
    flat: dict[str, object] = {f"param_groups.p{i}.lr": _Counted(i) for i in range(n)}
    flat |= {"param_groups.q.lr": _Counted(3), "param_groups.q.wd": 0.1}
    flat |= {"param_groups.r.lr": _Counted(5)}
    _Counted.comparisons = 0
    groups = unflatten({"optim": flat})["optim"]["param_groups"]
    assert _Counted.comparisons <= n + 2  # quadratic: ~n * n / 2
    assert len(groups) == n + 1
    assert groups[5] == {"lr": 5, "params": ["p5", "r"]}
    assert groups[-1] == {"lr": 3, "wd": 0.1, "params": ["q"]}


def _open_under(directory: Path, suffix: str = ".distcp") -> int:
    """How many ``suffix`` files of ``directory`` this process has open."""
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        count += target.startswith(str(directory)) and target.endswith(suffix)
    return count


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
def test_a_dcp_checkpoint_of_more_files_than_descriptors_converts(tmp_path: Path) -> None:
    """DCP writes a file per rank and writer thread; the reader kept every one open, so
    a checkpoint of 1,100 files failed under the common default limit of 1,024
    descriptors (``Too many open files``). Here the limit is lowered below the number of
    files instead: at most half of it is spent on them now."""
    import resource

    import torch.distributed.checkpoint as dcp

    baseline = len(list(Path("/proc/self/fd").iterdir()))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = 2 * baseline + 100
    n = baseline + 150  # more than the lowered limit leaves, beside what is open already
    weights = {f"l{i}.w": torch.full((3,), float(i)) for i in range(n)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
        writer = dcp.FileSystemWriter(str(tmp_path / "dcp"), thread_count=n)
        dcp.save({"model": weights}, storage_writer=writer)
    assert len(list((tmp_path / "dcp").glob("*.distcp"))) == n
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        with shardsafe.converters.read_source(tmp_path / "dcp") as source:
            assert _open_under(tmp_path / "dcp") <= lowered // 2
            for name, t in weights.items():
                assert torch.equal(source.tensors[f"model/{name}"].load_whole(), t), name
            assert _open_under(tmp_path / "dcp") <= lowered // 2
        shardsafe.convert(tmp_path / "dcp", tmp_path / "ss")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert shardsafe.converters.read_source(tmp_path / "ss").tensors.keys() == {
        f"model/{name}" for name in weights
    }


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
def test_a_hugging_face_index_of_more_shards_than_descriptors_converts(tmp_path: Path) -> None:
    """The Hugging Face reader opened every shard an index names and kept them all open,
    so an index of more shards than the process has descriptors failed with ``Too many
    open files``; it shares the DCP reader's bound now."""
    import json
    import resource

    from safetensors.torch import save_file

    baseline = len(list(Path("/proc/self/fd").iterdir()))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = 2 * baseline + 100
    n = baseline + 150
    src = tmp_path / "hf"
    src.mkdir()
    weights = {f"l{i}.w": torch.full((3,), float(i)) for i in range(n)}
    weight_map = {}
    for i, (name, t) in enumerate(weights.items()):
        weight_map[name] = f"model-{i:05d}.safetensors"
        save_file({name: t}, str(src / weight_map[name]))
    index = src / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        with shardsafe.converters.read_source(index) as source:
            assert _open_under(src, ".safetensors") <= lowered // 2
            for name, t in weights.items():
                assert torch.equal(source.tensors[f"model/{name}"].load_whole(), t), name
            assert _open_under(src, ".safetensors") <= lowered // 2
        assert _open_under(src, ".safetensors") == 0
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"only": "model"},
            r"^only='model' must be a list of entry names, such as only=\['model'\]$",
        ),
        ({"only": iter(["model"])}, r"^only=<list_iterator .*> must be a list of entry names"),
        ({"dry_run": "no"}, r"^dry_run='no' must be True or False$"),
        ({"progress": "yes"}, r"^progress='yes' must be True, False or None$"),
        ({"to": "hf", "strip_prefix": 1}, r"^strip_prefix=1 must be a string or None$"),
        (
            {"to": "hf", "max_shard_size": True},
            r"^max_shard_size=True is not a size: give bytes as",
        ),
    ],
)
def test_options_of_the_wrong_type_are_refused_naming_the_field(
    tmp_path: Path, options: dict[str, object], message: str
) -> None:
    """``convert(src, dst, only="model")`` read the string letter by letter and refused
    ``--only m, o, d, e, l``; ``dry_run="no"`` (truthy) wrote nothing; ``strip_prefix=1``
    failed with a raw ``TypeError`` from ``str.startswith``. Each is now refused before
    anything is read, naming the field (docs/converting.md)."""
    torch.save({"model": {"w": torch.ones(2, 2)}}, tmp_path / "src.pt")
    with pytest.raises(ValueError, match=message):
        shardsafe.convert(tmp_path / "src.pt", tmp_path / "out", **options)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def test_a_weight_named_like_safetensors_metadata_is_refused_before_writing(
    tmp_path: Path,
) -> None:
    """A weight named ``__metadata__`` overwrote the safetensors header's metadata: the
    file written did not parse ("__metadata__ is not a map of strings", said about the
    output) and stayed on disk. It is refused before anything is written, with the way out."""
    torch.save({"__metadata__": torch.ones(2), "w": torch.ones(3)}, tmp_path / "src.pt")
    with pytest.raises(shardsafe.CheckpointError, match=r"safetensors reserves .*--add-prefix"):
        shardsafe.convert(tmp_path / "src.pt", tmp_path / "hf", to="hf")
    assert not (tmp_path / "hf").exists()
    shardsafe.convert(tmp_path / "src.pt", tmp_path / "hf", to="hf", add_prefix="m.")
    from safetensors.torch import load_file

    back = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(back) == {"m.__metadata__", "m.w"}
    assert torch.equal(back["m.__metadata__"], torch.ones(2))


class _FlipsOnRead(LocalStorage):
    """Reads back a byte in the middle of every file flipped: a bad disk or cache, which
    the converter's read-back exists to catch."""

    def open_reader(self, name: str) -> LocalFileReader:
        reader = super().open_reader(name)
        middle, read_into = reader.size // 2, reader.read_into

        def flipped(offset: int, out: memoryview) -> None:
            read_into(offset, out)
            view = out.cast("B") if out.format != "B" else out
            if offset <= middle < offset + view.nbytes:
                view[middle - offset] ^= 0xFF

        reader.read_into = flipped  # type: ignore[method-assign]
        return reader


@pytest.mark.parametrize("to", ["dcp", "hf", "torch"])
def test_an_output_that_does_not_read_back_as_written_is_removed(tmp_path: Path, to: str) -> None:
    """The read-back ran after the output was committed (DCP's ``.metadata``, the HF
    index or single file, the ``torch.save`` file) and a failure left it in place: output
    that ``dcp.load``, ``from_pretrained`` or ``torch.load`` then reads without any
    checksum, corrupt. It is removed now, and the error says what did not read back."""
    from shardsafe.converters import dcp_write, hf, torch_file

    torch.save({"model": {"w": torch.arange(1 << 14, dtype=torch.float32)}}, tmp_path / "a.pt")
    out = tmp_path / "out"
    if to == "torch":
        out.mkdir()
    with (
        shardsafe.converters.read_source(tmp_path / "a.pt") as source,
        pytest.raises(shardsafe.CheckpointError, match=re.escape(str(out))),
    ):
        if to == "dcp":
            dcp_write.write(source, _FlipsOnRead(str(out)))
        elif to == "hf":
            hf.write(source, _FlipsOnRead(str(out)))
        else:
            torch_file.write(source, _FlipsOnRead(str(out)), "model.pt")
    assert not out.exists() if to != "torch" else list(out.iterdir()) == []


def test_hf_output_without_a_module_says_what_a_module_is(tmp_path: Path) -> None:
    """A file whose tensors are not a module (``{"w": t, "step": 3}``: plain values)
    was refused with "Name the entry with --only", which cannot help: ``--only w`` gave
    the same error, since ``--only`` keeps entries but makes none a module."""
    torch.save({"w": torch.ones(2, 2), "step": 3}, tmp_path / "src.pt")
    for only in (None, ["w"]):
        with pytest.raises(shardsafe.CheckpointError) as caught:
            shardsafe.convert(tmp_path / "src.pt", tmp_path / "hf", to="hf", only=only)
        assert "Name the entry with --only" not in str(caught.value)
        assert "a dict of tensors by name such as a model's state_dict()" in str(caught.value)
        assert "w (value)" in str(caught.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("to", ["shardsafe", "hf"])
def test_a_dtype_safetensors_cannot_store_is_refused_with_a_way_out(
    tmp_path: Path, to: str
) -> None:
    """An MX scale tensor (``float8_e8m0fnu``) or any other dtype with no safetensors
    code crashed the conversion with ``KeyError: torch.float8_e8m0fnu`` from inside the
    header builder ("a bug in shardsafe" on the command line). It is refused, naming the
    tensor and the formats that can hold it; ``--to torch`` converts it bitwise."""
    scales = torch.tensor([1.0, 2.0, 4.0]).to(torch.float8_e4m3fnuz)  # as e8m0fnu (torch 2.7+)
    torch.save({"w": torch.ones(3), "w_scale": scales}, tmp_path / "src.pt")
    with pytest.raises(
        shardsafe.CheckpointError,
        match=r"'model/w_scale' is float8_e4m3fnuz, which safetensors cannot store, so "
        rf"--to {to} cannot hold it; convert to torch or dcp instead",
    ):
        shardsafe.convert(tmp_path / "src.pt", tmp_path / "out", to=to)
    assert not (tmp_path / "out").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the pickle note
        shardsafe.convert(tmp_path / "src.pt", tmp_path / "out.pt", to="torch")
    back = torch.load(tmp_path / "out.pt", weights_only=True)["model"]["w_scale"]
    assert back.dtype == scales.dtype and torch.equal(_bits(back), _bits(scales))


class _WithExtraState(torch.nn.Module):
    """A module whose extra state is plain data (settings, an fp8 recipe's, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 3)
        self.scale = 1

    def get_extra_state(self) -> dict[str, int]:
        return {"scale": self.scale}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.scale = state["scale"]


@pytest.mark.parametrize("via", ["torch", "dcp"])
def test_a_module_with_extra_state_stays_a_module(tmp_path: Path, via: str) -> None:
    """A state dict holding ``<fqn>._extra_state`` beside its tensors (what
    ``get_extra_state`` returns) was not read as a module: shardsafe -> torch/DCP ->
    shardsafe gave a plain value, which ``shardsafe.load`` refused to put into the module
    ("saved as a 'value' value but is loaded into a ... ('module')")."""
    model = _WithExtraState()
    model.scale = 7
    shardsafe.save(tmp_path / "ss", {"model": model})
    middle = tmp_path / ("mid.pt" if via == "torch" else "mid")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the pickle note
        shardsafe.convert(tmp_path / "ss", middle, to=via)  # type: ignore[arg-type]
    shardsafe.convert(middle, tmp_path / "back")
    again = _WithExtraState()
    shardsafe.load(tmp_path / "back", {"model": again})
    assert again.scale == 7
    assert torch.equal(again.fc.weight, model.fc.weight)
    assert torch.equal(again.fc.bias, model.fc.bias)


def _hub_snapshot(root: Path) -> Path:
    """A Hugging Face cache snapshot: every file a link into ``blobs/``."""
    from safetensors.torch import save_file

    (root / "blobs").mkdir(parents=True)
    snapshot = root / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    save_file({"w": torch.arange(4.0)}, root / "blobs" / "a1")
    torch.save({"w": torch.arange(4.0)}, root / "blobs" / "b2")
    (snapshot / "model.safetensors").symlink_to("../../blobs/a1")
    (snapshot / "pytorch_model.bin").symlink_to("../../blobs/b2")
    return snapshot


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_source_file_named_through_a_link_converts(tmp_path: Path, name: str) -> None:
    """A file the user names may be a symbolic link (docs/guarantees.md; the engine's
    own imports follow one), as every file of a Hugging Face cache snapshot is; the
    converter refused it ("is a symbolic link, not a file")."""
    snapshot = _hub_snapshot(tmp_path / "hub")
    shardsafe.convert(snapshot / name, tmp_path / "out")
    with shardsafe.converters.read_source(tmp_path / "out") as source:
        assert torch.equal(source.tensors["model/w"].load_whole(), torch.arange(4.0))


def test_a_checkpoint_directory_of_links_is_refused_with_the_way_out(tmp_path: Path) -> None:
    """Links inside a checkpoint directory stay unfollowed, but the refusal says why and
    what to pass instead, rather than only that a link is not read."""
    snapshot = _hub_snapshot(tmp_path / "hub")
    with pytest.raises(
        shardsafe.CheckpointError,
        match=r"model\.safetensors is a symbolic link, and links inside a checkpoint are "
        r"never followed .*; pass .*model\.safetensors itself",
    ):
        shardsafe.convert(snapshot, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (snapshot / "model.safetensors.index.json").symlink_to("../../blobs/a1")
    with pytest.raises(shardsafe.CheckpointError, match=r"links inside a checkpoint .*cp -rL"):
        shardsafe.convert(snapshot / "model.safetensors.index.json", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("to", ["shardsafe", "hf"])
def test_a_tensor_name_that_is_no_utf8_is_refused_for_safetensors_output(
    tmp_path: Path, to: str
) -> None:
    """A pickle may hold a name with a lone surrogate (``"w\\ud800"``). ``--to hf`` wrote a
    ``model.safetensors`` that passed the converter's own read-back but that
    ``safetensors`` refuses ("invalid JSON in header"); ``--to shardsafe`` failed its
    verification after committing. Refused before anything is written; torch keeps it."""
    name = "w\ud800"
    torch.save({name: torch.ones(2), "b": torch.ones(3)}, tmp_path / "src.pt")
    with pytest.raises(shardsafe.CheckpointError, match="is not UTF-8 text"):
        shardsafe.convert(tmp_path / "src.pt", tmp_path / "out", to=to)
    assert not (tmp_path / "out").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the pickle note
        shardsafe.convert(tmp_path / "src.pt", tmp_path / "out.pt", to="torch")
    assert set(torch.load(tmp_path / "out.pt", weights_only=True)["model"]) == {name, "b"}


@pytest.mark.parametrize("to", ["shardsafe", "dcp", "hf"])
@pytest.mark.parametrize("kind", ["file", "dangling link"])
def test_a_destination_that_is_no_directory_is_refused_by_name(
    tmp_path: Path, to: str, kind: str
) -> None:
    """A destination that exists as a file (or a link to nothing) was refused with only
    ``[Errno 17] File exists: '...'`` from ``os.makedirs``; and it is left as it was."""
    torch.save({"w": torch.ones(2, 2)}, tmp_path / "src.pt")
    dst = tmp_path / "dst"
    if kind == "file":
        dst.write_text("mine")
    else:
        dst.symlink_to(tmp_path / "nowhere")
    with pytest.raises(
        shardsafe.CheckpointError,
        match=rf"^{re.escape(str(dst))} exists and is not a directory .*nothing is ever "
        "overwritten",
    ):
        shardsafe.convert(tmp_path / "src.pt", dst, to=to)  # type: ignore[arg-type]
    assert dst.read_text() == "mine" if kind == "file" else dst.is_symlink()
    assert not (tmp_path / "nowhere").exists()


class _AnotherWriterFirst(LocalStorage):
    """Another conversion into the same directory creates each file just before this one
    does (the race two runs launched at once into one new directory have)."""

    def create(self, name: str, size_hint: int = 0) -> FileSink:
        (Path(self.directory) / name).write_bytes(b"the other run's")
        return super().create(name, size_hint)


def test_a_failed_hf_conversion_never_deletes_a_file_it_did_not_create(tmp_path: Path) -> None:
    """The shard's name was recorded as written before the file was created, so when
    ``create`` refused it (another run had just made it), the cleanup deleted the other
    run's file."""
    from shardsafe.converters import hf

    torch.save({"w": torch.ones(4)}, tmp_path / "src.pt")
    out = tmp_path / "out"
    with (
        shardsafe.converters.read_source(tmp_path / "src.pt") as source,
        pytest.raises(shardsafe.CheckpointError, match="appeared while"),
    ):
        hf.write(source, _AnotherWriterFirst(str(out)))
    assert (out / "model.safetensors").read_bytes() == b"the other run's"


class _SwappedAfterOpen(LocalStorage):
    """Once a file is opened for reading, its name is made to name another file (a race
    with whoever can write the destination directory)."""

    def open_reader(self, name: str) -> LocalFileReader:
        reader = super().open_reader(name)
        other = Path(self.directory) / "other.pt"
        if other.exists():
            os.replace(other, Path(self.directory) / name)
        return reader


def test_torch_output_is_verified_through_the_descriptor_it_opened(tmp_path: Path) -> None:
    """The read-back of a ``torch.save`` output checked its records through one
    descriptor, then ``torch.load``-ed the file again by its name: whatever the name
    named by then (another file, a link) was read, unscanned, and judged."""
    from shardsafe.converters import torch_file

    torch.save({"w": torch.ones(4)}, tmp_path / "src.pt")
    out = tmp_path / "out"
    out.mkdir()
    torch.save({"something": "else"}, out / "other.pt")
    with shardsafe.converters.read_source(tmp_path / "src.pt") as source:
        torch_file.write(source, _SwappedAfterOpen(str(out)), "model.pt")
    assert torch.load(out / "model.pt", weights_only=True) == {"something": "else"}


def test_storage_options_go_to_the_object_store_end(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    """``convert("last.ckpt", "s3://...", storage_options=...)`` (the documented way to
    pass credentials) was refused: the options were applied to the local source too,
    and a local path refuses them. They now go to the URL end alone, both ways."""
    options = {
        "key": s3_server.env["AWS_ACCESS_KEY_ID"],
        "secret": s3_server.env["AWS_SECRET_ACCESS_KEY"],
        "endpoint_url": s3_server.endpoint,
    }
    weights = {"w": torch.randn(3, 4)}
    torch.save({"state_dict": weights, "epoch": 3}, tmp_path / "last.ckpt")
    url = f"s3://{s3_bucket}/imported"
    shardsafe.convert(tmp_path / "last.ckpt", url, storage_options=options, progress=False)
    assert "imported/manifest.json" in s3_server.keys(s3_bucket)
    shardsafe.convert(url, tmp_path / "back", to="hf", storage_options=options, progress=False)
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "back" / "model.safetensors")["w"], weights["w"])
    with pytest.raises(ValueError, match="which is a local path"):  # both local: a mistake
        shardsafe.convert(tmp_path / "last.ckpt", tmp_path / "x", storage_options=options)


def test_a_url_named_like_a_file_that_is_a_prefix_is_converted(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    """The Lightning strategy saves each checkpoint as a prefix named like its file
    (``epoch=0-step=5.ckpt``); ``convert`` of its URL was refused as "a prefix, not a
    file", because a URL's extension alone decided, while ``inspect`` and ``verify``
    read it. A local directory of that name always converted."""
    options = {
        "key": s3_server.env["AWS_ACCESS_KEY_ID"],
        "secret": s3_server.env["AWS_SECRET_ACCESS_KEY"],
        "endpoint_url": s3_server.endpoint,
    }
    model = torch.nn.Linear(4, 3)
    url = f"s3://{s3_bucket}/run/epoch=0-step=5.ckpt"
    shardsafe.save(url, {"model": model}, storage_options=options)
    shardsafe.convert(url, tmp_path / "back", to="hf", storage_options=options, progress=False)
    from safetensors.torch import load_file

    back = load_file(tmp_path / "back" / "model.safetensors")
    assert torch.equal(back["weight"], model.weight.detach())
    missing = f"s3://{s3_bucket}/run/epoch=1-step=9.ckpt"
    gone = r"epoch=1-step=9.ckpt is missing, not a file"
    with pytest.raises(shardsafe.CheckpointError, match=gone):
        shardsafe.convert(missing, tmp_path / "x", to="hf", storage_options=options)


def test_an_hf_index_that_maps_no_tensor_is_refused(tmp_path: Path) -> None:
    """``{"weight_map": {}}`` beside real shards converted to a checkpoint of nothing,
    silently (0 tensors, a manifest and no data)."""
    import json

    from safetensors.torch import save_file

    (tmp_path / "hf").mkdir()
    save_file({"w": torch.ones(2)}, tmp_path / "hf" / "model-00001-of-00001.safetensors")
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(shardsafe.CheckpointCorruptError, match="empty weight_map"):
        shardsafe.convert(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("optimizer", ["sgd", {"lr": 0.1}, {"state": {}, "param_groups": 3}])
def test_a_lightning_entry_named_optimizer_that_is_no_optimizer_stays_a_value(
    tmp_path: Path, optimizer: object
) -> None:
    """A file laid out as a shardsafe Lightning checkpoint whose ``optimizer`` entry is no
    optimizer state: read as one, it raised a raw TypeError or KeyError (a "bug in
    shardsafe" on the command line). It is now kept as the value it is."""
    source = tmp_path / "source.pt"
    lightning = {"pytorch-lightning_version": "2.4.0", "epoch": 1}
    torch.save(
        {"lightning": lightning, "model": {"w": torch.ones(2)}, "optimizer": optimizer}, source
    )
    shardsafe.convert(source, tmp_path / "out.pt", to="torch", progress=False)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["optimizer"] == optimizer and "optimizer_states" not in out
    assert torch.equal(out["state_dict"]["w"], torch.ones(2)) and out["epoch"] == 1


def test_a_key_dcp_stores_as_text_is_warned_about(tmp_path: Path) -> None:
    """An optimizer's numbered state converted --to dcp read back with keys '0', '1', and
    Adam.load_state_dict of it dropped the momentum in silence: now said when converted."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    source = tmp_path / "source.pt"
    torch.save({"state_dict": model.state_dict(), "optimizer": opt.state_dict()}, source)
    with pytest.warns(UserWarning) as said:
        shardsafe.convert(source, tmp_path / "dcp", to="dcp", progress=False)
    assert [str(w.message) for w in said] == [
        "shardsafe: DCP stores every key as text, so the key 0 of ['optimizer']['state'][0] "
        "(and any other key that is no string) reads back as '0' unless loaded into a state "
        "dict of your own (dcp.load uses its keys); an optimizer's numbered state read back "
        "so no longer matches its param_groups. Convert --to torch or --to shardsafe to keep "
        "the keys' types"
    ]


class _Rebuilt:
    """Pickles as torch.save's rebuild of a 6-float tensor over storage record '0', with
    ``hooks`` as its ``backward_hooks`` argument and, given, ``dtype`` (``_v3``)."""

    def __init__(self, hooks: object, dtype: torch.dtype | None = None) -> None:
        self.hooks, self.dtype = hooks, dtype


class _RebuildPickler(pickle.Pickler):
    """torch.save's pickling: ``_v2`` over a ``FloatStorage`` of 6, ``_v3`` over 24 bytes."""

    typed, untyped = object(), object()

    def reducer_override(self, obj: object) -> object:
        if not isinstance(obj, _Rebuilt):
            return NotImplemented
        if obj.dtype is None:
            args = (self.typed, 0, (2, 3), (3, 1), False, obj.hooks)
            return torch._utils._rebuild_tensor_v2, args
        args = (self.untyped, 0, (2, 3), (3, 1), False, obj.hooks, obj.dtype)
        return torch._utils._rebuild_tensor_v3, args

    def persistent_id(self, obj: object) -> object:
        if obj is self.typed:
            return ("storage", torch.FloatStorage, "0", "cpu", 6)
        if obj is self.untyped:
            return ("storage", torch.storage.UntypedStorage, "0", "cpu", 24)
        return None


def _crafted(path: Path, tensor: _Rebuilt) -> Path:
    """A torch.save archive of ``{"model": {"w": tensor}}`` whose record is 6 floats."""
    buf = io.BytesIO()
    _RebuildPickler(buf, protocol=2).dump({"model": {"w": tensor}})
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", buf.getvalue())
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/data/0", torch.arange(6.0).numpy().tobytes())
        zf.writestr("archive/version", "3\n")
    return path


def test_views_of_one_buffer_convert_to_dcp_at_their_own_size(tmp_path: Path) -> None:
    """q, k and v as views of one fused buffer: ``--to dcp`` wrote the whole buffer for
    each (torch.save writes a view's whole storage), 3x the bytes; a crafted file of a
    thousand views of one 4 MB storage became 4 GB, past untrusted_bytes_limit, which
    counts the views' own bytes (found in review)."""
    fused = torch.arange(3 * 65536, dtype=torch.float32)
    q, k, v = fused.split(65536)
    torch.save({"q": q, "k": k, "v": v, "listed": [q[:4], k[:4]]}, tmp_path / "src.pt")
    shardsafe.convert(tmp_path / "src.pt", tmp_path / "dcp", to="dcp")
    written = (tmp_path / "dcp" / "__0_0.distcp").stat().st_size
    assert 3 * 65536 * 4 < written < 3 * 65536 * 4 + 16384  # the tensors and torch.save's zip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the pickle note
        shardsafe.convert(tmp_path / "dcp", tmp_path / "back.pt", to="torch")
    back = torch.load(tmp_path / "back.pt", weights_only=True)  # not a module: kept flat
    assert all(torch.equal(back[n], t) for n, t in (("q", q), ("k", k), ("v", v)))
    assert [t.tolist() for t in back["listed"]] == [q[:4].tolist(), k[:4].tolist()]


@pytest.mark.parametrize(
    "hooks", [collections.OrderedDict, "ab", [5]], ids=["class", "str", "list"]
)
def test_a_tensor_whose_pickle_set_odd_hooks_converts_to_dcp(tmp_path: Path, hooks: object) -> None:
    """``_rebuild_tensor_v2``'s ``backward_hooks`` argument, which torch.save always
    writes as an empty OrderedDict, as another object: torch.load sets it on the tensor,
    and ``--to dcp`` failed inside torch.save ("convert failed unexpectedly: TypeError:
    'type' object is not iterable"). It converts the tensor's values (found in review)."""
    source = _crafted(tmp_path / "src.pt", _Rebuilt(hooks))
    shardsafe.convert(source, tmp_path / "dcp", to="dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the pickle note
        shardsafe.convert(tmp_path / "dcp", tmp_path / "back.pt", to="torch")
    back = torch.load(tmp_path / "back.pt", weights_only=True)["model"]["w"]
    assert torch.equal(back, torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("dtype", [torch.uint4, torch.int2, torch.qint8, torch.quint4x2])
def test_a_dtype_torch_save_cannot_store_is_refused_for_dcp_output(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """A pickle can rebuild a plain tensor of a sub-byte or quantized dtype, which
    torch.save (DCP's encoding) cannot write: ``--to dcp`` failed half-way, "convert
    failed unexpectedly: KeyError: 'dtype torch.uint4 is not recognized'" (found in
    review). It is refused before anything is written, with the way out."""
    source = _crafted(tmp_path / "src.pt", _Rebuilt(collections.OrderedDict(), dtype))
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(shardsafe.CheckpointError) as refused:
        shardsafe.convert(source, tmp_path / "dcp", to="dcp")
    assert str(refused.value) == (
        f"{source}: tensor 'model/w' is {name}, which torch.save (DCP's encoding) cannot "
        "store, so --to dcp cannot hold it; convert to torch instead, or leave its entry out "
        "with --only (nothing was written)"
    )
    assert not (tmp_path / "dcp").exists()


def test_the_dtypes_dcp_output_refuses_are_those_torch_save_cannot_write() -> None:
    """``dtypes.torch_save_stores`` pinned against torch itself, dtype by dtype."""
    for name in dtypes.all_names():
        dtype = getattr(torch, name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # complex32's, quantized dtypes' notes
                torch.save(torch.empty(2, dtype=dtype), io.BytesIO())
            saved = True
        except (RuntimeError, KeyError):
            saved = False
        assert dtypes.torch_save_stores(dtype) == saved, name
