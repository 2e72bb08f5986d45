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

import logging
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .. import knobs
from ..checkpoint.engine import FATAL_SAVE_ERRORS, CheckpointEngine, LoadPlan, Results
from ..checkpoint.tasks.background import close_process_saver
from ..checkpoint.tasks.handler_calls import NO_RECORDS
from ..checkpoint.tasks.handles import CheckpointManagerLike, PartialLoads, SessionSave
from ..checkpoint.tier import Source, check_args
from ..errors import NodeLostError, Preempted
from ..storage.formats.native.kept import release as release_kept
from .blobs import metric_output, metric_values, output_names, warn_added_blobs, warn_untracked
from .cadence import Cadence
from .events import DEFAULT_DISPLAY, CheckpointEvent, RunListener, auto_progress
from .job import Job
from .preemption import SignalGuard
from .recovery import RecoveryPolicy
from .tier import RunnerTier

logger = logging.getLogger("epochal")

__all__ = ["DEFAULT_DISPLAY", "FATAL_SAVE_ERRORS", "JobRunner"]


class JobRunner:
    """Runs ``job`` with ``checkpoint_manager`` (optional); see the module docstring.

    Keyword arguments beyond the seed's:

    - ``listeners``: RunListener objects; ``progress``: True/False (None: on when attached to
      a terminal); ``handle_signals``: preemption on SIGTERM/SIGINT (default True).
    - ``raise_on_preempt`` (default True): after a signal stopped training and its epoch was
      committed, ``train`` raises :class:`Preempted`; False returns the last epoch instead.
    - ``max_failed_saves`` (default 3): storage errors (disk full, I/O, network) are warnings
      and training goes on, until this many saves in a row failed: then ``train`` raises
      :class:`CheckpointError` with the cause. None:
      never (the seed's policy).
    - ``metrics``: ``{name: TaskOutput or blob name}`` of scalars fetched at each save (a
      blob name is read on the first node of the epoch group) and recorded in its commit (the manifest's ``metrics``; ``keep_best`` of a
      ``DirectoryMetadataHandler`` ranks by them); a handler whose ``write`` takes no
      ``metrics=`` refuses them at the first save.
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
    - ``local``: a node-local directory (RAM-backed, e.g. ``/dev/shm/run``) that every save
      goes to, keeping ``local_keep`` epochs; the epochs that are multiples of
      ``persist_every`` (None: none), the final one and a preempted one are also copied to the
      manager's directory, and so is the newest local epoch when the run fails with an error;
      a resume takes the newest intact epoch of either, the local copy first
      (:mod:`epochal.jobs.tier`, docs/tiers.md). Needs a DirectoryMetadataHandler.
    """

    def __init__(
        self,
        job: Job,
        checkpoint_manager: CheckpointManagerLike | None = None,
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
        metrics: Mapping[str, Any] | None = None,
        local: str | None = None,
        persist_every: int | None = 1,
        local_keep: int = 2,
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
        self.metrics = {str(k): metric_output(job, k, v) for k, v in (metrics or {}).items()}
        if local is not None:
            check_args(local, local_keep, persist_every)
            if max_failures:
                raise ValueError("max_failures > 0 with local=... is not supported yet: a lost node's local "
                                 "directory may be gone with it")
        self._local = (local, local_keep, persist_every)
        self._tier: RunnerTier | None = None  # the local tier of the run in progress
        #: save, commit, resume and the failure policy, shared with the Checkpointer
        self._engine = CheckpointEngine(NO_RECORDS, max_failed_saves=max_failed_saves, events=self)
        self._final: int | None = None  # the epoch committed as the job's last, in this run
        self._warned: set[tuple[str, str]] = set()  # (node, blob) left out of saves, said once
        self._outputs: set[str] = set()  # the job's task output names, fixed at the start of a run

    @property
    def last_committed(self) -> int | None:
        """The newest epoch committed (or resumed from) in this run (in either place, with ``local``)."""
        if self._tier is not None and self._tier.engine.last_committed is not None:
            return max(self._tier.engine.last_committed, self._engine.last_committed or 0)
        return self._engine.last_committed

    @last_committed.setter
    def last_committed(self, epoch: int | None) -> None:
        self._engine.last_committed = epoch

    # -- events
    def _emit(self, name: str, *args: Any) -> None:
        for listener in self._active:
            try:
                getattr(listener, name)(*args)
            except Exception as ex:  # a display must never break training
                logger.debug("listener %r failed in %s: %s", listener, name, ex)

    # the engine's events (EngineEvents)
    def checkpoint_start(self, action: str, epoch: int) -> None:
        self._emit("on_checkpoint_start", action, epoch)

    def checkpoint_end(self, action: str, epoch: int, seconds: float, nbytes: int, ok: bool,
                       error: str | None) -> None:
        self._emit("on_checkpoint", CheckpointEvent(action, epoch, seconds, nbytes, ok, error))

    def _mgr(self) -> CheckpointManagerLike:
        assert self.checkpoint_manager is not None
        return self.checkpoint_manager

    def _where(self) -> str:
        manager = self.checkpoint_manager
        return str(manager.location()) if manager else "?"

    def _say(self, message: str) -> None:
        """Log at INFO and, unless quiet, print on stderr (also without a terminal)."""
        logger.info("%s", message)
        if self.progress is not False and not knobs.is_quiet():
            print(f"epochal: {message}", file=sys.stderr, flush=True)

    # -- the seed's API
    def train(self, session: Any) -> int:
        """Run the job; return the absolute index of the last epoch run.

        Raises :class:`Preempted` after a preemption (unless ``raise_on_preempt=False``)."""
        self._active = list(self.listeners)
        self.preempted_by = None
        self._warned = set()
        self._final = None
        if self.progress is not False:
            display = auto_progress(force=bool(self.progress))
            if display is not None:
                self._active.append(display)
        manager = self.checkpoint_manager
        self._engine.records = manager or NO_RECORDS
        flush = True
        try:
            with SignalGuard(enabled=self.handle_signals) as guard:
                epoch = self._train(session, guard)
        except BaseException as ex:
            # a handler that ships commits in the background (a mirror) finishes them when
            # train ends; not after a second signal ("stop at once")
            flush = isinstance(ex, Exception)
            raise
        finally:
            close_process_saver()  # its writer thread and snapshot pool (when nothing is pending)
            release_kept()  # the nodes' kept bytes of incremental saves (memory)
            try:
                if manager:
                    self._engine.close(flush=flush)
            finally:
                if self._tier is not None:
                    self._tier.close(flush=flush)
                    self._tier = None
                for listener in self._active:
                    listener.close()
        if self.preempted_by is not None and self.raise_on_preempt:
            raise Preempted(epoch, self.preempted_by, self.last_committed, self._where())
        return epoch

    def _start(self) -> tuple[int | None, bool]:
        """Fix the nodes, take the lock, choose the resume epoch; (resume, finished)."""
        job, manager = self.job, self.checkpoint_manager
        user_epoch = self.resume_from_epoch
        if not manager:
            return self.resume_from_epoch, False
        manager.set_params(nodes=job.nodes_to_checkpoint())
        self._engine.open()
        local, keep, persist_every = self._local
        if local is not None:  # the resume is chosen by RunnerTier.resume, among both places
            self._tier = RunnerTier(local, keep=keep, persist_every=persist_every, manager=manager,
                                    durable=self._engine, events=self, max_failed_saves=self.max_failed_saves)
            return None, False
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

    def _chosen(self, resume: int | None, user_epoch: int | None, where: str | None = None) -> bool:
        """Record the resume epoch and say it (``where``: the place it is in, when not the
        manager's); whether the job had finished there."""
        self.resume_from_epoch = self.last_committed = resume
        limit = self.job.epoch_limit
        if resume is None:
            finished = False
        elif limit is not None:  # the limit in the code now decides, not the saved one
            finished = resume >= limit
        else:
            finished = user_epoch is None and (self._mgr().is_final(resume) or (
                self._tier is not None and self._tier.is_final(resume)))
        if resume is None:
            self._say(f"starting a new job in {self._where()}")
        else:
            self._say(f"resuming from epoch {resume} in {where or self._where()}")
        return finished

    def _train(self, session: Any, guard: SignalGuard) -> int:
        job, manager = self.job, self.checkpoint_manager
        user_epoch = self.resume_from_epoch
        resume, finished = self._start()
        self._emit("on_train_start", self.resume_from_epoch, list(job.nodes_to_checkpoint()))
        if manager:
            self._outputs = set(output_names(job))  # once per run: read at every save

        def chosen(epoch: int | None) -> None:
            nonlocal finished
            finished = self._chosen(epoch, None)

        # the load finds a damaged epoch before touching any live object: the handler skips
        # it and the previous committed epoch is loaded instead (not one the user chose)
        if self._tier is not None:
            resume, finished = self._tier.resume(user_epoch, self._chosen, lambda e, src: self._restore(session, e, src))
        else:
            resume = self._engine.resume(resume, lambda e: self._restore(session, e),
                                         fallback=bool(manager) and user_epoch is None, chosen=chosen)
        logger.info("Finished initializing")
        if resume is not None and not finished:  # (a new job's were prepared before its init save)
            self._prepare_saves(session)
        epoch = 1 if resume is None else resume + 1
        if finished:
            epoch -= 1
            logger.info("Epoch %d was the last epoch of a finished job: no further epoch runs", epoch)
            self._final = epoch
        recovery = RecoveryPolicy(self.max_failures, self.recovery_timeout)
        while True:
            try:
                return self._run(session, guard, epoch, finished)
            except NodeLostError as ex:
                self._engine.drop_pending()  # the lost node's background save went with it
                recovery.recover(session, manager, ex, self.last_committed, self._reload)
                assert self.last_committed is not None
                # the final epoch was committed: only what follows it runs again
                finished = self._final is not None and self._final == self.last_committed
                epoch = self.last_committed if finished else self.last_committed + 1

    def _run(self, session: Any, guard: SignalGuard, epoch: int, finished: bool) -> int:
        """The epochs from ``epoch``, the last commit, upload, download and exit groups."""
        job = self.job
        try:
            epoch = self._epochs(session, guard, epoch, finished)
            self._finish_pending()
        except NodeLostError:
            raise
        except Exception as ex:
            self._finish_pending(raise_errors=False)  # commit what is durable, then fail
            if self._tier is not None:  # the newest local epoch to the store, past what was due
                self._tier.persist_on_error(session, ex)
            raise
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

    def _reload(self, session: Any, epoch: int) -> None:
        """Every node's blob list and checkpoint of ``epoch`` again (after a lost node was
        placed anew), every node's live objects checked before any is written."""
        manager = self.checkpoint_manager
        assert manager is not None
        session.run(manager.reinit(epoch))
        self._load(session, epoch)

    def _finish_pending(self, *, raise_errors: bool = True) -> None:
        """Commit the background save in flight (with ``local``: its local write, then its copy)."""
        if self._tier is not None:
            self._tier.finish_pending(raise_errors=raise_errors)
        else:
            self._engine.finish_pending(raise_errors=raise_errors)

    def _restore(self, session: Any, resume: int | None, source: Source | None = None) -> None:
        """Initialize the job (``resume`` None) or the checkpoints of ``resume`` and load it
        (from ``source``: a local tier's or the manager's directory; None: the manager's)."""
        job, manager = self.job, self.checkpoint_manager
        if resume is None:
            session.run(job.init_group)
        if not manager:
            return
        logger.info("Preparing checkpoints ...")
        nodes = job.nodes_to_checkpoint()
        prefix = source.path_prefix if source is not None else None
        session.run(manager.init(nodes, retrieve_from_epoch=resume, path_prefix=prefix, exclude=sorted(self._outputs)))
        if resume is None:
            self._prepare_saves(session)
            self.save_checkpoints(0, session, wait=not self.async_save)
            return
        warn_added_blobs(self._mgr(), resume)
        logger.info("Loading checkpoints for epoch %d ...", resume)
        self._load(session, resume, source)
        logger.info("Checkpoint loaded")

    def _prepare_saves(self, session: Any) -> None:
        """With ``async_save``: every node's snapshot memory allocated now and faulted in on a
        thread of its process (the manager's ``prepare_saves`` task, see
        :meth:`CheckpointEngine.prepare_saves`), so the first snapshot copies into warm memory."""
        prepare = getattr(self.checkpoint_manager, "prepare_saves", None)
        if self.async_save and prepare is not None:
            prefix = self._tier.prefix if self._tier is not None else None
            self._engine.prepare_saves(lambda: session.run(prepare(prefix) if prefix else prepare()))

    def _load(self, session: Any, epoch: int, source: Source | None = None) -> None:
        """Load every node's checkpoint of ``epoch`` through the engine's :class:`LoadPlan`:
        every node's dbs and live objects are checked (a task on each node) before any
        node loads, so a misfit anywhere leaves every node untouched."""
        manager = self.checkpoint_manager
        assert manager is not None
        prefix = source.path_prefix if source is not None else None

        def write() -> Results:
            task = manager.load(epoch, path_prefix=prefix)
            session.run(task)
            return task.results()

        plan = LoadPlan(check=lambda: session.run(manager.check_live(epoch, path_prefix=prefix)), write=write,
                        nodes=[str(n) for n in self.job.nodes_to_checkpoint()])
        (source.engine if source is not None else self._engine).load("checkpoint_load", epoch, plan)

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
                self._finish_pending()
                if stop:  # lets a handler commit "final" in the same write as the epoch
                    manager.expect_final(epoch)
                    if self._tier is not None:
                        self._tier.handler.expect_final(epoch)
                wait = not self.async_save or must
                saved = self.save_checkpoints(epoch, session, wait=wait, persist=must)
            if stop:
                logger.info("Stopping")
                if saved:
                    self._mgr().mark_final(epoch)
                    if self._tier is not None:
                        self._tier.handler.mark_final(epoch)
                    self._final = epoch
                break
            if guard.signum is not None:
                self.preempted_by = guard.signum
                break
            epoch += 1
        return epoch

    def load_blobs_from_checkpoints(self, blob_names: Sequence[str], epoch: int, session: Any) -> bool:
        """Load ``blob_names`` from every node's checkpoint of ``epoch``; False if a db is
        missing (the seed's order: the nodes before it are loaded). Every node's live objects
        are checked before any is written."""
        manager = self.checkpoint_manager
        if not manager:
            raise ValueError("Checkpoint manager is None")
        if not isinstance(manager, PartialLoads):  # the seed's: only the multi-node manager
            raise AttributeError(f"{type(manager).__name__} has no load_blobs_locally: give the runner a "
                                 "MultiNodeCheckpointManager to load blobs from every node")
        logger.info("Loading checkpoint for epoch %d ...", epoch)
        self._engine.records = manager
        found: list[bool] = []

        def write() -> Results:  # (checks every node it loads before any loads)
            results, complete = manager.partial_load(self.job.nodes_to_checkpoint(), blob_names, epoch, session)
            found.append(complete)
            return results

        # the seed's partial load skips nodes without a db (and those after it): the dbs
        # that exist are checked against the manifest inside, node by node, before any loads
        self._engine.load("checkpoint_partial_load", epoch, LoadPlan(check=lambda: None, write=write, nodes=[]))
        return found[0]

    def save_checkpoints(self, epoch: int, session: Any, *, wait: bool = True, persist: bool = False) -> bool:
        """Save and commit every node's checkpoint of ``epoch``; True when committed.

        A storage failure logs a warning and returns False (the seed's policy), until
        ``max_failed_saves`` saves in a row failed: then CheckpointError. A value that no
        format stores (or a blob missing from the workspace) raises at once.

        With ``async_save`` and ``wait=False`` the save only snapshots the blobs; the write
        goes on in the background and is committed at the next save or at the end (False is
        returned: nothing is committed yet).

        With ``local``, the save goes to the local directory, and to the manager's when
        ``epoch`` is a multiple of ``persist_every`` or ``persist`` is True."""
        manager = self.checkpoint_manager
        if not manager:
            raise ValueError("Checkpoint manager is None")
        background = self.async_save and not wait
        self._engine.records = manager
        self._finish_pending()
        self.cadence.saved()
        tier = self._tier
        prefix = tier.prefix if tier is not None else None

        def start() -> SessionSave:
            task = manager.save(epoch, background=background, path_prefix=prefix) if prefix else \
                manager.save(epoch, background=background)
            session.run(task)
            warn_untracked(task, self._outputs or set(output_names(self.job)), self._warned)
            return SessionSave(session, manager, epoch, task, background, prefix)

        if tier is not None:
            return tier.save(epoch, session, start, background=background, persist=tier.due(epoch, persist),
                             metrics=metric_values(self.metrics))
        return self._engine.save(epoch, start, background=background, metrics=metric_values(self.metrics))

    __call__ = train
