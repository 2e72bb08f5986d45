"""``torch.distributed.checkpoint`` storage that writes epochal checkpoints.

::

    import torch.distributed.checkpoint as dcp
    from epochal.integrations.dcp import EpochalStorageReader, EpochalStorageWriter

    dcp.save(state_dict, storage_writer=EpochalStorageWriter("ckpt"))         # step: next
    dcp.load(state_dict, storage_reader=EpochalStorageReader("ckpt"))         # step: newest

One DCP save is one step of an epochal checkpoint directory: every rank writes the items
DCP's planner gave it (its shards; a replicated tensor is written by one rank only) into
one native db, ``<dir>/rank<r>.<step>`` (CRC-32C on every byte; temp file, fsync, rename),
and reports its size and digest; the coordinator then writes DCP's metadata as strict JSON
into ``<dir>/dcp.<step>`` and commits the step's manifest through
:class:`~epochal.checkpoint.handler.directory.DirectoryMetadataHandler` (under the directory's
writer lock), only after every rank's db is durable. A save killed at any moment leaves no
manifest, so the step does not exist; earlier steps are untouched.

Loading reads the manifest and the metadata db (verified), lets DCP's planner match the saved
chunks against the live ones (any world size, any sharding), and reads only the blobs of
the chunks that overlap this rank's shards (of a big chunk, stored as row blocks by the
writer, see :mod:`.blocks`, only the blocks its rows overlap; see :mod:`.reads`), each
checked by checksum before any live tensor is written; a damaged byte is :class:`~epochal.errors.CheckpointCorruptError` naming the
file and the item. Non-tensor items are encoded by epochal's codecs, never pickled (see
:mod:`.planners`); nothing on the load path unpickles.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ...checkpoint.handler.directory import DirectoryMetadataHandler
from ...checkpoint.handler.metadata import DbReport
from ...checkpoint.location.naming import db_token, new_token, split_db_file
from ...checkpoint.location.view import CheckpointDirectory
from ...errors import (
    CheckpointError,
    UnsupportedBlobError,
)
from ...storage.formats.native.incremental import write_incremental
from ...storage.formats.native.kept import KeptBytes
from ...storage.formats.native.reader import stat_native
from ...storage.formats.native.write import write_native
from ...storage.io.location import location_for
from ...storage.io.seam import is_url, local_path
from ..distributed import world as _world
from .blocks import block_rows, split_rows
from .metadata_json import ItemLocation, metadata_to_json
from .planners import item_value
from .staging import HostStaging

__all__ = ["META_BLOB", "META_NODE", "EpochalStorageWriter", "rank_node"]

#: the node whose db holds a step's DCP metadata (``<dir>/dcp.<step>``)
META_NODE = _world.META_NODE
#: the blob of that db holding the metadata JSON
META_BLOB = "metadata"


def rank_node(rank: int) -> str:
    """The node name of rank ``rank``'s db: ``rank0``, ``rank1``, ..."""
    return f"rank{int(rank)}"


def chunk_blob(fqn: str, offsets: Sequence[int] | None) -> str:
    """The blob name of a saved item: the FQN, and for a tensor chunk its offsets
    (``layer.weight@0,16``)."""
    return fqn if offsets is None else f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


@dataclasses.dataclass(frozen=True)
class Target:
    """What the coordinator tells each rank: the step, the rank's node name and, at a URL,
    the save's writer token (every rank's db is ``<node>.<step>.<token>``: a name no other
    job can produce, so a committed db is never overwritten; None: ``<node>.<step>``)."""

    step: int
    node: str
    token: str | None = None


@dataclasses.dataclass(frozen=True)
class Written:
    """A rank's WriteResult storage_data: where the item went and what the rank says of its db."""

    location: ItemLocation
    report: DbReport | None  # None: a deferred write (the db is written later, in the background)


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class AtPath:
    """DCP's checkpoint id of epochal's storage: its directory (a path or a URL)."""

    path: str

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class EpochalStorageWriter(AtPath, StorageWriter):
    """A DCP storage writer of epochal checkpoints (see the module doc).

    ``path``: the checkpoint directory (created). ``step``: the step this save commits;
    None: one more than the newest committed step (0 in an empty directory). A step that is
    already committed is refused. ``handler``: the :class:`DirectoryMetadataHandler` that
    commits (its retention applies); None: a default one, keeping every step. ``lock``: the
    coordinator takes the directory's writer lock for the commit (False when the caller
    holds it already, as a Checkpointer does). ``metrics``: numbers recorded in the manifest.
    ``deferred``: an async save (write_data only snapshots; see :meth:`write_deferred` and
    :meth:`commit_deferred`); ``hold_commit``: the data is written by write_data but the
    coordinator commits only at :meth:`commit_deferred` (a save run in the background on a
    snapshot, committed later by the training thread). ``staging``: the host buffer snapshots and CUDA tensors go
    through (a :class:`~epochal.integrations.dcp.staging.HostStaging`; None: fresh memory)."""

    def __init__(self, path: str | os.PathLike[str], step: int | None = None, *,
                 handler: DirectoryMetadataHandler | None = None, lock: bool = True,
                 metrics: dict[str, Any] | None = None, deferred: bool = False, hold_commit: bool = False,
                 staging: HostStaging | None = None, storage_options: dict[str, Any] | None = None,
                 incremental: bool = False, kept: KeptBytes | None = None) -> None:
        super().__init__()
        self.metrics = metrics
        #: each rank writes only the bytes its own db of the newest committed step before this
        #: one does not hold (docs/format.md, incremental dbs); the rest are references
        self.incremental = bool(incremental)
        #: the chunks this rank's last incremental save wrote, kept to compare the next one
        #: with instead of reading its base (a saver making a writer per save passes its own)
        self.kept = kept if kept is not None or not incremental else KeptBytes()
        self._marked: str | None = None  # (the location marked incremental by this writer)
        self._pending_target: Target | None = None
        #: write_data snapshots the rank's items into host memory and returns; the db is
        #: written by :meth:`write_deferred` and the step committed by :meth:`commit_deferred`
        #: (the coordinator, once every rank's write_deferred returned): an async save
        self.deferred = bool(deferred)
        self.hold_commit = self.deferred or bool(hold_commit)
        self.pending_db: str | None = None
        self.pending_blobs: dict[str, Any] = {}
        #: where deferred snapshots go (a reused host buffer; None: a fresh one per save)
        self.staging = staging if staging is not None else HostStaging(max_host_bytes=0)
        self._pooled = False
        self._pending_finish: tuple[Metadata, list[list[WriteResult]]] | None = None
        #: on the coordinator, once finish() was called: DCP's global metadata and every
        #: rank's write results (what a plan cache replays for a later step)
        self.finished: tuple[Metadata, list[list[WriteResult]]] | None = None
        self.path = _located(path, storage_options)
        self.step = None if step is None else int(step)
        self.handler = handler
        self.lock = bool(lock)
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        #: after a save: the step it committed (on the coordinator)
        self.committed: int | None = None
        self._step: int | None = None
        #: the handler holding the writer lock from the plan to the commit (``lock=True``)
        self._held: DirectoryMetadataHandler | None = None
        self._finalizer: weakref.finalize | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = local_path(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._step = None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise CheckpointError("EpochalStorageWriter: saves without collectives (rank-local metadata) "
                                  "cannot be committed as one step; use the default use_collectives=True")
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not is_url(self.path):
            os.makedirs(self.path, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator, before any rank writes: take the directory's writer lock (a
        second job saving there fails here, naming the holder: CheckpointLockedError) and
        hold it until the commit, then choose the step (a committed one is refused)."""
        if self.lock:
            self._hold_lock()
        try:
            d = CheckpointDirectory(self.path)  # the newest manifest and the step's own: not every one
            newest = d.newest_committed()
            step = self.step if self.step is not None else (newest[0] + 1 if newest else 0)
            if d.is_committed(step):
                raise CheckpointError(f"{self.path}: step {step} is already committed (a DCP save never replaces one)")
        except BaseException:
            self._let_go()
            raise
        token = None if d.location.is_local else new_token()
        return [dataclasses.replace(p, storage_data=Target(step, rank_node(i), token)) for i, p in enumerate(plans)]

    def _hold_lock(self) -> None:
        """The writer lock, held from the plan to the commit by a handler of this writer (let
        go by the commit, a failed plan, or when this writer is collected)."""
        self._let_go()  # a previous save of this writer that failed after its plan
        h = self.handler if self.handler is not None else DirectoryMetadataHandler()
        h.set_params(db_prefix=self.path, db_type="native", node_names=[], path_prefix=None, path_type=None)
        h.acquire_lock()
        self._held = h
        self._finalizer = weakref.finalize(self, h.release_lock)

    def _let_go(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.release_lock()
            if self._finalizer is not None:
                self._finalizer.detach()
                self._finalizer = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        target = plan.storage_data
        if not isinstance(target, Target):
            raise CheckpointError("EpochalStorageWriter.write_data: the plan did not come from prepare_global_plan")
        self._step = target.step
        blobs: dict[str, Any] = {}
        placed: list[tuple[MetadataIndex, str, int, int]] = []
        for item in plan.items:
            rows = 0
            if item.type == WriteItemType.BYTE_IO:
                name = chunk_blob(item.index.fqn, None)
                value = item_value(planner, item)
                nbytes = 0
            else:
                assert item.tensor_data is not None
                name = chunk_blob(item.index.fqn, item.tensor_data.chunk.offsets)
                value = planner.resolve_data(item)
                if not isinstance(value, torch.Tensor):
                    raise UnsupportedBlobError(f"DCP item {item.index.fqn!r}: the planner gave a "
                                               f"{type(value).__name__}, not a tensor")
                value = value.detach()
                nbytes = value.numel() * value.element_size()
                rows = block_rows(value)
            parts = split_rows(name, value, rows) if rows else {name: value}
            for part, v in parts.items():
                if part in blobs:
                    raise CheckpointError(f"DCP items {part!r}: two items of one save have the same blob name")
                blobs[part] = v
            placed.append((item.index, name, nbytes, rows))
        if not blobs:
            return _done([])
        db = CheckpointDirectory(self.path).token_db_path(target.node, target.step, target.token)
        report: DbReport | None = None
        if self.deferred:
            self.pending_blobs, self._pooled = self.staging.snapshot(blobs)
            self.pending_db, self._pending_target = db, target
        else:
            pooled = False
            if any(isinstance(v, torch.Tensor) and v.is_cuda for v in blobs.values()):
                # CUDA tensors come to host memory through the (pinned, reused) staging buffer
                blobs, pooled = self.staging.snapshot(blobs)
            try:
                self._write_db(db, blobs, target)  # UnsupportedBlobError names a value no codec stores
            finally:
                if pooled:
                    self.staging.release()
            report = self._report(db, _file_name(db))
        file = _file_name(db)
        return _done([
            WriteResult(index=idx, size_in_bytes=nbytes,
                        storage_data=Written(ItemLocation(file, name, 0, nbytes, rows), report))
            for idx, name, nbytes, rows in placed
        ])

    def _report(self, db: str, file: str) -> DbReport:
        """What the manifest records of a written db: the bytes stored (an incremental db's,
        not its logical size: what a check of the records finds) and its digest."""
        st = stat_native(db)
        stored = CheckpointDirectory(self.path).records.size(db) if self.incremental else st.file_bytes
        return DbReport(stored, st.digest, file=file)

    def _write_db(self, db: str, blobs: dict[str, Any], target: Target) -> None:
        """This rank's db of ``target``: whole, or (``incremental``) as references to the bytes
        its db of the newest committed step before ``target.step`` holds (none: whole)."""
        if not self.incremental:
            write_native(db, blobs)
            return
        d = CheckpointDirectory(self.path)
        if self._marked != self.path:  # (before the first incremental db: retention then
            d.mark_incremental()       # follows references; marked once per location)
            self._marked = self.path
        write_incremental(db, blobs, base=d.base_db(target.node, target.step), step=target.step, kept=self.kept)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator, after every rank's write_data returned (its db durable): write
        the metadata db and commit the step's manifest (deferred: kept for commit_deferred)."""
        self.finished = (metadata, results)
        if self.hold_commit:
            self._pending_finish = (metadata, results)
            return
        self._commit(metadata, results)

    def write_deferred(self) -> None:
        """Write this rank's snapshot of a deferred save to its db (temp file, fsync, rename);
        any thread. The snapshot is let go after."""
        db, blobs, target = self.pending_db, self.pending_blobs, self._pending_target
        self.pending_db, self.pending_blobs, self._pending_target = None, {}, None
        try:
            if db is not None and target is not None:
                self._write_db(db, blobs, target)
        finally:
            del blobs
            if self._pooled:
                self._pooled = False
                self.staging.release()

    def discard_deferred(self) -> None:
        """Let go of this rank's snapshot of a deferred save that will not be written (another
        rank failed): the host buffer goes back to the staging pool."""
        self.pending_db, self.pending_blobs, self._pending_finish = None, {}, None
        self._let_go()
        if self._pooled:
            self._pooled = False
            self.staging.release()

    def commit_deferred(self) -> int | None:
        """On the coordinator, once every rank's :meth:`write_deferred` (or, with ``hold_commit``,
        write_data) returned: the metadata
        db and the manifest of the deferred save (the dbs' sizes and digests are read from
        their files). Returns the step committed (None when this rank is not the coordinator)."""
        if self._pending_finish is None:
            return None
        metadata, results = self._pending_finish
        self._pending_finish = None
        self._commit(metadata, results)
        return self.committed

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._commit_held(metadata, results)
        finally:
            self._let_go()

    def _commit_held(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage: dict[MetadataIndex, ItemLocation] = {}
        reports: dict[str, DbReport] = {}
        step = self._step
        token: str | None = None  # the save's (its ranks' db names carry it)
        for rank_results in results:
            for r in rank_results:
                w = r.storage_data
                assert isinstance(w, Written)
                storage[r.index] = w.location
                node, ep = split_db_file(w.location.db) or ("", -1)
                if w.report is not None:
                    reports[node] = w.report
                elif node not in reports:  # a deferred write: the db as it now is on disk
                    reports[node] = self._report(CheckpointDirectory(self.path).path_of(w.location.db),
                                                 w.location.db)
                token = db_token(w.location.db)
                step = ep
        if step is None:
            raise CheckpointError("EpochalStorageWriter.finish: no step was planned")
        metadata.storage_data = storage
        d = CheckpointDirectory(self.path)
        meta_db = d.token_db_path(META_NODE, step, token) if token is not None else d.new_db_path(META_NODE, step)
        write_native(meta_db, {META_BLOB: metadata_to_json(metadata, self.save_id)})
        st = stat_native(meta_db)
        reports[META_NODE] = DbReport(st.file_bytes, st.digest, file=_file_name(meta_db))
        held = self._held
        commit_step(self.path, step, reports, held or self.handler, self.lock and held is None, self.metrics)
        self.committed = step


def commit_step(path: str, step: int, reports: dict[str, DbReport],
                handler: DirectoryMetadataHandler | None = None, lock: bool = True,
                metrics: dict[str, Any] | None = None) -> None:
    """Commit ``step`` of ``path`` over the dbs of ``reports`` (node -> what its writer said
    of it, every one durable): the manifest, then the handler's retention."""
    h = handler if handler is not None else DirectoryMetadataHandler()
    h.set_params(db_prefix=path, db_type="native", node_names=sorted(reports), path_prefix=None, path_type=None)
    if lock:
        h.acquire_lock()
    try:
        d = CheckpointDirectory(path)
        if d.records.exists(d.manifest_path(step)):  # another writer committed it meanwhile
            raise CheckpointError(f"{path}: step {step} was committed by another writer while this save ran; "
                                  "a committed step is never replaced (this save is not committed)")
        h.report_dbs(step, reports)
        h.write(step, metrics=metrics or None)
    finally:
        if lock:
            h.release_lock()


def _file_name(db: str) -> str:
    """The file name of a db path or URL."""
    return db.replace(os.sep, "/").rsplit("/", 1)[-1]


def _located(path: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> str:
    """The checkpoint directory ``path`` (``file://`` is the local disk); for a URL, its
    ``storage_options`` become this process's for URLs under it (every rank's own process)."""
    location = location_for(local_path(path), storage_options)
    location.remember()
    return location.root if location.is_url else local_path(path)
