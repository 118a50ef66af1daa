"""Saving under a name that may already hold a checkpoint: stage, commit, then swap in.

``shardsafe.save`` never overwrites a committed checkpoint, yet some callers must reuse a
name: PyTorch Lightning writes ``last.ckpt`` again at every save, and
``trainer.save_checkpoint(path)`` overwrites ``path``. So the save (``replacing.py``,
which runs it) goes to a hidden
staging directory next to the target, ``.<name>.shardsafe-partial``, is committed there
(manifest last), and only then takes the target's name:

* with no checkpoint under the name, by one ``rename``;
* over an older checkpoint, by an atomic exchange of the two names (Linux
  ``renameat2(RENAME_EXCHANGE)``), so the name always holds a complete checkpoint, the old
  or the new; where the exchange is unavailable, by two renames (the name is absent for
  the instant between them; both checkpoints stay complete on disk throughout);
* over a symbolic link (Lightning's ``save_last="link"``), by removing the link itself,
  never what it points at.

* over a Lightning ``.ckpt`` file (``torch.save``'s zip format; a run switched from
  Lightning's own strategy finds one under ``last.ckpt``), as over an older checkpoint:
  Lightning's own save would overwrite it too.

A name holding anything else (another file, a directory with files shardsafe did not
write) is refused before anything is written. The replaced checkpoint is deleted by the rules of
:mod:`.removal`. A staging directory left committed by a crash between the commit and
the rename is skipped by every rank alike (each picks the first staging name without a
manifest, which needs no communication) and deleted after the next successful save.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...errors import CheckpointError
from ..format.manifest import MANIFEST_NAME
from .leftovers import is_deletion
from .local import LocalStorage
from .protocol import Storage
from .removal import delete_checkpoint, foreign_entries
from .target_directory import remove_uncommitted

STAGING_SUFFIX = ".shardsafe-partial"
QUIET_S = 300.0
"""A staging directory unchanged this long is not a save in progress (``clear_interrupted``)."""
_STAGING = re.compile(r"\.(.+)" + re.escape(STAGING_SUFFIX) + r"(?:-[0-9]+)?")
"""A staging directory's name; its group, the name it is staged for."""
LIGHTNING_SUFFIX = ".ckpt"
_ZIP_MAGIC = b"PK\x03\x04"
_RENAME_EXCHANGE = 2
_MAX_STAGING = 100


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint goes (``parent/name``) and where it is staged meanwhile."""

    parent: str
    name: str
    staging: str

    @classmethod
    def of(cls, path: str) -> Placement:
        """The placement of ``path``; every rank computes the same one from the filesystem."""
        parent, name = os.path.split(os.path.abspath(path))
        if not name or name in (".", ".."):
            raise ValueError(f"{path!r} does not name a checkpoint directory")
        return cls(parent, name, _free_staging_name(parent, name))

    @property
    def path(self) -> str:
        return os.path.join(self.parent, self.name)

    @property
    def staging_path(self) -> str:
        return os.path.join(self.parent, self.staging)

    def check(self) -> None:
        """Refuse, before anything is written, a target that is not ours to replace."""
        with LocalStorage(self.parent) as parent:
            self._refuse_foreign(parent)

    def _refuse_foreign(self, parent: LocalStorage) -> None:
        refuse_foreign(parent, self.name)

    def publish(self) -> None:
        """Give the committed staging directory the target's name (rank 0, after commit)."""
        with LocalStorage(self.parent) as parent:
            self._refuse_foreign(parent)  # again: it may have changed since check()
            kind = parent.kind(self.name)
            if kind is None:
                _rename(parent, self.staging, self.name)
            elif kind == "symlink":
                parent.remove(self.name)  # the link itself, never its target
                _rename(parent, self.staging, self.name)
            elif _exchange(parent.fd, self.staging, self.name):
                parent.sync_directory()
                _delete_replaced(parent, self.staging, kind)  # now the replaced one
            else:
                _replace_in_two_renames(parent, self.staging, self.name, kind)
            _delete_committed_leftovers(parent, self.name)


def refuse_foreign(parent: Storage, name: str) -> None:
    """Refuse, before anything is written, a target ``parent/name`` that is not ours to
    replace (the rules in the module docstring)."""
    problem = _not_replaceable(parent, name)
    if problem is not None:
        raise CheckpointError(
            f"{parent.where(name)} {problem}, so shardsafe will not replace it with the new "
            "checkpoint (it only ever replaces a checkpoint it wrote). Move it away, or "
            "save under another name."
        )


def clear_interrupted(parent: str, *, quiet_for: float = QUIET_S) -> list[str]:
    """Delete the staging directories of saves into ``parent`` that never committed (a run
    interrupted mid-save, by Ctrl-C or a kill), by the rules of ``target_directory``: only
    what such a save wrote, and the directory only if that empties it. One whose files
    changed in the last ``quiet_for`` seconds is left alone: it may be another run's save
    in progress (two runs sharing a directory). Committed ones (a crash between the commit
    and the rename) are kept: each is a whole checkpoint, deleted after the next
    successful save of its name; one whose name a background save held empty is given
    that name (:func:`_publish_into_held_name`), and the empty name of one cleared goes
    with it (:func:`_release_held_name`). A checkpoint whose deletion was interrupted
    (:func:`_finish_deletion`) is deleted too. Returns the names deleted."""
    cleared: list[str] = []
    root = LocalStorage(parent, follow=True)
    with root:
        try:
            names = root.names()
        except (OSError, CheckpointError):
            return cleared  # no directory yet: nothing was interrupted there
        for name in names:
            if root.kind(name) != "directory":
                continue
            if _STAGING.fullmatch(name) is None:
                if _finish_deletion(root, name):
                    cleared.append(name)
                continue
            with contextlib.suppress(OSError, CheckpointError):
                with root.child(name) as staged:
                    if _changed_within(staged, quiet_for):
                        continue
                    committed = staged.exists(MANIFEST_NAME)
                    if not committed:
                        remove_uncommitted(staged)
                if committed:
                    _publish_into_held_name(root, name)
                elif root.kind(name) is None:
                    cleared.append(name)
                    _release_held_name(root, name)
    return cleared


def _finish_deletion(root: LocalStorage, name: str) -> bool:
    """Delete ``root/name`` if it is a checkpoint whose deletion was interrupted: its
    manifest gone and its marker a record of the deletion (``leftovers.is_deletion``).
    Lightning's ``save_top_k`` deletes an old checkpoint by its name, which no later save
    takes again: a kill between its manifest and its data files left them there for good
    (found by a kill test on a loaded machine). Returns whether it was deleted. No quiet
    time is waited: two runs that delete the same checkpoint both want it gone."""
    with contextlib.suppress(OSError, CheckpointError):
        with root.child(name) as step:
            if step.exists(MANIFEST_NAME) or not is_deletion(step):
                return False
        delete_checkpoint(root, name, replaced=False, uncommitted=True)
        return root.kind(name) is None
    return False


def committed_staging(parent: str, name: str) -> str | None:
    """The path of a committed staging directory of ``parent/name`` (a crash between the
    commit and the rename left it), or ``None``."""
    for staging in _staging_names(name):
        path = os.path.join(parent, staging)
        if not os.path.lexists(path):
            return None
        real = os.path.isdir(path) and not os.path.islink(path)
        if real and os.path.lexists(os.path.join(path, MANIFEST_NAME)):
            return path
    return None


def _publish_into_held_name(root: LocalStorage, staging: str) -> None:
    """Finish the save whose committed ``staging`` directory a crash left before the
    rename, if its name is held empty (``_held_name``): a later run's ``ModelCheckpoint``
    then finds the checkpoint under its name (and ``last.ckpt`` a link to it), where the
    whole checkpoint stayed hidden for good, its name never saved again."""
    held = _held_name(root, staging)
    if held is not None:
        _rename(root, staging, held)


def _held_name(root: LocalStorage, staging: str) -> str | None:
    """The target name of ``staging`` if it is an empty directory (a name a background
    save held from its start), else ``None``."""
    match = _STAGING.fullmatch(staging)
    if match is None or root.kind(match.group(1)) != "directory":
        return None
    with root.child(match.group(1)) as held:
        return None if held.names() else match.group(1)


def _release_held_name(root: LocalStorage, staging: str) -> None:
    """Remove the target name of the cleared ``staging`` directory if it is an empty
    directory: the name a background save held from its start (the Lightning strategies'
    ``cleanup.hold_name``), which the interrupted save never filled. Left there, the
    next run's ``ModelCheckpoint`` saw it taken and saved that step as ``-v1``."""
    with contextlib.suppress(OSError, CheckpointError):
        held = _held_name(root, staging)
        if held is not None:
            root.remove_child(held)


def _changed_within(directory: LocalStorage, seconds: float) -> bool:
    """Whether the directory or a name in it was modified in the last ``seconds``."""
    newest = os.stat(".", dir_fd=directory.fd).st_mtime
    for name in directory.names():
        newest = max(newest, os.stat(name, dir_fd=directory.fd, follow_symlinks=False).st_mtime)
    return time.time() - newest < seconds


def _staging_names(name: str) -> list[str]:
    first = f".{name}{STAGING_SUFFIX}"
    return [first] + [f"{first}-{i}" for i in range(1, _MAX_STAGING)]


def _free_staging_name(parent: str, name: str) -> str:
    """The first staging name that holds no committed checkpoint (a crash's leftover)."""
    try:
        root = LocalStorage(parent)
        root.fd  # noqa: B018 - opens it
    except (FileNotFoundError, NotADirectoryError):
        return _staging_names(name)[0]  # nothing there yet: rank 0 creates it while saving
    with root:
        for candidate in _staging_names(name):
            if not _taken(root, candidate):
                return candidate
    raise CheckpointError(
        f"{parent} holds {_MAX_STAGING} committed leftovers .{name}{STAGING_SUFFIX}*; delete them"
    )


def _taken(root: Storage, name: str) -> bool:
    """True if ``root/name`` is taken: a committed checkpoint, a link, or not a directory."""
    kind = root.kind(name)
    if kind is None:
        return False
    if kind != "directory":
        return True
    try:
        with root.child(name) as staged:
            return staged.kind(MANIFEST_NAME) is not None
    except (OSError, CheckpointError):
        return True


def _not_replaceable(parent: Storage, name: str) -> str | None:
    """Why ``parent/name`` may not be replaced, or ``None`` if it may (absent, a link, or
    a directory holding only what shardsafe writes)."""
    kind = parent.kind(name)
    if kind in (None, "symlink"):
        return None
    if kind == "file":
        if _lightning_file(parent, name):
            return None  # Lightning's own save would overwrite it too
        return "is a file (a checkpoint saved without shardsafe?), not a checkpoint directory"
    if kind != "directory":
        return f"is {parent.describe(name)}, not a checkpoint directory"
    with parent.child(name) as existing:
        foreign = foreign_entries(existing)
    if foreign:
        return f"holds {foreign[:3]}, which shardsafe did not write"
    return None


def _rename(parent: LocalStorage, source: str, target: str) -> None:
    os.rename(source, target, src_dir_fd=parent.fd, dst_dir_fd=parent.fd)
    parent.sync_directory()


def _replace_in_two_renames(parent: LocalStorage, staging: str, name: str, kind: str) -> None:
    old = f".{name}.shardsafe-old"
    if parent.kind(old) == "directory":
        delete_checkpoint(parent, old)  # a leftover of a crash between the two renames
    elif parent.kind(old) == "file" and _zip_file(parent, old):
        parent.remove(old)  # a replaced .ckpt file, left by the same crash
    _rename(parent, name, old)
    _rename(parent, staging, name)
    _delete_replaced(parent, old, kind)


def _delete_replaced(parent: Storage, name: str, kind: str) -> None:
    """Delete what the new checkpoint replaced: an older checkpoint directory, by the
    rules of :mod:`.removal`, or the Lightning ``.ckpt`` file ``_lightning_file`` vouched
    for."""
    if kind == "file":
        if _zip_file(parent, name):  # still: never delete what was swapped in since
            parent.remove(name)
    else:
        delete_checkpoint(parent, name)


def _lightning_file(parent: Storage, name: str) -> bool:
    """``parent/name`` is a checkpoint file Lightning wrote (a ``.ckpt`` in ``torch.save``'s
    zip format): what a run switched to the shardsafe strategy finds under
    ``last.ckpt``, which Lightning's own strategies overwrite at every save."""
    return name.endswith(LIGHTNING_SUFFIX) and _zip_file(parent, name)


def _zip_file(parent: Storage, name: str) -> bool:
    """``parent/name`` is a regular file in ``torch.save``'s zip format (never opened if
    it is not a regular file)."""
    head = bytearray(len(_ZIP_MAGIC))
    try:
        with parent.open_reader(name) as reader:
            if reader.size < len(head):
                return False
            reader.read_into(0, memoryview(head))
    except (OSError, CheckpointError):
        return False
    return bytes(head) == _ZIP_MAGIC


def _delete_committed_leftovers(parent: Storage, name: str) -> None:
    for candidate in _staging_names(name):
        if parent.kind(candidate) == "directory":
            with contextlib.suppress(CheckpointError):
                delete_checkpoint(parent, candidate)


def _exchange(fd: int, a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` in one atomic step; False where the system cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(fd, os.fsencode(a), fd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # an old kernel, or a filesystem without exchange
    raise OSError(err, os.strerror(err), b)


_Renameat2 = Callable[[int, bytes, int, bytes, int], int]


def _renameat2() -> _Renameat2 | None:
    """glibc's ``renameat2`` (Linux 3.15+, glibc 2.28+), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn
