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
from dataclasses import dataclass
from typing import Any

from ..checkpoint.engine import CheckpointEngine, Done, Results
from ..checkpoint.handler.directory import DirectoryMetadataHandler
from ..checkpoint.tasks.background import BackgroundSaver
from ..checkpoint.tasks.handler_calls import HandlerLink
from ..checkpoint.tasks.steps import JoinSave, SaveBlobs, SnapshotAndSave, StepResult, db_digest
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..storage.io.seam import committed, is_url, local_path, store_for
from .parts import DB_TYPE, NODE

__all__ = ["LocalTier", "Source", "copy_db"]

logger = logging.getLogger("epochal")

#: bytes per read/write of a copy from the local tier to the store
COPY_CHUNK = 8 << 20


def copy_db(src: str, dst: str, storage_options: dict[str, Any] | None = None) -> StepResult:
    """Copy the db ``src`` to ``dst`` (a path or URL) atomically (a temp file committed under
    its final name, or the object store's single put) and return what the store's commit
    records: its size and digest, the digest read back from ``dst`` and checked against the
    source's (CheckpointCorruptError naming both files when they differ)."""
    import time

    start = time.perf_counter_ns()
    want = db_digest(DB_TYPE, src)
    source = store_for(src).open_read(src)
    try:
        size = source.size()
        if not is_url(dst):
            os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        with committed(store_for(dst, storage_options).create(dst, size)) as sink:
            offset = 0
            while offset < size:
                chunk = source.read(min(COPY_CHUNK, size - offset), offset)
                if not chunk:
                    raise CheckpointCorruptError(src, f"ended at byte {offset} of {size} while copied to {dst}")
                sink.write(chunk)
                offset += len(chunk)
    finally:
        source.close()
    got = db_digest(DB_TYPE, dst)
    if got != want:
        raise CheckpointCorruptError(dst, f"its digest {got} differs from its source {src} ({want}) after the copy")
    return StepResult(dst, size, time.perf_counter_ns() - start, got)


def check_args(directory: str | os.PathLike[str], keep: int, persist_every: int | None) -> str:
    """The local directory's path; ValueError naming the argument at fault (before anything opens)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"local_keep must be an int >= 1, got {keep!r}")
    if persist_every is not None and (isinstance(persist_every, bool) or not isinstance(persist_every, int)
                                      or persist_every < 1):
        raise ValueError(f"persist_every must be an int >= 1 or None, got {persist_every!r}")
    path = local_path(directory)
    if is_url(path):
        raise ValueError(f"local={path!r}: the local tier is a directory of this machine, not a URL")
    return path


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


@dataclass(frozen=True)
class Source:
    """A place a step can be restored from: its name (``"local"``, ``"durable"``), its
    handler (which steps are committed, and their checks), its engine (the load) and the
    db of a step there."""

    name: str
    handler: DirectoryMetadataHandler
    engine: CheckpointEngine
    db_path: Callable[[int], str]


class LocalTier:
    """The node-local directory of a Checkpointer (see the module doc). ``durable``: the
    Checkpointer's own engine (the store at ``path``), which commits the copies;
    ``durable_db``: the db of a step there; ``saver``: the Checkpointer's background saver
    (its snapshot memory is the local write's)."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int, persist_every: int | None,
                 durable: CheckpointEngine, durable_db: Callable[[int], str],
                 durable_options: dict[str, Any] | None, saver: BackgroundSaver) -> None:
        self.directory = check_args(directory, keep, persist_every)
        os.makedirs(self.directory, exist_ok=True)
        self.persist_every = persist_every
        self.handler = DirectoryMetadataHandler(keep_last=keep)
        self.handler.set_params(db_prefix=self.directory, db_type=DB_TYPE, node_names=[NODE],
                                path_prefix=None, path_type=None)
        assert self.handler.directory is not None
        self._dir = self.handler.directory
        self.engine = CheckpointEngine(HandlerLink(self.handler, self.directory, DB_TYPE, [NODE]),
                                       max_failed_saves=1, word="step", own_error=True)
        self.engine.open()  # one writer per local directory, until close()
        self.durable, self.durable_db, self._options = durable, durable_db, durable_options
        self.saver = saver
        self.saves = 0  # saves by this process (the cadence of the copies to the store)
        self._copier: threading.Thread | None = None

    def db_path(self, step: int) -> str:
        """The local db of ``step``."""
        return self._dir.db_path(NODE, int(step))

    def steps(self) -> list[int]:
        """The steps committed in the local directory, oldest first."""
        return self.handler.committed_epochs()

    def source(self) -> Source:
        return Source("local", self.handler, self.engine, self.db_path)

    def last_step(self, durable_last: int | None) -> int | None:
        """The newest step committed (or restored) in either place."""
        known = [s for s in (durable_last, self.engine.last_committed) if s is not None]
        return max(known) if known else None

    def restore(self, step: int | None, committed: list[int], durable: Source,
                load: Callable[[Source, int], None]) -> int | None:
        """Load the newest step intact in either place (``step``: that one), the local copy
        first; None when neither holds a step. ``committed``: the steps of both, for errors."""
        sources = [self.source(), durable]
        order = restore_order(sources)
        if step is not None:
            order = [(s, src) for s, src in order if s == step]
            if not order:
                raise CheckpointNotFoundError(
                    f"step {step} is committed neither in {self.directory} nor in {durable.db_path(step)} "
                    f"(committed steps: {', '.join(map(str, committed)) or 'none'})")
        found = try_sources(order, load)
        if found is None:
            return None
        self.engine.last_committed = found[0]
        return found[0]

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

    def close(self) -> None:
        if self._copier is not None:
            self._copier.join()
        self.engine.close()


def restore_order(sources: list[Source]) -> list[tuple[int, Source]]:
    """Every (step, source) to try, newest step first, the nearer source first for a step."""
    held: dict[int, list[Source]] = {}
    for src in sources:
        for step in src.handler.committed_epochs():
            held.setdefault(step, []).append(src)
    return [(step, src) for step in sorted(held, reverse=True) for src in held[step]]


def try_sources(order: list[tuple[int, Source]], load: Callable[[Source, int], None]) -> tuple[int, Source] | None:
    """Load the first (step, source) of ``order`` that is intact; a damaged copy is named in a
    warning and the next one tried. None when ``order`` is empty; the last error when every
    copy is damaged."""
    last: Exception | None = None
    for i, (step, src) in enumerate(order):
        try:
            src.handler.resume_epoch(step)  # its dbs against its manifest (size, digest)
            load(src, step)
        except (CheckpointCorruptError, CheckpointNotFoundError) as ex:
            after = f"the {order[i + 1][1].name} copy of step {order[i + 1][0]}" if i + 1 < len(order) else "none"
            logger.warning("The %s copy of step %d (%s) is damaged: %s; restoring from %s instead", src.name,
                           step, src.db_path(step), ex, after)
            last = ex
            continue
        return step, src
    if last is not None:
        raise last
    return None
