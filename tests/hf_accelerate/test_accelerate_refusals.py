"""``shardsafe.accelerate`` in one process: what it refuses, and how, before anything is
written; and objects registered for checkpointing saved by the adapter that fits them."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from tests import forge

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from shardsafe._tree import PER_RANK  # noqa: E402
from shardsafe.accelerate import load_state, save_state, state_of  # noqa: E402
from shardsafe.adapters import find_adapter  # noqa: E402
from shardsafe.adapters.values import StatefulAdapter  # noqa: E402
from shardsafe.checkpoint.storage.local import LocalStorage  # noqa: E402
from shardsafe.protocol import SaveContext  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def accelerator() -> Iterator[Any]:
    """A one-process CPU Accelerator, its process-wide singletons reset afterwards."""
    made = accelerate.Accelerator(cpu=True)
    yield made
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def prepared(accelerator: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_state_hooks_are_refused_with_the_way_out(accelerator: Any, tmp_path: Path) -> None:
    prepared(accelerator)
    handle = accelerator.register_save_state_pre_hook(lambda models, weights, out: None)
    with pytest.raises(ValueError) as refused:
        save_state(accelerator, tmp_path / "c")
    assert str(refused.value) == (
        "the accelerator has 1 hook(s) registered with register_save_state_pre_hook: they "
        "save or load files in Accelerate's own layout, which a shardsafe checkpoint does "
        "not have. Register what they save with accelerator.register_for_checkpointing (any "
        "object with state_dict and load_state_dict), and remove the hooks"
    )
    assert not (tmp_path / "c").exists()
    handle.remove()
    save_state(accelerator, tmp_path / "c")
    accelerator.register_load_state_pre_hook(lambda models, input_dir: None)
    with pytest.raises(ValueError, match="1 hook\\(s\\) registered with register_load_state"):
        load_state(accelerator, tmp_path / "c")


def test_accelerates_safe_serialization_is_taken_as_ported(
    accelerator: Any, tmp_path: Path
) -> None:
    """A call ported from ``accelerator.save_state(dir, safe_serialization=True)`` failed
    with a bare ``TypeError: save() got an unexpected keyword argument`` (found in review);
    True is what shardsafe always does, and False (pickles) is refused saying so."""
    prepared(accelerator)
    assert save_state(accelerator, tmp_path / "c", safe_serialization=True) == str(tmp_path / "c")
    assert shardsafe.verify(tmp_path / "c").ok
    with pytest.raises(ValueError) as refused:
        save_state(accelerator, tmp_path / "d", safe_serialization=False)
    assert str(refused.value) == (
        "safe_serialization=False: shardsafe writes safetensors and JSON only and never "
        "pickles, as safe_serialization=True does; drop the argument"
    )
    assert not (tmp_path / "d").exists()


def test_no_directory_and_no_automatic_naming_is_refused(accelerator: Any) -> None:
    prepared(accelerator)
    with pytest.raises(ValueError, match="no output_dir given and automatic checkpoint naming"):
        save_state(accelerator)
    with pytest.raises(ValueError, match="no input_dir given and automatic checkpoint naming"):
        load_state(accelerator)


def test_a_registered_module_is_saved_by_parameter_name_and_restored(
    accelerator: Any, tmp_path: Path
) -> None:
    """A model registered rather than prepared (one sharded by hand, say) is a module to
    shardsafe: its tensors by name, resharded on load, not one pickled state dict."""
    model, _ = prepared(accelerator)
    extra = torch.nn.Linear(2, 2)
    accelerator.register_for_checkpointing(extra)
    saved = {k: v.clone() for k, v in extra.state_dict().items()}
    save_state(accelerator, tmp_path / "c")
    keys = {t.key for t in shardsafe.inspect(tmp_path / "c").tensors}
    assert {"custom_checkpoint_0/weight", "custom_checkpoint_0/bias"} <= keys
    assert "optimizer/model.weight/momentum_buffer" in keys  # by parameter name, not index
    with torch.no_grad():
        extra.weight.zero_()
        model.weight.zero_()
    accelerator.step = 7
    values = load_state(accelerator, tmp_path / "c")
    assert values == {"accelerator_step": 0}
    assert accelerator.step == 0
    assert torch.equal(extra.weight, saved["weight"])
    assert not torch.equal(model.weight, torch.zeros_like(model.weight))


class Tables:
    """A registered object that is not a module, with tensors under ``names``."""

    def __init__(self, *names: str) -> None:
        self.tables = {name: torch.full((3,), 5.0) for name in names}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.tables)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tables = dict(state)


class OwnAdapter(StatefulAdapter):
    """A user's adapter for :class:`Kept`: registered objects of its class are its own."""

    kind = "test-kept"

    def handles(self, obj: object) -> bool:
        return isinstance(obj, Kept)


class Kept(Tables):
    pass


shardsafe.register_adapter(OwnAdapter())


def test_registered_objects_are_saved_as_the_main_process_copy(
    accelerator: Any, tmp_path: Path
) -> None:
    """What one process can show of what ``test_accelerate.py`` shows on two (registered
    objects whose tensors differ per process come back as the main process's on both):
    a registered module stays itself in the state, so its parameters name an optimizer's
    state as before, another object is wrapped, each with every tensor the lowest rank's
    copy, in the built-in kinds (checkpoints written before load as they did); ranks whose
    object holds other tensors are refused, their non-tensor values are rank 0's; an
    object with a user's adapter is left to it."""
    prepared(accelerator)
    module, tables, kept = torch.nn.Linear(2, 2), Tables("a"), Kept("k")
    accelerator.register_for_checkpointing(module, tables, kept)
    state = state_of(accelerator)
    assert state["custom_checkpoint_0"] is module and state["custom_checkpoint_2"] is kept
    assert state["custom_checkpoint_1"].obj is tables
    for name in ("custom_checkpoint_0", "custom_checkpoint_1"):
        adapter = find_adapter(state[name], name)
        item = adapter.save(state[name], SaveContext(name=name, rank=1, world_size=2))
        assert item.chunks and all(c.lowest_rank_wins for c in item.chunks)
    save_state(accelerator, tmp_path / "c")
    kinds = {v.name: v.kind for v in shardsafe.inspect(tmp_path / "c").values}
    assert [kinds[f"custom_checkpoint_{i}"] for i in range(3)] == [
        "module", "stateful", "test-kept",
    ]  # fmt: skip
    tables.tables = {"a": torch.zeros(3)}
    load_state(accelerator, tmp_path / "c")
    assert torch.equal(tables.tables["a"], torch.full((3,), 5.0))

    adapter = find_adapter(state["custom_checkpoint_1"], "custom_checkpoint_1")
    assert adapter.merge([{"n": 0}, {"n": 1}]) == {"n": 0}
    with pytest.raises(shardsafe.CheckpointError) as refused:
        adapter.merge([{"a": {"__tensor__": "c/a"}}, {"b": {"__tensor__": "c/b"}}])
    assert str(refused.value) == (
        "its state_dict() holds other tensors on rank 1 than on rank 0. An object registered "
        "with accelerator.register_for_checkpointing is saved as the main process's copy, "
        "as Accelerate saves it, which needs the same keys on every process: give them to "
        "it (nothing was written)"
    )
    adapter = find_adapter(module, "custom_checkpoint_0")
    metas = [{"tensors": ["weight"], "extra": {"x": r}} for r in (0, 1)]
    assert adapter.merge(metas) == {"tensors": ["weight"], "extra": {"x": 0}}
    assert not adapter.handles(None) and not adapter.handles(torch.nn.Linear(2, 2))


def test_the_state_lists_what_accelerate_saves_in_its_order(accelerator: Any) -> None:
    model, optimizer = prepared(accelerator)
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.StepLR(optimizer, 2))
    loader = accelerator.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
    state = state_of(accelerator)
    assert list(state) == [
        "model", "optimizer", "scheduler", "dataloader", "rng", "accelerator_step",
    ]  # fmt: skip
    assert state["model"] is model and state["optimizer"] is optimizer
    assert state["scheduler"] is scheduler and state["dataloader"].dataloader is loader


def test_automatic_naming_on_an_object_store_takes_storage_options(
    s3_server: Any, s3_bucket: str
) -> None:
    """``storage_options`` reach the manager of ``project_dir/checkpoints`` (they were a
    TypeError from ``CheckpointManager.save``); other ones later are refused, naming why."""
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(
        project_dir=f"s3://{s3_bucket}/run", automatic_checkpoint_naming=True
    )
    accelerator = accelerate.Accelerator(cpu=True, project_config=config)
    try:
        model, _ = prepared(accelerator)
        options = {"client_kwargs": {"endpoint_url": s3_server.endpoint}}
        path = save_state(accelerator, storage_options=options)
        assert path == f"s3://{s3_bucket}/run/checkpoints/step-000000000"
        assert "run/checkpoints/step-000000000/manifest.json" in s3_server.keys(s3_bucket)
        saved = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.zero_()
        load_state(accelerator, storage_options=options)
        assert torch.equal(model.weight, saved)
        assert config.iteration == 1
        with pytest.raises(ValueError) as refused:
            save_state(accelerator, storage_options={"anon": True})
        assert str(refused.value) == (
            f"the checkpoints of s3://{s3_bucket}/run/checkpoints were opened with other "
            "storage_options: give the same ones to every save_state and load_state of this "
            "accelerator (or none after the first)"
        )
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_storage_options_for_a_local_directory_are_refused_before_anything_loads(
    accelerator: Any, tmp_path: Path
) -> None:
    prepared(accelerator)
    save_state(accelerator, tmp_path / "c")
    with pytest.raises(ValueError) as refused:
        load_state(accelerator, tmp_path / "c", storage_options={"anon": True})
    assert str(refused.value) == (
        f"storage_options were given for {str(tmp_path / 'c')!r}, which is a local path; "
        "they apply to object-store URLs (s3://..., gs://...) only"
    )


class Counter:
    """A registered object, as Accelerate's examples register one."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def test_an_object_the_resuming_accelerator_lacks_is_refused_before_anything_loads(
    accelerator: Any, tmp_path: Path
) -> None:
    """Saved with a registered object, loaded into an accelerator that has none: refused
    (Accelerate's own load_state raises too), not loaded without it, which left the
    object at its fresh state; the model is untouched. ``strict=False`` loads the rest."""
    model, _ = prepared(accelerator)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    counter.seen = 11
    save_state(accelerator, tmp_path / "c")
    accelerator._custom_objects.clear()  # the resuming script forgot to register it
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    with pytest.raises(shardsafe.CheckpointMismatchError) as refused:
        load_state(accelerator, tmp_path / "c")
    assert str(refused.value) == (
        "the checkpoint holds 'custom_checkpoint_0', which this accelerator has nothing to "
        "restore into: prepare the same models, optimizers, schedulers and dataloaders and "
        "register the same objects with accelerator.register_for_checkpointing, in the same "
        "order, as the run that saved it did; or pass strict=False to load only what the "
        "accelerator has"
    )
    assert torch.equal(model.weight, torch.zeros_like(model.weight))
    load_state(accelerator, tmp_path / "c", strict=False)
    assert torch.equal(model.weight, saved)


def test_a_saved_scaler_the_resuming_accelerator_lacks_is_left_unread(
    accelerator: Any, tmp_path: Path
) -> None:
    """The scaler is the accelerator's own (fp16 makes one): a resume without one changed
    the precision on purpose, so its saved scaler is not an object left behind."""
    model, _ = prepared(accelerator)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    try:
        save_state(accelerator, tmp_path / "c")
    finally:
        accelerator.scaler = None
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    load_state(accelerator, tmp_path / "c")
    assert torch.equal(model.weight, saved)


def test_a_scheduler_left_unprepared_is_refused_by_the_automatic_load_too(
    tmp_path: Path,
) -> None:
    """``load_state()`` under automatic naming: a scheduler saved but not prepared on
    resume is refused, not left at step 0."""
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = accelerate.Accelerator(cpu=True, project_config=config)
    try:
        _, optimizer = prepared(accelerator)
        accelerator.prepare(torch.optim.lr_scheduler.StepLR(optimizer, 2))
        save_state(accelerator)
        accelerator._schedulers.clear()
        with pytest.raises(shardsafe.CheckpointMismatchError, match="holds 'scheduler', which"):
            load_state(accelerator)
        assert config.iteration == 1
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {},
            "automatic checkpoint naming needs a project directory: build the Accelerator "
            "with ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True), or "
            "pass a directory to save_state and load_state",
        ),
        (
            {"project_dir": "run", "total_limit": 0},
            "ProjectConfiguration(total_limit=0) would keep no checkpoint: give the number of "
            "checkpoints to keep, 1 or more, or None to keep them all",
        ),
    ],
)
def test_automatic_naming_settings_it_cannot_follow_are_refused_by_their_names(
    settings: dict[str, Any], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``project_dir`` was a ``TypeError`` from ``os.path.join``; ``total_limit=0`` a
    ``ValueError`` about ``keep_last``, a name the user never set. Nothing is written."""
    from accelerate.utils import ProjectConfiguration

    monkeypatch.chdir(tmp_path)
    config = ProjectConfiguration(automatic_checkpoint_naming=True, **settings)
    accelerator = accelerate.Accelerator(cpu=True, project_config=config)
    try:
        prepared(accelerator)
        with pytest.raises(ValueError) as refused:
            save_state(accelerator)
        assert str(refused.value) == message
        assert os.listdir(tmp_path) == [] and config.iteration == 0
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


class SlowToCommit(LocalStorage):
    """Local storage whose manifest takes a second to write: an async save stays in flight."""

    def commit(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        time.sleep(1.0)
        super().commit(name, data, exclusive=exclusive)


def test_load_state_waits_for_the_save_in_flight_and_restores_it(tmp_path: Path) -> None:
    """``load_state()`` right after ``save_state(async_save=True)`` (a rollback to the
    newest checkpoint): the save in flight is the newest, so it is waited for and
    restored. It restored the checkpoint before it, with ``iteration`` set past both."""
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = accelerate.Accelerator(cpu=True, project_config=config)
    try:
        model, _ = prepared(accelerator)
        save_state(accelerator)  # step 0
        with torch.no_grad():
            model.weight.fill_(7.0)
        handle = save_state(accelerator, async_save=True, storage=SlowToCommit)  # step 1
        with torch.no_grad():
            model.weight.zero_()
        load_state(accelerator)
        assert torch.equal(model.weight, torch.full_like(model.weight, 7.0))
        assert config.iteration == 2
        assert handle.wait() == str(tmp_path / "checkpoints" / "step-000000001")
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.parametrize("newest", ["without its manifest", "damaged"])
def test_after_a_newest_step_passed_over_the_next_save_goes_after_it(
    tmp_path: Path, newest: str
) -> None:
    """``load_state()`` passes over a newest step it cannot load and restores the one
    before; ``iteration`` went to the one after the restored step, so with the newest's
    manifest gone the next save was refused as "not empty ... pick another path" (which
    automatic naming gives no way to do). It now goes after the passed-over step too."""
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = accelerate.Accelerator(cpu=True, project_config=config)
    steps = tmp_path / "checkpoints"
    try:
        model, _ = prepared(accelerator)
        save_state(accelerator)  # step 0
        with torch.no_grad():
            model.weight.fill_(7.0)
        save_state(accelerator)  # step 1
        if newest == "damaged":  # its last data byte flipped: the load falls back, warning
            shard = next((steps / "step-000000001").glob("shard-*"))
            data = bytearray(shard.read_bytes())
            data[-1] ^= 0xFF
            shard.write_bytes(bytes(data))
            with pytest.warns(UserWarning, match="could not load .*step-000000001"):
                load_state(accelerator)
        else:  # as an interrupted save's: passed over
            (steps / "step-000000001" / "manifest.json").unlink()
            load_state(accelerator)
        assert not torch.equal(model.weight, torch.full_like(model.weight, 7.0))
        assert config.iteration == 2
        assert save_state(accelerator) == str(steps / "step-000000002")
        assert shardsafe.verify(steps / "step-000000002").ok
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_a_checkpoint_accelerate_itself_wrote_is_refused_saying_so(
    accelerator: Any, tmp_path: Path
) -> None:
    """Not "no manifest.json ... a save into it may have been interrupted", which sends a
    user migrating from Accelerate looking for a crash; nothing is restored."""
    model, _ = prepared(accelerator)
    accelerator.save_state(str(tmp_path / "native"))
    with torch.no_grad():
        model.weight.zero_()
    with pytest.raises(shardsafe.CheckpointNotFoundError) as refused:
        load_state(accelerator, tmp_path / "native")
    assert str(refused.value) == (
        f"{tmp_path / 'native'} is a checkpoint Accelerate's own save_state wrote (it holds "
        "random_states_0.pkl, optimizer.bin, model.safetensors and no manifest.json): load it "
        "with accelerator.load_state; shardsafe.accelerate.load_state loads the checkpoints "
        "shardsafe.accelerate.save_state writes"
    )
    assert torch.equal(model.weight, torch.zeros_like(model.weight))


def test_checkpoints_accelerate_itself_named_are_pointed_to_by_the_automatic_load(
    tmp_path: Path,
) -> None:
    """A run switched from ``accelerator.save_state()`` with automatic naming keeps its
    ``checkpoint_<n>`` folders in the same ``project_dir/checkpoints``: ``load_state()``
    said "save one first", which sends the run (or a script that starts afresh on
    ``CheckpointNotFoundError``) training from scratch while they sit there."""
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = accelerate.Accelerator(cpu=True, project_config=config)
    try:
        prepared(accelerator)
        for _ in range(11):
            accelerator.save_state()
        (tmp_path / "checkpoints" / "checkpoint_99").mkdir()  # not Accelerate's: no files
        config.iteration = 0
        with pytest.raises(shardsafe.CheckpointNotFoundError) as refused:
            load_state(accelerator)
        root = tmp_path / "checkpoints"
        assert str(refused.value) == (
            f"no complete checkpoint shardsafe wrote in {root} to load, but Accelerate's own "
            f"save_state wrote {', '.join(f'checkpoint_{i}' for i in range(11))} there (no "
            "manifest.json): load the newest with accelerator.load_state(); "
            "shardsafe.accelerate.load_state loads the checkpoints "
            "shardsafe.accelerate.save_state writes"
        )
        assert config.iteration == 0
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.parametrize("bad", ["12abc", [3], None, 2.5, True, -1])
def test_a_step_that_is_not_a_number_of_steps_is_refused_before_anything_loads(
    accelerator: Any, tmp_path: Path, bad: Any
) -> None:
    """A checkpoint (from anyone) whose ``accelerator_step`` is not a whole number: the
    load restored everything, then ``int()`` raised a bare ``ValueError``/``TypeError``
    (or cut ``2.5`` and ``true`` to 2 and 1 without a word)."""
    model, _ = prepared(accelerator)
    state = state_of(accelerator)
    state["accelerator_step"] = bad
    shardsafe.save(tmp_path / "c", state)
    with torch.no_grad():
        model.weight.zero_()
    accelerator.step = 7
    with pytest.raises(shardsafe.CheckpointCorruptError) as refused:
        load_state(accelerator, tmp_path / "c")
    assert str(refused.value) == (
        f"the checkpoint's 'accelerator_step' is {bad!r}, not a number of steps (a whole "
        "number, 0 or more) as shardsafe.accelerate.save_state writes it; nothing was restored"
    )
    assert torch.equal(model.weight, torch.zeros_like(model.weight)) and accelerator.step == 7


@pytest.mark.parametrize("total_limit", [None, 1])
def test_a_restarted_script_that_did_not_load_is_told_the_accelerate_way_out(
    tmp_path: Path, total_limit: int | None
) -> None:
    """A script restarted without ``load_state()`` saves at ``iteration`` 0 over steps 0
    and 1 (or, with ``total_limit=1``, behind step 1 alone): refused, as before, but
    in the manager's words: "step-000000000 already holds a committed checkpoint ... or
    delete it first", or "CheckpointManager.load_latest(state), or resume='latest' in
    the Trainer"."""
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=total_limit
    )
    root = tmp_path / "checkpoints"
    try:
        accelerator = accelerate.Accelerator(cpu=True, project_config=config)
        prepared(accelerator)
        save_state(accelerator)
        save_state(accelerator)
        before = sorted(os.listdir(root))
        AcceleratorState._reset_state(True)  # the restarted script
        GradientState._reset_state()
        config.iteration = 0
        accelerator = accelerate.Accelerator(cpu=True, project_config=config)
        prepared(accelerator)
        with pytest.raises(shardsafe.CheckpointError) as refused:
            save_state(accelerator)
        assert str(refused.value) == (
            f"{root} already holds checkpoints up to step 1, and this accelerator's first "
            "save is step 0 (ProjectConfiguration.iteration): it did not resume from them. "
            "Call shardsafe.accelerate.load_state(accelerator) without input_dir before "
            "training, which restores the newest and sets iteration past it, or give this "
            "run another project_dir; nothing was written"
        )
        assert sorted(os.listdir(root)) == before and config.iteration == 0
        load_state(accelerator)  # the way out
        assert save_state(accelerator) == str(root / "step-000000002")
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _restarted_loading(tmp_path: Path, step_dir: str) -> tuple[Any, Any]:
    """Three automatic saves into ``tmp_path``, then the script restarted (iteration 0)
    loading ``checkpoints/<step_dir>`` by name: its accelerator and configuration."""
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = accelerate.Accelerator(cpu=True, project_config=config)
    prepared(accelerator)
    for _ in range(3):
        save_state(accelerator)
    AcceleratorState._reset_state(True)  # the restarted script
    GradientState._reset_state()
    config.iteration = 0
    accelerator = accelerate.Accelerator(cpu=True, project_config=config)
    prepared(accelerator)
    load_state(accelerator, tmp_path / "checkpoints" / step_dir)
    return accelerator, config


def test_a_rollback_by_name_is_told_how_to_continue_from_it(tmp_path: Path) -> None:
    """A script that loads an older automatic checkpoint by name (a rollback) and saves:
    it was told it "did not resume from them" and to call load_state without input_dir,
    which would undo the rollback (found in review)."""
    root = tmp_path / "checkpoints"
    try:
        accelerator, config = _restarted_loading(tmp_path, "step-000000001")  # rolling back
        with pytest.raises(shardsafe.CheckpointError) as refused:
            save_state(accelerator)
        assert str(refused.value) == (
            f"{root} already holds checkpoints up to step 2, and this accelerator's first "
            f"save is step 0 (ProjectConfiguration.iteration): it loaded "
            f"{root / 'step-000000001'}, not the newest. To continue from it, move the "
            f"checkpoints after step 1 out of {root} (shardsafe deletes none for you) and "
            "set accelerator.project_configuration.iteration = 2; to save after them "
            "instead, set it to 3; or give this run another project_dir. Nothing was written"
        )
        shutil.move(root / "step-000000002", tmp_path / "moved")  # the way out
        config.iteration = 2
        assert save_state(accelerator) == str(root / "step-000000002")
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_the_newest_loaded_by_name_is_told_to_set_iteration(tmp_path: Path) -> None:
    """A script that resumes by naming the newest automatic checkpoint and saves: it was
    told it loaded step 2 "not the newest" and to move "the checkpoints after step 2"
    out, although step 2 was the newest (found in review)."""
    root = tmp_path / "checkpoints"
    try:
        accelerator, config = _restarted_loading(tmp_path, "step-000000002")  # by name
        with pytest.raises(shardsafe.CheckpointError) as refused:
            save_state(accelerator)
        assert str(refused.value) == (
            f"{root} already holds checkpoints up to step 2, and this accelerator's first "
            f"save is step 0 (ProjectConfiguration.iteration): it loaded "
            f"{root / 'step-000000002'}, the newest, by name, and a load by name does not "
            "set iteration. To continue from it, set "
            "accelerator.project_configuration.iteration = 3, or load it with "
            "shardsafe.accelerate.load_state(accelerator) without input_dir, which loads "
            "the newest and sets iteration past it. Nothing was written"
        )
        assert sorted(os.listdir(root))[-1] == "step-000000002"
        config.iteration = 3  # the way out
        assert save_state(accelerator) == str(root / "step-000000003")
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.parametrize(
    ("kind", "engine"), [("DEEPSPEED", "DeepSpeed"), ("MEGATRON_LM", "Megatron-LM")]
)
def test_deepspeed_and_megatron_are_refused_as_the_docs_say(
    accelerator: Any, tmp_path: Path, kind: str, engine: str
) -> None:
    """docs/accelerate.md lists them under "What is refused", but a save went ahead and
    saved the engine's objects as plain torch ones. deepspeed is not installed here: the
    distributed type is set as Accelerate sets it when it prepares such a plugin (as
    test_accelerate.py sets FSDP)."""
    from accelerate.utils import DistributedType

    prepared(accelerator)
    shardsafe.save(tmp_path / "saved", state_of(accelerator))
    AcceleratorState().distributed_type = DistributedType(kind)
    message = (
        f"the accelerator runs {engine}, which saves its models and optimizers through its "
        "own engine; shardsafe.accelerate does not wrap it: use accelerator.save_state and "
        "accelerator.load_state"
    )
    with pytest.raises(ValueError) as refused:
        save_state(accelerator, tmp_path / "c")
    assert str(refused.value) == message and not (tmp_path / "c").exists()
    with pytest.raises(ValueError) as refused:
        load_state(accelerator, tmp_path / "saved")
    assert str(refused.value) == message


def test_the_folder_of_automatic_checkpoints_is_named_as_such(tmp_path: Path) -> None:
    """``load_state(accelerator, "project/checkpoints")`` (the folder, not a checkpoint in
    it) said it "has no manifest.json ... a save into it may have been interrupted",
    which sends the user looking for a crash."""
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = accelerate.Accelerator(cpu=True, project_config=config)
    try:
        prepared(accelerator)
        for _ in range(5):
            save_state(accelerator)
        with pytest.raises(shardsafe.CheckpointNotFoundError) as refused:
            load_state(accelerator, tmp_path / "checkpoints")
        folder = tmp_path / "checkpoints"
        assert str(refused.value) == (
            f"{folder} is a folder of checkpoints, not one checkpoint (the newest committed one "
            f"in it is {folder / 'step-000000004'}): pass one of them, or, with automatic "
            "checkpoint naming, call load_state(accelerator) without input_dir to load the newest"
        )
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


class _Forged:
    """A stateful object whose state is whatever a forger chose (saved as 'stateful', as a
    dataloader position is)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ({"iteration": "3"}, "holds iteration '3', not a whole number from 0 to"),
        ({"iteration": True}, "holds iteration True, not a whole number from 0 to"),
        ({"sampler": {"epoch": 1, "seed": 1 << 70}}, f"holds sampler seed {1 << 70}, not a"),
        ({"sampler": {"epoch": -1, "seed": 0}}, "holds sampler epoch -1, not a whole number"),
        ({"sampler": [1, 2]}, "holds sampler epoch None, not a whole number"),
        (
            {"sampler": {"epoch": 3, "seed": (1 << 64) - 1}},
            f"holds sampler seed {(1 << 64) - 1} and epoch 3, whose sum, the seed of the "
            f"epoch's shuffle, is past {(1 << 64) - 1}, the largest seed torch takes",
        ),
        ({PER_RANK: [{"iteration": "3"}]}, "holds, for rank 0, iteration '3', not a whole"),
    ],
)
def test_a_dataloader_position_out_of_range_is_refused_before_anything_loads(
    accelerator: Any, tmp_path: Path, edit: dict[str, Any], said: str
) -> None:
    """A dataloader position (from anyone) whose epoch counter or seed is no whole number
    in range: a string failed in ``int()`` after everything else was restored, and a seed
    of 2**70 only when the next epoch reseeded the sampler, mid-run."""
    from torch.utils.data import DataLoader

    model, _ = prepared(accelerator)
    accelerator.prepare(DataLoader(list(range(8)), batch_size=2))
    state = state_of(accelerator)
    saved = dict(state)
    saved["dataloader"] = _Forged({**state["dataloader"].state_dict(), **edit})
    if PER_RANK in edit:  # a per-rank record, as a save of positions that differed writes
        saved["dataloader"] = _Forged(state["dataloader"].state_dict())
    shardsafe.save(tmp_path / "c", saved)
    if PER_RANK in edit:
        doc = forge.read_manifest(tmp_path / "c")
        doc["values"]["dataloader"]["meta"] = edit
        forge.write_manifest(tmp_path / "c", doc)
    with torch.no_grad():
        model.weight.zero_()
    with pytest.raises(shardsafe.CheckpointCorruptError) as refused:
        load_state(accelerator, tmp_path / "c")
    assert said in str(refused.value)
    assert str(refused.value).startswith("the checkpoint's 'dataloader' holds")
    assert str(refused.value).endswith("; nothing was restored")
    assert torch.equal(model.weight, torch.zeros_like(model.weight))


def _seedable_run(path: Path, resume: bool, after_the_loop: bool = False) -> list[list[int]]:
    """Epochs 1 and 2 of 8 samples in batches of 2 under a seedable sampler; epoch 0's
    last batch saves, or its loop once ended (``resume``: loads that save instead of
    running epoch 0)."""
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from torch.utils.data import DataLoader

    set_seed(0)
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    made = accelerate.Accelerator(cpu=True, dataloader_config=config)
    try:
        loader = made.prepare(DataLoader(list(range(8)), batch_size=2, shuffle=True))
        if resume:
            load_state(made, path)
        else:
            for i, _ in enumerate(loader):
                if i == 3 and not after_the_loop:  # Accelerate has not counted the epoch yet
                    save_state(made, path)
            if after_the_loop:
                save_state(made, path)
        return [[x for batch in loader for x in batch.tolist()] for _ in range(2)]
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_a_save_at_an_epochs_last_batch_resumes_with_the_next_epochs_shuffle(
    tmp_path: Path,
) -> None:
    """The saved epoch counter was the finished epoch's (Accelerate counts it after the
    loop), and the resumed loader replayed that epoch's order, every later epoch one
    behind the uninterrupted run's."""
    uninterrupted = _seedable_run(tmp_path / "c", resume=False)
    assert _seedable_run(tmp_path / "c", resume=True) == uninterrupted
    assert _seedable_run(tmp_path / "d", resume=False, after_the_loop=True) == uninterrupted
    assert _seedable_run(tmp_path / "d", resume=True) == uninterrupted


def _resumed_twice(path: Path, run: str) -> list[list[int]]:
    """Orders of samples under a seedable sampler (8 samples, batches of 2). ``whole``:
    epochs 0-2. ``first``: epoch 0, then saves after epoch 1's first batch. ``second``:
    resumes there, finishes epoch 1 through ``skip_first_batches`` (saving in that copy's
    last batch), then runs epoch 2. ``third``: resumes from that save, runs one epoch."""
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from torch.utils.data import DataLoader

    def epochs(loader: Any, n: int) -> list[list[int]]:
        return [[x for batch in loader for x in batch.tolist()] for _ in range(n)]

    set_seed(0)
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    made = accelerate.Accelerator(cpu=True, dataloader_config=config)
    try:
        loader = made.prepare(DataLoader(list(range(8)), batch_size=2, shuffle=True))
        if run == "whole":
            return epochs(loader, 3)
        if run == "first":
            epochs(loader, 1)
            for _ in loader:
                save_state(made, path / "a")
                break
            return []
        if run == "third":
            load_state(made, path / "b")
            return epochs(loader, 1)
        load_state(made, path / "a")
        rest = []
        for i, batch in enumerate(made.skip_first_batches(loader, 1)):
            rest += batch.tolist()
            if i == 2:  # the last of the epoch's 4 batches
                save_state(made, path / "b")
        loader.set_epoch(loader.iteration + 1)
        return [rest, *epochs(loader, 1)]
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_a_save_in_the_last_batch_of_a_skipped_into_epoch_resumes_with_the_next_epochs_shuffle(
    tmp_path: Path,
) -> None:
    """A resumed run finishes its epoch through ``accelerator.skip_first_batches`` and
    saves in that copy's last batch (as the shipped example does): the copy, not the
    prepared loader, was Accelerate's active dataloader, so the saved epoch counter was
    the finished epoch's, and the next resume replayed that epoch's order, every later
    loss differing from the uninterrupted run's (found in review)."""
    whole = _resumed_twice(tmp_path, "whole")
    assert _resumed_twice(tmp_path, "first") == []
    assert _resumed_twice(tmp_path, "second") == [whole[1][2:], whole[2]]
    assert _resumed_twice(tmp_path, "third") == [whole[2]]
    assert len({tuple(order) for order in whole}) == 3  # the epochs' shuffles differ


class _Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        return iter(torch.arange(16.0).reshape(16, 1))


@pytest.mark.parametrize("with_eval", [False, True], ids=["alone", "beside an eval loader"])
def test_an_iterable_datasets_skipping_copy_counts_only_its_own_loaders_epoch(
    accelerator: Any, with_eval: bool
) -> None:
    """The copy ``skip_first_batches`` makes of an iterable dataset's loader names no
    loader it came from: saved in its last batch, its own loader's epoch is counted done;
    but an evaluation loader over the same dataset object had its counter bumped too,
    though it never ran (found in review). Where both could have made it, neither moves."""
    from torch.utils.data import DataLoader

    data = _Stream()
    loaders = [DataLoader(data, batch_size=4) for _ in range(2 if with_eval else 1)]
    prepared_loaders = accelerator.prepare(*loaders)
    train = prepared_loaders[0] if with_eval else prepared_loaders
    seen = None
    for _ in accelerator.skip_first_batches(train, 2):
        if accelerator.gradient_state.end_of_dataloader:  # the epoch's last batch
            seen = {k: v.state_dict() for k, v in state_of(accelerator).items() if "loader" in k}
    expected = {"dataloader": {"iteration": 0 if with_eval else 1}}
    if with_eval:
        expected["dataloader_1"] = {"iteration": 0}
    assert seen == expected
