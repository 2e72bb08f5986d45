"""The local tier of a JobRunner: every epoch's save to a node-local directory, some to the store.

``JobRunner(job, manager, local="/dev/shm/run", persist_every=K, local_keep=2)``: each node's
db of every saved epoch is written to ``local`` (``<local>/<node>.<epoch>``), committed there
as an ordinary epochal location (:class:`~epochal.checkpoint.tier.LocalPlace`: its own
manifest, writer lock and retention keeping ``local_keep`` epochs). The epochs that are
multiples of ``persist_every`` (the init save, epoch 0, included), the job's final epoch and
the epoch saved after a SIGTERM also go to the manager's directory: each node copies its local
db there, byte for byte, in its own process (:meth:`CheckpointManager.copy`), and the runner's
own engine commits it through the manager's handler (its retention, stats, mirror and lock as
always). With ``async_save`` the local write runs in the background as usual, and a copy is
made when that write is joined (at the next save, or at the end). A run that fails with an
error copies its newest local epoch the store lacks before the error leaves ``train``
(:meth:`RunnerTier.persist_on_error`).

A resume takes the newest epoch intact in either place, the local copy first
(:func:`~epochal.checkpoint.tier.try_sources`): a damaged local copy is named in a warning and
the next one is used — the store's copy of that epoch, else the next older epoch of either.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..checkpoint.engine import CheckpointEngine, EngineEvents, Results, SaveHandle
from ..checkpoint.tasks.handles import CheckpointManagerLike
from ..checkpoint.tier import LocalPlace, Source
from ..errors import CheckpointCorruptError, CheckpointError

__all__ = ["RunnerTier"]

logger = logging.getLogger("epochal")


class _Later:
    """A save whose work happens when it is joined (the engine's SaveHandle)."""

    def __init__(self, work: Callable[[], Results]) -> None:
        self.work = work

    def join(self) -> Results:
        return self.work()


class RunnerTier(LocalPlace):
    """The local directory of a JobRunner's run (see the module doc). ``manager``: the
    runner's checkpoint manager, whose handler must be a directory handler (one that lists
    its committed epochs); ``durable``: the runner's engine, which commits the copies in the
    manager's directory; ``events``, ``max_failed_saves``: the runner's, for the local saves too."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int, persist_every: int | None,
                 manager: CheckpointManagerLike, durable: CheckpointEngine, events: EngineEvents,
                 max_failed_saves: int | None) -> None:
        handler = manager.metadata_handler
        if handler is None or not callable(getattr(handler, "committed_epochs", None)):
            raise CheckpointError(
                f"JobRunner(local=...): the manager's metadata handler {handler!r} does not list its committed "
                "epochs; give the manager a DirectoryMetadataHandler()")
        if getattr(handler, "incremental", False):
            raise CheckpointError("JobRunner(local=...) with DirectoryMetadataHandler(incremental=True): a local "
                                  "tier's epochs are written whole")
        if not callable(getattr(manager, "copy", None)):
            raise CheckpointError(f"JobRunner(local=...): {type(manager).__name__} cannot copy a node's db to "
                                  "its directory (no copy()); use a CheckpointManager or MultiNodeCheckpointManager")
        named: Any = manager  # (both managers have db_type and node_names; the protocol does not say)
        super().__init__(directory, keep=keep, persist_every=persist_every, db_type=named.db_type,
                         nodes=[str(n) for n in named.node_names()], word="epoch",
                         max_failed_saves=max_failed_saves, own_error=False, events=events)
        #: the seed's ``path_prefix`` of the local dbs (prefix + file name)
        self.prefix = self.path_prefix = os.path.join(self.directory, "")
        self.manager, self.durable = manager, durable

    def due(self, epoch: int, force: bool) -> bool:
        """Whether the save of ``epoch`` also goes to the store: ``force`` (the final epoch, a
        preempted one), or ``epoch`` a multiple of ``persist_every``."""
        return force or (self.persist_every is not None and epoch % self.persist_every == 0)

    def durable_source(self) -> Source:
        """The manager's directory, as a place to restore from."""
        handler: Any = self.manager.metadata_handler
        manager: Any = self.manager

        def dbs(epoch: int) -> str:
            return ", ".join(str(manager.get_ckpt_db_name(n, epoch)) for n in self.nodes)

        return Source("durable", handler, self.durable, dbs)

    def all_steps(self) -> list[int]:
        """The epochs committed in either place, oldest first."""
        handler: Any = self.manager.metadata_handler
        return sorted(set(self.steps()) | set(handler.committed_epochs()))

    def resume(self, user_epoch: int | None, chosen: Callable[[int | None, int | None, str | None], bool],
               restore: Callable[[int | None, Source | None], None]) -> tuple[int | None, bool]:
        """The runner's resume: load ``user_epoch`` (None: the newest intact epoch) from the
        nearest place holding it intact (see the module doc), else start the job afresh;
        (epoch, finished). ``chosen``: the runner's record of the epoch it resumes (with the
        user's epoch and the place), which says whether the job had finished there;
        ``restore``: its initialization and load of an epoch (None: a new job) from a source."""
        finished = False

        def load(source: Source, epoch: int) -> None:
            nonlocal finished
            finished = chosen(epoch, user_epoch, self.directory if source.name == "local" else None)
            restore(epoch, source)

        found = self.restore(user_epoch, self.all_steps(), self.durable_source(), load)
        if found is None:
            finished = chosen(None, user_epoch, None)
            restore(None, None)
        return found, finished

    def is_final(self, epoch: int) -> bool:
        """Whether ``epoch`` was a finished job's last, as the local manifest says."""
        return self.handler.is_final(epoch)

    def save(self, epoch: int, session: Any, start: Callable[[], SaveHandle], *, background: bool, persist: bool,
             metrics: Mapping[str, Any] | None) -> bool:
        """Save ``epoch`` to the local directory with ``start`` (the runner's save task, at
        :attr:`prefix`) and with ``persist`` copy it to the store once its local write is
        committed; True when the local save was committed (False: in the background, or failed)."""
        self.finish_pending()
        saved = self.engine.save(epoch, start, background=background, metrics=metrics)
        if persist and (saved or self.engine.pending_epoch == epoch):
            self.durable.save(epoch, lambda: self._copy(epoch, session), background=background, metrics=metrics)
        return saved

    def _copy(self, epoch: int, session: Any, *, verify: bool = False) -> SaveHandle:
        """The copy of ``epoch`` to the store, made when joined: at once for a synchronous save,
        else when the engine commits the background one (at the next save, or the end).
        ``verify``: ``epoch`` is one committed before (not the save just made), and each of its
        local dbs' checksums is checked before it is copied."""
        def work() -> Results:
            self.engine.finish_pending()  # the local write first (a background one is joined here)
            if self.engine.last_committed != epoch and not verify:
                raise CheckpointError(f"epoch {epoch} was not copied to {self.manager.location()}: its local save "
                                      f"in {self.directory} was not committed")
            task = self.manager.copy(epoch, self.prefix, verify=verify)  # type: ignore[attr-defined]
            session.run(task)
            return task.results()  # type: ignore[no-any-return]

        return _Later(work)

    def persist_on_error(self, session: Any, error: BaseException) -> int | None:
        """The run is leaving on ``error``: copy the newest local epoch that is newer than the
        store's newest to the store (each db's checksums checked first; committed by the
        manager's handler as every copy is), so a replaced machine resumes from it; the epoch
        copied, or None. A damaged local epoch is named in a warning and the next older one
        tried; a copy that fails is named in a warning and in a note on ``error``. Never raises:
        ``error`` is what the run raises."""
        handler: Any = self.manager.metadata_handler
        try:
            stored = handler.committed_epochs()
            candidates = [e for e in reversed(self.steps()) if not stored or e > stored[-1]]
        except Exception as ex:  # (the store cannot even be listed: nothing to copy to)
            self._not_copied(error, None, ex)
            return None
        for epoch in candidates:
            failure: list[BaseException] = []

            def start(epoch: int = epoch, failure: list[BaseException] = failure) -> SaveHandle:
                copy = self._copy(epoch, session, verify=True)

                def work() -> Results:
                    try:
                        return copy.join()
                    except BaseException as ex:
                        failure.append(ex)
                        raise
                return _Later(work)

            try:
                if self.durable.save(epoch, start):
                    logger.warning("The run failed with %s: %s; epoch %d of %s was copied to %s, where a new "
                                   "machine resumes from it", type(error).__name__, error, epoch, self.directory,
                                   self.manager.location())
                    return epoch
            except Exception as ex:  # (one failed save too many, by the runner's policy)
                failure.append(ex)
            why = failure[0] if failure else CheckpointError("its commit failed (see the warning above)")
            if isinstance(why, CheckpointCorruptError) and why.path.startswith(self.prefix):
                logger.warning("Epoch %d of %s is damaged and was not copied to %s: %s", epoch, self.directory,
                               self.manager.location(), why)
                continue  # the next older local epoch, if the store lacks it too
            self._not_copied(error, epoch, why)
            return None
        return None

    def _not_copied(self, error: BaseException, epoch: int | None, why: BaseException) -> None:
        """Say (a warning, and a note on the run's ``error``) that ``epoch`` (None: the newest)
        of the local directory did not reach the store, and why."""
        dbs = ", ".join(self.db_path(epoch, n) for n in self.nodes) if epoch is not None else self.directory
        what = f"epoch {epoch}" if epoch is not None else "the newest local epoch"
        message = (f"{what} ({dbs}) was not copied to {self.manager.location()} after the run failed: "
                   f"{type(why).__name__}: {why}")
        logger.warning("%s", message[0].upper() + message[1:])
        add_note = getattr(error, "add_note", None)  # (Python >= 3.11; on 3.10 the warning alone)
        if callable(add_note):
            add_note(f"epochal: {message}")

    def finish_pending(self, *, raise_errors: bool = True) -> None:
        """Commit the local save in flight, then its copy to the store."""
        self.durable.finish_pending(raise_errors=raise_errors)  # (joins its local save first)
        self.engine.finish_pending(raise_errors=raise_errors)
