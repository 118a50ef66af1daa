"""The public surface is exactly what ``__all__`` lists; anything else is private."""

from __future__ import annotations

import inspect
import sys
import typing

import pytest

import shardsafe
from shardsafe.checkpoint.options import LoadKeywords, LoadOptions, SaveKeywords, SaveOptions

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # a dependency of torch's
    from typing_extensions import Unpack

PUBLIC = [
    "Adapter",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "InspectReport",
    "RNGState",
    "SaveHandle",
    "TieredCheckpointManager",
    "Trainer",
    "TrainingModule",
    "VerifyReport",
    "__version__",
    "async_save",
    "convert",
    "inspect",
    "load",
    "read_manifest",
    "register_adapter",
    "save",
    "verify",
]


def test_all_is_pinned() -> None:
    assert sorted(shardsafe.__all__) == PUBLIC
    assert len(shardsafe.__all__) == len(set(shardsafe.__all__))
    for name in PUBLIC:
        assert hasattr(shardsafe, name), name


def test_error_tree() -> None:
    assert issubclass(shardsafe.CheckpointCorruptError, shardsafe.CheckpointError)
    assert issubclass(shardsafe.CheckpointMismatchError, shardsafe.CheckpointError)
    assert issubclass(shardsafe.CheckpointVersionError, shardsafe.CheckpointCorruptError)
    assert issubclass(shardsafe.CheckpointNotFoundError, shardsafe.CheckpointError)
    assert issubclass(shardsafe.CheckpointError, Exception)


def test_save_and_load_options_are_keyword_only() -> None:
    for fn in (shardsafe.save, shardsafe.load):
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params[:2]] == ["path", "state"]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:]), fn
    save_options = [p for p in inspect.signature(shardsafe.save).parameters][2:]
    assert save_options == list(SaveOptions.__dataclass_fields__)


def test_converts_keywords_are_exactly_convert_options_fields_with_its_defaults() -> None:
    """``convert`` takes one options object the way ``save`` does: its keyword arguments
    are :class:`ConvertOptions`' fields, defaults written once (there), validated there."""
    from shardsafe.converters import ConvertOptions

    params = list(inspect.signature(shardsafe.convert).parameters.values())
    assert [p.name for p in params[:2]] == ["src", "dst"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:])
    assert [p.name for p in params[2:]] == list(ConvertOptions.__dataclass_fields__)
    defaults = ConvertOptions()
    assert all(p.default == getattr(defaults, p.name) for p in params[2:])
    hints, fields = typing.get_type_hints(shardsafe.convert), typing.get_type_hints(ConvertOptions)
    assert all(hints[p.name] == fields[p.name] for p in params[2:])


def test_async_save_and_the_managers_saves_take_exactly_saves_options() -> None:
    """They take ``**options: Unpack[SaveKeywords]``: the same names as ``save``, refused
    if unknown (by ``SaveOptions.of``), typed by one TypedDict."""
    assert list(SaveKeywords.__annotations__) == list(SaveOptions.__dataclass_fields__)
    for fn in (
        shardsafe.async_save,
        shardsafe.CheckpointManager.save,
        shardsafe.CheckpointManager.async_save,
    ):
        kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
        assert kinds[-1] is inspect.Parameter.VAR_KEYWORD, fn
    with pytest.raises(TypeError, match=r"unknown save option\(s\) \['layuot'\]"):
        SaveOptions.of(layuot="sharded")
    assert inspect.signature(shardsafe.save).parameters["layout"].default == "sharded"
    assert inspect.signature(shardsafe.load).parameters["strict"].default is True


def test_the_managers_saves_take_one_options_object_or_saves_keywords() -> None:
    """One way each: ``save``/``async_save`` take a :class:`SaveOptions` (the Trainer's
    way) or ``save``'s keywords, which override it."""
    for fn in (shardsafe.CheckpointManager.save, shardsafe.CheckpointManager.async_save):
        params = inspect.signature(fn).parameters
        assert list(params)[:4] == ["self", "step", "state", "options"], fn
        assert params["options"].default is None
        hints = typing.get_type_hints(fn)
        assert hints["options"] == SaveOptions | None
        assert hints["keywords"] == Unpack[SaveKeywords]
    assert not hasattr(shardsafe.CheckpointManager, "save_with")
    assert not hasattr(shardsafe.CheckpointManager, "async_save_with")


def test_load_latest_takes_exactly_loads_options_typed_like_save() -> None:
    """Both managers' ``load_latest`` take ``**options: Unpack[LoadKeywords]``: ``load``'s
    names, typed by one TypedDict, refused if unknown (by ``LoadOptions.of``)."""
    assert list(LoadKeywords.__annotations__) == list(LoadOptions.__dataclass_fields__)
    assert (
        list(LoadKeywords.__annotations__) == list(inspect.signature(shardsafe.load).parameters)[2:]
    )
    for fn in (
        shardsafe.CheckpointManager.load_latest,
        shardsafe.TieredCheckpointManager.load_latest,
    ):
        kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
        assert kinds[-1] is inspect.Parameter.VAR_KEYWORD, fn
        assert typing.get_type_hints(fn)["options"] == Unpack[LoadKeywords], fn
    with pytest.raises(TypeError, match=r"unknown load option\(s\) \['strcit'\]"):
        LoadOptions.of(strcit=True)


def test_version_is_a_string() -> None:
    assert isinstance(shardsafe.__version__, str) and shardsafe.__version__.count(".") >= 2


def test_a_managers_save_refuses_storage_options_of_its_own(tmp_path: object) -> None:
    manager = shardsafe.CheckpointManager(str(tmp_path))
    with pytest.raises(TypeError, match=r"pass them to CheckpointManager\(root, storage_options"):
        manager.save(1, {"x": 1}, storage_options={"endpoint_url": "http://elsewhere"})
    manager.close()


def test_adapters_offer_the_protocols_names_and_no_deprecated_aliases() -> None:
    import shardsafe.adapters as adapters

    assert sorted(adapters.__all__) == [
        "Adapter",
        "Chunk",
        "LoadContext",
        "LoadRequests",
        "PartitionedOptimizerAdapter",
        "RNGState",
        "ReadRequest",
        "SaveContext",
        "SaveItem",
        "SavedValue",
        "find_adapter",
        "register_adapter",
    ]
    assert not hasattr(adapters, "Context") and not hasattr(adapters, "LoadPlan")


def test_string_options_are_typed_by_one_literal_each_and_checked_at_run_time() -> None:
    """Type checkers see the allowed strings (``Layout``, ``VerifyMode``, ``Format``,
    ``DcpLayout``, each defined once); a wrong string still fails at once, naming them."""
    from shardsafe.checkpoint import Layout, VerifyMode
    from shardsafe.checkpoint.storage.local import LocalStorage
    from shardsafe.checkpoint.storage.protocol import EntryKind
    from shardsafe.converters import DcpLayout, Format

    assert typing.get_args(Layout) == ("sharded", "consolidated")
    assert typing.get_args(VerifyMode) == ("first", "inline")
    assert typing.get_args(Format) == ("shardsafe", "dcp", "hf", "torch")
    assert typing.get_args(DcpLayout) == ("nested", "flat")
    assert typing.get_args(EntryKind) == ("file", "directory", "symlink", "other")
    assert typing.get_type_hints(shardsafe.save)["layout"] == Layout
    assert typing.get_type_hints(SaveOptions)["layout"] == Layout
    assert typing.get_type_hints(shardsafe.load)["verify"] == VerifyMode
    assert typing.get_type_hints(shardsafe.Trainer.__init__)["layout"] == Layout
    convert = typing.get_type_hints(shardsafe.convert)
    assert (convert["to"], convert["dcp_layout"]) == (Format, DcpLayout)
    assert typing.get_type_hints(LocalStorage.kind)["return"] == EntryKind | None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"layout": "zip"}, r"layout='zip' is not one of \('sharded', 'consolidated'\)"),
        ({"verify": "both"}, r"verify='both' is not one of \('first', 'inline'\)"),
        ({"to": "zip"}, "to='zip' is not one of shardsafe, dcp, hf, torch"),
        ({"dcp_layout": "tree"}, "dcp_layout='tree' is not 'nested' or 'flat'"),
    ],
)
def test_a_wrong_string_option_fails_at_once_naming_the_allowed_ones(
    options: dict[str, str], message: str
) -> None:
    from shardsafe.checkpoint import LoadOptions

    with pytest.raises(ValueError, match=message):
        if "layout" in options:
            SaveOptions(**options)  # type: ignore[arg-type]
        elif "verify" in options:
            LoadOptions(**options)  # type: ignore[arg-type]
        else:
            shardsafe.convert("nowhere", "nothing", **options)  # type: ignore[arg-type]


def test_the_integrations_offer_exactly_their_entry_points() -> None:
    """Each integration's surface is its ``__all__``, pinned here (imported lazily: the
    integration's own package is needed only by those who use it)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("pytorch_lightning")
    import shardsafe.accelerate as accelerate_integration
    import shardsafe.lightning as lightning_integration

    assert sorted(accelerate_integration.__all__) == ["load_state", "save_state", "state_of"]
    pytest.importorskip("transformers")
    import shardsafe.transformers as transformers_integration

    assert sorted(transformers_integration.__all__) == ["SHARDSAFE_DIR", "ShardsafeTrainer"]
    assert sorted(lightning_integration.__all__) == [
        "ShardsafeDDPStrategy",
        "ShardsafeModelParallelStrategy",
        "load_from_checkpoint",
    ]


SUBPACKAGES = {
    "shardsafe.checkpoint": ["Layout", "LoadOptions", "SaveHooks", "SaveOptions", "VerifyMode"],
    "shardsafe.converters": [
        "Conversion",
        "ConvertOptions",
        "DcpLayout",
        "Format",
        "convert",
        "describe",
        "read_source",
    ],
    "shardsafe.interop": [
        "gather_optimizer_state_dict",
        "import_torch_checkpoint",
        "load_optimizer_state_dict",
    ],
    "shardsafe.distributed": [
        "Coordinator",
        "DEAD_AFTER_S",
        "Phase",
        "PhaseOutcome",
        "comm_device",
        "reset_store_requests",
        "store_requests",
        "world",
    ],
}


def test_the_subpackages_the_docs_send_users_to_are_pinned_too() -> None:
    """The docs name ``shardsafe.checkpoint.SaveOptions``, ``shardsafe.interop.*`` and the
    like: those subpackages' ``__all__`` are public surface as well, and every such name
    the README or docs/ mention is in one."""
    import importlib
    import re
    from pathlib import Path

    for module, names in SUBPACKAGES.items():
        assert sorted(importlib.import_module(module).__all__) == names, module
    root = Path(__file__).resolve().parents[2]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    mentioned = re.compile(r"\b(shardsafe\.(?:checkpoint|converters|interop|distributed))\.(\w+)")
    for page in pages:
        for module, name in mentioned.findall(page.read_text()):
            assert name in SUBPACKAGES[module], f"{page.name}: {module}.{name} is not public"
