"""The steps that checkpoint tasks run on a node's workspace.

Each is a small picklable object (not a closure), so a multi-machine session can ship it to
the node's own process and run it there, next to that node's workspace and disk.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import (
    CheckpointError,
    CheckpointNotFoundError,
    MissingBlobError,
    UnsupportedBlobError,
)
from ...storage.encoding.codecs import PLAIN_VALUES, LoadOptions, load_options
from ...storage.encoding.fit import KeyReport, check_all_live
from ...storage.formats.base import ReadStats, get_db_type
from ...storage.io.location import Location, location_for
from ...storage.io.seam import is_url
from ..handler.metadata import DbReport
from .background import BackgroundSaver, process_saver

logger = logging.getLogger("epochal")

#: Blobs under this prefix are epochal's own bookkeeping (timers, sizes) and never checkpointed.
INTERNAL_PREFIX = "__epochal__/"


def db_location(db: str, storage_options: dict[str, Any] | None) -> Location:
    """The :class:`~epochal.storage.io.location.Location` of the folder of ``db`` with the
    manager's fsspec ``storage_options``: a step carries it to the node's process and
    activates it around its format calls (never registered process-wide)."""
    folder = db.rsplit("/", 1)[0] if is_url(db) else (os.path.dirname(db) or ".")
    return location_for(folder, storage_options)


@dataclass(frozen=True)
class StepResult:
    """What one checkpoint step did to its db, returned to whoever ran it (the Checkpointer
    directly; in a Task the step puts these in its outputs for the driver): the db, the bytes
    moved, the nanoseconds it took (a background save: snapshot until durable), and for a
    save the db's digest (None when the format has none) and whether the node uploaded it to
    the handler's mirror."""

    db: str
    nbytes: int
    ns: int
    digest: str | None = None
    pushed: bool = False

    def report(self) -> DbReport:
        """What the handler commits of this db (its file name, size and digest, never reread)."""
        return DbReport(int(self.nbytes), self.digest, self.pushed, _base_name(self.db))


def _base_name(db: str) -> str:
    """The file name of a db path or URL (``/`` separates either)."""
    return db.replace(os.sep, "/").rsplit("/", 1)[-1]


def ensure_directory(db: str) -> None:
    """Create the local directory of ``db`` when it does not exist yet (as DCP's file writer
    and Orbax do); an OSError naming that directory when it cannot be (a path under a regular
    file, no permission). Nothing for a URL (object stores have no folders)."""
    if is_url(db):
        return
    folder = os.path.dirname(db) or "."
    if os.path.isdir(folder):
        return
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as ex:
        raise OSError(ex.errno, f"cannot create the checkpoint directory {folder}: {ex.strerror or ex}",
                      folder) from ex


def push_db(push: Any, db: str) -> bool:
    """Upload the db just written to ``push`` (a :class:`~.metadata.PushTarget`, or None)
    from this node's process; whether it worked. A failed upload is a warning: the driver
    pushes the epoch itself then (if it can see the file)."""
    if push is None:
        return False
    from ...storage.formats.remote import upload_file

    try:
        upload_file(db, f"{push.url.rstrip('/')}/{db.rsplit('/', 1)[-1]}", **push.storage_options)
        return True
    except Exception as ex:
        logger.warning("Cannot push %s to the mirror %s from its node (the driver will try): %s",
                       db, push.url, ex)
        return False


def db_digest(db_type: str, db: str) -> str | None:
    """The digest of the db just written (None when the format has none): the driver commits
    with it and never opens the node's file."""
    return get_db_type(db_type).digest(db) or None


def put_outputs(ws: Any, result: StepResult, digest_output: str | None, pushed_output: str | None) -> None:
    """A save's digest and push flag as task outputs (a str blob, "" for no digest)."""
    if digest_output is not None:
        ws[digest_output] = np.str_(result.digest or "")
    if pushed_output is not None:
        ws[pushed_output] = np.bool_(result.pushed)


class GetBlobNames:
    """Store the sorted names of the workspace's own blobs (not a parent's) in ``output``."""

    def __init__(self, output: str) -> None:
        self.output = output

    def __call__(self, ws: Any) -> int:
        names = [n for n in ws.blobs if not n.startswith(INTERNAL_PREFIX)]
        if self.output not in names:
            names = sorted([*names, self.output])
        ws[self.output] = np.array(names, dtype=str)
        return 0


def _own_names(ws: Any, exclude: Sequence[str] = ()) -> list[str]:
    """The workspace's own blob names (not a parent's), without epochal's bookkeeping and
    ``exclude`` (task outputs: values recomputed every epoch, not state)."""
    skip = set(exclude)
    return [n for n in ws.blobs if not n.startswith(INTERNAL_PREFIX) and n not in skip]




class LoadBlobs:
    """Load ``names`` (all listed in the db when None) from one db into the workspace.

    Live objects already in the workspace are passed to the codecs, which restore them in place
    (torch tensors, modules, optimizers); everything is verified before anything is restored.
    ``whole``: ``names`` are (nearly) all the db holds (a resume), so the format may fetch the
    whole file at once (:class:`~epochal.storage.encoding.codecs.LoadOptions`).
    """

    def __init__(
        self,
        db: str,
        db_type: str,
        names: Sequence[str] | None,
        *,
        node: str,
        epoch: int,
        allow_incomplete: bool = False,
        keep_device: bool = False,
        map_location: Any = None,
        verify: bool = True,
        storage_options: dict[str, Any] | None = None,
        whole: bool = False,
        strict: bool = True,
    ) -> None:
        self.db, self.db_type = db, db_type
        self.whole = whole
        #: a dict of tensors held in the state must have the checkpoint's keys (see
        #: :mod:`epochal.storage.encoding.fit`); False: what differs goes to :attr:`keys`
        self.strict = strict
        self.keys = KeyReport()
        self.location = db_location(db, storage_options)
        self.names = list(names) if names is not None else None
        self.node, self.epoch = node, epoch
        self.allow_incomplete, self.keep_device = allow_incomplete, keep_device
        self.map_location, self.verify = map_location, verify
        #: after a call: the names asked for that the db lacked (with allow_incomplete)
        self.missing: list[str] = []

    def run(self, ws: Any) -> StepResult:
        """Load, and say what was read (bytes, ns)."""
        start = time.perf_counter_ns()
        nbytes = self(ws)
        return StepResult(self.db, nbytes, time.perf_counter_ns() - start)

    def _where(self) -> str:
        return f"checkpoint {self.db} (node {self.node!r}, epoch {self.epoch})"

    def _open(self) -> Any:
        backend = get_db_type(self.db_type)
        if not backend.exists(self.db):
            raise CheckpointNotFoundError(
                f"checkpoint {self.db} (node {self.node!r}, epoch {self.epoch}) does not exist"
            )
        return backend

    def _options(self, where: str) -> LoadOptions:
        return LoadOptions(map_location=self.map_location, keep_device=self.keep_device, where=where,
                           whole=self.whole, strict=self.strict, keys=self.keys)

    def check(self, ws: Any) -> None:
        """Only the check of :meth:`__call__` (the db's index against the live objects),
        writing nothing: every door runs it before the load (the engine's
        :class:`~epochal.checkpoint.engine.LoadPlan`), for every node before any loads."""
        with self.location.active():
            backend = self._open()
            existing = {n: ws[n] for n in (self.names or []) if n in ws}
            where = self._where()
            with load_options(self._options(where)):
                self._check_live(backend, existing, where)

    def __call__(self, ws: Any) -> int:
        with self.location.active():
            return self._load(ws)

    def _load(self, ws: Any) -> int:
        backend = self._open()
        names = self.names
        existing = {n: ws[n] for n in (names or []) if n in ws}
        where = self._where()
        opts = self._options(where)
        if not backend.checks_live:
            with load_options(opts):
                self._check_live(backend, existing, where)
        stats = ReadStats()
        with load_options(opts):
            values = backend.read(
                self.db, names, allow_incomplete=self.allow_incomplete, existing=existing,
                verify=self.verify, stats=stats,
            )
        for name, value in values.items():
            ws[name] = value
        self.missing = [n for n in names or [] if n not in values]
        return stats.nbytes

    def _check_live(self, backend: Any, existing: dict[str, Any], where: str) -> None:
        """Refuse the load before anything is written when any blob does not fit its live
        object (keys, shapes, dtypes, parameter groups): a mismatch in one blob must not leave
        the others half-restored. Plain values are replaced, not restored: no check. (A
        backend with ``checks_live`` does this inside its read, with the index it opened.)"""
        live = {n: v for n, v in existing.items() if not isinstance(v, PLAIN_VALUES)}
        if live:
            check_all_live(
                ((i.name, i.kind, i.meta, live[i.name]) for i in backend.describe(self.db) if i.name in live),
                where,
            )


class ResumeBlobNames(LoadBlobs):
    """At resume: load the blob list stored in the checkpoint into ``names[0]``, and add to it
    every blob the workspace holds now that the checkpoint lacks (the code put it there
    before ``train``): it keeps its current value and is saved from then on. The names added
    go to ``added_output`` (an array, empty when none), so the driver can say so."""

    def __init__(self, db: str, db_type: str, output: str, added_output: str, *,
                 exclude: Sequence[str] = (), **kw: Any) -> None:
        super().__init__(db, db_type, [output], **kw)
        self.output, self.added_output, self.exclude = output, added_output, list(exclude)

    def __call__(self, ws: Any) -> int:
        before = _own_names(ws, self.exclude)
        nbytes = super().__call__(ws)
        stored = [str(n) for n in np.asarray(ws[self.output]).tolist()]
        known = set(stored)
        added = sorted(n for n in before if n not in known)
        if added:
            ws[self.output] = np.array([*stored, *added], dtype=str)
        ws[self.added_output] = np.array(added, dtype=str)
        return nbytes


class SaveBlobs:
    """Save ``names`` from the workspace to one db (created or replaced, atomically).

    ``untracked_output``, when given, receives the names of the workspace's own blobs that are
    not in the list (they are not saved; the driver warns about them once)."""

    def __init__(self, db: str, db_type: str, names: Sequence[str], *, node: str, epoch: int,
                 untracked_output: str | None = None, digest_output: str | None = None,
                 storage_options: dict[str, Any] | None = None, push: Any = None,
                 pushed_output: str | None = None) -> None:
        self.db, self.db_type, self.names = db, db_type, list(names)
        self.node, self.epoch = node, epoch
        self.untracked_output, self.digest_output = untracked_output, digest_output
        self.location = db_location(db, storage_options)
        self.push, self.pushed_output = push, pushed_output
        #: write only what differs from ``base`` (the db of the newest committed step before
        #: this one; set just before the save runs), a native db only (docs/format.md)
        self.incremental = False
        self.base: str | None = None
        #: the bytes the last save in this folder kept (a KeptBytes of the saver; None: the
        #: node's, in the process that runs the save: kept.for_node)
        self.kept: Any = None

    def writer(self) -> Callable[[str, Mapping[str, Any]], int]:
        """How this save writes its db: the db type's write, or an incremental one."""
        if not self.incremental:
            return get_db_type(self.db_type).write
        if self.db_type != "native":
            raise CheckpointError(f"incremental saves write native dbs, not {self.db_type!r}")
        from ...storage.formats.native import kept as kept_bytes
        from ...storage.formats.native.incremental import write_incremental

        base, step, kept = self.base, self.epoch, self.kept
        if kept is None and not is_url(self.db):  # a node's saves: kept in its own process
            kept = kept_bytes.for_node(self.db, self.node)
        return lambda path, blobs: write_incremental(path, blobs, base=base, step=step, kept=kept)

    def _where(self) -> str:
        return f"node {self.node!r}, epoch {self.epoch} ({self.db})"

    def _note_untracked(self, ws: Any) -> None:
        if self.untracked_output is not None:
            listed = set(self.names)
            ws[self.untracked_output] = np.array(
                [n for n in _own_names(ws) if n not in listed], dtype=str
            )

    def _gather(self, ws: Any) -> dict[str, Any]:
        """The listed blobs, in list order; an error naming the first one missing."""
        if not self.names:
            raise CheckpointError(f"checkpoint {self.db}: nothing to save (empty blob list)")
        blobs: dict[str, Any] = {}
        for name in self.names:
            if name not in ws:
                raise MissingBlobError(
                    f"blob {name!r} of the blob list of node {self.node!r} is not in its workspace "
                    f"(saving {self.db}, epoch {self.epoch})"
                )
            blobs[name] = ws[name]
        return blobs

    def run(self, ws: Any) -> StepResult:
        """Save, and say what was written: bytes, ns, the db's digest, whether pushed."""
        start = time.perf_counter_ns()
        ensure_directory(self.db)
        blobs = self._gather(ws)
        self._note_untracked(ws)
        with self.location.active():
            try:
                nbytes = int(self.writer()(self.db, blobs))
            except UnsupportedBlobError as ex:  # a value no format stores: name where it is
                raise UnsupportedBlobError(f"{self._where()}: {ex}") from ex
            digest = db_digest(self.db_type, self.db)
        pushed = push_db(self.push, self.db) if self.pushed_output is not None else False
        return StepResult(self.db, nbytes, time.perf_counter_ns() - start, digest, pushed)

    def __call__(self, ws: Any) -> int:
        result = self.run(ws)
        put_outputs(ws, result, self.digest_output, self.pushed_output)
        return result.nbytes


class DbExists:
    """Set ``output`` to whether the db can be opened for reading."""

    def __init__(self, db: str, db_type: str, output: str, storage_options: dict[str, Any] | None = None) -> None:
        self.db, self.db_type, self.output = db, db_type, output
        self.location = db_location(db, storage_options)

    def __call__(self, ws: Any) -> int:
        ws[self.output] = np.bool_(False)
        with self.location.active():
            ws[self.output] = np.bool_(get_db_type(self.db_type).exists(self.db))
        return 0


class Timed:
    """Run ``op`` and record its duration (a 1-element int64 array of ns) and bytes moved."""

    def __init__(self, op: Any, ns_blob: str, bytes_blob: str) -> None:
        self.op, self.ns_blob, self.bytes_blob = op, ns_blob, bytes_blob
        self.name = getattr(op, "name", type(op).__name__)

    def __call__(self, ws: Any) -> None:
        start = time.perf_counter_ns()
        nbytes = self.op(ws)
        ws[self.ns_blob] = np.array([time.perf_counter_ns() - start], dtype=np.int64)
        ws[self.bytes_blob] = np.int64(nbytes or 0)


# ---------------------------------------------------------------- background saves
class SnapshotAndSave(SaveBlobs):
    """Snapshot the blobs now (encoded and copied: later updates can't reach them) and write
    them on the background thread of this node's process (:mod:`.background`);
    :class:`JoinSave` waits for it.

    The snapshot costs a copy of the checkpoint in memory, reused from epoch to epoch; the
    write overlaps the next epoch. ``saver``: whose pool and thread (None: the process's)."""

    def __init__(self, *args: Any, saver: BackgroundSaver | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.saver = saver

    def run(self, ws: Any) -> StepResult:
        """Take the snapshot and start the write; the bytes and ns of the snapshot (the
        save's own come from :meth:`JoinSave.join`)."""
        start = time.perf_counter_ns()
        nbytes = self(ws)
        return StepResult(self.db, nbytes, time.perf_counter_ns() - start)

    def __call__(self, ws: Any) -> int:
        ensure_directory(self.db)
        saver = self.saver or process_saver()
        if saver.pending(self.db):
            raise CheckpointError(f"checkpoint {self.db}: a background save of it is still running")
        blobs = self._gather(ws)
        self._note_untracked(ws)
        try:
            snap = saver.snapshot(snapshot_owner(self.node, self.db), blobs)
        except UnsupportedBlobError as ex:
            raise UnsupportedBlobError(f"{self._where()}: {ex}") from ex
        with self.location.active():  # the saver's thread writes with this location's options
            saver.start(self.db, self.db_type, snap, self.writer())
        return snap.nbytes


def snapshot_owner(node: str, db: str) -> str:
    """Whose snapshot arenas a background save of ``db`` takes: the node and its checkpoint
    location, so each state finds its arenas again every epoch (and :class:`PrepareSaves`
    prepares the ones its saves will take)."""
    return f"{node}@{db.rpartition('/')[0]}"


class PrepareSaves:
    """As a run with background saves starts: have this node's process allocate the snapshot
    arenas that background saves of ``names`` (to dbs next to ``db``) take, and fault them in
    on a thread now (:meth:`.background.BackgroundSaver.prepare`), so that even the first
    snapshot copies into warm memory instead of paying first-touch faults on the training
    thread. Nothing is copied; names the workspace lacks are left out (the save names them).
    Returns the arenas queued (0: they were ready)."""

    name = "checkpoint_prepare"

    def __init__(self, db: str, names: Sequence[str], *, node: str, saver: BackgroundSaver | None = None) -> None:
        self.owner, self.names, self.saver = snapshot_owner(node, db), list(names), saver

    def __call__(self, ws: Any) -> int:
        blobs = {n: ws[n] for n in self.names if n in ws}
        return (self.saver or process_saver()).prepare(self.owner, blobs) if blobs else 0


class JoinSave:
    """Wait for the background save of ``db``; record its whole duration (snapshot to durable
    file) and bytes like a synchronous save's; re-raise its error."""

    def __init__(self, db: str, ns_blob: str, bytes_blob: str, *, db_type: str = "native",
                 digest_output: str | None = None, push: Any = None, pushed_output: str | None = None,
                 saver: BackgroundSaver | None = None, storage_options: dict[str, Any] | None = None) -> None:
        self.db, self.ns_blob, self.bytes_blob = db, ns_blob, bytes_blob
        self.location = db_location(db, storage_options)
        self.saver = saver
        self.db_type, self.digest_output = db_type, digest_output
        self.push, self.pushed_output = push, pushed_output
        self.name = "checkpoint_save"

    def join(self) -> StepResult:
        """Wait for the write; what the whole save did (re-raises its error)."""
        done = (self.saver or process_saver()).join(self.db)
        pushed = push_db(self.push, self.db) if self.pushed_output is not None else False
        with self.location.active():
            digest = db_digest(self.db_type, self.db)
        return StepResult(self.db, done.nbytes, done.done_ns - done.started_ns, digest, pushed)

    def __call__(self, ws: Any) -> None:
        result = self.join()
        ws[self.ns_blob] = np.array([result.ns], dtype=np.int64)
        ws[self.bytes_blob] = np.int64(result.nbytes)
        put_outputs(ws, result, self.digest_output, self.pushed_output)


class CheckLive:
    """The check of a :class:`LoadBlobs` alone (see :meth:`LoadBlobs.check`): run on every
    node before a load of several nodes, so a misfit on one node leaves every node untouched."""

    name = "checkpoint_check"

    def __init__(self, load: LoadBlobs) -> None:
        self.load = load

    def __call__(self, ws: Any) -> int:
        self.load.check(ws)
        return 0
