"""Checkpoint tasks that own their results, and the manager seam the runner is typed against.

A manager's ``save``/``join_save``/``load``/``load_blobs_from_checkpoint`` return a
:class:`CheckpointTask` (one node) or a :class:`CheckpointGroup` (one task per node): still a
``Task``/``TaskGroup`` for ``session.run`` (the seed's call shapes), and after the run
:meth:`CheckpointTask.results` reads what each node's step did (db, bytes, ns, digest) from
the task's own outputs. Nothing is read back from "the task the manager built last".

:class:`CheckpointManagerLike` lists exactly what :class:`~epochal.jobs.runner.JobRunner`
(and its recovery) asks of a checkpoint manager; both managers are one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ...execution.task import Task, TaskGroup, TaskOutput
from ..handler.metadata import DbReport, MetadataHandler
from .steps import StepResult

__all__ = ["CheckpointGroup", "CheckpointManagerLike", "CheckpointTask", "PartialLoads", "SessionSave"]


class CheckpointTask(Task):
    """A timed checkpoint task of one node on one db; :meth:`results` after it ran."""

    _ctx_shared = True  # the context stack of Task: it is a Task wherever one is expected

    db: str = ""
    ns_output: TaskOutput | None = None
    bytes_output: TaskOutput | None = None
    digest_output: TaskOutput | None = None
    pushed_output: TaskOutput | None = None
    untracked_output: TaskOutput | None = None

    def outputs_of(self, db: str, ns: str, nbytes: str, digest: str | None = None,
                   pushed: str | None = None) -> CheckpointTask:
        """Declare the outputs its step writes (names of blobs) for the db ``db``."""
        self.db = db
        self.ns_output, self.bytes_output = self.add_output(ns), self.add_output(nbytes)
        self.digest_output = self.add_output(digest) if digest is not None else None
        self.pushed_output = self.add_output(pushed) if pushed is not None else None
        return self

    def result(self) -> StepResult:
        """What the step did (RuntimeError when the task has not run)."""
        if self.ns_output is None or self.bytes_output is None:
            raise RuntimeError(f"task {self.name!r} reports no results")
        ns, nbytes = self.ns_output.fetch(), self.bytes_output.fetch()
        if ns is None or nbytes is None:
            raise RuntimeError(f"task {self.name!r} has not run: no results")
        digest = self.digest_output.fetch() if self.digest_output is not None else None
        pushed = self.pushed_output.fetch() if self.pushed_output is not None else None
        return StepResult(self.db, int(nbytes), int(ns[0]), (str(digest) or None) if digest is not None else None,
                          bool(pushed))

    def results(self) -> dict[str, StepResult]:
        """``{node: result}``."""
        return {self.node: self.result()}

    def untracked(self) -> dict[str, list[str]]:
        """``{node: names}`` of the global-workspace blobs a save left out (not in the blob
        list); {} for another task."""
        if self.untracked_output is None:
            return {}
        try:
            value = self.untracked_output.fetch()
        except (RuntimeError, KeyError):
            return {}
        return {self.node: [] if value is None else [str(n) for n in np.asarray(value).tolist()]}

    def db_reports(self) -> dict[str, DbReport]:
        """``{node: DbReport}`` of a save (or join) that ran and reported a digest; {} else."""
        if self.digest_output is None:
            return {}
        try:
            return {node: r.report() for node, r in self.results().items()}
        except (RuntimeError, KeyError):
            return {}


class CheckpointGroup(TaskGroup):
    """One :class:`CheckpointTask` per node; :meth:`results` of all of them."""

    _ctx_shared = True

    def node_tasks(self) -> list[CheckpointTask]:
        return [t for t in self._all_tasks() if isinstance(t, CheckpointTask)]

    def results(self) -> dict[str, StepResult]:
        out: dict[str, StepResult] = {}
        for task in self.node_tasks():
            out.update(task.results())
        return out

    def db_reports(self) -> dict[str, DbReport]:
        out: dict[str, DbReport] = {}
        for task in self.node_tasks():
            out.update(task.db_reports())
        return out

    def untracked(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for task in self.node_tasks():
            out.update(task.untracked())
        return out


CheckpointRun = CheckpointTask | CheckpointGroup


@runtime_checkable
class CheckpointManagerLike(Protocol):
    """What the runner asks of a checkpoint manager (``CheckpointManager`` and
    ``MultiNodeCheckpointManager`` are both; see :mod:`.handler_calls` for the handler side)."""

    @property
    def metadata_handler(self) -> MetadataHandler | None: ...

    # where, and the handler's lifecycle
    def set_params(self, nodes: Any, path_prefix: str | None = None, path_type: str | None = None) -> None: ...

    def location(self) -> str: ...

    def acquire_lock(self) -> None: ...

    def release_lock(self) -> None: ...

    def flush(self) -> None: ...

    # resume
    def existing_epochs(self) -> list[int]: ...

    def resume_epoch(self, user_epoch: int | None = None) -> int | None: ...

    def reject_epoch(self, epoch: int, reason: str) -> bool: ...

    def check_dbs(self, epoch: int, nodes: Sequence[str] | None = None) -> None: ...

    def is_final(self, epoch: int) -> bool: ...

    def init(self, nodes: Sequence[Any], retrieve_from_epoch: int | None = None, path_prefix: str | None = None,
             path_type: str | None = None, *, exclude: Sequence[str] = ()) -> Task | TaskGroup: ...

    def reinit(self, epoch: int) -> Task | TaskGroup: ...

    def added_blobs(self) -> dict[str, list[str]]: ...

    def check_live(self, epoch: int, blob_names: Sequence[str] | None = None,
                   path_prefix: str | None = None) -> Task | TaskGroup: ...

    def load(self, epoch: int, path_prefix: str | None = None, path_type: str | None = None) -> CheckpointRun: ...

    # save and commit
    def cp_accessible(self, epoch: int | None = None) -> bool: ...

    def save(self, epoch: int, background: bool = False, *, path_prefix: str | None = None) -> CheckpointRun: ...

    def join_save(self, epoch: int, *, path_prefix: str | None = None) -> CheckpointRun: ...

    def expect_final(self, epoch: int) -> None: ...

    def mark_final(self, epoch: int) -> None: ...

    def commit(self, epoch: int, reports: Mapping[str, DbReport], metrics: Mapping[str, Any] | None = None) -> None: ...

    def report_results(self, action_name: str, results: Mapping[str, StepResult]) -> None: ...


@runtime_checkable
class PartialLoads(Protocol):
    """A manager that loads chosen blobs of every node (the seed's multi-node manager only):
    what ``JobRunner.load_blobs_from_checkpoints`` needs."""

    def partial_load(self, nodes: Sequence[Any], blob_names: Sequence[str], epoch: int,
                     session: Any) -> tuple[dict[str, StepResult], bool]: ...


@dataclass
class SessionSave:
    """A save the runner started on the nodes (the engine's SaveHandle): a synchronous one's
    results are its task's; a background one is joined by a join task on every node.
    ``path_prefix``: where the dbs were written (a local tier's directory; None: the manager's)."""

    session: Any
    manager: CheckpointManagerLike
    epoch: int
    task: CheckpointRun
    background: bool
    path_prefix: str | None = None

    def join(self) -> dict[str, StepResult]:
        if not self.background:
            return self.task.results()
        join = (self.manager.join_save(self.epoch, path_prefix=self.path_prefix) if self.path_prefix
                else self.manager.join_save(self.epoch))
        self.session.run(join)
        return join.results()
