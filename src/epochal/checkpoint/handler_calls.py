"""What both checkpoint managers say to the metadata handler: the seed's calls (with its
truthiness quirk) and epochal's extensions, through the handler's full interface
(:func:`~epochal.checkpoint.metadata.with_extensions`), so the runner talks to the manager
alone and never looks a handler method up itself."""

from __future__ import annotations

import logging
from typing import Any

from .metadata import BaseMetadataHandler, DbReport, MetadataHandler, with_extensions
from .naming import epochs_on_disk

logger = logging.getLogger("epochal")

__all__ = ["HandlerCalls"]


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
        """Commit ``epoch`` through the handler: first what each node reported of its db
        (``report_dbs``: size, digest), then the seed's ``write``."""
        if self._metadata_handler is not None:
            reports = self.db_reports()
            if reports:
                assert self._handler is not None
                self._handler.report_dbs(epoch, reports)
            self._metadata_handler.write(epoch=epoch)

    def db_reports(self) -> dict[str, DbReport]:
        """``{node: DbReport}`` of the save (or join) task built last and run: the size and
        digest each node reported of the db it wrote ({} before one ran)."""
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

    #: bytes per db of the last ``report_checkpoint_stats`` (read by JobRunner's events, so
    #: they need not fetch the stats from the nodes a second time)
    last_report_sizes: dict[str, int] | None = None

    def _report(self, action_name: str, stats: dict[str, int], sizes: dict[str, int]) -> None:
        self.last_report_sizes = dict(sizes)
        logger.debug("%s stats: %s", action_name, stats)
        if self._metadata_handler:
            assert self._handler is not None
            self._handler.report_bytes(action_name, sizes)
            self._metadata_handler.report(action_name, stats)
