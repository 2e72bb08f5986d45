"""What both checkpoint managers say to the metadata handler: the seed's calls (with its
truthiness quirk) and epochal's extensions, through the handler's full interface
(:func:`~epochal.checkpoint.handler.metadata.with_extensions`), so the runner talks to the manager
alone and never looks a handler method up itself."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointError
from ..handler.metadata import BaseMetadataHandler, DbReport, MetadataHandler, with_extensions
from ..location.naming import epochs_on_disk

if TYPE_CHECKING:
    from .steps import StepResult

logger = logging.getLogger("epochal")

__all__ = ["NO_RECORDS", "HandlerCalls", "HandlerLink"]


class HandlerCalls:
    """The handler-facing methods both managers share (seed semantics, incl. its truthiness
    quirk: ``report``/``set_params`` under ``if handler:``, the rest under ``is not None``)."""

    _metadata_handler: Any
    _db_prefix: str
    _db_type: str
    _path_prefix: str | None
    _path_type: str | None

    @property
    def metadata_handler(self) -> MetadataHandler | None:
        return self._metadata_handler  # type: ignore[no-any-return]

    @property
    def db_prefix(self) -> str:
        return self._db_prefix

    @property
    def db_type(self) -> str:
        return self._db_type

    @property
    def _handler(self) -> BaseMetadataHandler | None:
        """The handler with the full interface (extensions as no-ops where it lacks them)."""
        h = self._metadata_handler
        return None if h is None else with_extensions(h)

    def incremental_base(self, epoch: int) -> tuple[bool, int | None]:
        """Whether the save of ``epoch`` is incremental (the handler's ``incremental``), and
        on which epoch: the newest committed before it (None: none, the db is written whole)."""
        h = self._metadata_handler
        if h is None or not getattr(h, "incremental", False):
            return False, None
        if getattr(h, "directory", None) is not None:
            h.directory.mark_incremental()  # before its first incremental db (retention reads refs there)
        newest = h.directory.newest_committed() if getattr(h, "directory", None) is not None else None
        if newest is not None and newest[0] < epoch:
            return True, int(newest[0])
        older = [e for e in h.committed_epochs() if e < epoch]
        return True, (max(older) if older else None)

    # -- epochal's handler extensions, for the runner (no-ops without a handler)
    def expect_final(self, epoch: int) -> None:
        """The stop condition holds at ``epoch``, about to be saved (see the handler doc)."""
        if self._handler is not None:
            self._handler.expect_final(epoch)

    def mark_final(self, epoch: int) -> None:
        """Committed ``epoch`` was the job's last."""
        if self._handler is not None:
            self._handler.mark_final(epoch)

    def is_final(self, epoch: int) -> bool:
        """Whether committed ``epoch`` was a finished job's last."""
        return bool(self._handler.is_final(epoch)) if self._handler is not None else False

    def flush(self) -> None:
        """Wait for the handler's background work (a mirror's pushes)."""
        if self._handler is not None:
            self._handler.flush()

    def acquire_lock(self) -> None:
        """Take the handler's writer lock for a run (after ``set_params``)."""
        if self._handler is not None:
            self._handler.acquire_lock()

    def release_lock(self) -> None:
        if self._handler is not None:
            self._handler.release_lock()

    def location(self) -> str:
        """Where the checkpoints are, for messages: the handler's directory, else db_prefix."""
        where = self._handler.location() if self._handler is not None else None
        return where or self._db_prefix

    def write_checkpoint_metadata(self, epoch: int) -> None:
        """Commit ``epoch`` through the handler (the seed's call): what each node reported of
        the save task built last (:meth:`db_reports`), then the seed's ``write``."""
        self.commit(epoch, self.db_reports())

    def commit(self, epoch: int, reports: Mapping[str, DbReport],
               metrics: Mapping[str, Any] | None = None) -> None:
        """Commit ``epoch``: first what each node reported of its db (``report_dbs``: size,
        digest; the handler then never reopens a db), then ``write`` (with ``metrics`` when
        given: CheckpointError when the handler's ``write`` takes none)."""
        handler = self._metadata_handler
        if handler is None:
            return
        if reports:
            assert self._handler is not None
            self._handler.report_dbs(epoch, dict(reports))
        if not metrics:
            handler.write(epoch=epoch)
            return
        params = inspect.signature(handler.write).parameters
        if "metrics" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise CheckpointError(
                f"the metadata handler {type(handler).__name__} records no metrics (its write() "
                f"takes no metrics=): cannot commit epoch {epoch} with {sorted(metrics)}")
        handler.write(epoch=epoch, metrics=dict(metrics))

    def report_results(self, action_name: str, results: Mapping[str, StepResult]) -> None:
        """One stats line per db of a save or load: its ns and bytes, as its step said."""
        self._report(action_name, {r.db: int(r.ns) for r in results.values()},
                     {r.db: int(r.nbytes) for r in results.values()})

    def db_reports(self) -> dict[str, DbReport]:
        """``{node: DbReport}`` of the save (or join) task built last and run: the size and
        digest each node reported of the db it wrote ({} before one ran). The seed's
        ``write_checkpoint_metadata`` uses it; the runner commits with the results of the
        task it ran (:meth:`~.handles.CheckpointTask.results`)."""
        raise NotImplementedError

    def get_resume_from_epoch_id(self, user_epoch: int | None = None) -> int | None:
        if self._metadata_handler is not None:
            return self._metadata_handler.last_epoch(user_epoch=user_epoch)  # type: ignore[no-any-return]
        return user_epoch

    def resume_epoch(self, user_epoch: int | None = None) -> int | None:
        """:meth:`get_resume_from_epoch_id` for the runner, whose load verifies every checksum
        before any live object is touched: the handler may check less up front (one read of
        the checkpoint); a load that fails is reported with :meth:`reject_epoch`."""
        if self._handler is not None:
            return self._handler.resume_epoch(user_epoch)
        return user_epoch

    def reject_epoch(self, epoch: int, reason: str) -> bool:
        """The load of ``epoch`` found it damaged: True when the handler will choose another
        (ask :meth:`resume_epoch` again), False when the load's error must stand."""
        return bool(self._handler.reject_epoch(int(epoch), reason)) if self._handler is not None else False

    def check_dbs(self, epoch: int, nodes: Sequence[str] | None = None) -> None:
        """Each db of committed ``epoch`` (of ``nodes``) against what its commit recorded
        (size, digest), before a load writes anything (no-op without a handler)."""
        h = self._handler
        if h is None:
            return
        if getattr(h, "directory", True) is None and "db_prefix" in inspect.signature(h.check_dbs).parameters:
            h.check_dbs(int(epoch), nodes, db_prefix=self._db_prefix)  # (no run has told it where)
        else:
            h.check_dbs(int(epoch), nodes)

    def cp_accessible(self, epoch: int | None = None) -> bool:
        if self._metadata_handler is not None:
            return self._metadata_handler.cp_accessible(epoch)  # type: ignore[no-any-return]
        return True

    def existing_epochs(self) -> list[int]:
        """Epochs whose db of one of this manager's nodes is in the (local) checkpoint
        directory, committed or not; [] for a URL."""
        return epochs_on_disk(self._db_prefix, list(self.node_names()), self._path_prefix)

    def node_names(self) -> list[str]:
        raise NotImplementedError

    def _keep_paths(self, path_prefix: str | None, path_type: str | None) -> None:
        if path_prefix:
            self._path_prefix = path_prefix
        if path_type:
            self._path_type = path_type

    def _handler_set_params(self, node_names: list[str]) -> None:
        if self._metadata_handler:
            self._metadata_handler.set_params(
                db_prefix=self._db_prefix, db_type=self._db_type, node_names=node_names,
                path_prefix=self._path_prefix, path_type=self._path_type,
            )

    def collect_checkpoint_stats(self, stats: dict[str, int], sizes: dict[str, int] | None = None) -> None:
        """Add ``{db path: ns}`` (and bytes to ``sizes``) of the timed task built last (a
        manager's; nothing here)."""

    def report_checkpoint_stats(self, action_name: str) -> None:
        """Report the timed task built last to the handler (the seed's call)."""
        stats: dict[str, int] = {}
        sizes: dict[str, int] = {}
        self.collect_checkpoint_stats(stats, sizes)
        self._report(action_name, stats, sizes)

    def _report(self, action_name: str, stats: dict[str, int], sizes: dict[str, int]) -> None:
        logger.debug("%s stats: %s", action_name, stats)
        if self._metadata_handler:
            assert self._handler is not None
            self._handler.report_bytes(action_name, sizes)
            self._metadata_handler.report(action_name, stats)


class HandlerLink(HandlerCalls):
    """A handler seen through :class:`HandlerCalls` without a manager (the Checkpointer's):
    the same commit, report, lock and resume calls as the managers make."""

    def __init__(self, handler: MetadataHandler | None, db_prefix: str, db_type: str, node_names: list[str]) -> None:
        self._metadata_handler = handler
        self._db_prefix, self._db_type = db_prefix, db_type
        self._path_prefix = self._path_type = None
        self._node_names = list(node_names)

    def node_names(self) -> list[str]:
        return list(self._node_names)

    def db_reports(self) -> dict[str, DbReport]:
        return {}


#: the records of a door with no manager and no handler: every call a no-op
NO_RECORDS = HandlerLink(None, "?", "native", [])
