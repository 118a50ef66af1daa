"""``TrainerConfig``: every setting of a run, checked once, before any process starts."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..checkpoint.format.manifest_format import LAYOUTS, Layout
from ..checkpoint.options import SaveOptions
from ..checkpoint.storage.files import describe_mode, first_non_directory
from ..checkpoint.storage.locations import is_url, local_path, scheme
from ..errors import CheckpointError
from ..strategies import STRATEGIES
from ..tiers.manager import LOCAL_DEFAULTS, refuse_without_local_tier


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Settings of :class:`shardsafe.Trainer`; invalid values raise ``ValueError`` here."""

    max_steps: int
    """Train until this global step (counted from 1), also across resumes."""
    run_dir: str
    """Holds ``checkpoints/`` and ``metrics.jsonl``. An object-store URL
    (``s3://bucket/run``) holds the checkpoints; the metrics, appended line by line,
    stay local (see :attr:`metrics_path`). A ``file://`` URL is the local directory it
    names."""
    strategy: str = "single"
    devices: int = 1
    """Processes to train on. Under torchrun it must equal the world size torchrun set."""
    checkpoint_every: int | None = None
    """Save every this many steps and at the last step; ``None``: never save."""
    layout: Layout = "sharded"
    seed: int = 0
    keep_last: int | None = None
    """Keep this many newest checkpoints; ``None`` keeps all."""
    batch_size: int | None = None
    """Batch size per process, used only when ``fit`` is given a ``Dataset`` (refused
    beside a ``DataLoader`` whose own batch size differs)."""
    async_save: bool = False
    """Write checkpoints in the background (``shardsafe.async_save``): the step goes on
    while they are written; ``fit`` waits for the last one before it returns."""
    local_checkpoint_dir: str | None = None
    """A node-local directory (a tmpfs such as ``/dev/shm/run1``, or an NVMe path) for
    frequent checkpoints of each rank's own state, replicated to a rank on another node
    when the run spans several: the local tier of a :class:`shardsafe.TieredCheckpointManager`
    whose persistent tier is :attr:`checkpoint_dir`. ``resume="latest"`` then restores
    the newest step of either tier. ``None``: no local tier."""
    local_every: int = LOCAL_DEFAULTS["local_every"]
    """With :attr:`local_checkpoint_dir`: save to it every this many steps."""
    keep_local: int = LOCAL_DEFAULTS["keep_local"]
    """With :attr:`local_checkpoint_dir`: the newest local steps each node keeps, and one
    more until every rank has written the newest (its room is checked before the first
    save: ``keep_local + 2`` steps at most)."""

    def __post_init__(self) -> None:
        _path("run_dir", self.run_dir)
        object.__setattr__(self, "run_dir", _local_if_file_url(self.run_dir))
        if not isinstance(self.strategy, str) or self.strategy not in STRATEGIES:
            raise ValueError(
                f"strategy={self.strategy!r} is not a strategy; use one of {sorted(STRATEGIES)}"
            )
        _positive("devices", self.devices)
        _positive("max_steps", self.max_steps)
        if self.strategy == "single" and self.devices != 1:
            raise ValueError(
                f"devices={self.devices} needs several processes, but strategy='single' runs "
                "one; use strategy='ddp' (or 'zero', 'fsdp'), or devices=1"
            )
        if self.checkpoint_every is not None:
            _positive("checkpoint_every", self.checkpoint_every, "or None to never save")
        if self.keep_last is not None:
            _positive("keep_last", self.keep_last, "or None to keep every checkpoint")
        if self.batch_size is not None:
            _positive("batch_size", self.batch_size)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not a layout; use one of {LAYOUTS}")
        self._check_seed()
        if not isinstance(self.async_save, bool):
            raise ValueError(f"async_save={self.async_save!r} must be True or False")
        if not self.run_dir:
            raise ValueError("run_dir='' is empty; name a directory, e.g. run_dir='runs/exp1'")
        _directory_or_absent("run_dir", self.run_dir)
        self._check_local_tier()
        self._check_something_is_saved()

    def _check_seed(self) -> None:
        """Each rank seeds numpy's global generator with ``seed + rank``, which numpy
        takes only below 2**32: a larger seed failed in the workers with numpy's
        traceback, and ``2**32 - 1`` on rank 1 alone."""
        largest = 2**32 - self.devices
        if (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not (0 <= self.seed <= largest)
        ):
            raise ValueError(
                f"seed={self.seed!r} must be an int from 0 to {largest} (rank r seeds "
                f"numpy with seed + r, which must be below 2**32)"
            )

    def _check_something_is_saved(self) -> None:
        """``keep_last``, ``layout`` and ``async_save`` shape saves; a run that saves none
        would accept them and silently do nothing (as ``local_every`` without its tier).
        ``keep_last`` and ``layout`` shape the run directory's checkpoints only: a run
        that writes only the local tier (which keeps its newest 2 steps, each rank's own)
        accepted them too, and did nothing with them."""
        shaping = [
            ("keep_last", self.keep_last, None),
            ("layout", self.layout, "sharded"),
            ("async_save", self.async_save, False),
        ]
        if self.checkpoint_every is not None:
            return
        for field, value, default in shaping:
            if value == default:
                continue
            if self.local_checkpoint_dir is None:
                raise ValueError(
                    f"{field}={value!r} applies to checkpoints, but this run saves none; "
                    "pass checkpoint_every=N (--checkpoint-every N) too, or leave "
                    f"{field} out"
                )
            if field != "async_save":  # the local tier's saves are asynchronous too
                raise ValueError(
                    f"{field}={value!r} applies to the checkpoints of checkpoint_every, but "
                    f"this run writes only the local tier (which keeps its newest "
                    f"{self.keep_local} steps, each rank's own); pass checkpoint_every=N "
                    f"(--checkpoint-every N) too, or leave {field} out"
                )

    def _check_local_tier(self) -> None:
        _positive("local_every", self.local_every)
        _positive("keep_local", self.keep_local)
        if self.local_checkpoint_dir is None:
            refuse_without_local_tier({f: getattr(self, f) for f in LOCAL_DEFAULTS})
            return
        _path("local_checkpoint_dir", self.local_checkpoint_dir, ", or None for no local tier")
        local = _local_if_file_url(self.local_checkpoint_dir)
        object.__setattr__(self, "local_checkpoint_dir", local)
        if not local:
            raise ValueError(
                "local_checkpoint_dir='' is empty; name a node-local directory, e.g. "
                "local_checkpoint_dir='/dev/shm/run1', or pass None for no local tier"
            )
        _directory_or_absent("local_checkpoint_dir", local)
        if is_url(local):
            raise ValueError(
                f"local_checkpoint_dir={local!r} is a URL; the local tier is a directory on "
                "each node's own disk (e.g. '/dev/shm/run1'); an object store belongs in run_dir"
            )
        if not is_url(self.run_dir) and _overlap(local, self.checkpoint_dir):
            raise ValueError(
                f"local_checkpoint_dir={local!r} overlaps the persistent checkpoints in "
                f"{self.checkpoint_dir}; give the local tier a directory of its own, e.g. "
                "'/dev/shm/run1'"
            )

    @property
    def checkpoint_dir(self) -> str:
        if is_url(self.run_dir):
            return f"{self.run_dir.rstrip('/')}/checkpoints"
        return os.path.join(self.run_dir, "checkpoints")

    @property
    def metrics_path(self) -> str:
        """``run_dir/metrics.jsonl``; for a URL run_dir (objects cannot be appended to),
        ``metrics/<scheme>-<bucket>+<path>.jsonl`` in the working directory of rank 0
        (:func:`_flat_name`: one file name per run)."""
        if is_url(self.run_dir):
            rest = self.run_dir.split("://", 1)[1].strip("/")
            return os.path.join("metrics", f"{scheme(self.run_dir)}-{_flat_name(rest)}.jsonl")
        return os.path.join(self.run_dir, "metrics.jsonl")

    @property
    def save_options(self) -> SaveOptions:
        """How every checkpoint of the run is saved (the options object ``save`` takes)."""
        return SaveOptions(layout=self.layout)

    def checkpoint_due(self, step: int) -> bool:
        every = self.checkpoint_every
        return every is not None and (step % every == 0 or step == self.max_steps)


def _path(field: str, value: object, or_else: str = "") -> None:
    """Refuse, naming the field, a value that is not a path (a number or ``None`` read
    from a config file): ``os.fspath``'s bare ``TypeError`` named neither."""
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{field}={value!r} must be a path (a str or os.PathLike){or_else}")


def _local_if_file_url(path: str | os.PathLike[str]) -> str:
    """``path``, with a ``file://`` URL made the local path it names (an object-store URL
    kept, a URL that is neither refused: ``locations.local_path``).

    ``file://`` is a local path everywhere in shardsafe; kept as a URL here, the run's
    metrics and lock went to a directory literally named ``file:`` in the working
    directory, and the first save, after the steps before it had trained, failed.
    """
    text = os.fspath(path)
    if is_url(text):
        return text
    try:
        return local_path(text)
    except CheckpointError as e:  # a file URL of another host; a collapsed s3:/ URL
        raise ValueError(str(e)) from None


def _directory_or_absent(field: str, path: str) -> None:
    """A local ``path`` that exists must be a directory: a run_dir that is a file failed
    only once the workers ran, with a bare ``[Errno 17] File exists``."""
    if is_url(path) or os.path.isdir(path):
        return
    if not os.path.lexists(path):
        blocker = first_non_directory(path)  # run/afile/sub: failed later, exit 1
        if blocker is not None:
            what = describe_mode(os.stat(blocker).st_mode)
            raise ValueError(
                f"{field}={path!r} is under {blocker}, which is {what}, not a directory; "
                "name a directory"
            )
        return
    what = describe_mode(os.stat(path).st_mode) if os.path.exists(path) else "a broken link"
    raise ValueError(f"{field}={path!r} is {what}, not a directory; name a directory")


def _flat_name(path: str) -> str:
    """``path`` as one file name, different for different paths: ``/`` becomes ``+``,
    and any other character but letters, digits, ``-``, ``_`` and ``.`` becomes ``%XX``.

    Both ``/`` and ``_`` used to become ``_``, so ``s3://b/exp_1`` and ``s3://b/exp/1``
    shared one metrics file, and a new run of one cut the other's losses from it.
    """
    kept = "-_."
    return "".join(
        c if (c.isascii() and c.isalnum()) or c in kept else "+" if c == "/" else _escaped(c)
        for c in path
    )


def _escaped(c: str) -> str:
    """``%XX`` for each byte of ``c`` in UTF-8."""
    return "".join(f"%{b:02X}" for b in c.encode())


def _overlap(a: str, b: str) -> bool:
    """Whether one of the two directories is the other or inside it."""
    a, b = os.path.abspath(a), os.path.abspath(b)
    return os.path.commonpath([a, b]) in (a, b)


def _positive(field: str, value: object, alternative: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        fix = f"; pass an int >= 1 {alternative}".rstrip()
        raise ValueError(f"{field}={value!r} must be a positive int{fix}")
