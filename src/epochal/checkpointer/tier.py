"""The fast tier of a Checkpointer: every save to a node-local directory, every K-th to the store.

``Checkpointer(path, local="/dev/shm/run", persist_every=K, local_keep=2)``: every save is
written to ``local`` (a RAM-backed directory survives the process, not the machine) as an
ordinary epochal location — the native format, CRC-32C on every byte, a committed manifest,
its own writer lock and retention (``keep_last=local_keep``) — so ``epochal ls``/``verify``
read it like any other. Every ``persist_every``-th save, the save after a SIGTERM and
:meth:`LocalTier.persist` (at ``close``) also put the step in ``path``: the local db's bytes are
copied there (no second snapshot, no second encoding) and committed by the Checkpointer's own
engine, as a save of ``path`` always is. With ``async_save`` both the local write and the copy
run off the training thread (the copy right after the write, on a thread of the tier).

Restore takes the newest step intact in either place, the local copy first: a damaged local
copy is named in a warning and the next source (the store's copy of that step, else the next
older step of either) is used.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from ..checkpoint.engine import CheckpointEngine, Done, Results
from ..checkpoint.tasks.background import BackgroundSaver
from ..checkpoint.tasks.copy import copy_db as _copy_db
from ..checkpoint.tasks.steps import JoinSave, SaveBlobs, SnapshotAndSave, StepResult
from ..checkpoint.tier import LocalPlace, Source, check_args
from ..errors import CheckpointError
from .parts import DB_TYPE, NODE

__all__ = ["LocalTier", "Source", "check_args", "copy_db"]

logger = logging.getLogger("epochal")


def copy_db(src: str, dst: str, storage_options: dict[str, Any] | None = None) -> StepResult:
    """:func:`epochal.checkpoint.tasks.copy.copy_db` of a Checkpointer's (native) db."""
    return _copy_db(src, dst, DB_TYPE, storage_options)


def rank_tier(dc: Any, local: str | os.PathLike[str], *, keep: int, persist_every: int | None, replicas: int,
              stride: int | None) -> Any:
    """The local tier of this rank of ``dc`` (a DistributedCheckpointer; collective)."""
    from ..integrations.distributed.tier import RankTier

    return RankTier(local, ranks=dc.ranks, keep=keep, persist_every=persist_every, replicas=replicas,
                    stride=stride, per_rank=dc.per_rank, async_save=dc.async_save)


class _Part:
    """One engine's view of a save both tiers share (the engine's SaveHandle)."""

    def __init__(self, future: Future[StepResult]) -> None:
        self.future = future

    def join(self) -> Results:
        return {NODE: self.future.result()}


class LocalTier(LocalPlace):
    """The node-local directory of a Checkpointer (see the module doc). ``durable``: the
    Checkpointer's own engine (the store at ``path``), which commits the copies;
    ``durable_db``: the db of a step there; ``saver``: the Checkpointer's background saver
    (its snapshot memory is the local write's)."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int, persist_every: int | None,
                 durable: CheckpointEngine, durable_db: Callable[[int], str],
                 durable_options: dict[str, Any] | None, saver: BackgroundSaver) -> None:
        super().__init__(directory, keep=keep, persist_every=persist_every, db_type=DB_TYPE, nodes=[NODE])
        self.durable, self.durable_db, self._options = durable, durable_db, durable_options
        self.saver = saver
        self.saves = 0  # saves by this process (the cadence of the copies to the store)
        self._copier: threading.Thread | None = None

    def last_step(self, durable_last: int | None) -> int | None:
        """The newest step committed (or restored) in either place."""
        known = [s for s in (durable_last, self.engine.last_committed) if s is not None]
        return max(known) if known else None

    def due(self, preempted: bool) -> bool:
        """Whether this save also goes to the store: every ``persist_every``-th, or after a SIGTERM."""
        self.saves += 1
        return preempted or (self.persist_every is not None and self.saves % self.persist_every == 0)

    # -- save
    def save(self, step: int, state: Mapping[str, Any], names: list[str], metrics: Mapping[str, Any] | None,
             *, background: bool, persist: bool) -> None:
        """Save ``step`` to the local directory, and with ``persist`` copy it to the store (both
        off this thread with ``background``). The copy of the previous save is committed (or
        its failure raised) first, and the local copy it reads is not deleted before."""
        self.durable.finish_pending()
        db = self.db_path(step)
        if not background:
            save = SaveBlobs(db, DB_TYPE, names, node=NODE, epoch=step)
            self.engine.save(step, lambda: Done({NODE: save.run(state)}), metrics=metrics)
            if persist:
                self.durable.save(step, lambda: Done({NODE: copy_db(db, self.durable_db(step), self._options)}),
                                  metrics=metrics)
            return
        local: Future[StepResult] = Future()
        copied: Future[StepResult] | None = Future() if persist else None

        def start() -> _Part:
            SnapshotAndSave(db, DB_TYPE, names, node=NODE, epoch=step, saver=self.saver).run(state)
            joiner = JoinSave(db, "", "", db_type=DB_TYPE, saver=self.saver)
            thread = threading.Thread(target=self._finish, args=(joiner, step, local, copied),
                                      name="epochal-tier", daemon=True)
            previous, self._copier = self._copier, thread
            if previous is not None:
                previous.join()  # one copy at a time, in order
            thread.start()
            return _Part(local)

        self.engine.save(step, start, background=True, metrics=metrics)
        if copied is not None and self.engine.pending_epoch == step:
            self.durable.save(step, lambda: _Part(copied), background=True, metrics=metrics)

    def _finish(self, joiner: JoinSave, step: int, local: Future[StepResult],
                copied: Future[StepResult] | None) -> None:
        """(The tier's thread.) Wait for the local write, then copy it to the store."""
        try:
            local.set_result(joiner.join())
        except BaseException as ex:
            local.set_exception(ex)
            if copied is not None:
                copied.set_exception(CheckpointError(f"step {step} was not copied to the store: its local write "
                                                     f"failed: {ex}"))
            return
        if copied is None:
            return
        try:
            copied.set_result(copy_db(joiner.db, self.durable_db(step), self._options))
        except BaseException as ex:
            copied.set_exception(ex)

    def busy(self) -> bool:
        """True while the copy of a step to the store is running (see ``when_busy``)."""
        return self._copier is not None and self._copier.is_alive()

    def wait(self) -> None:
        """Commit the local save in flight, then its copy to the store."""
        self.engine.finish_pending()
        self.durable.finish_pending()

    def persist(self, durable_steps: list[int]) -> int | None:
        """Copy the newest local step to the store unless it is there (at ``close``): nothing
        committed locally is left only in this machine's memory. Returns the step copied."""
        self.wait()
        local = self.steps()
        if not local or local[-1] in durable_steps or (durable_steps and local[-1] < durable_steps[-1]):
            return None
        step = local[-1]
        db = self.db_path(step)
        self.durable.save(step, lambda: Done({NODE: copy_db(db, self.durable_db(step), self._options)}))
        return step

    def close(self, *, flush: bool = True) -> None:
        """Wait for the copy in flight, then let the local directory's lock go."""
        if self._copier is not None:
            self._copier.join()
        super().close(flush=flush)

