"""The checkpoint manager of one node: build the tasks that save and load its db per epoch.

As in the seed, a manager never touches a workspace itself: ``init``, ``save``, ``load`` and
friends *build* Tasks (or TaskGroups, one task per node) that a session runs where each node
lives. Timing stats (ns per db) and sizes are task outputs, read when reported. The manager of
many nodes, one of these per node, is :mod:`.multi_node`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import CheckpointError
from ...execution.task import Task, TaskOutput
from ...storage.formats.base import get_db_type
from ...storage.io.seam import local_path
from ..handler.metadata import DbReport, MetadataHandler, PushTarget
from ..location.naming import check_node_name, db_name
from ..location.view import CheckpointDirectory
from .copy import CopyDb
from .handler_calls import HandlerCalls
from .handles import CheckpointTask
from .steps import (
    INTERNAL_PREFIX,
    CheckLive,
    DbExists,
    GetBlobNames,
    JoinSave,
    LoadBlobs,
    PrepareSaves,
    ResumeBlobNames,
    SaveBlobs,
    SnapshotAndSave,
    Timed,
    db_location,
)

logger = logging.getLogger("epochal")


class InitRequiredError(CheckpointError, AssertionError):
    """A manager method that needs ``init`` was called before it."""


class NodeListMismatchError(CheckpointError, AssertionError):
    """A multi-node manager was called with other nodes than it was initialized with."""


def _fetch_names(output: TaskOutput | None) -> list[str]:
    if output is None:
        return []
    try:
        value = output.fetch()
    except (RuntimeError, KeyError):
        return []
    return [] if value is None else [str(n) for n in np.asarray(value).tolist()]


class CheckpointManager(HandlerCalls):
    """Checkpoints the global workspace of one node: one db per epoch at
    ``db_name(epoch, node_name, db_prefix)``.

    ``map_location`` and ``verify`` are epochal's additions: where loaded torch tensors go
    (default: back to their saved device when it exists), and whether loads check checksums.
    ``db_prefix`` may be an fsspec URL (``s3://bucket/run``); ``storage_options`` then go to
    fsspec, here and in the node's process (the steps carry them; see docs/remote.md).
    """

    BLOB_NAMES = "blob_names"

    def __init__(
        self,
        db_prefix: str,
        node_name: str,
        db_type: str = "native",
        metadata_handler: MetadataHandler | None = None,
        *,
        map_location: Any = None,
        verify: bool = True,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self._db_prefix = db_prefix = local_path(db_prefix)  # file:// is the local disk
        self._storage_options = dict(storage_options) if storage_options else None
        # the driver's handler and tools may be built without options: they find these
        db_location(db_name(0, "_", db_prefix), self._storage_options).remember()
        self._node_name = check_node_name(str(node_name))
        self._db_type = db_type
        get_db_type(db_type)  # an unknown db_type fails here, naming it
        self._metadata_handler = metadata_handler
        self._map_location, self._verify = map_location, verify
        self._blob_names = self.BLOB_NAMES
        self._names_output: TaskOutput | None = None
        self._added_output: TaskOutput | None = None
        self._untracked_output: TaskOutput | None = None
        self._path_prefix: str | None = None
        self._path_type: str | None = None
        #: {(epoch, path prefix): db} of the saves started (a background save's join reports that db)
        self._saving: dict[tuple[int, str], str] = {}
        #: the timed task built last: only the seed's calls that name none read it
        #: (collect_checkpoint_stats, write_checkpoint_metadata); the runner uses the task's own
        self._last: CheckpointTask | None = None

    # -- accessors
    @property
    def node_name(self) -> str:
        return self._node_name

    def node_names(self) -> list[str]:
        return [self._node_name]

    def get_ckpt_db_name(self, node_name: str, epoch: int) -> str | None:
        """The db path of ``node_name`` at ``epoch`` (as its manifest names it, when it is
        committed); None for a node this manager lacks."""
        if str(node_name) != self._node_name:
            return None
        return self._db(epoch)

    def _db(self, epoch: int, path_prefix: str | None = None) -> str:
        """The db of ``epoch`` to read: the file its manifest names (at a URL, with its
        writer's token: read afresh, a step saved again has another), else the seed's name."""
        if path_prefix:
            return db_name(epoch, self._node_name, self._db_prefix, path_prefix)
        try:
            view = CheckpointDirectory(self._db_prefix, storage_options=self._storage_options)
            return view.db_path(self._node_name, epoch)
        except (OSError, ValueError, ImportError):  # no records there (a store of bytes alone)
            return db_name(epoch, self._node_name, self._db_prefix)

    def _new_db(self, epoch: int) -> str:
        """Where a save of ``epoch`` writes: at a URL a name with a fresh writer token (no
        other writer can overwrite it; kept until its join), else the seed's name."""
        return CheckpointDirectory(self._db_prefix, storage_options=self._storage_options).new_db_path(
            self._node_name, epoch)

    # -- tasks
    def init(
        self,
        nodes: Sequence[Any] | None = None,
        retrieve_from_epoch: int | None = None,
        path_prefix: str | None = None,
        path_type: str | None = None,
        *,
        exclude: Sequence[str] = (),
    ) -> Task:
        """A Task whose output ``blob_names`` fixes the blob list: every blob of the node's
        global workspace now (run it right after init_group), or the list stored in the
        checkpoint of ``retrieve_from_epoch`` plus the blobs the workspace holds now that the
        checkpoint lacks (see :meth:`added_blobs`; ``exclude``: names never added, such as
        the job's task outputs)."""
        if nodes and len(nodes) != 1:  # None or [] (a job whose init group has no task)
            raise AssertionError("CheckpointManager only supports single node.")
        added = f"{INTERNAL_PREFIX}{self._node_name}/added_blobs"
        if retrieve_from_epoch is None:
            step: Any = GetBlobNames(self._blob_names)
            outputs = [self._blob_names]
        else:
            full = self._db(retrieve_from_epoch, path_prefix)
            logger.info("Initializing checkpoints from = %s", full)
            step = ResumeBlobNames(
                full, path_type or self._db_type, self._blob_names, added, exclude=exclude,
                node=self._node_name, epoch=retrieve_from_epoch, keep_device=True, verify=self._verify,
                storage_options=self._storage_options,
            )
            outputs = [self._blob_names, added]
        task = Task(step=step, outputs=outputs, node=self._node_name, name="checkpoint_init")
        self._names_output = task.outputs()[0]
        self._added_output = task.outputs()[1] if len(outputs) > 1 else None
        return task

    def reinit(self, epoch: int) -> Task:
        """The init task again, from the checkpoint of ``epoch``: after a node was lost and
        placed anew (its workspace is empty), it fixes the blob list from that checkpoint
        before the load."""
        return self.init([self._node_name], retrieve_from_epoch=epoch)

    def added_blobs(self) -> dict[str, list[str]]:
        """``{node: names}`` of the blobs the resume init added to the stored blob list
        (empty when none, or when the job did not resume)."""
        return {self._node_name: _fetch_names(self._added_output)} if self._added_output else {}

    def untracked_blobs(self) -> dict[str, list[str]]:
        """``{node: names}`` of the global-workspace blobs the last save left out (not in the
        blob list); empty before a save."""
        return {self._node_name: _fetch_names(self._untracked_output)} if self._untracked_output else {}

    def blob_list(self) -> list[str]:
        """The current blob list (init must have been built and run)."""
        if self._names_output is None:
            raise InitRequiredError(f"node {self._node_name!r}: init must be called first.")
        try:
            names = self._names_output.fetch()
        except RuntimeError:
            names = None
        if names is None:
            raise InitRequiredError(f"node {self._node_name!r}: the init task has not run yet")
        return [str(n) for n in names.tolist()]

    def _timed_task(self, cp_op_name: str, op: Any, db: str, digest: str | None = None,
                    pushed: str | None = None) -> CheckpointTask:
        base = f"{INTERNAL_PREFIX}{self._node_name}/{cp_op_name}"
        task = CheckpointTask(step=Timed(op, f"{base}.ns", f"{base}.bytes"), node=self._node_name, name=cp_op_name)
        self._last = task.outputs_of(db, f"{base}.ns", f"{base}.bytes", digest, pushed)
        return task

    def collect_checkpoint_stats(self, stats: dict[str, int], sizes: dict[str, int] | None = None) -> None:
        """Add ``{db path: ns}`` of the most recently built timed task (and bytes to ``sizes``)."""
        if self._last is not None:
            try:
                result = self._last.result()
            except (RuntimeError, KeyError):
                result = None
            if result is not None:
                stats[result.db] = result.ns
                if sizes is not None:
                    sizes[result.db] = result.nbytes
                return
        logger.info("Failed to collect checkpoint stats: %s", self._last.db if self._last else None)

    def _load_step(self, epoch: int, path_prefix: str | None = None, path_type: str | None = None) -> LoadBlobs:
        added = set(self.added_blobs().get(self._node_name, ()))  # not in that checkpoint
        if added:  # and the list itself is the one init extended, not the stored one
            added.add(self._blob_names)
        names = [n for n in self.blob_list() if n not in added]
        return LoadBlobs(
            self._db(epoch, path_prefix), path_type or self._db_type, names,
            node=self._node_name, epoch=epoch, keep_device=True,
            map_location=self._map_location, verify=self._verify, storage_options=self._storage_options,
            whole=True,
        )

    def _partial_step(self, blob_names: Sequence[str], epoch: int) -> LoadBlobs:
        return LoadBlobs(
            self._db(epoch), self._db_type, list(blob_names), node=self._node_name,
            epoch=epoch, allow_incomplete=True, map_location=self._map_location, verify=self._verify,
            storage_options=self._storage_options,
        )

    def load(self, epoch: int, path_prefix: str | None = None, path_type: str | None = None) -> CheckpointTask:
        """A timed Task loading every blob of the blob list from the db of ``epoch``."""
        step = self._load_step(epoch, path_prefix, path_type)
        logger.info("Loading checkpoints from = %s", step.db)
        return self._timed_task("checkpoint_load", step, step.db)

    def check_live(self, epoch: int, blob_names: Sequence[str] | None = None,
                   path_prefix: str | None = None) -> Task:
        """A Task that checks, writing nothing, that the db of ``epoch`` fits the node's live
        objects (what :meth:`load`, or with ``blob_names`` :meth:`load_blobs_from_checkpoint`,
        would load): a load of several nodes runs it on every node first, so a misfit on one
        node leaves every node untouched (BlobMismatchError naming each blob). ``path_prefix``:
        the db is read there (as :meth:`load`'s)."""
        step = (self._load_step(epoch, path_prefix) if blob_names is None
                else self._partial_step(blob_names, epoch))
        return Task(step=CheckLive(step), node=self._node_name, name="checkpoint_check")

    def load_blobs_from_checkpoint(self, blob_names: Sequence[str], epoch: int) -> CheckpointTask:
        """A timed Task loading just ``blob_names`` (those the db has) from ``epoch``."""
        step = self._partial_step(blob_names, epoch)
        logger.info("Load from %s", step.db)
        return self._timed_task("checkpoint_partial_load", step, step.db)

    def check_db_exists(self, epoch: int) -> Task:
        """A Task whose one output says whether the db of ``epoch`` exists."""
        path = self._db(epoch)
        logger.info("Check existence of %s", path)
        flag = f"{INTERNAL_PREFIX}{self._node_name}/db_exists"
        return Task(step=DbExists(path, self._db_type, flag, self._storage_options), outputs=[flag], node=self._node_name,
                    name="check_db_exists")

    def _push_target(self, push: PushTarget | None) -> PushTarget | None:
        """``push`` when given (a multi-node manager asked its handler), else this manager's
        handler's (None without one)."""
        if push is not None or self._handler is None:
            return push
        return self._handler.node_push_target()

    def save(self, epoch: int, background: bool = False, *, push: PushTarget | None = None,
             incremental: tuple[bool, int | None] | None = None, path_prefix: str | None = None) -> CheckpointTask:
        """A timed Task saving the blob list, in order, to the db of ``epoch``; after it ran,
        its :meth:`~.handles.CheckpointTask.results` hold the db's size, digest and time.

        With ``background``, the task only snapshots the blobs and starts the write on a
        background thread of the node's process; run :meth:`join_save` before committing.
        With a handler whose ``incremental`` is set (or ``incremental``: (True, base epoch),
        from a multi-node manager), the db holds only the bytes the base epoch's db of this
        node lacks (docs/format.md, "Incremental db files").

        ``path_prefix``: the db is written there instead (a local tier's directory, on the
        node's own disk: whole, never pushed to a mirror; see :meth:`copy`).
        """
        db = db_name(epoch, self._node_name, self._db_prefix, path_prefix) if path_prefix else self._new_db(epoch)
        if path_prefix:
            push, incremental = None, (False, None)
        if background:
            self._saving[(int(epoch), path_prefix or "")] = db
        logger.info("Saving to %s%s", db, " (background)" if background else "")
        step = SnapshotAndSave if background else SaveBlobs
        untracked = f"{INTERNAL_PREFIX}{self._node_name}/untracked_blobs"
        base = f"{INTERNAL_PREFIX}{self._node_name}/checkpoint_save"
        digest = None if background else f"{base}.digest"
        pushed = None if background else f"{base}.pushed"
        save = step(
            db, self._db_type, self.blob_list(), node=self._node_name, epoch=epoch,
            untracked_output=untracked, digest_output=digest,
            storage_options=None if path_prefix else self._storage_options,
            push=None if background or path_prefix else self._push_target(push),
            pushed_output=pushed,
        )
        on, older = self.incremental_base(epoch) if incremental is None else incremental
        if on:
            save.incremental, save.base = True, (self._db(older) if older is not None else None)
        task = self._timed_task("checkpoint_save", save, db, digest, pushed)
        self._untracked_output = task.untracked_output = task.add_output(untracked)
        return task

    def prepare_saves(self, path_prefix: str | None = None) -> Task:
        """A Task that prepares the node's background saves of the blob list (to the dbs at
        ``path_prefix``, when given) as a run with ``async_save`` starts
        (:class:`~.steps.PrepareSaves`: snapshot memory faulted in on a thread of the node's
        process, so the first snapshot copies into warm memory)."""
        step = PrepareSaves(db_name(0, self._node_name, self._db_prefix, path_prefix), self.blob_list(),
                            node=self._node_name)
        return Task(step=step, node=self._node_name, name="checkpoint_prepare")

    def join_save(self, epoch: int, *, push: PushTarget | None = None,
                  path_prefix: str | None = None) -> CheckpointTask:
        """A Task waiting for the background save of ``epoch`` (at ``path_prefix``, when
        given); it re-raises the save's error, and its results are the whole save's (snapshot
        until the file is durable)."""
        db = (self._saving.pop((int(epoch), path_prefix or ""), None)
              or db_name(epoch, self._node_name, self._db_prefix, path_prefix))
        if path_prefix:
            push = None
        base = f"{INTERNAL_PREFIX}{self._node_name}/checkpoint_save"
        task = CheckpointTask(step=JoinSave(db, f"{base}.ns", f"{base}.bytes",
                                            db_type=self._db_type, digest_output=f"{base}.digest",
                                            push=self._push_target(push), pushed_output=f"{base}.pushed",
                                            storage_options=None if path_prefix else self._storage_options),
                              node=self._node_name, name="checkpoint_join")
        self._last = task.outputs_of(db, f"{base}.ns", f"{base}.bytes", f"{base}.digest", f"{base}.pushed")
        return task

    def copy(self, epoch: int, path_prefix: str, *, verify: bool = False) -> CheckpointTask:
        """A timed Task copying the node's db of ``epoch`` at ``path_prefix`` (a local tier's
        directory) to this manager's directory, byte for byte, where the node lives
        (:class:`~.copy.CopyDb`: atomic, its digest checked against the source's; ``verify``:
        every checksum of the source checked first); its
        :meth:`~.handles.CheckpointTask.results` are what the commit records."""
        src, db = self._db(epoch, path_prefix), self._new_db(epoch)  # (at a URL: a writer token)
        base = f"{INTERNAL_PREFIX}{self._node_name}/checkpoint_copy"
        step = CopyDb(src, db, self._db_type, digest_output=f"{base}.digest", storage_options=self._storage_options,
                      verify=verify)
        task = CheckpointTask(step=Timed(step, f"{base}.ns", f"{base}.bytes"), node=self._node_name,
                              name="checkpoint_copy")
        return task.outputs_of(db, f"{base}.ns", f"{base}.bytes", f"{base}.digest")

    def db_reports(self) -> dict[str, DbReport]:
        return self._last.db_reports() if self._last is not None else {}

    def set_params(self, nodes: Any, path_prefix: str | None = None, path_type: str | None = None) -> None:
        self._keep_paths(path_prefix, path_type)
        self._handler_set_params([self._node_name])
