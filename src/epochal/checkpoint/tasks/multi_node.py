"""The checkpoint manager of many nodes: one :class:`~.manager.CheckpointManager` per node,
TaskGroups of one task per node, and every handler call made here, never by a node's manager.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ...errors import CheckpointError
from ...execution.task import Node, TaskGroup, WorkspaceType
from ...storage.formats.base import get_db_type
from ...storage.io.seam import local_path
from ..handler.metadata import DbReport, MetadataHandler
from ..location.naming import check_node_name, db_name
from .handler_calls import HandlerCalls
from .handles import CheckpointGroup
from .manager import CheckpointManager, InitRequiredError, NodeListMismatchError
from .steps import StepResult, db_location

logger = logging.getLogger("epochal")


class MultiNodeCheckpointManager(HandlerCalls):
    """One CheckpointManager per node; builds TaskGroups with one task per node.

    Handler calls happen only here, never in the per-node managers.
    """

    def __init__(
        self,
        db_prefix: str,
        db_type: str = "native",
        metadata_handler: MetadataHandler | None = None,
        *,
        map_location: Any = None,
        verify: bool = True,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self._node_managers: list[tuple[str, CheckpointManager]] | None = None
        self._db_prefix = db_prefix = local_path(db_prefix)  # file:// is the local disk
        self._storage_options = dict(storage_options) if storage_options else None
        # the driver's handler and tools may be built without options: they find these
        db_location(db_name(0, "_", db_prefix), self._storage_options).remember()
        self._db_type = db_type
        get_db_type(db_type)
        self._metadata_handler = metadata_handler
        self._map_location, self._verify = map_location, verify
        self._path_prefix: str | None = None
        self._path_type: str | None = None
        self._node_names: list[str] = []

    def node_names(self) -> list[str]:
        if self._node_managers is not None:
            return [n for n, _ in self._node_managers]
        return list(self._node_names)

    def node_managers(self) -> list[tuple[str, CheckpointManager]]:
        """``(node name, its CheckpointManager)`` in node order (empty before init)."""
        return list(self._node_managers or [])

    def _check_nodes(self, nodes: Sequence[Any]) -> None:
        assert self._node_managers is not None
        old, new = [n for n, _ in self._node_managers], [str(n) for n in nodes]
        if old != new:
            raise NodeListMismatchError(
                f"node list changed: the manager was initialized with {old}, now called with {new}"
            )

    def _create_managers(self, nodes: Sequence[Any]) -> None:
        if not nodes:
            raise CheckpointError(
                "no nodes to checkpoint: the job's init group has no task; give the Job "
                "nodes_to_checkpoint=[...] or add an init task on each node"
            )
        self._node_managers = []
        for node in nodes:
            name = str(node)
            self._node_managers.append((name, CheckpointManager(
                db_prefix=self._db_prefix, node_name=name, db_type=self._db_type,
                map_location=self._map_location, verify=self._verify, storage_options=self._storage_options,
            )))

    def _task_group(self, func: Any, *args: Any, **kw: Any) -> CheckpointGroup:
        if self._node_managers is None:
            raise InitRequiredError("init must be called first.")
        with CheckpointGroup(WorkspaceType.GLOBAL) as group:
            for node, manager in self._node_managers:
                with Node(node):
                    func(manager, *args, **kw)
        return group

    def init(
        self,
        nodes: Sequence[Any],
        retrieve_from_epoch: int | None = None,
        path_prefix: str | None = None,
        path_type: str | None = None,
        *,
        exclude: Sequence[str] = (),
    ) -> TaskGroup:
        """Per-node init tasks; a no-op group if already initialized (the blob lists are kept)."""
        if self._node_managers is not None:
            self._check_nodes(nodes)
            return TaskGroup(WorkspaceType.GLOBAL)
        self._create_managers(nodes)
        return self._task_group(
            CheckpointManager.init, nodes=[nodes[-1]], retrieve_from_epoch=retrieve_from_epoch,
            path_prefix=path_prefix, path_type=path_type, exclude=exclude,
        )

    def reinit(self, epoch: int) -> TaskGroup:
        """Every node's init task again, from the checkpoint of ``epoch`` (after a lost node
        was placed anew: see :meth:`CheckpointManager.reinit`)."""
        return self._task_group(CheckpointManager.reinit, epoch)

    def added_blobs(self) -> dict[str, list[str]]:
        """``{node: names}`` the resume init added to each node's blob list."""
        return {n: v for _, m in self._node_managers or [] for n, v in m.added_blobs().items()}

    def untracked_blobs(self) -> dict[str, list[str]]:
        """``{node: names}`` of the global-workspace blobs each node's last save left out."""
        return {n: v for _, m in self._node_managers or [] for n, v in m.untracked_blobs().items()}

    def load(self, epoch: int, path_prefix: str | None = None, path_type: str | None = None) -> CheckpointGroup:
        return self._task_group(CheckpointManager.load, epoch, path_prefix=path_prefix, path_type=path_type)

    def check_live(self, epoch: int, blob_names: Sequence[str] | None = None,
                   path_prefix: str | None = None) -> CheckpointGroup:
        """Every node's :meth:`CheckpointManager.check_live` (run before a load of all nodes)."""
        return self._task_group(CheckpointManager.check_live, epoch, blob_names, path_prefix)

    def save(self, epoch: int, background: bool = False, *, path_prefix: str | None = None) -> CheckpointGroup:
        """Every node's :meth:`CheckpointManager.save` (``path_prefix``: to a local tier)."""
        if path_prefix:
            return self._task_group(CheckpointManager.save, epoch, background=background, path_prefix=path_prefix)
        push = self._handler.node_push_target() if self._handler is not None else None
        return self._task_group(CheckpointManager.save, epoch, background=background, push=push,
                                incremental=self.incremental_base(epoch))

    def prepare_saves(self, path_prefix: str | None = None) -> CheckpointGroup:
        return self._task_group(CheckpointManager.prepare_saves, path_prefix)

    def join_save(self, epoch: int, *, path_prefix: str | None = None) -> CheckpointGroup:
        push = self._handler.node_push_target() if self._handler is not None and not path_prefix else None
        return self._task_group(CheckpointManager.join_save, epoch, push=push, path_prefix=path_prefix)

    def copy(self, epoch: int, path_prefix: str, *, verify: bool = False) -> CheckpointGroup:
        """Every node's :meth:`CheckpointManager.copy` (its db of ``epoch`` at ``path_prefix``
        to the manager's directory, in the node's own process; ``verify``: checked first)."""
        return self._task_group(CheckpointManager.copy, epoch, path_prefix, verify=verify)

    def partial_load(self, nodes: Sequence[Any], blob_names: Sequence[str], epoch: int,
                     session: Any) -> tuple[dict[str, StepResult], bool]:
        """:meth:`load_blobs_locally`, returning what was loaded ({node: result}) and whether
        every db existed."""
        if self._node_managers is not None:
            self._check_nodes(nodes)
        else:
            self._create_managers(nodes)
        assert self._node_managers is not None
        return _partial_load([m for _, m in self._node_managers], blob_names, epoch, session, self.check_dbs)

    def load_blobs_locally(self, nodes: Sequence[Any], blob_names: Sequence[str], epoch: int, session: Any) -> bool:
        """Load ``blob_names`` from every node's db of ``epoch``, node by node; False (after
        logging which db) at the first node whose db does not exist. Every node that loads is
        checked against its live objects before any node loads."""
        return self.partial_load(nodes, blob_names, epoch, session)[1]

    def get_ckpt_db_name(self, node_name: str, epoch: int) -> str | None:
        if self._node_managers is None:
            raise TypeError("init must be called first: the manager has no nodes yet")
        for node, manager in self._node_managers:
            if node == str(node_name):
                return manager.get_ckpt_db_name(node, epoch)
        return None

    def db_reports(self) -> dict[str, DbReport]:
        out: dict[str, DbReport] = {}
        for _, manager in self._node_managers or []:
            out.update(manager.db_reports())
        return out

    def collect_checkpoint_stats(self, stats: dict[str, int], sizes: dict[str, int] | None = None) -> None:
        for _, manager in self._node_managers or []:
            manager.collect_checkpoint_stats(stats, sizes)

    def set_params(self, nodes: Sequence[Any], path_prefix: str | None = None, path_type: str | None = None) -> None:
        self._node_names = [check_node_name(str(n)) for n in nodes]
        self._keep_paths(path_prefix, path_type)
        self._handler_set_params(self._node_names)


def _partial_load(managers: list[CheckpointManager], blob_names: Sequence[str], epoch: int,
                  session: Any, check_dbs: Any = None) -> tuple[dict[str, StepResult], bool]:
    """Load ``blob_names`` from each manager's db of ``epoch``, node by node, up to the first
    node whose db does not exist (the seed's order: the nodes before it are loaded, and the
    second value is False). Every node that is loaded is checked (its db against the
    manifest, with ``check_dbs``, and its live objects) before any loads. ({node: result},
    whether every db existed)."""
    for manager in managers:  # the seed's calls that follow report only what this call loads
        manager._last = None
    found: list[CheckpointManager] = []
    for manager in managers:
        exists_task = manager.check_db_exists(epoch)
        session.run(exists_task)
        if not bool(exists_task.outputs()[0].fetch()):
            break
        found.append(manager)
    if check_dbs is not None and found:  # the dbs that exist, against the manifest
        check_dbs(epoch, [m.node_name for m in found])
    for manager in found:
        session.run(manager.check_live(epoch, blob_names))
    results: dict[str, StepResult] = {}
    for manager in found:
        task = manager.load_blobs_from_checkpoint(blob_names, epoch)
        session.run(task)
        results.update(task.results())
    if len(found) < len(managers):
        missing = managers[len(found)]
        logger.info("DB %s does not exist!", missing.get_ckpt_db_name(missing.node_name, epoch))
        return results, False
    logger.info("Successfully loaded from checkpoints.")
    return results, True
