"""The Checkpointer under ``torch.distributed``: every rank saves its shards, one commit.

``epochal.Checkpointer(directory, ...)`` created on every rank after ``init_process_group``
(world size > 1) is a :class:`DistributedCheckpointer`; the API is the Checkpointer's, and
:meth:`~DistributedCheckpointer.save`, :meth:`~DistributedCheckpointer.restore`,
:meth:`~DistributedCheckpointer.due` and :attr:`~DistributedCheckpointer.preempted` are
collective: every rank calls them at the same point with the same step.

A step is one DCP save through :mod:`epochal.integrations.dcp`: each rank writes the items
DCP's planner gives it (the shards it owns, a replicated tensor on one rank only) to its db
``<dir>/rank<r>.<step>``; rank 0 writes the metadata db and commits the manifest once every
rank's db is durable, through its :class:`~epochal.checkpoint.handler.directory.DirectoryMetadataHandler`
(rank 0 holds the writer lock, applies retention and best-k, and appends the stats). A step
with any rank's data missing is never committed and never resumed.

What goes in ``state`` (by name, as the Checkpointer):

* ``nn.Module`` (plain, DDP, FSDP2, ``torch.compile``d) and optimizers: through
  ``torch.distributed.checkpoint.state_dict``'s ``get_*_state_dict``/``set_*_state_dict``,
  so parameters are matched by FQN whatever the wrapper; an optimizer is paired with the
  module of ``state`` that holds its parameters;
* tensors and DTensors: saved sharded as they are, loaded in place into any layout;
* per-rank values (:class:`~epochal.RNGState`, samplers, data loaders, and the names in
  ``per_rank``): each rank's own, under ``__rank<r>__/<name>``; restored to the same rank
  when the world size is unchanged, else left as they are (a warning names them);
* other stateful objects (LR schedulers, GradScaler) and plain values: the same on every
  rank, written once (one rank's), restored on every rank (plain values replaced in the dict).

Restore: rank 0 picks the newest committed step whose dbs are all present with their sizes
and digests (the manifest lists every rank's), broadcasts it, and every rank loads its part
(each byte checked by checksum before it reaches a live tensor). If any rank finds damage,
every rank falls back to the previous step together; with none left, it raises (live objects
may already hold part of the damaged step then). Coordination uses tensors on a gloo group
(the default group when it is gloo, else one of its own); nothing is unpickled from a file.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import logging
import os
import signal
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException

from ...checkpoint.handler.directory import DirectoryMetadataHandler
from ...checkpoint.location.best import metric_number
from ...checkpoint.location.view import CheckpointDirectory, best_of_directory
from ...errors import CheckpointCorruptError, CheckpointError
from ...jobs.cadence import Cadence, parse_interval
from ...storage.encoding.compress import WriteOptions, write_options
from ...storage.formats.native.kept import KeptBytes
from ...storage.io.location import location_for
from ...storage.io.seam import local_path
from ..dcp import META_NODE, EpochalStorageReader, EpochalStorageWriter, Whole
from ..dcp.background import Pending, Worker
from ..dcp.plan_cache import RecordingSavePlanner, SavePlanCache
from ..dcp.staging import HostStaging
from ..ranks import RankGroup, process_world, unwrap_failure
from .state import dcp_state
from .tier import RankTier
from .world import SINGLE_NODE, RankSignalGuard, load_one_process_step

__all__ = ["DistributedCheckpointer", "process_world"]

logger = logging.getLogger("epochal")


class DistributedCheckpointer:
    """:class:`epochal.Checkpointer` for a ``torch.distributed`` job (see the module doc).

    Arguments as the Checkpointer's; ``per_rank``: names of ``state`` entries that differ
    from rank to rank beyond the default ones (RNG, samplers, data loaders); ``group``: the
    process group (the default one). ``async_save``: :meth:`save` snapshots this rank's part
    into host memory and returns; a thread writes it, and the step is committed (by rank 0,
    once every rank's write is durable) at the next ``save``, ``wait``, ``restore`` or
    ``close``, which are collective. ``directory`` may be a URL (``s3://bucket/run``;
    ``storage_options`` go to fsspec on every rank): rank 0 commits, every rank writes its db."""

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
        per_rank: tuple[str, ...] | list[str] = (),
        group: Any = None,
        compression: str | None = None,
        incremental: bool = False,
    ) -> None:
        #: how each rank's db is written (compression, as the Checkpointer's), set around saves
        self._write_options = WriteOptions(compression=compression)
        #: each rank writes only the bytes its db of the step before does not hold
        self.incremental = bool(incremental)
        #: this rank's kept chunks of its last incremental save (freed on close)
        self._kept: KeptBytes | None = KeptBytes() if self.incremental else None
        location = location_for(local_path(directory), storage_options)  # file:// is the local disk
        location.remember()  # a URL's options: this process's for every path under it
        self.directory = location.root
        self._options = dict(storage_options) if storage_options else None
        self.async_save = bool(async_save)
        self._staging = HostStaging(max_host_bytes)  # async snapshots: one host buffer, reused
        self._pending: Pending | None = None
        self.ranks = RankGroup(group, self.directory)  # host-side coordination (gloo)
        self.rank, self.world = self.ranks.rank, self.ranks.world
        self._dist, self._group = self.ranks.dist, self.ranks.group
        self._plans = SavePlanCache()  # the last save's DCP plans, reused while the state's structure holds
        # background writes agree on their outcome on a gloo group of their own, off the training thread
        self._bg = self.ranks.fork() if self.async_save else self.ranks
        self._worker = Worker()
        self.per_rank = set(per_rank)
        self.handler: DirectoryMetadataHandler | None = None
        problem: BaseException | None = None
        if self.rank == 0:
            try:
                if location.is_local:
                    os.makedirs(self.directory, exist_ok=True)
                h = DirectoryMetadataHandler(keep_last=keep_last, keep_best=keep_best, metric=metric, mode=mode,
                                             storage_options=self._options)
                h.set_params(db_prefix=self.directory, db_type="native", node_names=[], path_prefix=None,
                             path_type=None)
                h.acquire_lock()  # rank 0's, until close()
                self.handler = h
            except Exception as ex:
                problem = ex
        self.ranks.agree(problem, "open the checkpoint directory")
        self._metric = metric
        self.last_step: int | None = None
        self._last_save = time.monotonic()
        self._guard = RankSignalGuard((signal.SIGTERM,)).__enter__()
        self._closed = False
        #: this rank's node-local tier (``local=``; docs/tiers.md), None without one
        self.tier: RankTier | None = None
        #: ``when_busy="skip"`` (set by the Checkpointer), and the steps it skipped
        self.skip_busy, self.skipped = False, list[int]()

    def __repr__(self) -> str:
        return f"DistributedCheckpointer({self.directory!r}, rank={self.rank}, world={self.world})"

    # -- the API
    @property
    def preempted(self) -> bool:
        """True on every rank once any rank got SIGTERM (collective: call it on every rank)."""
        return bool(self.ranks.all_max([int(self._guard.signum is not None)])[0])

    def due(self, step: int, every: int | None = None, interval: float | str | None = None) -> bool:
        """The Checkpointer's ``due``, agreed by all ranks (collective): True on every rank
        when any rank says so (a SIGTERM on one rank, or its clock's ``interval``)."""
        local = self._guard.signum is not None or Cadence(
            every, parse_interval(interval), _last=self._last_save).due(int(step))
        return bool(self.ranks.all_max([int(local)])[0])

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None) -> None:
        """Save ``state`` as step ``step`` (collective): each rank writes its part; rank 0
        commits once all are durable. Raises on every rank when any rank's part failed
        (the step is then not committed; earlier ones are untouched). With ``async_save``,
        this rank's state is copied into host memory and the rest (planning, writing, the
        ranks' agreement) runs in the background, on a group of its own: no collective here;
        a failure is raised by :meth:`wait` (or the next save) on every rank."""
        with write_options(self._write_options):  # (the background job runs in a copy of this context)
            self._save(step, state, metrics)

    def _save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None) -> None:
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        recorded = {str(k): metric_number(str(k), v) for k, v in (metrics or {}).items()}
        if self._metric and self._metric not in recorded and self._metric in state:
            recorded[self._metric] = metric_number(self._metric, state[self._metric])
        self._last_save = time.monotonic()
        start = time.perf_counter_ns()
        sd, _ = dcp_state(state, self.rank, self.per_rank, None, self.directory)
        persist = self.tier.due(self.preempted) if self.tier is not None else False
        if self.skip_busy:  # (see the front Checkpointer's when_busy)
            forced = persist if self.tier is not None else self.preempted  # (due() counts a SIGTERM in)
            if not forced and self._busy():  # (collective: every rank skips the same steps)
                self.skipped.append(step)
                return
        self.wait()  # the previous background save is committed (or has failed) first
        shared: tuple[dict[str, Any], bool] | None = None
        if self.tier is not None:
            # a step that goes to the store too is snapshotted once, for both writes
            shared = self.tier.save(step, sd, share=persist and self.async_save)
            if not persist:  # this step stays in the local tiers only
                self.last_step = step
                return

        def writer(deferred: bool = False) -> EpochalStorageWriter:
            return EpochalStorageWriter(self.directory, step=step, handler=self.handler, lock=False,
                                        metrics=recorded or None, deferred=deferred,
                                        hold_commit=self.async_save, staging=self._staging,
                                        storage_options=self._options, incremental=self.incremental,
                                        kept=self._kept)

        if not self.async_save:
            self._write(step, sd, writer(), self.ranks)
            self._committed(step, start)
            return
        problem: BaseException | None = None
        snap: tuple[dict[str, Any], bool] | None = shared
        staging = self.tier.staging if shared is not None and self.tier is not None else self._staging
        try:
            if snap is None:
                snap = self._staging.snapshot_state(sd)
        except Exception as ex:
            problem = ex
        if snap is None and problem is None:  # (no snapshot of the whole: planned here, staged as written)
            w = writer(deferred=True)
            self._write(step, sd, w, self.ranks)
            job: Callable[[], None] = w.write_deferred
        else:
            w = writer()
            job = functools.partial(self._write_snapshot, step, snap, w, problem, staging)
        self._pending = Pending(step, w, start, self._bg, job)
        self._worker.submit(functools.partial(contextvars.copy_context().run, self._pending.run))

    def _busy(self) -> bool:
        """Whether any rank's previous save is still in the background (collective)."""
        busy = (self.tier is not None and self.tier.busy()) or (self._pending is not None
                                                                and not self._pending.done.is_set())
        return bool(self.ranks.all_max([int(busy)])[0])

    def _write_snapshot(self, step: int, snap: tuple[dict[str, Any], bool] | None, writer: EpochalStorageWriter,
                        problem: BaseException | None, staging: HostStaging) -> None:
        """The background part of an async save of a snapshot (``problem``: this rank's
        failure to take it; ``staging``: whose buffer it is in, released once written):
        collective on the background group."""
        try:
            self._write(step, {} if snap is None else snap[0], writer, self._bg, problem)
        finally:
            if snap is not None and snap[1]:
                staging.release()

    def _write(self, step: int, sd: dict[str, Any], writer: EpochalStorageWriter, ranks: RankGroup,
               problem: BaseException | None = None) -> None:
        """Plan and write ``sd`` as ``step`` (collective on ``ranks``): with the kept plans
        when every rank's local plan is unchanged, else through DCP's planning in full."""
        planner, kept = self._planned(step, sd, ranks, problem)
        if kept:
            self._save_planned(step, planner, writer, ranks)
            return
        self._plans.forget()  # the first save, or the state's structure changed
        try:
            with _quiet():
                dcp_save(sd, storage_writer=writer, planner=planner, process_group=ranks.group,
                         no_dist=not ranks.dist)
        except CheckpointException as ex:
            writer.discard_deferred()
            raise unwrap_failure(ex, f"save step {step}") from None
        self._plans.record(planner, writer)

    def _planned(self, step: int, sd: dict[str, Any], ranks: RankGroup, problem: BaseException | None
                 ) -> tuple[RecordingSavePlanner, bool]:
        """One all-reduce: whether every rank's local plan is the one kept from the last save
        (then the save reuses the kept plans: no DCP planning collectives), that no rank
        failed (``problem``, or to plan), that rank 0 found ``step`` not committed yet, that
        every rank saves the same step (else CheckpointError naming the steps, on every rank,
        before anything is written) and that the plain values are the same on every rank
        (else ValueError naming them)."""
        planner, same = RecordingSavePlanner(), False
        try:
            if problem is None:
                planner, same = self._plans.planner(sd, ranks.rank == 0)
            if problem is None and ranks.rank == 0 and CheckpointDirectory(self.directory).is_committed(step):
                raise CheckpointError(f"{self.directory}: step {step} is already committed (a save never "
                                      "replaces one)")
        except Exception as ex:
            problem = ex
        names = sorted(k for k, v in sd.items() if isinstance(v, Whole) and not k.startswith("__rank"))
        digest = _plain_digest(sd, names)
        got = ranks.all_max(ranks.slots(problem) + [int(not same), digest, -digest, step, -step])
        ranks.settle(got[:ranks.world], problem, f"plan step {step}")
        hi, lo = got[-2], -got[-1]
        if hi != lo:  # the step is part of what the ranks agree on: nothing is written
            raise CheckpointError(
                f"{self.directory}: the ranks passed different steps to save: rank {ranks.rank} step {step}, "
                f"others from step {lo} to step {hi}; every rank must save the same step (nothing was written)")
        if got[-4] != -got[-3]:
            self._check_replicated(sd, names, ranks)
        return planner, not got[ranks.world]

    def _save_planned(self, step: int, planner: RecordingSavePlanner, writer: EpochalStorageWriter,
                      ranks: RankGroup) -> None:
        """Save ``step`` with the kept plans: each rank writes its kept items (a deferred
        writer: snapshots them); rank 0 finishes (commits, unless the writer holds the commit)
        once every rank's are written."""
        problem: BaseException | None = None
        try:
            self._plans.write(planner, writer, step, ranks.rank)
        except Exception as ex:
            problem = ex
        try:
            ranks.agree(problem, f"save step {step}")
        except BaseException:
            writer.discard_deferred()
            raise
        try:
            if ranks.rank == 0:
                self._plans.finish(writer, step)
        except Exception as ex:
            problem = ex
        ranks.agree(problem, f"commit step {step}")

    def _committed(self, step: int, start: int) -> None:
        self.last_step = step
        if self.handler is not None:
            d = CheckpointDirectory(self.directory)
            db = d.db_path("rank0", step)
            self.handler.report_bytes("checkpoint_save", {db: d.read_manifest(step).size})
            self.handler.report("checkpoint_save", {db: time.perf_counter_ns() - start})
            logger.info("Committed step %d in %s (%d ranks)", step, self.directory, self.world)

    def restore(self, state: MutableMapping[str, Any]) -> int | None:
        """Restore ``state`` from the newest step every rank can read (collective) and return
        it; None (``state`` untouched) on a fresh start."""
        self._check_open()
        self.wait()
        self._last_save = time.monotonic()
        if self.tier is not None:
            self.last_step = self.tier.restore(state, self.directory, self._options)
            return self.last_step
        touched = False
        while True:
            step, problem = -1, None  # type: tuple[int, BaseException | None]
            if self.handler is not None:
                try:
                    self.handler.node_names = []  # check every db the manifest lists
                    found = self.handler.resume_epoch()
                    step = -1 if found is None else found
                except Exception as ex:
                    problem = ex
            self.ranks.agree(problem, "choose the step to resume")
            step = self.ranks.broadcast(step)
            if step < 0:
                if touched:
                    raise CheckpointCorruptError(self.directory, "no intact step left after a damaged one was "
                                                 "partly loaded: the live objects hold part of it")
                logger.info("No checkpoint in %s: starting a new run", self.directory)
                return None
            problem = None
            try:
                self._load(step, state)
            except CheckpointException as ex:
                problem = unwrap_failure(ex, f"load step {step}")
            except Exception as ex:
                problem = ex
            touched = True
            if not self.ranks.agree(problem, f"load step {step}", corrupt_ok=True):
                break
            rejected = 1
            if self.handler is not None:
                rejected = int(self.handler.reject_epoch(step, str(problem or "damaged on another rank")))
            if not self.ranks.broadcast(rejected):
                raise problem if problem is not None else CheckpointCorruptError(self.directory, f"step {step} is damaged")
        logger.info("Resumed from step %d in %s", step, self.directory)
        self.last_step = step
        return step

    def steps(self) -> list[int]:
        """The committed steps, oldest first."""
        return CheckpointDirectory(self.directory).committed_epochs()

    def best_steps(self) -> list[int]:
        """Committed steps ranked best first by ``metric`` ([] without one)."""
        if self.handler is None or not self.handler.policy.metric:
            return []
        p = self.handler.policy
        best = best_of_directory(self.directory, metric=p.metric, mode=p.mode, k=p.keep_best)
        return best.epochs if best is not None else []

    def wait(self) -> None:
        """Finish the background save, if any (collective): every rank's write is joined;
        when all are durable rank 0 commits the step, else the step is not committed and
        this raises on every rank (naming the ranks that failed). Nothing to do after a
        synchronous save."""
        if self.tier is not None:
            self.tier.wait()
        if not self.async_save:
            return
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.done.wait()  # written, and every rank's outcome agreed (in the background)
        if pending.error is not None:
            raise pending.error
        problem: BaseException | None = None
        try:
            pending.writer.commit_deferred()
        except Exception as ex:
            problem = ex
        self.ranks.agree(problem, f"commit step {pending.step}")
        self._committed(pending.step, pending.start)

    def close(self) -> None:
        """Finish the background save (collective, as :meth:`wait`), let rank 0's lock go and
        restore the previous SIGTERM handler."""
        self._close(commit=True)

    def _close(self, commit: bool) -> None:
        if self._closed:
            return
        try:
            if commit:
                self.wait()
            elif self._pending is not None:
                # leaving on an error: the other ranks may not reach a collective, so the
                # background write is waited for but not committed
                pending, self._pending = self._pending, None
                pending.written.wait()
        finally:
            self._closed = True
            self._kept = None  # (the kept chunks: memory)
            self._guard.__exit__(None, None, None)
            if self.tier is not None:
                self.tier.close()
            self._close_handler()
            # DCP's planners and our loads leave cycles that hold tensors and gloo work:
            # freed now, while the process group lives (freed at interpreter exit, after
            # destroy_process_group, gloo's threads can abort the process with SIGABRT)
            gc.collect()

    def _close_handler(self) -> None:
        if self.handler is not None:
            try:
                self.handler.flush()
            finally:
                self.handler.release_lock()

    def __enter__(self) -> DistributedCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close(commit=not (exc and exc[0] is not None and self.async_save))

    # -- internals
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self!r} is closed")

    def _check_replicated(self, sd: dict[str, Any], names: list[str], ranks: RankGroup) -> None:
        """Plain values are written once (one rank's): ValueError on every rank, naming them,
        when they differ between ranks (collective; called once their digests differed,
        before anything is written)."""
        counts = ranks.all_max([len(names), -len(names)])
        sums = [_plain_digest(sd, [k]) for k in names] if counts[0] == -counts[1] else []
        hi, lo = ranks.all_max(sums), [-v for v in ranks.all_max([-v for v in sums])]
        differ = [k for k, a, b in zip(names, hi, lo) if a != b] or names
        raise ValueError(
            f"state {differ} differ between ranks: a value that is neither a tensor nor a module or "
            "optimizer is saved once, as one rank's; make it the same on every rank (an all-reduced "
            "loss, say) or name it in per_rank= (DistributedCheckpointer) to keep each rank's own"
        )

    def _load(self, step: int, state: MutableMapping[str, Any]) -> None:
        manifest = CheckpointDirectory(self.directory).read_manifest(step)
        if META_NODE not in manifest.nodes and list(manifest.nodes) == [SINGLE_NODE]:
            load_one_process_step(self.directory, step, state, self.ranks, self._options)
            return
        reader = EpochalStorageReader(self.directory, step=step, storage_options=self._options)
        saved = set(reader.read_metadata().state_dict_metadata)
        # the ranks that saved per-rank values: all of a world of the same size, or none
        ranks = {k[len("__rank"):].split("__/", 1)[0] for k in saved if k.startswith("__rank")}
        if ranks and ranks != {str(r) for r in range(self.world)}:
            saved = {k for k in saved if not k.startswith("__rank")}
        sd, after = dcp_state(state, self.rank, self.per_rank, saved, self.directory)
        with _quiet():
            dcp_load(sd, storage_reader=reader, process_group=self._group, no_dist=not self._dist)
        for key, apply in after.items():
            apply(sd[key])


def _plain_digest(sd: dict[str, Any], names: list[str]) -> int:
    """A CRC-32 of the names and values (their repr) of the plain values ``names`` of ``sd``."""
    text = repr([(k, sd[k].value) for k in names])
    return zlib.crc32(text.encode("utf-8", "backslashreplace"))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield
