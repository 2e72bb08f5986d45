"""The restore of a one-process Checkpointer (or its forward to the ranks' one): the newest
intact step, or a chosen one, loaded into the live state with every checksum verified and
every live object checked before anything is touched; from a local tier's copy first when it
has one. The Checkpointer (:mod:`.core`) gets these methods from :class:`Restoring`."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

from ..checkpoint.engine import CheckpointEngine, LoadPlan
from ..checkpoint.handler.directory import DirectoryMetadataHandler
from ..checkpoint.tasks.background import BackgroundSaver
from ..checkpoint.tasks.steps import LoadBlobs, PrepareSaves
from ..checkpoint.tier import restore_order
from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from .parts import DB_TYPE, NODE, RestoreReport, _check_state, _in_steps, _reworded
from .tier import LocalTier, Source

if TYPE_CHECKING:
    from ..integrations.distributed import DistributedCheckpointer

__all__ = ["Restoring"]

logger = logging.getLogger("epochal")


class Restoring:
    """The Checkpointer's restore (see the module doc); the attributes are the Checkpointer's."""

    distributed: DistributedCheckpointer | None
    directory: str
    handler: DirectoryMetadataHandler
    async_save: bool
    last_restore: RestoreReport | None
    _engine: CheckpointEngine
    _saver: BackgroundSaver
    _tier: LocalTier | None
    _storage_options: dict[str, Any] | None
    _last_save: float
    _restored: bool

    if TYPE_CHECKING:  # (the Checkpointer's own)
        def _check_open(self) -> None: ...
        def wait(self) -> None: ...
        def steps(self) -> list[int]: ...
        def db_path(self, step: int) -> str: ...

    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *,
                strict: bool = True) -> int | None:
        """Restore ``state`` from the newest intact checkpoint and return its step; None (and
        ``state`` untouched) on a fresh start. Every checksum is verified before any object
        is touched; damaged newer steps are skipped with a warning. ``step``: restore that
        committed step instead (the seed's ``resume_from_epoch``): an uncommitted or damaged
        one raises (CheckpointNotFoundError / CheckpointCorruptError naming the step and the
        file), with ``state`` untouched. Entries the checkpoint lacks keep their values (one
        warning names them); see the module doc for what is restored in place.

        ``strict`` (as ``load_state_dict``'s): a module, or a state dict held in the state
        (``{"model": model.state_dict()}``), must have the checkpoint's keys exactly, else
        BlobMismatchError names the keys and nothing is written. ``strict=False`` restores the
        keys both have; the others keep their values and are listed in :attr:`last_restore`
        (``missing_keys``, ``unexpected_keys``, per entry of ``state``)."""
        if self.distributed is not None:
            if step is not None or not strict:
                raise ValueError(f"{self!r}: restore(step=..., strict=False) is for one process; across "
                                 "ranks the newest intact step is restored, strictly")
            t0 = time.perf_counter()
            found = self.distributed.restore(state)
            tier = self.distributed.tier
            self.last_restore = RestoreReport(found, time.perf_counter() - t0, source=(
                tier.source if tier is not None else "durable" if found is not None else None))
            return found
        with _in_steps():
            t0 = time.perf_counter()
            self.last_restore = None
            found = self._restore(state, step, strict)
            if self.last_restore is None:  # a fresh start
                self.last_restore = RestoreReport(found, time.perf_counter() - t0)
            else:
                self.last_restore = dataclasses.replace(self.last_restore, seconds=time.perf_counter() - t0)
            return found

    def _restore(self, state: MutableMapping[str, Any], step: int | None, strict: bool) -> int | None:
        self._check_open()
        names = _check_state(state, "restore")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step must be a non-negative int or None, got {step!r}")
        self.wait()
        self._last_save = time.monotonic()
        self._restored = True
        if self._tier is not None:
            found = self._tier.restore(step, self.steps(), self._durable(),
                                       lambda src, s: self._load(s, names, state, strict, src))
        else:
            first = self._chosen_step(step)
            found = self._engine.resume(first, lambda s: self._load(s, names, state, strict), fallback=step is None)
        if self.async_save:  # the run starts: its first snapshot will copy into warm memory
            where = self._tier.db_path(0) if self._tier is not None else self.db_path(0)
            prepare = PrepareSaves(where, names, node=NODE, saver=self._saver)
            self._engine.prepare_saves(lambda: prepare(state))
        if found is None:
            logger.info("No checkpoint in %s: starting a new run", self.directory)
            return None
        logger.info("Resumed from step %d in %s", found, self.directory)
        return found

    def _chosen_step(self, step: int | None) -> int | None:
        """The handler's newest intact step, or ``step`` checked."""
        try:
            return self.handler.resume_epoch(step)
        except CheckpointNotFoundError as ex:
            committed = ", ".join(map(str, self.steps())) or "none"
            raise CheckpointNotFoundError(
                f"step {step} of {self.directory} is not committed (committed steps: {committed}): {ex}") from ex

    def _load(self, step: int | None, names: list[str], state: MutableMapping[str, Any], strict: bool,
              source: Source | None = None) -> None:
        """Load ``step`` into ``state`` (every checksum verified, and every live object
        checked, before anything is touched), from ``source`` (None: ``directory``)."""
        if step is None:
            return
        db = source.db_path(step) if source is not None else self.db_path(step)
        engine = source.engine if source is not None else self._engine
        load = LoadBlobs(db, DB_TYPE, names, node=NODE, epoch=step, allow_incomplete=True,
                         storage_options=self._storage_options, whole=True, strict=strict)

        def checked(fn: Any) -> Any:
            try:
                return fn()
            except CheckpointCorruptError as ex:  # found before any object was touched
                raise _reworded(ex, f"step {step} cannot be restored: {ex}") from ex

        plan = LoadPlan(check=lambda: checked(lambda: load.check(state)),
                        write=lambda: checked(lambda: {NODE: load.run(state)}), nodes=[NODE])
        engine.load("checkpoint_load", step, plan)
        self.last_restore = RestoreReport(step, 0.0, dict(load.keys.missing), dict(load.keys.unexpected),
                                          list(load.missing), source.name if source is not None else "durable")
        if load.missing:  # (the db is opened once: no separate listing of its blobs)
            logger.warning("The checkpoint of step %d (%s) has no %s: they keep their current values",
                           step, db, ", ".join(map(repr, load.missing)))

    def _durable(self) -> Source:
        """The Checkpointer's own directory as a place to restore from."""
        return Source("durable", self.handler, self._engine, self.db_path)

    def _places(self, step: int | None) -> list[tuple[int | None, str, str]]:
        """(step, place, directory) a restore tries, in order, for readers of their own (the
        JAX door): with a local tier every step either place holds, newest first, the local
        copy first (``step``: that one's copies; CheckpointNotFoundError when neither holds
        it); else the directory alone, the step chosen there. A pending async save is
        committed first."""
        self.wait()
        if self._tier is None:
            return [(step, "durable", self.directory)]
        order: list[tuple[int | None, str, str]] = [
            (s, src.name, self._tier.directory if src.name == "local" else self.directory)
            for s, src in restore_order([self._tier.source(), self._durable()]) if step is None or s == step]
        if not order:
            raise CheckpointNotFoundError(
                f"step {step} is committed neither in {self._tier.directory} nor in {self.directory}"
                if step is not None else f"{self.directory}: no committed step to restore")
        return order
