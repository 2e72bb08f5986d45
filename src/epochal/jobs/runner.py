"""JobRunner: drives a Job through init, checkpointed epochs, upload, download and exit.

The order of work and return values are the seed's (see shared/caffe2_spec.md section 4.7);
a missing checkpoint to resume from raises. Where the seed could lose a run without a word,
epochal is loud instead:

- a value no format stores raises at the first save that meets it, naming node and blob;
  storage errors stay warnings (the seed's policy) until ``max_failed_saves`` in a row;
- a preempted run (first SIGTERM/SIGINT finishes and commits the epoch) raises
  :class:`~epochal.errors.Preempted`, so the process exits non-zero and is restarted;
- the epoch limit in force is the one the code gives now (``Job.epoch_limit``);
- blobs the checkpoint lacks are named (added at resume, or left out of a save);
- rerunning over existing dbs without a metadata handler warns; every start says whether it
  resumes, and from where;
- the handler's writer lock (``acquire_lock``) is held for the whole ``train``.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..checkpoint.background import close_process_saver
from ..errors import (
    BlobMismatchError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLockedError,
    MissingBlobError,
    NodeLostError,
    Preempted,
    UnsupportedBlobError,
)
from .cadence import Cadence
from .events import CheckpointEvent, RunListener
from .job import Job
from .preemption import SignalGuard
from .recovery import RecoveryPolicy

logger = logging.getLogger("epochal")

#: the terminal display attached when stderr is a terminal: named, not imported, so this
#: layer does not depend on the views above it
DEFAULT_DISPLAY = "epochal.progress:TerminalProgress"

#: errors about the values themselves: no retry can make such a save succeed
FATAL_SAVE_ERRORS = (UnsupportedBlobError, MissingBlobError, BlobMismatchError, CheckpointLockedError)


def _quiet() -> bool:
    return bool(os.environ.get("EPOCHAL_QUIET"))


def _auto_progress(force: bool = False) -> RunListener | None:
    """The terminal progress display: when forced, or when stderr is a terminal outside CI and
    EPOCHAL_QUIET is unset."""
    if not force and (os.environ.get("CI") or _quiet() or not sys.stderr.isatty()):
        return None
    module, _, name = DEFAULT_DISPLAY.partition(":")
    try:
        display = getattr(importlib.import_module(module), name)
    except ImportError:
        return None
    return display(force=force)  # type: ignore[no-any-return]


class JobRunner:
    """Runs ``job`` with ``checkpoint_manager`` (optional); see the module docstring.

    Keyword arguments beyond the seed's:

    - ``listeners``: RunListener objects; ``progress``: True/False (None: on when attached to
      a terminal); ``handle_signals``: preemption on SIGTERM/SIGINT (default True).
    - ``raise_on_preempt`` (default True): after a signal stopped training and its epoch was
      committed, ``train`` raises :class:`Preempted`; False returns the last epoch instead.
    - ``max_failed_saves`` (default 3): storage errors (disk full, I/O, network) are warnings
      and training goes on, until this many saves in a row failed: then ``train`` raises
      :class:`CheckpointError` with the cause. None: never (the seed's policy).
    - ``save_every`` / ``save_interval``: checkpoint every K epochs and/or when that much time
      (seconds, or ``"30m"``) has passed since the last save; by default every epoch. The
      final epoch and a preempted one are always saved.
    - ``max_failures`` (default 0): how many lost nodes (``NodeLostError`` from the session:
      a node's process or machine died) one ``train`` survives. Each time, the runner waits
      up to ``recovery_timeout`` seconds for the session to place the node again
      (``session.replace_node``), reloads every node from the last committed epoch and
      carries on; one more raises. With 0, a lost node raises at once, naming the node and
      the last committed epoch. See :mod:`epochal.jobs.recovery`.
    - ``async_save``: write each epoch's checkpoint in the background while the next epoch
      runs; it is committed once durable, at the next save. The cost: a snapshot copy of the
      blobs in memory, and a crash during epoch N+1 may lose epoch N too, since N is not
      committed yet. The final epoch is always saved synchronously.
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
        raise_on_preempt: bool = True,
        async_save: bool = False,
        max_failed_saves: int | None = 3,
        save_every: int | None = None,
        save_interval: float | str | None = None,
        max_failures: int = 0,
        recovery_timeout: float = 300.0,
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
        if max_failed_saves is not None and max_failed_saves < 1:
            raise ValueError(f"max_failed_saves must be >= 1 or None, got {max_failed_saves!r}")
        self.max_failed_saves = max_failed_saves
        self.cadence = Cadence(save_every, save_interval)  # type: ignore[arg-type]
        self.max_failures, self.recovery_timeout = max_failures, recovery_timeout
        RecoveryPolicy(max_failures, recovery_timeout)  # refuse bad values here, not mid-run
        if max_failures and async_save:
            raise ValueError("max_failures > 0 with async_save=True is not supported yet: "
                             "a lost node takes its background save with it")
        self._pending: tuple[int, float] | None = None
        self._failed_saves: list[int] = []  # epochs of the failed saves since the last commit
        self._warned: set[tuple[str, str]] = set()  # (node, blob) left out of saves, said once
        self._outputs: set[str] = set()  # the job's task output names, fixed at the start of a run
        self.last_committed: int | None = None

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
            sizes = manager.last_report_sizes or {}
            nbytes = sum(sizes.values())
        self._emit("on_checkpoint", CheckpointEvent(action, epoch, time.perf_counter() - start, nbytes, ok, error))

    def _where(self) -> str:
        manager = self.checkpoint_manager
        return str(manager.location()) if manager else "?"

    def _say(self, message: str) -> None:
        """Log at INFO and, unless quiet, print on stderr (also without a terminal)."""
        logger.info("%s", message)
        if self.progress is not False and not _quiet():
            print(f"epochal: {message}", file=sys.stderr, flush=True)

    # -- the seed's API
    def train(self, session: Any) -> int:
        """Run the job; return the absolute index of the last epoch run.

        Raises :class:`Preempted` after a preemption (unless ``raise_on_preempt=False``)."""
        self._active = list(self.listeners)
        self.preempted_by = None
        self._failed_saves = []
        self._warned = set()
        if self.progress is not False:
            display = _auto_progress(force=bool(self.progress))
            if display is not None:
                self._active.append(display)
        manager = self.checkpoint_manager
        try:
            with SignalGuard(enabled=self.handle_signals) as guard:
                epoch = self._train(session, guard)
            # a handler that ships commits in the background (a mirror) finishes them here;
            # not after a second signal ("stop at once")
            if manager:
                manager.flush()
        except Exception:
            if manager:
                manager.flush()
            raise
        finally:
            close_process_saver()  # its writer thread and snapshot pool (when nothing is pending)
            if manager:
                manager.release_lock()
            for listener in self._active:
                listener.close()
        if self.preempted_by is not None and self.raise_on_preempt:
            raise Preempted(epoch, self.preempted_by, self.last_committed, self._where())
        return epoch

    def _output_names(self) -> list[str]:
        """Blob names of every task output of the job (recomputed values, not state)."""
        job = self.job
        names: set[str] = set()
        for group in (job.init_group, job.epoch_group, job.download_group, job.exit_group):
            tasks = group.tasks() if hasattr(group, "tasks") and callable(group.tasks) else []
            for task in tasks:
                names.update(getattr(task, "output_names", lambda: [])())
        for out in job.stop_conditions:
            names.update(out.names)
        return sorted(names)

    def _start(self) -> tuple[int | None, bool]:
        """Fix the nodes, take the lock, choose the resume epoch; (resume, finished)."""
        job, manager = self.job, self.checkpoint_manager
        user_epoch = self.resume_from_epoch
        if not manager:
            return self.resume_from_epoch, False
        manager.set_params(nodes=job.nodes_to_checkpoint())
        manager.acquire_lock()
        if manager.metadata_handler is None and user_epoch is None:
            found = manager.existing_epochs()
            if found:
                logger.warning(
                    "%s already holds this job's checkpoints (newest: epoch %d), and without a "
                    "metadata handler they are not resumed: the job starts anew and overwrites "
                    "them. To resume, pass resume_from_epoch=%d, or give the manager a "
                    "DirectoryMetadataHandler()", self._where(), found[-1], found[-1],
                )
        resume = manager.resume_epoch(self.resume_from_epoch)
        return resume, self._chosen(resume, user_epoch)

    def _chosen(self, resume: int | None, user_epoch: int | None) -> bool:
        """Record the resume epoch and say it; whether the job had finished there."""
        self.resume_from_epoch = self.last_committed = resume
        limit = self.job.epoch_limit
        if resume is None:
            finished = False
        elif limit is not None:  # the limit in the code now decides, not the saved one
            finished = resume >= limit
        else:
            finished = user_epoch is None and self.checkpoint_manager.is_final(resume)
        if resume is None:
            self._say(f"starting a new job in {self._where()}")
        else:
            self._say(f"resuming from epoch {resume} in {self._where()}")
        return finished

    def _train(self, session: Any, guard: SignalGuard) -> int:
        job, manager = self.job, self.checkpoint_manager
        user_epoch = self.resume_from_epoch
        resume, finished = self._start()
        self._emit("on_train_start", self.resume_from_epoch, list(job.nodes_to_checkpoint()))
        if manager:
            self._outputs = set(self._output_names())  # once per run: read at every save
        while True:
            try:
                self._restore(session, resume)
                break
            except CheckpointCorruptError as ex:
                # the load found the chosen epoch damaged before touching any live object:
                # the handler skips it and the previous committed epoch is loaded instead
                if resume is None or user_epoch is not None or not manager.reject_epoch(resume, str(ex)):
                    raise
                resume = manager.resume_epoch(None)
                finished = self._chosen(resume, None)
        logger.info("Finished initializing")

        epoch = 1 if resume is None else resume + 1
        if finished:
            epoch -= 1
            logger.info("Epoch %d was the last epoch of a finished job: no further epoch runs", epoch)
        recovery = RecoveryPolicy(self.max_failures, self.recovery_timeout)
        while True:
            try:
                epoch = self._epochs(session, guard, epoch, finished)
                break
            except NodeLostError as ex:
                self._pending = None  # the lost node's background save went with it
                recovery.recover(session, manager, ex, self.last_committed)
                assert self.last_committed is not None
                epoch = self.last_committed + 1
            except Exception:
                self._finish_pending(session, raise_fatal=False)  # commit what is durable, then fail
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

    def _restore(self, session: Any, resume: int | None) -> None:
        """Initialize the job (``resume`` None) or the checkpoints of ``resume`` and load it."""
        job, manager = self.job, self.checkpoint_manager
        if resume is None:
            session.run(job.init_group)
        if not manager:
            return
        logger.info("Preparing checkpoints ...")
        nodes = job.nodes_to_checkpoint()
        session.run(manager.init(nodes, retrieve_from_epoch=resume, exclude=sorted(self._outputs)))
        if resume is None:
            self.save_checkpoints(0, session, wait=not self.async_save)
            return
        self._warn_added_blobs(resume)
        logger.info("Loading checkpoints for epoch %d ...", resume)
        start = time.perf_counter()
        self._emit("on_checkpoint_start", "checkpoint_load", resume)
        try:
            session.run(manager.load(resume))
        except Exception as ex:
            self._checkpoint_event("checkpoint_load", resume, start, False, str(ex))
            raise
        manager.report_checkpoint_stats("checkpoint_load")
        self._checkpoint_event("checkpoint_load", resume, start, True, None)
        logger.info("Checkpoint loaded")

    def _epochs(self, session: Any, guard: SignalGuard, epoch: int, finished: bool) -> int:
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
            stop = any([o.fetch() for o in job.stop_conditions])
            saved = False
            must = stop or guard.signum is not None
            if manager and (must or self.cadence.due(epoch)):
                self._finish_pending(session)
                if stop:  # lets a handler commit "final" in the same write as the epoch
                    manager.expect_final(epoch)
                wait = not self.async_save or must
                saved = self.save_checkpoints(epoch, session, wait=wait)
            if stop:
                logger.info("Stopping")
                if saved:
                    manager.mark_final(epoch)
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
        """Save and commit every node's checkpoint of ``epoch``; True when committed.

        A storage failure logs a warning and returns False (the seed's policy), until
        ``max_failed_saves`` saves in a row failed: then CheckpointError. A value that no
        format stores (or a blob missing from the workspace) raises at once.

        With ``async_save`` and ``wait=False`` the save only snapshots the blobs; the write
        goes on in the background and is committed at the next save or at the end (False is
        returned: nothing is committed yet)."""
        if not self.checkpoint_manager:
            raise ValueError("Checkpoint manager is None")
        self._finish_pending(session)
        background = self.async_save and not wait
        start = time.perf_counter()
        self.cadence.saved()
        failure: BaseException
        try:
            if self.checkpoint_manager.cp_accessible(epoch=None):
                logger.info("Saving checkpoints for epoch %d", epoch)
                self._emit("on_checkpoint_start", "checkpoint_save", epoch)
                if background:
                    session.run(self.checkpoint_manager.save(epoch, background=True))
                    self._pending = (epoch, start)
                    self._warn_untracked()
                    return False
                session.run(self.checkpoint_manager.save(epoch))
                self._warn_untracked()
                self._commit(epoch, start)
                return True
            failure = CheckpointError(
                f"checkpoint files of epoch {epoch} cannot be accessed in {self._where()} "
                "(see the warning above)")
        except Exception as ex:
            failure = ex
        self._save_failed(epoch, start, failure)
        return False

    def _save_failed(self, epoch: int, start: float, ex: BaseException) -> None:
        """A save of ``epoch`` failed: raise for a value no retry can save, or for one failure
        too many; otherwise warn (the run goes on, the last committed epoch stays)."""
        self._checkpoint_event("checkpoint_save", epoch, start, False, str(ex))
        if isinstance(ex, FATAL_SAVE_ERRORS):
            raise ex
        self._failed_saves.append(epoch)
        if self.max_failed_saves is None or len(self._failed_saves) < self.max_failed_saves:
            logger.warning("Unable to write checkpoint for epoch %d. Error=%s", epoch, ex)
        else:
            epochs = ", ".join(map(str, self._failed_saves))
            last = "none" if self.last_committed is None else f"epoch {self.last_committed}"
            raise CheckpointError(
                f"{len(self._failed_saves)} checkpoint saves in a row failed in {self._where()} "
                f"(epochs {epochs}; the newest committed checkpoint is {last}); the last error: {ex}"
            ) from ex

    def _commit(self, epoch: int, start: float) -> None:
        assert self.checkpoint_manager is not None
        self.checkpoint_manager.write_checkpoint_metadata(epoch)
        logger.info("Checkpoints saved")
        self.last_committed = epoch
        self._failed_saves = []
        self.checkpoint_manager.report_checkpoint_stats("checkpoint_save")
        self._checkpoint_event("checkpoint_save", epoch, start, True, None)

    def _finish_pending(self, session: Any, *, raise_fatal: bool = True) -> bool:
        """Wait for the background save in flight (if any) and commit it; True if committed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        epoch, start = pending
        try:
            session.run(self.checkpoint_manager.join_save(epoch))
            self._commit(epoch, start)
            return True
        except Exception as ex:
            try:
                self._save_failed(epoch, start, ex)
            except Exception:
                if raise_fatal:
                    raise
            return False

    # -- blobs outside the checkpoint
    def _warn_added_blobs(self, epoch: int) -> None:
        for node, names in self.checkpoint_manager.added_blobs().items():
            if names:
                logger.warning(
                    "Node %r holds blobs that the checkpoint of epoch %d lacks: %s. They keep "
                    "their current values and are saved from now on", node, epoch, ", ".join(names),
                )

    def _warn_untracked(self) -> None:
        """Warn once per run about each global blob a save left out (not in the blob list)."""
        outputs = self._outputs or set(self._output_names())  # save_checkpoints outside train
        for node, names in self.checkpoint_manager.untracked_blobs().items():
            new = [n for n in names if n not in outputs and (node, n) not in self._warned]
            if new:
                self._warned.update((node, n) for n in new)
                logger.warning(
                    "Node %r has blobs in its global workspace that are not checkpointed: %s "
                    "(the blob list was fixed after init; put state there in init_group, or "
                    "before train() when resuming)", node, ", ".join(new),
                )

    __call__ = train
