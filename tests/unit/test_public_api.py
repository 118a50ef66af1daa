"""The public surface is exactly what ``__all__`` lists; anything else is private."""

from __future__ import annotations

import inspect

import shardsafe

PUBLIC = [
    "Adapter",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "RNGState",
    "SaveHandle",
    "Trainer",
    "TrainingModule",
    "__version__",
    "async_save",
    "convert",
    "load",
    "read_manifest",
    "register_adapter",
    "save",
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
    for fn in (shardsafe.save, shardsafe.async_save, shardsafe.load):
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params[:2]] == ["path", "state"]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:]), fn
    assert inspect.signature(shardsafe.save).parameters["layout"].default == "sharded"
    assert inspect.signature(shardsafe.load).parameters["strict"].default is True


def test_version_is_a_string() -> None:
    assert isinstance(shardsafe.__version__, str) and shardsafe.__version__.count(".") >= 2
