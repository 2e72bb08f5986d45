"""The checkpoint folders of :mod:`epochal.integrations.transformers`: how one is committed,
verified and found again, without importing transformers.

A folder ``<output_dir>/checkpoint-<N>`` holds what transformers' ``Trainer`` writes for the
model (``model.safetensors``, ``config.json``, ``generation_config.json``, the tokenizer's
files, ``training_args.bin``) and ``trainer_state.json``, unchanged, so ``from_pretrained``
and transformers' tools read it; and, instead of the pickled ``optimizer.pt``,
``scheduler.pt``, ``scaler.pt`` and ``rng_state*.pth``, one epochal native db per process,
``rank<i>.<N>`` (CRC-32C on every byte, no pickle). Process 0's db also records every other
file of the folder (:data:`FILES_BLOB`: size and CRC-32C), so a load checks those bytes too.

Commit: everything is written in ``<output_dir>/.epochal-tmp-checkpoint-<N>``, each file
fsynced, then the folder is renamed to ``checkpoint-<N>`` (and the parent fsynced). So a
``checkpoint-<N>`` folder exists only complete; a kill leaves at most a temp folder, which no
resume looks at and the next run removes. Deletions rename a folder away before removing it,
so a kill during a deletion leaves no half folder under a checkpoint name either.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointError
from ..storage.formats.base import get_db_type
from ..storage.io import atomic
from ..storage.io.checksum import checksum_function, default_algorithm, format_checksum

__all__ = [
    "FILES_BLOB",
    "CheckpointRead",
    "read_checkpoint",
    "checkpoint_step",
    "commit_folder",
    "db_path",
    "find_resume_checkpoint",
    "is_epochal_checkpoint",
    "read_file_checked",
    "record_files",
    "remove_folder",
    "remove_stale",
    "temp_folder",
    "verify_checkpoint",
]

logger = logging.getLogger("epochal")

DB_TYPE = "native"
#: the blob of process 0's db that records the folder's other files: {name: {size, checksum}}
FILES_BLOB = "files"
#: the weights file a resume reads once into memory (others are checked as a stream)
WEIGHTS = "model.safetensors"
TEMP_PREFIX = ".epochal-tmp-"
TRASH_PREFIX = ".epochal-del-"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 16 << 20


def checkpoint_step(folder: str) -> int | None:
    """N of a ``checkpoint-<N>`` folder path, None for any other name."""
    m = _CHECKPOINT.match(os.path.basename(os.path.normpath(folder)))
    return int(m.group(1)) if m else None


def db_path(folder: str, process_index: int, step: int | None = None) -> str:
    """The db of process ``process_index`` in ``folder`` (``rank<i>.<N>``)."""
    if step is None:
        step = checkpoint_step(folder)
        if step is None:
            raise CheckpointError(f"{folder}: not a checkpoint-<N> folder")
    return os.path.join(folder, f"rank{int(process_index)}.{int(step)}")


def is_epochal_checkpoint(folder: str) -> bool:
    """True when ``folder`` is a checkpoint folder written by epochal (process 0's db is there)."""
    step = checkpoint_step(folder)
    return step is not None and os.path.isfile(db_path(folder, 0, step))


def temp_folder(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, f"{TEMP_PREFIX}checkpoint-{int(step)}")


def _file_checksum(path: str, algorithm: str) -> tuple[int, int]:
    """(size, checksum) of a file, read in chunks."""
    fn = checksum_function(algorithm)
    value, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                return size, value
            value = fn(chunk, value)
            size += len(chunk)


def _regular_files(folder: str) -> Iterator[str]:
    """Relative paths of the regular files under ``folder`` (sharded weights may sit in subfolders)."""
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            yield os.path.relpath(os.path.join(root, name), folder)


def record_files(folder: str, skip: set[str]) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "checksum"}}`` of every regular file of ``folder`` not in
    ``skip``, fsyncing each (they were written by transformers, which does not)."""
    algorithm = default_algorithm()
    out: dict[str, dict[str, Any]] = {}
    for rel in _regular_files(folder):
        if rel in skip:
            continue
        full = os.path.join(folder, rel)
        size, value = _file_checksum(full, algorithm)
        atomic.fsync_file(full)
        out[rel] = {"size": size, "checksum": format_checksum(algorithm, value)}
    return out


def commit_folder(temp: str, final: str) -> None:
    """Make ``temp`` (every file durable) the folder ``final``: fsync it, rename, fsync the
    parent. An existing ``final`` (the same step saved again) is renamed away first and then
    removed."""
    for root, dirs, _ in os.walk(temp):
        for d in dirs:
            atomic.fsync_dir(os.path.join(root, d))
    atomic.fsync_dir(temp)
    parent = os.path.dirname(os.path.abspath(final))
    old = None
    if os.path.lexists(final):
        old = os.path.join(parent, f"{TRASH_PREFIX}{os.path.basename(final)}")
        remove_stale_path(old)
        os.rename(final, old)
    os.rename(temp, final)
    atomic.fsync_dir(parent)
    if old is not None:
        remove_stale_path(old)


def remove_folder(folder: str) -> None:
    """Delete a checkpoint folder so that it never exists half deleted under its name."""
    if not os.path.isdir(folder):
        return
    parent = os.path.dirname(os.path.abspath(folder))
    trash = os.path.join(parent, f"{TRASH_PREFIX}{os.path.basename(os.path.normpath(folder))}")
    remove_stale_path(trash)
    os.rename(folder, trash)
    atomic.fsync_dir(parent)
    remove_stale_path(trash)


def remove_stale_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def remove_stale(run_dir: str) -> list[str]:
    """Remove the temp and trash folders of saves and deletions a kill cut short; their names."""
    gone: list[str] = []
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return gone
    for name in names:
        if name.startswith((TEMP_PREFIX, TRASH_PREFIX)):
            remove_stale_path(os.path.join(run_dir, name))
            gone.append(name)
    return gone


def _recorded(folder: str) -> dict[str, Any]:
    """Process 0's record of the folder's files (the db verified as it is read)."""
    db = db_path(folder, 0)
    files = get_db_type(DB_TYPE).read(db, [FILES_BLOB])[FILES_BLOB]
    if not isinstance(files, Mapping):
        raise CheckpointCorruptError(db, "the record of the folder's files is not a dict", FILES_BLOB)
    return dict(files)


def _check_entry(folder: str, rel: str, entry: Any, db: str) -> tuple[int, str]:
    if (not isinstance(rel, str) or os.path.isabs(rel) or ".." in rel.split(os.sep)
            or not isinstance(entry, Mapping)):
        raise CheckpointCorruptError(db, f"bad file record {str(rel)[:80]!r}", FILES_BLOB)
    size, digest = entry.get("size"), entry.get("checksum")
    if not isinstance(size, int) or not isinstance(digest, str) or ":" not in digest:
        raise CheckpointCorruptError(db, f"bad file record for {rel!r}", FILES_BLOB)
    return size, digest


def read_file_checked(folder: str, rel: str, files: Mapping[str, Any] | None = None) -> bytes:
    """The bytes of ``folder/rel``, read once and checked against the size and checksum process
    0's db recorded for it (CheckpointCorruptError naming the file otherwise)."""
    files = _recorded(folder) if files is None else files
    db = db_path(folder, 0)
    path = os.path.join(folder, rel)
    if rel not in files:
        raise CheckpointCorruptError(path, f"not recorded in {db}")
    size, digest = _check_entry(folder, rel, files[rel], db)
    algorithm = digest.split(":", 1)[0]
    try:
        with open(path, "rb") as f:
            data = f.read(size + 1)
    except FileNotFoundError:
        raise CheckpointCorruptError(path, "missing (recorded in the checkpoint)") from None
    if len(data) != size:
        raise CheckpointCorruptError(path, f"{len(data)} bytes, {size} recorded")
    value = checksum_function(algorithm)(data, 0)
    if format_checksum(algorithm, value) != digest:
        raise CheckpointCorruptError(path, f"checksum mismatch ({format_checksum(algorithm, value)}, {digest} recorded)")
    return data


@dataclass
class CheckpointRead:
    """A checkpoint folder read whole and checked: what a resume loads, so that it reads each
    byte once. ``blobs``: process 0's db (``optimizer``, ``scheduler``, ``scaler``, ``rng``:
    state dicts; ``files``); ``own``: this process's db when it is not process 0;
    ``weights``: the bytes of ``model.safetensors`` (None when the folder has no such file,
    or when only verified)."""

    folder: str
    blobs: dict[str, Any] = field(default_factory=dict, repr=False)
    own: dict[str, Any] = field(default_factory=dict, repr=False)
    weights: bytes | None = field(default=None, repr=False)
    #: (process index, name) of what the loads took (each is handed out once, then freed)
    taken: set[tuple[int, str]] = field(default_factory=set)

    def take(self, name: str, process_index: int = 0) -> tuple[bool, Any]:
        """``(True, value)`` of the blob ``name`` of process ``process_index``'s db (value None
        when the db lacks it; ``"weights"``: the weights' bytes), handed out once and freed;
        ``(False, None)`` when it was taken before (the caller reads the file again)."""
        if (process_index, name) in self.taken:
            return False, None
        self.taken.add((process_index, name))
        if name == "weights":
            value, self.weights = self.weights, None
            return True, value
        return True, (self.own if process_index else self.blobs).pop(name, None)


def read_checkpoint(folder: str, process_index: int = 0, *, keep: bool = True) -> CheckpointRead:
    """Check a checkpoint folder whole: process 0's db and this process's (every checksum),
    and every file recorded (size and CRC-32C). With ``keep`` the dbs' values and the weights'
    bytes are kept for the loads (read once), else only checked. Raises
    :class:`~epochal.errors.CheckpointError` (a CheckpointCorruptError naming the file for damage)."""
    if not is_epochal_checkpoint(folder):
        raise CheckpointError(f"{folder}: not a checkpoint written by epochal (no rank0.<N> db in it)")
    backend = get_db_type(DB_TYPE)
    db = db_path(folder, 0)
    out = CheckpointRead(folder)
    if keep:
        out.blobs = backend.read(db)
    else:
        backend.verify(db)
    mine = db_path(folder, process_index)
    if process_index and os.path.exists(mine):
        if keep:
            out.own = backend.read(mine)
        else:
            backend.verify(mine)
    files = out.blobs.get(FILES_BLOB) if keep else _recorded(folder)
    if not isinstance(files, Mapping):
        raise CheckpointCorruptError(db, "the record of the folder's files is not a dict", FILES_BLOB)
    for rel, entry in files.items():
        size, digest = _check_entry(folder, rel, entry, db)
        if keep and rel == WEIGHTS:
            out.weights = read_file_checked(folder, rel, files)
            continue
        path = os.path.join(folder, rel)
        try:
            got_size, value = _file_checksum(path, digest.split(":", 1)[0])
        except FileNotFoundError:
            raise CheckpointCorruptError(path, "missing (recorded in the checkpoint)") from None
        except ValueError as ex:
            raise CheckpointCorruptError(db, str(ex), FILES_BLOB) from None
        if got_size != size:
            raise CheckpointCorruptError(path, f"{got_size} bytes, {size} recorded")
        if format_checksum(digest.split(":", 1)[0], value) != digest:
            raise CheckpointCorruptError(path, "checksum mismatch with the checkpoint's record")
    return out


def verify_checkpoint(folder: str, process_index: int = 0) -> None:
    """Check a checkpoint folder whole, keeping nothing (see :func:`read_checkpoint`)."""
    read_checkpoint(folder, process_index, keep=False)


def find_resume_checkpoint(run_dir: str, process_index: int = 0) -> CheckpointRead | None:
    """The newest ``checkpoint-<N>`` folder of ``run_dir`` that verifies whole, read (see
    :func:`read_checkpoint`); each newer one that does not (damaged, or not written by
    epochal) is skipped with a warning naming it. None when there is none."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return None
    found = sorted(((checkpoint_step(n), n) for n in names if checkpoint_step(n) is not None), reverse=True)
    for _, name in found:
        folder = os.path.join(run_dir, name)
        if not os.path.isdir(folder):
            continue
        try:
            return read_checkpoint(folder, process_index)
        except (CheckpointError, OSError) as ex:
            logger.warning("Skipping checkpoint %s: %s", folder, ex)
    return None
