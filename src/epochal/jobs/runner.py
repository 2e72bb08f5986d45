"""JobRunner: drives a Job through init, checkpointed epochs, upload, download and exit.

The order of work, return values, logging and error policy are the seed's (see
shared/caffe2_spec.md section 4.7): a failed save is a warning and training goes on; a
missing checkpoint to resume from raises. epochal adds preemption (first SIGTERM/SIGINT
finishes and commits the epoch), finished-job detection through the metadata handler, and
listeners for progress displays.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..checkpoint.metadata import call_optional
from ..errors import Preempted
from .events import CheckpointEvent, RunListener
from .job import Job
from .preemption import SignalGuard

logger = logging.getLogger("epochal")


def _auto_progress(force: bool = False) -> RunListener | None:
    """The terminal progress display: when forced, or when stderr is a terminal outside CI and
    EPOCHAL_QUIET is unset."""
    if not force and (os.environ.get("CI") or os.environ.get("EPOCHAL_QUIET") or not sys.stderr.isatty()):
        return None
    try:
        from ..progress import TerminalProgress
    except ImportError:
        return None
    return TerminalProgress(force=force)


class JobRunner:
    """Runs ``job`` with ``checkpoint_manager`` (optional); see the module docstring.

    Extra keyword arguments: ``listeners`` (RunListener objects), ``progress`` (True/False;
    None = automatic: on when attached to a terminal), ``handle_signals`` (preemption on
    SIGTERM/SIGINT, default True), ``raise_on_preempt`` (raise :class:`Preempted` instead
    of returning the last epoch) and ``async_save`` (write each epoch's checkpoint in the
    background while the next epoch runs; it is committed once durable, at the next save. The
    cost: a snapshot copy of the blobs in memory, and a crash during epoch N+1 may lose
    epoch N too, since N is not committed yet. The final epoch is always saved synchronously).
    """

    def __init__(
        self,
        job: Job,
        checkpoint_manager: Any = None,
        resume_from_epoch: int | None = None,
        upload_task_group_builder: Any = None,
        *,
        listeners: Sequence[RunListener] = (),
        progress: bool | None = None,
        handle_signals: bool = True,
        raise_on_preempt: bool = False,
        async_save: bool = False,
    ) -> None:
        self.job = job
        self.checkpoint_manager = checkpoint_manager
        self.resume_from_epoch = resume_from_epoch
        self.upload_task_group_builder = upload_task_group_builder
        self.listeners: list[RunListener] = list(listeners)
        self._active: list[RunListener] = list(self.listeners)  # plus the display during train
        self.progress = progress
        self.handle_signals = handle_signals
        self.raise_on_preempt = raise_on_preempt
        self.preempted_by: int | None = None
        self.async_save = async_save
        self._pending: tuple[int, float] | None = None

    # -- events
    def _emit(self, name: str, *args: Any) -> None:
        for listener in self._active:
            try:
                getattr(listener, name)(*args)
            except Exception as ex:  # a display must never break training
                logger.debug("listener %r failed in %s: %s", listener, name, ex)

    def _checkpoint_event(self, action: str, epoch: int, start: float, ok: bool, error: str | None) -> None:
        nbytes = 0
        manager = self.checkpoint_manager
        if ok and manager is not None:
            # called right after report_checkpoint_stats: reuse what it collected
            sizes: dict[str, int] | None = getattr(manager, "last_report_sizes", None)
            if sizes is None:  # another manager class: collect (it may not take sizes)
                sizes = {}
                try:
                    manager.collect_checkpoint_stats({}, sizes)
                except TypeError:
                    pass
            nbytes = sum(sizes.values())
        self._emit("on_checkpoint", CheckpointEvent(action, epoch, time.perf_counter() - start, nbytes, ok, error))

    # -- the seed's API
    def train(self, session: Any) -> int:
        """Run the job; return the absolute index of the last epoch run."""
        self._active = list(self.listeners)
        self.preempted_by = None
        if self.progress is not False:
            display = _auto_progress(force=bool(self.progress))
            if display is not None:
                self._active.append(display)
        manager = self.checkpoint_manager
        handler = getattr(manager, "metadata_handler", None) if manager else None
        try:
            with SignalGuard(enabled=self.handle_signals) as guard:
                epoch = self._train(session, guard)
            # a handler that ships commits in the background (a mirror) finishes them here;
            # not after a second signal ("stop at once")
            call_optional(handler, "flush")
        except Exception:
            call_optional(handler, "flush")
            raise
        finally:
            for listener in self._active:
                listener.close()
        if self.preempted_by is not None and self.raise_on_preempt:
            raise Preempted(epoch, self.preempted_by)
        return epoch

    def _train(self, session: Any, guard: SignalGuard) -> int:
        job, manager = self.job, self.checkpoint_manager
        user_epoch = self.resume_from_epoch
        if manager:
            manager.set_params(nodes=job.nodes_to_checkpoint())
            self.resume_from_epoch = manager.get_resume_from_epoch_id(self.resume_from_epoch)
            if self.resume_from_epoch is not None:
                logger.info("Resuming from epoch %d", self.resume_from_epoch)
        resume = self.resume_from_epoch
        from_scratch = resume is None
        handler = getattr(manager, "metadata_handler", None) if manager else None
        finished = bool(
            not from_scratch and user_epoch is None
            and call_optional(handler, "is_final", resume)
        )
        self._emit("on_train_start", self.resume_from_epoch, list(job.nodes_to_checkpoint()))
        if from_scratch:
            session.run(job.init_group)
        if manager:
            logger.info("Preparing checkpoints ...")
            session.run(manager.init(job.nodes_to_checkpoint(), retrieve_from_epoch=resume))
            if resume is None:
                self.save_checkpoints(0, session, wait=not self.async_save)
            else:
                logger.info("Loading checkpoints for epoch %d ...", resume)
                start = time.perf_counter()
                self._emit("on_checkpoint_start", "checkpoint_load", resume)
                session.run(manager.load(resume))
                manager.report_checkpoint_stats("checkpoint_load")
                self._checkpoint_event("checkpoint_load", resume, start, True, None)
                logger.info("Checkpoint loaded")
        logger.info("Finished initializing")

        epoch = 1 if resume is None else resume + 1
        if finished:
            epoch -= 1
            logger.info("Epoch %d was the last epoch of a finished job: no further epoch runs", epoch)
        try:
            epoch = self._epochs(session, guard, epoch, finished, handler)
        except Exception:
            self._finish_pending(session)  # commit what is already durable, then fail
            raise
        self._finish_pending(session)
        if self.preempted_by is not None:
            logger.warning("Preempted after epoch %d: skipping the rest of the job", epoch)
            self._emit("on_train_end", epoch, True)
            return epoch
        logger.info("Finished training")
        if self.upload_task_group_builder:
            session.run(self.upload_task_group_builder.build(epoch, self.checkpoint_manager))
            logger.info("Finished uploading the checkpoints")
        session.run(job.download_group)
        logger.info("Finished downloading the parameters")
        session.run(job.exit_group)
        logger.info("Finished running the exit group")
        self._emit("on_train_end", epoch, False)
        return epoch

    def _epochs(self, session: Any, guard: SignalGuard, epoch: int, finished: bool, handler: Any) -> int:
        """The epoch loop; returns the last epoch run (``preempted_by`` set if a signal
        stopped it)."""
        job, manager = self.job, self.checkpoint_manager
        while not finished:
            if guard.signum is not None:  # a signal arrived during init or the load
                self.preempted_by = guard.signum
                return epoch - 1
            logger.info("Starting epoch %d", epoch)
            self._emit("on_epoch_start", epoch)
            start = time.perf_counter()
            session.run(job.epoch_group)
            logger.info("Finished epoch %d", epoch)
            self._emit("on_epoch_end", epoch, time.perf_counter() - start)
            stop = [o.fetch() for o in job.stop_conditions]
            saved = False
            if manager:
                self._finish_pending(session)
                if any(stop):  # lets a handler commit "final" in the same write as the epoch
                    call_optional(handler, "expect_final", epoch)
                wait = not self.async_save or any(stop) or guard.signum is not None
                saved = self.save_checkpoints(epoch, session, wait=wait)
            if any(stop):
                logger.info("Stopping")
                if saved:
                    call_optional(handler, "mark_final", epoch)
                break
            if guard.signum is not None:
                self.preempted_by = guard.signum
                break
            epoch += 1
        return epoch

    def load_blobs_from_checkpoints(self, blob_names: Sequence[str], epoch: int, session: Any) -> bool:
        """Load ``blob_names`` from every node's checkpoint of ``epoch``; False if a db is missing."""
        if not self.checkpoint_manager:
            raise ValueError("Checkpoint manager is None")
        logger.info("Loading checkpoint for epoch %d ...", epoch)
        result: bool = self.checkpoint_manager.load_blobs_locally(
            self.job.nodes_to_checkpoint(), blob_names, epoch, session
        )
        self.checkpoint_manager.report_checkpoint_stats("checkpoint_partial_load")
        return result

    def save_checkpoints(self, epoch: int, session: Any, *, wait: bool = True) -> bool:
        """Save and commit every node's checkpoint of ``epoch``. Never raises for a failed
        save: it logs a warning and returns False (True when committed).

        With ``async_save`` and ``wait=False`` the save only snapshots the blobs; the write
        goes on in the background and is committed at the next save or at the end (False is
        returned: nothing is committed yet)."""
        if not self.checkpoint_manager:
            raise ValueError("Checkpoint manager is None")
        self._finish_pending(session)
        background = self.async_save and not wait
        start = time.perf_counter()
        try:
            if self.checkpoint_manager.cp_accessible(epoch=None):
                logger.info("Saving checkpoints for epoch %d", epoch)
                self._emit("on_checkpoint_start", "checkpoint_save", epoch)
                if background:
                    session.run(self.checkpoint_manager.save(epoch, background=True))
                    self._pending = (epoch, start)
                    return False
                session.run(self.checkpoint_manager.save(epoch))
                self._commit(epoch, start)
                return True
            logger.warning("Checkpoint files cannot be accessed!")
            self._checkpoint_event("checkpoint_save", epoch, start, False, "checkpoint files cannot be accessed")
        except Exception as ex:
            logger.warning("Unable to write checkpoint for epoch %d. Error=%s", epoch, ex)
            self._checkpoint_event("checkpoint_save", epoch, start, False, str(ex))
        return False

    def _commit(self, epoch: int, start: float) -> None:
        assert self.checkpoint_manager is not None
        self.checkpoint_manager.write_checkpoint_metadata(epoch)
        logger.info("Checkpoints saved")
        self.checkpoint_manager.report_checkpoint_stats("checkpoint_save")
        self._checkpoint_event("checkpoint_save", epoch, start, True, None)

    def _finish_pending(self, session: Any) -> bool:
        """Wait for the background save in flight (if any) and commit it; True if committed."""
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is None:
            return False
        epoch, start = pending
        try:
            session.run(self.checkpoint_manager.join_save(epoch))
            self._commit(epoch, start)
            return True
        except Exception as ex:
            logger.warning("Unable to write checkpoint for epoch %d. Error=%s", epoch, ex)
            self._checkpoint_event("checkpoint_save", epoch, start, False, str(ex))
            return False

    __call__ = train
