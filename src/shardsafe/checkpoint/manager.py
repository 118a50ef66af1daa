"""A directory of step checkpoints with a ``latest`` pointer and retention.

Order of operations on save, chosen so that no crash loses the last good checkpoint:

1. write ``root/step-<step>`` (data files, then ``manifest.json`` atomically);
2. replace ``root/latest`` atomically (temp file, fsync, rename);
3. only then delete older checkpoints beyond ``keep_last``, and leftovers of saves that
   never committed. A checkpoint is first marked as being deleted, then loses its
   manifest, so a crash half-way through a deletion leaves a directory that is plainly
   not a checkpoint (and that the next save finishes deleting), never a broken one.

``latest()`` trusts manifests, not the pointer: it returns the newest step directory
whose checkpoint would load (manifest and data files checked, see :func:`problem_with`),
and warns about each newer one it passes over. The pointer file is for humans and other
tools.

What the manager touches: only entries of ``root`` named exactly as it names step
directories (``step-`` and at least nine ASCII digits), only if they are real
directories (a symlink is never followed, written through or deleted), and inside them
only regular files with names shardsafe writes. Anything else is left in place, with a
warning when it stops a deletion.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .. import _warnings
from ..distributed import world
from ..distributed.coordinator import rank_zero_answer
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from . import background, loading
from .background import SaveHandle
from .format.manifest import MANIFEST_NAME, Manifest
from .io.reader import CheckpointReader
from .io.staging import Stager
from .options import (
    LoadKeywords,
    LoadOptions,
    SaveHooks,
    SaveKeywords,
    SaveOptions,
    storage_factory,
)
from .refusals import tell_others, told_if_refused
from .saving import save as _save
from .storage.files import describe_mode
from .storage.locations import check_options, is_url, local_path, open_storage, path_text
from .storage.lock import RootLock
from .storage.protocol import Storage
from .storage.removal import delete_checkpoint
from .storage.store_failures import (
    StoreFailedError,
    UnansweredError,
    listing_errors,
    store_errors,
)
from .storage.target_directory import INCOMPLETE_MARKER

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # a dependency of torch's
    from typing_extensions import Unpack

_STEP_DIR = re.compile(r"step-([0-9]{9,})", re.ASCII)
LATEST = "latest"
_POINTER_TEMP = re.compile(r"\.latest\.tmp-[0-9]+", re.ASCII)
"""The temporary names of the pointer's commits (``commit_temp_name``: a pid), the only
ones of the root's other entries the manager removes, never a directory (a link is
unlinked itself): any name starting ``.latest.tmp-`` was removed, a file of yours with
it, and a directory so named failed every save after its commit (retention never ran)."""
_PROBE = re.compile(r"\.shardsafe\.probe-[0-9a-f]{32}", re.ASCII)
"""The names of :meth:`CheckpointManager.require_writable_root`'s probes (a uuid), removed
with the pointer's temporary files: one is left only by a process killed between
creating and removing it."""
_NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
_S = SaveOptions()


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def step_of(name: str) -> int | None:
    """The step of a directory name the manager writes, else ``None`` (``step-1``,
    ``step-0000000001`` and non-ASCII digits are not its names)."""
    match = _STEP_DIR.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dir_name(step) == name else None


class CheckpointManager:
    """Saves ``root/step-<step>`` checkpoints, keeps the newest ``keep_last`` of them.

    A fresh run (no :meth:`load_latest` or :meth:`latest` on this manager) whose first
    save goes into a root that already holds older checkpoints is warned once, on rank
    0: it is probably a second run over the first one's directory, whose retention would
    count the first run's steps as its own. Not at construction: the documented resume
    pattern calls ``load_latest`` on the next line, and a save behind the newest step is
    refused anyway, by an error that says what to do. ``warn_if_not_empty=False``
    silences the warning (the Trainer checks for itself before its first step).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep_last: int | None = None,
        *,
        warn_if_not_empty: bool = True,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if keep_last is not None and (
            not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
        ):  # 2.5 was taken, and every save then committed and raised a TypeError
            raise ValueError(
                f"keep_last={keep_last!r} must be an int, at least 1 (or None to keep all)"
            )
        root = path_text(root)
        check_options(root, storage_options)  # here, not at each rank's first save
        # A local root as the path it names (file:// read, a collapsed s3:/ URL refused)
        # here, not at the first save, whose rank 0 made the directory before looking.
        self.root = root.rstrip("/") if is_url(root) else local_path(root)
        self._made_in = None if is_url(self.root) or os.path.isabs(self.root) else _cwd()
        """The working directory a relative root names a directory of (see
        :meth:`_check_made_in`)."""
        self.keep_last = keep_last
        self.storage_options = storage_options
        self._lock = RootLock(self._root_storage)
        self._resumed_from: int | None = None
        self._passed_over: dict[int, str] = {}
        """Steps the last ``load_latest`` could not load and passed over, and why."""
        self._failed_loading = False  # a load_latest's candidate failed while loading
        self._considered: set[str] = set()  # the step directories it has looked at
        self._fresh = warn_if_not_empty
        """Whether the next save is this run's first and the run has not looked for a
        checkpoint to continue from (``latest``, ``load_latest``): see ``_warn_if_fresh``."""
        self._handle: SaveHandle | None = None
        self._stager = Stager()
        self._root_checked = False
        # What this manager's saves found already (rank 0): a step directory stays one, and
        # a committed step stays committed, so each save asks the store about new names
        # only. Asking about every kept step, twice, cost a save 11 requests per step kept
        # (1,704 at 150 steps on S3, 25 s: found in review).
        self._seen_dirs: set[str] = set()
        self._seen_committed: set[str] = set()
        self._seen_unmarked: set[str] = set()
        """Whether :meth:`require_writable_root` found the bucket (it asks once)."""

    def close(self) -> None:
        """Wait for a save in flight, then give up this process's claim on the root (also
        done at exit). Raises the save's error if nobody has seen it."""
        handle = self._handle
        if handle is not None:
            try:
                handle._settle()
            except BaseException:
                if not handle._finished.is_set():  # interrupted while it still writes:
                    raise  # keep the claim on the root, and the save to wait for again
                self._handle = None
                self._lock.release()
                raise
            self._handle = None
        self._lock.release()

    def path_for(self, step: int) -> str:
        return (
            f"{self.root}/{step_dir_name(step)}"
            if is_url(self.root)
            else (os.path.join(self.root, step_dir_name(step)))
        )

    def _root_storage(self) -> Storage:
        return open_storage(self._anchored_root(), storage_options=self.storage_options)

    def _anchored_root(self) -> str:
        """The root, anchored where the manager was made: latest and retention run on the
        writer thread after an async save's commit, while the caller may have moved on."""
        return self.root if self._made_in is None else os.path.join(self._made_in, self.root)

    def _check_made_in(self) -> None:
        """Refuse to go on with a relative root after an ``os.chdir``: the steps would go
        into the new directory's ``root`` while ``latest`` moved in the first one's (and a
        resume from the first never saw them)."""
        if self._made_in is None:
            return
        now = _cwd() or "a directory that was deleted"
        if now != self._made_in:
            raise ValueError(
                f"the working directory changed from {self._made_in} to {now} since "
                f"CheckpointManager({self.root!r}) was made, and its checkpoints are in "
                f"{os.path.join(self._made_in, self.root)}: give the manager that absolute "
                "root, or change back"
            )

    def save(
        self,
        step: int,
        state: Any,
        options: SaveOptions | None = None,
        **keywords: Unpack[SaveKeywords],
    ) -> str:
        """Save ``state`` as step ``step`` on every rank; return the checkpoint's path.

        The keyword arguments are those of :func:`shardsafe.save` (``SaveOptions``)
        but ``storage_options``, which is the manager's; ``options`` gives them as one
        :class:`SaveOptions` instead (the Trainer's way), the keywords overriding it.
        ``hooks`` run after the manager's own. The first save takes
        ``root/.shardsafe.lock`` for this process (see ``lock.py``): a second run saving
        into the same root gets a :class:`CheckpointError`.
        """
        path, opts = self._prepared(step, self._options(step, options, keywords))
        background.drain()  # one save in flight: an asynchronous one finishes first
        _save(path, state, opts)
        return path

    def async_save(
        self,
        step: int,
        state: Any,
        options: SaveOptions | None = None,
        *,
        overlap: bool = False,
        **keywords: Unpack[SaveKeywords],
    ) -> SaveHandle:
        """:meth:`save` in the background (see :func:`shardsafe.async_save`): returns once
        the state is staged; ``latest`` moves and retention runs after the commit.

        ``overlap=True`` returns before the copies to host memory have landed: call the
        handle's ``wait_staged()`` before changing the tensors (the Trainer overlaps the
        copies with its next step).
        """
        path, opts = self._prepared(step, self._options(step, options, keywords))
        self._handle = background.async_save(
            path, state, opts, self._stager, overlap=overlap, step=step
        )
        return self._handle

    def _options(
        self, step: int, options: SaveOptions | None, keywords: SaveKeywords
    ) -> SaveOptions:
        """The save's options; one refused on this rank alone is told to the others,
        under the name the save agrees under (they waited ``entry_timeout``, then said
        this rank never called ``save``)."""
        check_step(step)
        if "storage_options" in keywords:
            # The lock, latest and retention use the manager's: a save elsewhere would
            # make latest name a step that is not there.
            raise TypeError(
                "storage_options are the CheckpointManager's own; pass them to "
                "CheckpointManager(root, storage_options=...), not to each save"
            )

        def made() -> SaveOptions:
            self._check_made_in()
            return SaveOptions.of(options, **keywords)

        return told_if_refused("save", self.path_for(step), made)

    def _load_options(self, options: LoadKeywords) -> LoadOptions:
        """A load's options; one refused on this rank alone is told to the others, under
        the name ``load_latest`` first agrees under (see :meth:`_agreed_next`)."""
        _refuse_own_settings(options)

        def made() -> LoadOptions:
            self._check_made_in()
            return LoadOptions.of(**options)

        return told_if_refused("load", f"{self.root}#latest", made)

    def wait(self) -> str | None:
        """Wait for this manager's save in flight; return its path (``None`` if none), or
        raise its error."""
        handle = self._handle
        if handle is None:
            return None
        try:
            path = handle.wait()
        except BaseException:
            # Forgotten while it still wrote (Ctrl-C in the wait), close() returned at
            # once and gave up the root's lock under a save that went on to commit.
            if handle._finished.is_set():
                self._handle = None
            raise
        self._handle = None
        return path

    def _prepared(self, step: int, opts: SaveOptions) -> tuple[str, SaveOptions]:
        path = self.path_for(step)
        if world()[0] == 0 and not is_url(self.root):
            _make_root(self.root)
        self._warn_if_fresh(step)
        mine = SaveHooks(
            before_write=lambda: self._before_write(step, opts.hooks.before_write),
            after_commit=lambda: self._after_commit(step, opts.hooks.after_commit),
        )
        options = opts.storage_options or self.storage_options
        storage = functools.partial(storage_factory(opts.storage, options), follow=False)
        return path, SaveOptions.of(opts, storage=storage, hooks=mine, storage_options=options)

    def _warn_if_fresh(self, step: int) -> None:
        """On a fresh run's first save, warn (rank 0) if the root holds older checkpoints.

        Newer or equal ones are not warned about: that save is refused, and its error says
        what to do. Once per manager, and never after ``latest``/``load_latest``.
        """
        fresh, self._fresh = self._fresh, False
        if not fresh or world()[0] != 0:
            return
        try:
            steps = self._classified_steps(cached=True)[0]
        except UnansweredError as e:
            # A store that never answered: the save would wait out every timeout again
            # (210 s, not 108, at the defaults). This runs on rank 0 alone, before the
            # save's entry barrier: the others are told there, not left waiting at it.
            tell_others("save", self.path_for(step), e)
            raise
        except Exception:  # only a warning: the save itself then fails, agreed
            return
        if steps and steps[-1] < step:
            _warn(
                f"{self.root} already holds checkpoints up to step {steps[-1]} that this run "
                f"did not resume from; saving step {step} beside them. To continue that run, "
                "call load_latest(state) before training; to start afresh, use another root",
            )

    def _before_write(self, step: int, then: Callable[[], None] | None) -> None:
        """Runs on rank 0 before any data is written: own the root, and never go back in time."""
        if not self._lock.held:
            self.require_writable_root()
        try:
            self._lock.acquire()
        except OSError as e:  # the probe passed, then the permissions changed
            if is_url(self.root) or e.errno not in _NOT_WRITABLE:
                raise
            # Raw, it named only the lock's temporary file: '.shardsafe.lock.4a55...'.
            raise CheckpointError(_not_writable(self.root, e)) from e
        self.check_not_behind(step)
        self._check_pointer_replaceable()
        if then is not None:
            then()

    def require_writable_root(self, saves: bool = True) -> None:
        """Refuse, before anything is written (the Trainer: before its first step), a root
        no checkpoint could be saved in, naming it and saying what to do. ``saves=False``
        (a run that only resumes from the root and never saves there) leaves out the
        checks of permissions: a read-only directory of checkpoints to fine-tune from is
        fine then (review).

        On an object store, a root whose bucket does not exist (:meth:`_require_bucket`).
        On a filesystem the root is made as needed; something else in its place is
        refused (:func:`_require_directory_or_absent`), and so is a directory where
        ``latest`` belongs (:meth:`_check_pointer_replaceable`), or a root this process
        cannot create files in (:meth:`_require_creatable_files`), or, where the root is
        absent, cannot be made (:func:`_require_makeable`): a read-only
        ``run_dir/checkpoints`` was found by the first save, after all the training, as a
        bare 'Permission denied' naming the lock's temporary file and no directory."""
        if is_url(self.root):
            self._require_bucket()
            return
        _require_directory_or_absent(self.root)
        if os.path.isdir(self.root):
            self._check_pointer_replaceable()
            if saves:
                self._require_creatable_files()
        elif saves:
            _require_makeable(self._anchored_root())

    def _require_bucket(self) -> None:
        """On an object store, raise the save's error for a root whose bucket does not
        exist (shardsafe never creates one: ``make_directory``), naming it.

        Asked before a save's first write (the lock's PUT failed with the client's bare
        'The specified bucket does not exist'), and by a listing that found nothing (see
        :meth:`_step_dirs`): s3fs lists a missing bucket as empty, or as not found, and a
        resume with a mistyped bucket or endpoint started the run afresh, to fail at its
        first save. Once per manager: the Trainer asks before its first step, and the
        first save asked again, a round trip to the store for nothing."""
        if not is_url(self.root) or self._root_checked:
            return
        with self._store_errors(), self._root_storage() as root:
            root.make_directory()
        self._root_checked = True

    def _require_creatable_files(self) -> None:
        """Refuse an existing local root this process cannot create files in.

        A real probe (a file of a unique name created with ``O_EXCL|O_NOFOLLOW``, so no
        link is followed and nothing is overwritten, then removed), not ``os.access``:
        this asks the filesystem the very question the save will (a read-only mount, an
        ACL, a root-squashing NFS server or an immutable directory answer ``access``
        differently, or not at all), and it writes only inside the manager's own root."""
        name = f".shardsafe.probe-{uuid.uuid4().hex}"
        with self._root_storage() as root:
            try:
                root.touch(name)
            except OSError as e:
                if e.errno not in _NOT_WRITABLE:
                    raise
                raise CheckpointError(_not_writable(self.root, e)) from None
            root.remove(name)

    def _check_pointer_replaceable(self) -> None:
        """Refuse, before any data is written, a directory where ``latest`` belongs.

        The pointer is replaced by a rename, which a directory refuses: each save then
        committed its checkpoint and raised a bare ``IsADirectoryError`` from the rename,
        every time, and retention never ran. (A file, a symlink or a FIFO is replaced by
        the rename itself, never written through; an object store has no directories.)"""
        if is_url(self.root):
            return
        with self._root_storage() as root:
            if root.kind(LATEST) == "directory":
                raise CheckpointError(
                    f"{root.where(LATEST)} is a directory, where CheckpointManager keeps "
                    "its latest pointer (a one-line file naming the newest step); "
                    "shardsafe will not delete it. Move it away and save again; nothing "
                    "was written."
                )

    def _problem_of(self, name: str) -> str | None:
        """Why the checkpoint in step directory ``name`` would not load
        (:func:`problem_with`), or ``None``; for an error's advice, so a failure to look
        is the problem."""
        try:
            with self._open(name) as storage:
                return problem_with(storage)
        except (CheckpointError, OSError) as e:
            return f"{type(e).__name__}: {e}"

    def _after_commit(self, step: int, then: Callable[[], None] | None) -> None:
        self._publish(step)
        if then is not None:
            then()

    def check_not_behind(self, step: int) -> None:
        """Refuse to continue at ``step`` in a root that holds newer checkpoints.

        Going on would let retention delete this run's own checkpoints while keeping the
        newer ones of the other run, and ``latest()`` would name those. Deleting the
        newer ones silently could destroy the run the user wanted, so the user decides.
        """
        newer = []
        for found, name in self._step_dirs(known=self._seen_dirs):  # newest first
            if found <= step:
                break
            with contextlib.suppress(CheckpointError, OSError):
                if self._committed(name, cached=True):
                    newer.append(found)
        if not newer:
            return
        newer.sort()
        names = dict(self._step_dirs())  # listed once, not once per newer step
        problems = {
            s: self._passed_over.get(s) or self._problem_of(names.get(s, step_dir_name(s)))
            for s in newer
        }
        if all(problems.values()):
            # "Resume from the newest" is what the run did: they would not load. Asked of
            # the steps themselves too, not only of this object's load_latest: the Trainer
            # resumes through latest() in another process (found in review).
            resumed = self._resumed_from
            how = (
                f", resuming from step {resumed}. To continue from step {resumed}"
                if (resumed is not None)
                else ". To continue"
            )
            raise CheckpointError(
                f"{self.root} holds step {newer[-1]}, newer than step {step} that this run "
                f"is at, which would not load, so latest() and load_latest pass over it "
                f"({_shorter(problems[newer[-1]] or '')}){how}, move "
                f"{', '.join(step_dir_name(s) for s in newer[:5])}"
                f"{' ...' if len(newer) > 5 else ''} out of the root (or delete "
                f"{'it' if len(newer) == 1 else 'them'}); shardsafe will not delete "
                "checkpoints for you. Nothing was written."
            )
        if self._resumed_from is not None:
            how = f"this run resumed from step {self._resumed_from}, older than them"
        else:
            how = "this run did not resume from them"
        raise CheckpointError(
            f"{self.root} already holds step {newer[-1]}, newer than step {step} that this "
            f"run is at: {how}. Either resume from the newest "
            "(CheckpointManager.load_latest(state), or resume='latest' in the Trainer and "
            "--resume latest in shardsafe fit), or save into another root; shardsafe will not "
            f"delete {', '.join(step_dir_name(s) for s in newer[:5])}"
            f"{' ...' if len(newer) > 5 else ''} for you."
        )

    def _publish(self, step: int) -> None:
        """Runs on rank 0 right after the commit: move ``latest``, then apply retention."""
        with self._root_storage() as root:
            root.commit(LATEST, (step_dir_name(step) + "\n").encode())
            committed, unknown = self._classified_steps(cached=True)
            keep = self._kept(committed)
            for name in root.names():
                if (_POINTER_TEMP.fullmatch(name) or _PROBE.fullmatch(name)) and root.kind(
                    name
                ) != "directory":
                    root.remove(name)  # a pointer update killed half-way (a link: itself)
                if self._lock.is_stale_claim(root, name):
                    root.remove(name)  # a lock claim killed before its link
            broken: list[str | None] = []  # why the new step is not whole, once asked
            for found, name in self._step_dirs(known=self._seen_dirs):
                if found in committed and found not in keep and found != step and not broken:
                    broken.append(self._not_whole(step))
                    if broken[0] is not None:
                        _warn(
                            f"retention deleted no checkpoint: the new one, {self.path_for(step)}, "
                            f"is not whole in the store ({broken[0]}), which said it had stored "
                            "it; the older ones are what a restart can load"
                        )
                if found in committed and broken and broken[0] is not None:
                    continue
                if found in unknown and found != step:
                    # Counted as incomplete, it was deleted: one throttled request (S3's
                    # 503 SlowDown after its retries) cost a checkpoint keep_last kept,
                    # and an older one was kept in its place. The next save looks again.
                    _warn(
                        f"retention left {root.where(name)} in place: whether it is a "
                        f"complete checkpoint could not be read ({unknown[found]})"
                    )
                elif found not in keep and found != step and not self._damaged_among(found, keep):
                    for seen in (self._seen_dirs, self._seen_committed, self._seen_unmarked):
                        seen.discard(name)
                    delete_checkpoint(root, name, uncommitted=found not in committed)
                elif found != step:
                    self._drop_stale_marker(name)

    def _not_whole(self, step: int) -> str | None:
        """Why the committed ``step`` is not whole in the store, or ``None``: each data file
        its manifest names must be listed at its recorded size. Asked before retention
        deletes an older checkpoint: a store that answered a data object's upload with
        ``200`` and kept nothing made the new step unloadable, and ``keep_last`` then
        deleted the last one that loaded (found in review). One listing and the manifest:
        the data files' bytes are the load's to check."""
        try:
            with store_errors(self.root), self._open(step_dir_name(step)) as storage:
                recorded = loading.read_manifest_from(storage).files
                listed = storage.sizes()
        except (CheckpointError, OSError) as e:
            return f"{type(e).__name__}: {e}"
        for name, size in recorded.items():
            if name not in listed:
                return f"data file {name} is missing"
            if listed[name] != size:
                return f"data file {name} is {listed[name]} bytes, the manifest recorded {size}"
        return None

    def _kept(self, committed: list[int]) -> list[int]:
        """The committed steps retention keeps: the newest ``keep_last`` of those that
        load, as far as this run knows. A step ``load_latest`` passed over as damaged is
        not counted: counted, it pushed out the good step the run had just resumed from
        (Accelerate's automatic naming saves past it), leaving ``keep_last`` checkpoints
        of which one would not load (found in review)."""
        if self.keep_last is None:
            return committed
        good = [s for s in committed if s not in self._passed_over]
        return good[-self.keep_last :]

    def _damaged_among(self, step: int, keep: list[int]) -> bool:
        """Whether ``step`` is one ``load_latest`` passed over as damaged, newer than the
        oldest step kept: left in place (shardsafe deletes only what retention's window
        leaves behind, and the user may want to see why it failed), until it falls out."""
        return step in self._passed_over and bool(keep) and step > keep[0]

    def _drop_stale_marker(self, name: str) -> None:
        """A save killed between its manifest's commit and the marker's removal leaves a
        committed checkpoint that still carries the marker; remove it (harmless to loads,
        but not what a committed checkpoint holds)."""
        if name in self._seen_unmarked:  # looked at by an earlier save of this manager
            return
        with contextlib.suppress(CheckpointError, OSError), self._open(name) as storage:
            if name not in self._seen_committed and storage.kind(MANIFEST_NAME) != "file":
                return  # (one this manager found committed was asked already)
            if storage.kind(INCOMPLETE_MARKER) == "file":
                storage.remove(INCOMPLETE_MARKER)
            self._seen_unmarked.add(name)

    def _step_dirs(self, known: set[str] | None = None) -> Iterator[tuple[int, str]]:
        """``(step, name)`` of every real step directory under ``root``, newest first.

        ``known``: names already found to be directories, not asked again; each one found
        is added to it (a save's own bookkeeping: every load path asks afresh)."""
        try:
            # A store's client's own exception (botocore's EndpointConnectionError: not an
            # OSError) as a CheckpointError: the listing runs outside any agreed operation,
            # which would have made it one, and escaped a loop's ``except CheckpointError``.
            with self._store_errors():
                root = self._root_storage()
                listed = root.names_and_kinds()  # one listing, not a request per name
        except (FileNotFoundError, NotADirectoryError, CheckpointNotFoundError):
            # No root yet. Any other error is raised: a store's client that cannot be made
            # (a broken credentials file) read as "no checkpoint", and load_latest started
            # the run afresh without ever asking the store. Nor is a missing bucket a
            # fresh start (s3fs says NoSuchBucket as FileNotFoundError); a missing prefix
            # in an existing bucket is.
            self._require_bucket()
            return
        if not listed:
            self._require_bucket()  # ... or as an empty listing
        with root:
            found = sorted(((s, n) for n in listed if (s := step_of(n)) is not None), reverse=True)
            for step, name in found:
                if known is not None and name in known:
                    yield step, name
                    continue
                kind = listed[name]
                if kind == "directory":
                    if known is not None:
                        known.add(name)
                    yield step, name
                elif kind is not None:
                    _warn(f"{root.where(name)} is {root.describe(name)}, not a directory")

    def newest_committed_step(self, above: int | None = None) -> int | None:
        """The newest committed step (a step directory holding a regular
        ``manifest.json``) newer than ``above``, looked for newest first: one listing, and
        a look inside each step directory newer than the first committed one found."""
        for step, name in self._step_dirs():
            if above is not None and step <= above:
                return None
            with (
                contextlib.suppress(CheckpointError, OSError),
                store_errors(self.root),
                self._open(name) as storage,
            ):
                if storage.kind(MANIFEST_NAME) == "file":
                    return step
        return None

    def complete_steps(self) -> list[int]:
        """Steps of every committed checkpoint under ``root`` (a step directory holding a
        regular ``manifest.json``), oldest first."""
        self._check_made_in()
        return self._classified_steps()[0]

    def _classified_steps(self, cached: bool = False) -> tuple[list[int], dict[int, str]]:
        """:meth:`complete_steps`, and the steps that could not be classified, with why
        (the check of their manifest raised: a request the store refused, a directory
        that could not be opened). ``cached``: for a save's own checks, what this
        manager's saves found already is not asked again."""
        steps, unknown = [], {}
        for step, name in self._step_dirs(known=self._seen_dirs if cached else None):
            try:
                if self._committed(name, cached):
                    steps.append(step)
            except (CheckpointError, OSError) as e:
                unknown[step] = f"{type(e).__name__}: {e}"
        return sorted(steps), unknown

    def _committed(self, name: str, cached: bool) -> bool:
        """Whether step directory ``name`` holds a manifest (raises what asking raised);
        ``cached``: one this manager found committed is not asked again."""
        if cached and name in self._seen_committed:
            return True
        with store_errors(self.root), self._open(name) as storage:
            found = storage.kind(MANIFEST_NAME) == "file"
        if found and cached:
            self._seen_committed.add(name)
        return found

    def latest(self) -> str | None:
        """Path of the newest checkpoint that would load, or ``None`` if there is none.

        Newer step directories that would not (a damaged or symlinked manifest, a missing
        or resized data file) are passed over with a warning saying why.
        """
        self._fresh = False  # the caller is looking for a checkpoint to continue from
        self._check_made_in()
        background.drain()  # a save in flight is the newest checkpoint, once it commits
        return self._newest()

    def _newest(self) -> str | None:
        """:meth:`latest` as the root holds it now, waiting for no save (for an error's
        hint: draining there raised, and marked seen, a failed save's error that the
        hint's caller then dropped)."""
        return next(self._loadable(), None)

    def _loadable(self, considered: set[str] | None = None) -> Iterator[str]:
        """Paths of the checkpoints that pass :func:`problem_with`, newest first.

        Step directories named in ``considered`` are skipped, and every checkpoint yielded
        or passed over is added to it: a load that looks again after a failure neither
        retries a step nor warns twice about one it passed over, and looks again at a
        directory whose save had not committed yet (it may have since: the newer step a
        writer's retention deleted the one being read for). A load (``considered`` given)
        records the steps it passes over, with why, for retention and
        ``check_not_behind``."""
        for step, name in self._step_dirs():
            if considered is not None and name in considered:
                continue
            with self._store_errors(), self._open(name) as storage:
                if storage.kind(MANIFEST_NAME) is None:
                    continue  # an interrupted save (or one in flight), not a checkpoint
                problem = problem_with(storage)
            if considered is not None:
                considered.add(name)
            if problem is None:
                yield self.path_for_name(name)  # as spelled: what the ranks agree under
                continue
            _warn(f"passing over {self.path_for_name(name)}: {problem}")
            if considered is not None:
                self._passed_over[step] = problem

    def load_latest(self, state: Any, **options: Unpack[LoadKeywords]) -> dict[str, Any] | None:
        """Load the newest checkpoint into ``state``; ``None`` if there is none yet.

        ``options`` are those of :func:`shardsafe.load` (``strict``, ``entry_timeout``,
        ``timeout``, ``untrusted_bytes_limit``, ...). Returns what :func:`shardsafe.load`
        returns: the plain values the checkpoint holds (for the Trainer's checkpoints,
        ``{"trainer": {"step": ..., ...}}``). If the newest checkpoint turns out to be
        damaged while loading (nothing is restored then), the steps are listed again and
        the newest one not yet tried is loaded instead, with a warning: the next older one,
        or a newer one committed meanwhile (a writer's retention deleting the step being
        read); if every one is damaged, the newest one's error is raised.
        """
        if not isinstance(state, Mapping):  # a raw AttributeError from deep in the load
            loading.refuse_state(state, f"{self.root}#latest", self._load_options(options))
        return self._load_latest_chosen(lambda manifest: state, **options)

    def _load_latest_chosen(
        self, choose: Callable[[Manifest], Any], **options: Unpack[LoadKeywords]
    ) -> dict[str, Any] | None:
        """:meth:`load_latest`, with the state chosen from each candidate's manifest by
        ``choose`` (``loading.load_chosen``): a refusal it raises is every rank's, before
        anything is restored (``shardsafe.accelerate`` refuses a checkpoint holding objects
        the accelerator has nothing to restore into)."""
        opts = self._load_options(options)
        # A save of this process still in flight (``async_save``) is the newest
        # checkpoint: loaded before it committed, the one before it was restored, in
        # silence (the run then found its next save's step taken). Its error, if it
        # failed, is raised here, as the next save would.
        background.drain()
        self._fresh = False
        first: CheckpointCorruptError | None = None
        self._passed_over = {}
        self._failed_loading = False
        considered: set[str] = set()
        self._considered = considered
        candidates = self._loadable(considered)
        while (path := self._agreed_next(candidates, opts)) is not None:
            name = path.rstrip("/").rsplit("/", 1)[-1]
            try:  # opened inside the load: a node that cannot (its store's client) fails it
                values = loading.load_opening(
                    functools.partial(self._open, name), path, choose, opts
                )
            except CheckpointCorruptError as e:
                _warn(f"could not load {path}, looking for the newest checkpoint that loads: {e}")
                passed = step_of(name)
                if passed is not None:  # always: the candidates are step directories
                    self._passed_over[passed] = str(e)
                first = first or e
                self._failed_loading = True
                # Listed again, from the newest: a writer's retention may have deleted
                # this step while it was read, after committing a newer one, which the
                # first listing did not hold. The steps already looked at are skipped.
                candidates = self._loadable(considered)
                continue
            self._resumed_from = step_of(name)
            return values
        if first is not None:
            raise first
        return None

    def _agreed_next(self, candidates: Iterator[str], opts: LoadOptions) -> str | None:
        """The next of ``candidates`` (newest first) as rank 0 finds it, on every rank.

        Each rank looking on its own could see the store differently (a request that
        failed on one rank only, a save committed in between) and go on to load another
        step, or raise the store's error alone while the others waited out the load's
        ``entry_timeout`` to blame it for not calling ``load``. Rank 0 looks; its error
        is every rank's."""
        if world()[1] == 1:
            return self._next_loadable(candidates)
        return rank_zero_answer(
            "load",
            f"{self.root}#latest",
            lambda: self._next_loadable(candidates),
            timeout=opts.timeout,
            entry_timeout=opts.entry_timeout,
        )

    def _next_loadable(self, candidates: Iterator[str]) -> str | None:
        """The next of ``candidates``; at their end, if every committed step was passed
        over as damaged (and none failed while loading, whose error is raised then), the
        newest one's problem, raised: ``None`` said "no checkpoint yet", and the run
        started afresh beside a checkpoint that one missing object made unloadable
        (found in review)."""
        found = next(candidates, None)
        if found is None and self._passed_over and not self._failed_loading:
            # Listed once more first: a step committed since (whose retention deleted the
            # one passed over while it was looked at) is the one to load.
            found = next(self._loadable(self._considered), None)
        if found is None and self._passed_over and not self._failed_loading:
            step = max(self._passed_over)
            raise CheckpointCorruptError(
                f"no checkpoint under {self.root} would load, and so none was restored: the "
                f"newest, {self.path_for(step)}: {self._passed_over[step]}. Repair it (or load "
                "an older step by its path); to start afresh, delete the damaged steps or use "
                "another root"
            )
        return found

    def _store_errors(self) -> contextlib.AbstractContextManager[None]:
        """How a look at the root's steps reports its store's errors: on an object store,
        a refused request (gcsfs's 403, an ``OSError``) as a ``CheckpointError`` too."""
        return listing_errors(self.root) if is_url(self.root) else store_errors(self.root)

    def _open(self, name: str) -> Storage:
        where = self.path_for_name(name)
        if self._made_in is not None:  # where the manager was made (see _root_storage)
            where = os.path.join(self._made_in, where)
        return open_storage(where, follow=False, storage_options=self.storage_options)

    def path_for_name(self, name: str) -> str:
        return f"{self.root}/{name}" if is_url(self.root) else os.path.join(self.root, name)


def _shorter(text: str) -> str:
    return text if len(text) <= 200 else f"{text[:197]}..."


def check_step(step: Any) -> None:
    """Refuse a step no checkpoint can carry: the tiers send steps between ranks as
    int64, and a step of 2**63 saved locally, then broke every replication that followed
    with a raw overflow, after a wait of the whole timeout."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**63:
        raise ValueError(f"step={step!r} must be a non-negative int below 2**63")


def _refuse_own_settings(options: Mapping[str, Any]) -> None:
    """The manager finds and opens its steps itself: a load through other settings would
    be ignored, so they are refused."""
    if "storage_options" in options:
        raise TypeError(
            "storage_options are the CheckpointManager's own; pass them to "
            "CheckpointManager(root, storage_options=...), not to load_latest"
        )
    if "storage" in options:
        raise TypeError(
            "load_latest opens the manager's steps under its root; to load through "
            "another storage, call shardsafe.load(path, state, storage=...)"
        )


def loadable_manifest(storage: Storage) -> Manifest:
    """The manifest of the checkpoint in ``storage``, once cheap checks say it would load;
    else a ``CheckpointError`` (or ``OSError``) saying why.

    The manifest is read, checksummed and validated; every data file must be a regular
    file of the recorded size whose header matches its checksum. Tensor bytes are not
    read (``load`` checks those, and ``shardsafe verify`` checks all of them).
    """
    manifest = loading.read_manifest_from(storage)
    with CheckpointReader(storage, manifest) as reader:
        problems = reader.check_files()
    if problems:
        raise CheckpointCorruptError(problems[min(problems)])
    return manifest


def problem_with(storage: Storage) -> str | None:
    """Why the checkpoint in ``storage`` would not load (:func:`loadable_manifest`), or
    ``None``."""
    try:
        loadable_manifest(storage)
    except StoreFailedError:
        raise  # the store, not the checkpoint: passed over, the run rolled back
    except (CheckpointError, OSError) as e:
        return str(e)
    return None


def _cwd() -> str | None:
    """The working directory, or ``None`` where it was deleted (``os.getcwd`` raises)."""
    try:
        return os.getcwd()
    except OSError:
        return None


def _make_root(root: str) -> None:
    """Create the root on rank 0 before a save, if it can be; a failure is not raised here.

    This runs before the save's entry barrier, on rank 0 alone: raising would leave every
    other rank waiting at that barrier for ``entry_timeout`` (or, if rank 0 then exited,
    losing its store), instead of raising the same error. A root that cannot be made (a
    path through a regular file, a dangling symlink, a FIFO in its place) fails again
    inside the save, when rank 0 prepares the step directory, where the failure is agreed
    and every rank raises it."""
    with contextlib.suppress(OSError):
        os.makedirs(root, exist_ok=True)


def _require_directory_or_absent(root: str) -> None:
    """Refuse a local root that exists as anything but a directory (or a link to one).

    The Trainer asks before its first step: a file, a FIFO or a broken link named
    ``run_dir/checkpoints`` was found only by the first save, after ``checkpoint_every``
    steps of training, and a broken link then as a bare 'No such file or directory'."""
    if not os.path.lexists(root) or os.path.isdir(root):
        return
    what = describe_mode(os.stat(root).st_mode) if os.path.exists(root) else "a broken link"
    raise CheckpointError(
        f"{root} is {what}, not a directory, where the checkpoints belong; shardsafe will "
        "not follow or delete it: move it away, or save into another root (run_dir)"
    )


def _require_makeable(root: str) -> None:
    """Refuse an absent local root whose nearest existing parent this process cannot
    create a directory in (the save makes the root with its parents).

    ``os.access``, not a probe as in an existing root: that parent is outside the root,
    where the manager writes nothing. Asked with the effective ids (what ``mkdir`` uses),
    where the platform can. A parent that is not a directory is left to the save, whose
    error says what is in the way."""
    parent = os.path.dirname(os.path.abspath(root))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    effective = os.access in os.supports_effective_ids
    if os.path.isdir(parent) and not os.access(parent, os.W_OK | os.X_OK, effective_ids=effective):
        raise CheckpointError(
            f"{root} does not exist, and this process cannot create it in {parent} "
            f"(not writable by it), where the checkpoints belong: {_make_writable(parent)}"
        )


def _not_writable(root: str, error: OSError) -> str:
    """The message for a local root that files cannot be created in (``error``: why)."""
    why = error.strerror or type(error).__name__
    return (
        f"cannot create files in {root} ({why}), where the checkpoints belong: "
        f"{_make_writable(root)}"
    )


def _make_writable(directory: str) -> str:
    return (
        f"make {directory} writable (chmod u+w {directory}, or run as its owner), or save "
        "into another root (run_dir); nothing was written"
    )


def _warn(message: str) -> None:
    _warnings.warn(f"shardsafe: {message}")
