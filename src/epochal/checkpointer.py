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

The same machinery as the Job model, on the same directory layout: a step is an epoch of one
node (``local``), saved as the db ``<directory>/local.<step>`` by the native backend (temp
file, fsync, rename; CRC32C on every byte; no pickle) and committed by
:class:`~epochal.checkpoint.directory.DirectoryMetadataHandler` (``.epochal/manifest.<step>.json``,
retention, stats), so ``epochal ls`` and ``CheckpointDirectory`` show it like any other, and a
save interrupted at any instant never damages an earlier checkpoint.

What ``restore`` does with each entry of ``state``: an object with ``state_dict``/
``load_state_dict`` (modules, optimizers, schedulers, GradScaler, samplers, torchdata's
``StatefulDataLoader``, :class:`~epochal.RNGState`) and a torch tensor are restored in place;
any other value (ints, lists, dicts of plain values) is replaced in the dict by the saved one,
so read it back from ``state`` after ``restore``.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from .checkpoint.background import BackgroundSaver
from .checkpoint.best import metric_number
from .checkpoint.directory import DirectoryMetadataHandler, best_of_directory
from .checkpoint.steps import INTERNAL_PREFIX, JoinSave, LoadBlobs, SaveBlobs, SnapshotAndSave
from .errors import CheckpointCorruptError, CheckpointError, UnsupportedBlobError
from .jobs.cadence import Cadence, parse_interval
from .jobs.preemption import SignalGuard

__all__ = ["Checkpointer"]

logger = logging.getLogger("epochal")

#: the node name of a Checkpointer's dbs (``<directory>/local.<step>``)
NODE = "local"
DB_TYPE = "native"


def _is_url(path: str) -> bool:
    return "://" in path


def _check_state(state: Mapping[str, Any], what: str) -> list[str]:
    """The names of ``state`` (str keys, not epochal's own), with a hint for a plain DataLoader."""
    if not isinstance(state, Mapping) or not state:
        raise ValueError(f"{what} needs a non-empty dict of name -> object, got {state!r}")
    names = []
    for name, value in state.items():
        if not isinstance(name, str) or not name or name.startswith(INTERNAL_PREFIX):
            raise ValueError(f"{what}: state key {name!r} must be a non-empty str (not {INTERNAL_PREFIX!r}...)")
        t = type(value)
        if t.__name__ == "DataLoader" and t.__module__.startswith("torch.") and not hasattr(value, "state_dict"):
            raise UnsupportedBlobError(
                f"state[{name!r}] is a torch DataLoader, which has no state to save: put its sampler "
                "in the state instead (epochal.integrations.torch.ResumableSampler), or use "
                "torchdata's StatefulDataLoader (see docs/pytorch.md)"
            )
        names.append(name)
    return names


class Checkpointer:
    """Save and restore a dict of live training objects, step by step (see the module doc).

    ``directory``: where the checkpoints go (created). ``keep_last``/``keep_best``/``metric``/
    ``mode``: retention, applied after each commit (the newest step is always kept; with
    ``keep_best`` the ranking value is ``metrics[metric]`` of :meth:`save`, else the scalar
    ``state[metric]``; both are recorded in the step's manifest). ``async_save``: :meth:`save`
    takes a snapshot (a copy in memory) and writes it on a background thread; it is committed
    by :meth:`wait`, the next :meth:`save`, :meth:`restore` or :meth:`close`. The snapshot's
    memory is reused from save to save, up to ``max_host_bytes`` (None: one state's worth; see
    :mod:`epochal.checkpoint.background`).
    ``storage_options``: for a remote (URL) directory, passed to the handler where it
    supports them.

    Installs a SIGTERM handler (in the main thread only) so that :attr:`preempted` turns
    True; a second SIGTERM exits at once. Holds the directory's writer lock (a second writer
    gets :class:`~epochal.errors.CheckpointLockedError` naming this one). :meth:`close` (or
    leaving ``with``) lets the lock go and restores the previous handler.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Checkpointer:
        """Under torch.distributed with more than one rank, or on a directory written by ranks:
        a DistributedCheckpointer (docs/distributed.md)."""
        from .integrations.world import use_distributed

        directory = args[0] if args else kwargs.get("directory")
        if cls is Checkpointer and directory is not None and use_distributed(directory):
            from .integrations.distributed import DistributedCheckpointer

            return DistributedCheckpointer(*args, **kwargs)  # type: ignore[return-value]
        return super().__new__(cls)

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
    ) -> None:
        self.directory = os.fspath(directory)
        kw: dict[str, Any] = {"keep_last": keep_last, "keep_best": keep_best, "metric": metric, "mode": mode}
        remote = _is_url(self.directory)
        if remote or storage_options is not None:
            if "storage_options" not in inspect.signature(DirectoryMetadataHandler).parameters:
                raise CheckpointError(
                    f"Checkpointer({self.directory!r}): this epochal keeps checkpoints in local "
                    "directories only (storage_options and URLs are not supported); give a local "
                    "path, and DirectoryMetadataHandler(mirror=URL) to copy commits to remote storage"
                )
            kw["storage_options"] = storage_options
        self.handler = DirectoryMetadataHandler(**kw)
        if not remote:
            os.makedirs(self.directory, exist_ok=True)
        self.handler.set_params(db_prefix=self.directory, db_type=DB_TYPE, node_names=[NODE],
                                path_prefix=None, path_type=None)
        assert self.handler.directory is not None
        self._dir = self.handler.directory
        self.handler.acquire_lock()  # one writer per directory, until close()
        self.async_save = bool(async_save)
        self._saver = BackgroundSaver(max_host_bytes=max_host_bytes)
        #: the newest step committed (or restored) by this Checkpointer, None before any
        self.last_step: int | None = None
        self._pending: tuple[int, str, dict[str, Any] | None] | None = None
        self._last_save = time.monotonic()
        self._guard = SignalGuard((signal.SIGTERM,)).__enter__()
        self._closed = False

    def __repr__(self) -> str:
        return f"Checkpointer({self.directory!r}, {self.handler.policy}, async_save={self.async_save})"

    # -- the API
    @property
    def preempted(self) -> bool:
        """True once a SIGTERM arrived: save and leave the loop."""
        return self._guard.signum is not None

    def db_path(self, step: int) -> str:
        """The db of ``step`` (``<directory>/local.<step>``)."""
        return self._dir.db_path(NODE, int(step))

    def restore(self, state: MutableMapping[str, Any]) -> int | None:
        """Restore ``state`` from the newest intact checkpoint and return its step; None (and
        ``state`` untouched) on a fresh start. Every checksum is verified before any object
        is touched; damaged newer steps are skipped with a warning. Entries the checkpoint
        lacks keep their values (one warning names them); see the module doc for what is
        restored in place."""
        self._check_open()
        names = _check_state(state, "restore")
        self.wait()
        self._last_save = time.monotonic()
        step = self.handler.resume_epoch()
        while step is not None:
            try:
                self._load(step, names, state)
                break
            except CheckpointCorruptError as ex:  # found before any object was touched
                if not self.handler.reject_epoch(step, str(ex)):
                    raise
                step = self.handler.resume_epoch()
        if step is None:
            logger.info("No checkpoint in %s: starting a new run", self.directory)
            return None
        logger.info("Resumed from step %d in %s", step, self.directory)
        self.last_step = step
        return step

    def _load(self, step: int, names: list[str], state: MutableMapping[str, Any]) -> None:
        """Load ``step`` into ``state`` (every checksum verified before anything is touched)."""
        db = self.db_path(step)
        start = time.perf_counter_ns()
        load = LoadBlobs(db, DB_TYPE, names, node=NODE, epoch=step, allow_incomplete=True)
        nbytes = load(state)
        if load.missing:  # (the db is opened once: no separate listing of its blobs)
            logger.warning("The checkpoint of step %d (%s) has no %s: they keep their current values",
                           step, db, ", ".join(map(repr, load.missing)))
        self._report("checkpoint_load", db, time.perf_counter_ns() - start, nbytes)

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None) -> None:
        """Save ``state`` as the checkpoint of ``step`` and commit it (with ``async_save``: take
        the snapshot now and commit once written; a background save still running is
        committed first). ``metrics``: numbers recorded in the manifest (``keep_best`` ranks by
        ``metrics[metric]``). Raises what the save raised (OSError, UnsupportedBlobError):
        earlier checkpoints are untouched then."""
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        names = _check_state(state, "save")
        recorded = {str(k): metric_number(str(k), v) for k, v in (metrics or {}).items()}
        self.wait()
        db = self.db_path(step)
        self._last_save = time.monotonic()
        if self.async_save:
            SnapshotAndSave(db, DB_TYPE, names, node=NODE, epoch=step, saver=self._saver)(state)
            self._pending = (step, db, recorded)
            return
        start = time.perf_counter_ns()
        nbytes = SaveBlobs(db, DB_TYPE, names, node=NODE, epoch=step)(state)
        self._commit(step, db, recorded, time.perf_counter_ns() - start, nbytes)

    def wait(self) -> None:
        """Wait for the background save in flight (if any) and commit it; re-raise its error
        (the step is then not committed)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, db, recorded = pending
        scratch: dict[str, Any] = {}
        JoinSave(db, "ns", "bytes", saver=self._saver)(scratch)
        self._commit(step, db, recorded, int(scratch["ns"][0]), int(scratch["bytes"]))

    def due(self, step: int, every: int | None = None, interval: float | str | None = None) -> bool:
        """Whether to save at ``step``: after a SIGTERM, always; else when ``step`` is a
        multiple of ``every``, or ``interval`` (seconds, or ``"30m"``, ``"1h30m"``) has passed
        since the last save (or the restore); with neither given, every step."""
        if self.preempted:
            return True
        return Cadence(every, parse_interval(interval), _last=self._last_save).due(int(step))

    def steps(self) -> list[int]:
        """The committed steps, oldest first."""
        return self.handler.committed_epochs()

    def best_steps(self) -> list[int]:
        """The committed steps ranked best first by ``metric`` (the ``keep_best`` kept ones, when
        set); [] without a metric."""
        policy = self.handler.policy
        if not policy.metric:
            return []
        best = best_of_directory(self.directory, metric=policy.metric, mode=policy.mode, k=policy.keep_best)
        return best.epochs if best is not None else []

    def close(self) -> None:
        """Commit a background save in flight, then restore the previous SIGTERM handler."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._saver.close()
            self._guard.__exit__(None, None, None)
            try:
                self.handler.flush()
            finally:
                self.handler.release_lock()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
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

    def _commit(self, step: int, db: str, metrics: dict[str, Any] | None, ns: int, nbytes: int) -> None:
        self.handler.write(step, metrics=metrics or None)
        self._report("checkpoint_save", db, ns, nbytes)
        self.last_step = step
        logger.info("Committed step %d in %s", step, self.directory)

    def _report(self, action: str, db: str, ns: int, nbytes: int) -> None:
        self.handler.report_bytes(action, {db: int(nbytes)})
        self.handler.report(action, {db: int(ns)})
