"""Checkpointer: epochal's checkpoints for a training loop you already have.

::

    with epochal.Checkpointer("ckpt", keep_last=2, keep_best=3, metric="val_loss") as ckpt:
        state = {"model": model, "opt": opt, "sched": sched, "sampler": sampler,
                 "rng": epochal.RNGState(), "history": []}
        step = ckpt.restore(state) or 0       # in place; None on a fresh start
        while step < total_steps:
            step += 1
            ...                                 # one training step
            if ckpt.due(step, every=100) or step == total_steps:
                ckpt.save(step, state, metrics={"val_loss": val_loss})
            if ckpt.preempted:                 # SIGTERM: the step is saved, leave
                break

The same machinery as the Job model, on the same layout: a step is an epoch of one node
(``local``), the db ``<directory>/local.<step>`` (native format: CRC32C on every byte, no
pickle), committed by a DirectoryMetadataHandler (manifest, retention, stats), so ``epochal
ls`` shows it, and a save interrupted at any instant never damages an earlier checkpoint.

What ``restore`` does with each entry of ``state``: an object with ``state_dict``/
``load_state_dict`` (modules, optimizers, schedulers, GradScaler, samplers, torchdata's
``StatefulDataLoader``, :class:`~epochal.RNGState`) and a torch tensor are restored in place;
any other value (ints, lists, dicts of plain values) is replaced in the dict by the saved one,
so read it back from ``state`` after ``restore``.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ..checkpoint.engine import CheckpointEngine, Done
from ..checkpoint.handler.directory import DirectoryMetadataHandler
from ..checkpoint.location.view import best_of_directory
from ..checkpoint.tasks.background import BackgroundSaver
from ..checkpoint.tasks.handler_calls import HandlerLink
from ..checkpoint.tasks.steps import SaveBlobs, SnapshotAndSave
from ..errors import (
    CheckpointError,
)
from ..jobs.cadence import Cadence, parse_interval
from ..jobs.events import auto_progress
from ..jobs.preemption import SignalGuard
from ..storage.encoding.compress import WriteOptions, write_options
from ..storage.formats.native.kept import KeptBytes
from ..storage.io.seam import is_url, local_path
from .parts import (
    DB_TYPE,
    NODE,
    RestoreReport,
    _Background,
    _check_state,
    _in_steps,
    _Shown,
    check_ranked,
)
from .restoring import Restoring
from .tier import LocalTier, check_args, rank_tier

if TYPE_CHECKING:
    from ..integrations.distributed import DistributedCheckpointer

__all__ = ["Checkpointer"]

_S = TypeVar("_S", bound=SaveBlobs)

logger = logging.getLogger("epochal")

class Checkpointer(Restoring):
    """Save and restore a dict of live training objects, step by step (see the module doc).

    ``directory``: where the checkpoints go (created). ``keep_last``/``keep_best``/``metric``/
    ``mode``: retention, applied after each commit (the newest step is always kept; with
    ``keep_best`` the ranking value is ``metrics[metric]`` of :meth:`save`, else the scalar
    ``state[metric]``; both are recorded in the step's manifest). ``async_save``: :meth:`save`
    takes a snapshot (a copy in memory) and writes it on a background thread; it is committed
    by :meth:`wait`, the next :meth:`save`, :meth:`restore` or :meth:`close`; :meth:`restore`
    has the snapshot's memory faulted in off the training thread. The snapshot's
    memory is reused from save to save, up to ``max_host_bytes`` (None: two states' worth, a
    second only while a write is in flight; N: at most N bytes, and a state bigger than N is
    saved synchronously, with no copy; 0: every save synchronous; see
    :mod:`epochal.checkpoint.tasks.background`).
    ``incremental``: each save writes only the bytes that differ from the newest step committed
    before it (whole chunks found there by content digest, and changed runs of a chunk); the
    rest are references to the older steps' files, which retention then keeps as long as a
    kept step uses them (docs/format.md, "Incremental db files"; docs/reliability.md). A save
    compares with a copy of the chunks the previous one wrote, kept in memory (up to 2 GiB)
    while their files are unchanged, rather than reading them back. Across
    ranks each rank's db is written against its own db of that step.
    ``storage_options``: fsspec's, for a URL directory. ``max_failed_saves`` (default 1): how many saves in a row may fail before
    :meth:`save` raises. With 1 every failed save raises its own error (OSError, ...), as a
    plain function call would; with N > 1 a storage error (disk full, I/O, network) is a
    warning, the step is not committed and training goes on, until the N-th failure in a
    row raises CheckpointError naming the steps and the newest committed one (the JobRunner's
    policy, whose default is 3); None: never (each failure a warning). A value no format
    stores always raises at once. ``progress``: None (default) a bar and a line for each save
    or load of 64 MiB or more when stderr is a terminal (not under ``CI`` or ``EPOCHAL_QUIET``);
    True always (on stderr); False never. ``compression``: None (default)
    writes every byte raw; ``"zstd"`` compresses each blob (byte planes of floats, then zstd,
    in frames a partial read decodes alone; a blob that would not shrink stays raw);
    ``"auto"`` does so only where a sample of the blob compresses (docs/format.md). With
    ``async_save`` the compression runs on the background writer, not in the snapshot.
    ``when_busy`` (with ``async_save``): ``"wait"`` (default) a save first waits for the
    previous one's background work (its write, a local tier's copy to the store or to peers);
    ``"skip"``: a save that would wait is skipped instead (on every rank, when any is busy):
    nothing is written or blocked, its step is appended to :attr:`skipped`, and the next save
    that finds the way clear writes the state as it is then. A save due for ``directory``
    (``persist_every``) and the save after a SIGTERM are never skipped.

    ``local``: a node-local directory (RAM-backed, e.g. ``/dev/shm/run``) that every save goes
    to, as an ordinary location keeping ``local_keep`` steps; every ``persist_every``-th save
    (None: none), the save after a SIGTERM and :meth:`close` also put the step in
    ``directory``, as a copy of the local db's bytes; :meth:`restore` takes the newest step
    intact in either place, the local copy first (:mod:`.tier`, docs/tiers.md).

    In a ``torch.distributed`` process group (under ``torchrun``; a world of one included), or
    on a directory whose newest step was written by ranks, the same one line saves across
    ranks: :attr:`distributed` holds a
    :class:`~epochal.integrations.distributed.DistributedCheckpointer` and every method is its
    collective one (docs/distributed.md); ``per_rank`` (state entries that differ from rank
    to rank) and ``group`` (the process group) are for it.

    Installs a SIGTERM handler (in the main thread only) so that :attr:`preempted` turns
    True; a second SIGTERM exits at once. Holds the directory's writer lock (a second writer
    gets :class:`~epochal.errors.CheckpointLockedError` naming this one). :meth:`close` (or
    leaving ``with``) lets the lock go and restores the previous handler.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: str = "min",
        async_save: bool = False,
        max_host_bytes: int | None = None,
        storage_options: dict[str, Any] | None = None,
        max_failed_saves: int | None = 1,
        progress: bool | None = None,
        per_rank: tuple[str, ...] | list[str] = (),
        group: Any = None,
        compression: str | None = None,
        incremental: bool = False,
        local: str | os.PathLike[str] | None = None,
        persist_every: int | None = 1,
        local_keep: int = 2,
        replicas: int = 0,
        replica_stride: int | None = None,
        when_busy: str = "wait",
    ) -> None:
        #: how the step's db is written (compression), set around each save
        self._write_options = WriteOptions(compression=compression)  # (ValueError: unknown)
        from ..integrations.distributed.world import use_distributed  # (torch-free, no group)

        #: the part that saves across ranks (docs/distributed.md): set in a torch.distributed
        #: process group (a world of one included) or on a directory written by ranks; every
        #: method is then its (collective) one. None: this process saves alone.
        self.distributed: DistributedCheckpointer | None = None
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', not {when_busy!r}")
        if when_busy == "skip" and not async_save:
            raise ValueError("Checkpointer(when_busy='skip') needs async_save=True: a synchronous save is never "
                             "waiting for an earlier one")
        self._skip_busy = when_busy == "skip"
        if local is not None:
            check_args(local, local_keep, persist_every)
            if incremental:
                raise ValueError("Checkpointer(incremental=True, local=...): a local tier's steps are written whole")
        if use_distributed(directory, storage_options):
            self._open_distributed(directory, keep_last=keep_last, keep_best=keep_best, metric=metric, mode=mode,
                                   async_save=async_save, max_host_bytes=max_host_bytes,
                                   storage_options=storage_options, per_rank=per_rank, group=group,
                                   max_failed_saves=max_failed_saves, compression=compression,
                                   incremental=incremental)
            assert self.distributed is not None
            self.distributed.skip_busy = self._skip_busy
            if local is not None:
                self.distributed.tier = rank_tier(self.distributed, local, keep=local_keep,
                                                  persist_every=persist_every, replicas=replicas,
                                                  stride=replica_stride)
            return
        if replicas:
            raise ValueError("Checkpointer(replicas=...): a copy on a peer is for ranks of a torch.distributed "
                             "process group; this process is in none")
        if group is not None:
            raise ValueError("Checkpointer(group=...): this process is in no torch.distributed process group")
        #: each save writes only the bytes the newest committed step before it does not hold
        self.incremental = bool(incremental)
        self._kept: KeptBytes | None = None
        self.directory = local_path(directory)  # file:// is the local disk
        #: the fsspec options every step of this Checkpointer carries (a URL directory)
        self._storage_options = dict(storage_options) if storage_options else None
        kw: dict[str, Any] = {"keep_last": keep_last, "keep_best": keep_best, "metric": metric, "mode": mode}
        remote = is_url(self.directory)
        if remote or storage_options is not None:
            kw["storage_options"] = storage_options
        self.handler = DirectoryMetadataHandler(**kw)
        if not remote:
            os.makedirs(self.directory, exist_ok=True)
        self.handler.set_params(db_prefix=self.directory, db_type=DB_TYPE, node_names=[NODE],
                                path_prefix=None, path_type=None)
        assert self.handler.directory is not None
        self._dir = self.handler.directory
        #: the terminal display of long saves and loads (None: quiet; see ``progress``)
        self._display = None if progress is False else auto_progress(force=bool(progress), big_only=True,
                                                                        word="step")
        self._engine = CheckpointEngine(HandlerLink(self.handler, self.directory, DB_TYPE, [NODE]),
                                        max_failed_saves=max_failed_saves, word="step",
                                        own_error=True, events=_Shown(self._display) if self._display else None)
        self._engine.open()  # one writer per directory, until close()
        self.async_save = bool(async_save)
        self._saver = BackgroundSaver(max_host_bytes=max_host_bytes)
        self._restored = False  # restore() was called (no warning about older steps then)
        self._skipped_steps: list[int] = []
        #: what the last :meth:`restore` did (None before one)
        self.last_restore: RestoreReport | None = None
        self._saved = False
        self._last_save = time.monotonic()
        #: the node-local fast tier (``local=``; None without one): see :mod:`.tier`
        self._tier = None if local is None else LocalTier(
            local, keep=local_keep, persist_every=persist_every, durable=self._engine,
            durable_db=lambda s: self._dir.new_db_path(NODE, s), durable_options=self._storage_options, saver=self._saver)
        self._guard = SignalGuard((signal.SIGTERM,), word="step").__enter__()
        self._closed = False

    def _open_distributed(self, directory: str | os.PathLike[str], *, max_failed_saves: int | None,
                          **kw: Any) -> None:
        from ..integrations.distributed import DistributedCheckpointer

        if max_failed_saves != 1:
            raise ValueError("Checkpointer(max_failed_saves=...) is for one process: across ranks every "
                             "failed save raises on every rank (docs/distributed.md)")
        self.distributed = DistributedCheckpointer(directory, **kw)
        self.directory = self.distributed.directory
        self.async_save = self.distributed.async_save
        self.last_restore = None

    def __repr__(self) -> str:
        if self.distributed is not None:
            return f"Checkpointer({self.directory!r}, rank {self.distributed.rank} of {self.distributed.world})"
        return f"Checkpointer({self.directory!r}, {self.handler.policy}, async_save={self.async_save})"

    # -- the API
    @property
    def last_step(self) -> int | None:
        """The newest step committed (or restored) by this Checkpointer, None before any."""
        if self.distributed is not None:
            return self.distributed.last_step
        if self._tier is not None:
            return self._tier.last_step(self._engine.last_committed)
        return self._engine.last_committed

    @property
    def skipped(self) -> list[int]:
        """The steps whose save was skipped (``when_busy="skip"``), oldest first."""
        if self.distributed is not None:
            return self.distributed.skipped
        return self._skipped_steps

    @property
    def preempted(self) -> bool:
        """True once a SIGTERM arrived: save and leave the loop."""
        if self.distributed is not None:
            return self.distributed.preempted
        return self._guard.signum is not None

    def db_path(self, step: int) -> str:
        """The db of ``step``: ``<directory>/local.<step>`` (at a URL, its manifest's name)."""
        if self.distributed is not None:
            raise ValueError(f"{self!r}: a step saved across ranks has a db per rank (docs/format.md), not one")
        return self._dir.db_path(NODE, int(step))

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None) -> None:
        """Save ``state`` as the checkpoint of ``step`` and commit it (with ``async_save``: take
        the snapshot now and commit once written; a background save still running is
        committed first). ``metrics``: numbers recorded in the manifest (``keep_best`` ranks by
        ``metrics[metric]``). Raises what the save raised (OSError, UnsupportedBlobError; see
        ``max_failed_saves``): earlier checkpoints are untouched then. The first save of a
        step below the newest committed one, without a :meth:`restore` first, warns: the
        next restore would return the newer step of an earlier run."""
        if self.distributed is not None:
            return self.distributed.save(step, state, metrics)
        with _in_steps(), write_options(self._write_options):  # (seen by a background write too)
            self._save(step, state, metrics)

    def _save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None) -> None:
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        names = _check_state(state, "save")
        check_ranked(self.handler.policy, step, state, metrics)
        if not self._saved and not self._restored:
            self._warn_older(step)
        self._saved = True
        db = self._dir.new_db_path(NODE, step)  # at a URL: a name no other writer can produce
        self._last_save = time.monotonic()
        if self._tier is not None:
            persist = self._tier.due(self.preempted)
            if not self._skipped(step, persist):
                self._tier.save(step, state, names, metrics, background=self.async_save, persist=persist)
            return
        if self._skipped(step, self.preempted):
            return
        if self.async_save:
            snapshot = SnapshotAndSave(db, DB_TYPE, names, node=NODE, epoch=step, saver=self._saver,
                                       storage_options=self._storage_options)
            self._engine.save(step, lambda: _Background(self._based(snapshot), state, self._saver),
                              background=True, metrics=metrics)
            return
        save = SaveBlobs(db, DB_TYPE, names, node=NODE, epoch=step, storage_options=self._storage_options)
        self._engine.save(step, lambda: Done({NODE: self._based(save).run(state)}), metrics=metrics)

    def _skipped(self, step: int, forced: bool) -> bool:
        """``when_busy="skip"``: True (and ``step`` recorded) when this save, not ``forced``,
        would wait for the previous one's background work."""
        if not self._skip_busy or forced:
            return False
        if not (self._saver.busy() or (self._tier is not None and self._tier.busy())):
            return False
        self._skipped_steps.append(step)
        logger.debug("Skipped the save of step %d: the previous save is still being written", step)
        return True

    def _based(self, save: _S) -> _S:
        """``save``, incremental on the db of the newest step committed before its own (asked
        as it starts: after any earlier background save is committed) when ``incremental``."""
        if self.incremental:
            self._dir.mark_incremental()  # (retention then asks kept dbs what they reference)
            older = [e for e in self._dir.manifest_epochs() if e < save.epoch]
            save.incremental = True
            save.base = self.db_path(max(older)) if older else None
            if self._kept is None:  # (what the last save wrote, compared with instead of re-read)
                self._kept = KeptBytes()
            save.kept = self._kept
        return save

    def _warn_older(self, step: int) -> None:
        if (committed := self.steps()) and step < committed[-1]:
            logger.warning(
                "Saving step %d in %s, which holds committed steps up to %d of an earlier run: restore() would "
                "return step %d, not this run's. Call restore() first to continue that run, or use a new "
                "directory", step, self.directory, committed[-1], committed[-1])

    def wait(self) -> None:
        """Wait for the background save in flight (if any) and commit it; re-raise its error
        (the step is then not committed; see ``max_failed_saves``)."""
        if self.distributed is not None:
            return self.distributed.wait()
        with _in_steps():
            if self._tier is not None:
                self._tier.wait()
            self._engine.finish_pending()

    def due(self, step: int, every: int | None = None, interval: float | str | None = None) -> bool:
        """Whether to save at ``step``: after a SIGTERM, always; else when ``step`` is a
        multiple of ``every``, or ``interval`` (seconds, or ``"30m"``, ``"1h30m"``) has passed
        since the last save (or the restore); with neither given, every step."""
        if self.distributed is not None:
            return self.distributed.due(step, every, interval)
        if self.preempted:
            return True
        return Cadence(every, parse_interval(interval), _last=self._last_save).due(int(step))

    def steps(self) -> list[int]:
        """The committed steps, oldest first."""
        if self.distributed is not None:
            return self.distributed.steps()
        if self._tier is not None:  # either place's
            return sorted(set(self.handler.committed_epochs()) | set(self._tier.steps()))
        return self.handler.committed_epochs()

    def best_steps(self) -> list[int]:
        """The committed steps ranked best first by ``metric`` (the ``keep_best`` kept ones, when
        set); [] without a metric."""
        if self.distributed is not None:
            return self.distributed.best_steps()
        policy = self.handler.policy
        if not policy.metric:
            return []
        best = best_of_directory(self.directory, metric=policy.metric, mode=policy.mode, k=policy.keep_best)
        return best.epochs if best is not None else []

    def close(self) -> None:
        """Commit a background save in flight, then restore the previous SIGTERM handler."""
        if self.distributed is not None:
            return self.distributed.close()
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
            if self._tier is not None:
                with _in_steps():
                    self._tier.persist(self.handler.committed_epochs())
        finally:
            self._kept = None  # (the last save's kept bytes: memory)
            if self._tier is not None:
                self._tier.close()
            self._saver.close()
            self._guard.__exit__(None, None, None)
            self._engine.close()
            if self._display is not None:
                self._display.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.distributed is not None:
            return self.distributed.__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.close()
            return
        try:  # the loop failed: still commit what is durable, without hiding its error
            self.close()
        except Exception as ex:
            logger.warning("Could not commit the background save while leaving on an error: %s", ex)

    # -- internals
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self!r} is closed")
