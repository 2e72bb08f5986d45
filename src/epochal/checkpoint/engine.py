"""The one checkpoint engine under both doors (``JobRunner`` and ``Checkpointer``).

Each door knows how to run a save or a load where its state lives (the runner: tasks on
the nodes through a session; the Checkpointer: a step on the dict it was given) and hands
the engine a callable that does it and returns typed results
(:class:`~.steps.StepResult` per node: db, bytes, ns, digest). Everything else is here, once:

- **resume with fallback**: the epoch the handler chooses is loaded (every checksum checked
  before any live object is written); a :class:`~epochal.errors.CheckpointCorruptError` goes
  to ``reject_epoch`` and the next epoch ``resume_epoch`` gives is loaded instead;
- **save -> join -> commit -> report**: the room check, the save, its join (a background
  save is joined at the next save, at :meth:`CheckpointEngine.finish_pending` or when the
  door closes), the commit with what the nodes reported of their dbs (size, digest: the
  handler never reopens a db) and the metrics, then one stats line per db;
- **the failure policy**: a value no retry can save raises at once; a storage error is a
  warning until ``max_failed_saves`` saves in a row failed (see :class:`CheckpointEngine`);
- **background saves prepared**: :meth:`CheckpointEngine.prepare_saves` as a run with
  ``async_save`` starts (snapshot memory faulted in off the training thread);
- **the lock and flush lifecycle**: :meth:`CheckpointEngine.open` takes the writer lock,
  :meth:`CheckpointEngine.close` flushes the handler's background work and lets it go.

The handler side is a :class:`Records` (both managers are one, through
:class:`~.handler_calls.HandlerCalls`; the Checkpointer uses a
:class:`~.handler_calls.HandlerLink`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import (
    BlobMismatchError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLockedError,
    MissingBlobError,
    NodeLostError,
    UnsupportedBlobError,
)
from .handler.metadata import DbReport
from .location.best import metric_number
from .tasks.steps import StepResult

__all__ = ["FATAL_SAVE_ERRORS", "CheckpointEngine", "Done", "EngineEvents", "LoadPlan", "Records", "SaveHandle"]

logger = logging.getLogger("epochal")

#: errors no retry can fix: about the values themselves, or a location another job took over
FATAL_SAVE_ERRORS = (UnsupportedBlobError, MissingBlobError, BlobMismatchError, CheckpointLockedError)
#: errors that are not the save's at all: the caller handles them (a lost node is recovered)
_NOT_A_SAVE_ERROR = (NodeLostError,)

Results = Mapping[str, StepResult]  # node -> what its step did


class SaveHandle(Protocol):
    """A save started by a door: :meth:`join` waits for it (at once for a synchronous save)
    and returns each node's result; it re-raises the save's error."""

    def join(self) -> Results: ...


@dataclass(frozen=True)
class Done:
    """A save whose results are already in hand (a synchronous save)."""

    results: Results

    def join(self) -> Results:
        return self.results


class Records(Protocol):
    """What the engine asks of the handler side (no-ops where there is no handler)."""

    def resume_epoch(self, user_epoch: int | None = None) -> int | None: ...

    def reject_epoch(self, epoch: int, reason: str) -> bool: ...

    def check_dbs(self, epoch: int, nodes: Sequence[str] | None = None) -> None: ...

    def cp_accessible(self, epoch: int | None = None) -> bool: ...

    def commit(self, epoch: int, reports: Mapping[str, DbReport],
               metrics: Mapping[str, Any] | None = None) -> None: ...

    def report_results(self, action_name: str, results: Results) -> None: ...

    def acquire_lock(self) -> None: ...

    def release_lock(self) -> None: ...

    def flush(self) -> None: ...

    def location(self) -> str: ...


class EngineEvents(Protocol):
    """Who hears of each save and load (the runner's listeners)."""

    def checkpoint_start(self, action: str, epoch: int) -> None: ...

    def checkpoint_end(self, action: str, epoch: int, seconds: float, nbytes: int, ok: bool,
                       error: str | None) -> None: ...


@dataclass(frozen=True)
class LoadPlan:
    """A door's load of one epoch, which the engine runs in this order (:meth:`CheckpointEngine.load`):

    1. the dbs of ``nodes`` (None: every node of the epoch) against what their commit recorded
       (size, digest: :meth:`Records.check_dbs`; skipped for an epoch the resume just chose,
       which ``resume_epoch`` checked so);
    2. ``check()``: every blob of every node against the live object it goes into (key sets,
       shapes, dtypes, parameter groups), from the dbs' indexes alone, writing nothing;
    3. ``write()``: the load (each format's reader verifies every checksum of what it reads
       before any live byte is written) and its results, which are reported.

    A door names the live objects and the epoch; no door writes before all three checks pass,
    whichever door it is and whichever process wrote the checkpoint.
    """

    check: Callable[[], None]
    write: Callable[[], Results]
    nodes: Sequence[str] | None = None


@dataclass
class _Pending:
    """A background save started and not committed yet."""

    epoch: int
    handle: SaveHandle
    start: float
    metrics: dict[str, float | int | None] | None


class CheckpointEngine:
    """Resume, save, commit and report for one door (see the module docstring).

    ``max_failed_saves``: how many saves in a row may fail before one raises (None: never,
    the seed's policy; every failure is a warning). When the limit is reached the error
    raised is a CheckpointError naming the failed epochs, the newest committed one and the
    last error; with ``own_error`` (the Checkpointer's: its ``save`` raises what the save
    raised) a failure that is the only one in the row is raised as it is.
    ``word``: what the door calls an epoch in its messages ("epoch", or "step" for the
    Checkpointer).
    """

    def __init__(self, records: Records, *, max_failed_saves: int | None = 3, word: str = "epoch",
                 events: EngineEvents | None = None, own_error: bool = False) -> None:
        if max_failed_saves is not None and (isinstance(max_failed_saves, bool) or max_failed_saves < 1):
            raise ValueError(f"max_failed_saves must be >= 1 or None, got {max_failed_saves!r}")
        self.records = records
        self.max_failed_saves = max_failed_saves
        self.word = word
        self.own_error = own_error
        self.events = events
        #: the newest epoch committed (or resumed from) through this engine, None before any
        self.last_committed: int | None = None
        self._failed: list[int] = []  # epochs of the failed saves since the last commit
        self._pending: _Pending | None = None
        self._vetted: int | None = None  # the epoch resume() is loading (its dbs checked)

    # -- lifecycle
    def open(self) -> None:
        """Take the writer lock for a run (after the handler knows where it is)."""
        self._failed = []
        self.records.acquire_lock()

    def close(self, *, flush: bool = True) -> None:
        """Wait for the handler's background work (unless ``flush`` is False: a second signal
        asked to stop at once), then let the lock go (always)."""
        try:
            if flush:
                self.records.flush()
        finally:
            self.records.release_lock()

    # -- resume
    def resume(self, first: int | None, load: Callable[[int | None], None], *, fallback: bool = True,
               chosen: Callable[[int | None], None] | None = None) -> int | None:
        """Load ``first`` (None: nothing to load, ``load(None)`` starts afresh) and return the
        epoch loaded. A load that finds its epoch damaged (CheckpointCorruptError, raised
        before any live object was written) is reported with ``reject_epoch`` and the next
        epoch ``resume_epoch`` gives is loaded (``chosen`` hears of it), unless ``fallback``
        is False or the handler keeps the error."""
        epoch = first
        while True:
            self._vetted = epoch  # resume_epoch checked its dbs against the manifest
            try:
                load(epoch)
            except CheckpointCorruptError as ex:
                if epoch is None or not fallback or not self.records.reject_epoch(epoch, str(ex)):
                    raise
                epoch = self.records.resume_epoch(None)
                if chosen is not None:
                    chosen(epoch)
                continue
            self.last_committed = epoch if epoch is not None else self.last_committed
            return epoch

    def load(self, action: str, epoch: int, plan: LoadPlan) -> Results:
        """Run a door's load of ``epoch`` (see :class:`LoadPlan`: the dbs against the manifest,
        every live object against its blob, then the write) and report it (one stats line
        per db, the events). Raises before anything is written when a check fails."""
        start = time.perf_counter()
        self._start(action, epoch)
        vetted, self._vetted = self._vetted == epoch, None
        try:
            if not vetted and (plan.nodes is None or plan.nodes):
                self.records.check_dbs(epoch, plan.nodes)
            plan.check()
            results = plan.write()
        except Exception as ex:
            self._end(action, epoch, start, 0, False, str(ex))
            raise
        self.records.report_results(action, results)
        self._end(action, epoch, start, _bytes(results), True, None)
        return results

    # -- save
    def prepare_saves(self, run: Callable[[], object]) -> bool:
        """As a run with background saves starts: ``run`` is the door's call of
        :meth:`~.tasks.background.BackgroundSaver.prepare` where its state lives (the runner:
        a task on every node; the Checkpointer: on its dict), which allocates the snapshot
        memory and has a thread fault it in, so the first background save copies into warm
        memory. Best effort: a failure is logged (the first save meets its cause
        and reports it) and False returned; a lost node is raised as it is."""
        try:
            run()
            return True
        except _NOT_A_SAVE_ERROR:
            raise
        except Exception as ex:
            logger.debug("Could not prepare the snapshot memory of background saves: %s", ex)
            return False

    @property
    def pending_epoch(self) -> int | None:
        """The epoch of the background save in flight (None when none)."""
        return self._pending.epoch if self._pending is not None else None

    def save(self, epoch: int, start: Callable[[], SaveHandle], *, background: bool = False,
             metrics: Mapping[str, Any] | None = None) -> bool:
        """Save ``epoch`` with ``start`` (which runs the door's save and returns its handle)
        and commit it; True when committed. ``background``: the save goes on after ``start``
        returns and is committed by :meth:`finish_pending` (False is returned). A background
        save in flight is committed first. ``metrics``: numbers recorded in the commit
        (TypeError naming one that is not a number, before anything is written).

        Failures follow the policy of the class docstring; an error that is not the save's
        (a lost node) is raised as it is."""
        recorded = {str(k): metric_number(str(k), v) for k, v in (metrics or {}).items()} or None
        self.finish_pending()
        t0 = time.perf_counter()
        try:
            if not self.records.cp_accessible(None):
                raise CheckpointError(
                    f"checkpoint files of {self.word} {epoch} cannot be accessed in "
                    f"{self.records.location()} (see the warning above)")
            logger.info("Saving checkpoints for %s %d", self.word, epoch)
            self._start("checkpoint_save", epoch)
            handle = start()
            if background:
                self._pending = _Pending(epoch, handle, t0, recorded)
                return False
            self._commit(epoch, handle.join(), recorded, t0)
            return True
        except _NOT_A_SAVE_ERROR:
            raise
        except Exception as ex:
            self._save_failed(epoch, t0, ex)
            return False

    def finish_pending(self, *, raise_errors: bool = True) -> bool:
        """Wait for the background save in flight (if any) and commit it; True if committed.
        Its failure follows the policy (``raise_errors`` False: never raises, for a door that
        is already leaving on another error)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        try:
            self._commit(pending.epoch, pending.handle.join(), pending.metrics, pending.start)
            return True
        except _NOT_A_SAVE_ERROR:
            if raise_errors:
                raise
            return False
        except Exception as ex:
            try:
                self._save_failed(pending.epoch, pending.start, ex)
            except Exception:
                if raise_errors:
                    raise
            return False

    def drop_pending(self) -> None:
        """Forget the background save in flight (its node was lost, and the save with it)."""
        self._pending = None

    def _commit(self, epoch: int, results: Results, metrics: dict[str, Any] | None, t0: float) -> None:
        self.records.commit(epoch, {node: r.report() for node, r in results.items()}, metrics)
        self.last_committed = epoch
        self._failed = []
        logger.info("Committed %s %d in %s", self.word, epoch, self.records.location())
        self.records.report_results("checkpoint_save", results)
        self._end("checkpoint_save", epoch, t0, _bytes(results), True, None)

    def _save_failed(self, epoch: int, t0: float, ex: BaseException) -> None:
        """A save of ``epoch`` failed: raise for a value no retry can save, or for one failure
        too many; otherwise warn (the last committed epoch stays)."""
        self._end("checkpoint_save", epoch, t0, 0, False, str(ex))
        if isinstance(ex, FATAL_SAVE_ERRORS):
            raise ex
        self._failed.append(epoch)
        if self.max_failed_saves is None or len(self._failed) < self.max_failed_saves:
            logger.warning("Unable to write checkpoint for %s %d. Error=%s", self.word, epoch, ex)
            return
        if self.own_error and len(self._failed) == 1:
            raise ex
        epochs = ", ".join(map(str, self._failed))
        last = "none" if self.last_committed is None else f"{self.word} {self.last_committed}"
        raise CheckpointError(
            f"{len(self._failed)} checkpoint saves in a row failed in {self.records.location()} "
            f"({self.word}s {epochs}; the newest committed checkpoint is {last}); the last error: {ex}"
        ) from ex

    # -- events
    def _start(self, action: str, epoch: int) -> None:
        if self.events is not None:
            self.events.checkpoint_start(action, epoch)

    def _end(self, action: str, epoch: int, t0: float, nbytes: int, ok: bool, error: str | None) -> None:
        if self.events is not None:
            self.events.checkpoint_end(action, epoch, time.perf_counter() - t0, nbytes, ok, error)


def _bytes(results: Results) -> int:
    return sum(int(r.nbytes) for r in results.values())
