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
import functools
import logging
import os
import signal
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..checkpoint.handler.directory import DirectoryMetadataHandler
from ..checkpoint.location.best import metric_number
from ..checkpoint.location.view import CheckpointDirectory, best_of_directory
from ..checkpoint.tasks.steps import INTERNAL_PREFIX
from ..errors import CheckpointCorruptError, CheckpointError
from ..jobs.cadence import Cadence, parse_interval
from ..jobs.preemption import SignalGuard
from ..storage.io.seam import is_url, local_path
from .dcp import EpochalStorageReader, EpochalStorageWriter, Whole
from .dcp.staging import HostStaging

__all__ = ["DistributedCheckpointer", "process_world"]

logger = logging.getLogger("epochal")

#: type names whose objects are per rank by default (data positions and RNG)
PER_RANK_TYPES = ("RNGState", "ResumableSampler", "StatefulDataLoader", "DistributedSampler")


#: a second SIGTERM this soon after the first is a duplicate delivery, not "stop at once"
DUPLICATE_SECONDS = 5.0


def process_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_key(rank: int, name: str) -> str:
    return f"__rank{int(rank)}__/{name}"


def _stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def _unwrap(ex: BaseException, what: str) -> BaseException:
    """The exception behind a CheckpointException (DCP wraps each rank's): this rank's own
    when it failed; else the first failed rank's, as a CheckpointError naming that rank (a
    CheckpointCorruptError, which names its file and blob, stays one)."""
    if not isinstance(ex, CheckpointException) or not ex.failures:
        return ex
    rank = process_world()[0]
    if rank in ex.failures:
        exc = ex.failures[rank][0]
        return exc if isinstance(exc, BaseException) else ex
    other, (exc, _) = next(iter(sorted(ex.failures.items(), key=lambda kv: kv[0])))
    if isinstance(exc, CheckpointCorruptError):
        return exc
    err = CheckpointError(f"rank {other} failed to {what}: {exc!r}")
    err.__cause__ = exc if isinstance(exc, BaseException) else None
    return err


class DistributedCheckpointer:
    """:class:`epochal.Checkpointer` for a ``torch.distributed`` job (see the module doc).

    Arguments as the Checkpointer's; ``per_rank``: names of ``state`` entries that differ
    from rank to rank beyond the default ones (RNG, samplers, data loaders); ``group``: the
    process group (the default one). ``async_save``: :meth:`save` snapshots this rank's part
    into host memory and returns; a thread writes it, and the step is committed (by rank 0,
    once every rank's write is durable) at the next ``save``, ``wait``, ``restore`` or
    ``close``, which are collective. URLs are not supported here yet."""

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
    ) -> None:
        self.directory = local_path(directory)  # file:// is the local disk
        if storage_options is not None or is_url(self.directory):
            raise CheckpointError(
                f"Checkpointer({self.directory!r}) under torch.distributed: URLs and "
                "storage_options are not supported yet (docs/distributed.md)"
            )
        self.async_save = bool(async_save)
        self._staging = HostStaging(max_host_bytes)  # async snapshots: one host buffer, reused
        self._pending: _Pending | None = None
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank, self.world = process_world()
        if self._dist and group is not None:  # ranks of that group
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._group = group
        if self._dist and group is None and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # host-side coordination
        self.per_rank = set(per_rank)
        self.handler: DirectoryMetadataHandler | None = None
        problem: BaseException | None = None
        if self.rank == 0:
            try:
                os.makedirs(self.directory, exist_ok=True)
                h = DirectoryMetadataHandler(keep_last=keep_last, keep_best=keep_best, metric=metric, mode=mode)
                h.set_params(db_prefix=self.directory, db_type="native", node_names=[], path_prefix=None,
                             path_type=None)
                h.acquire_lock()  # rank 0's, until close()
                self.handler = h
            except Exception as ex:
                problem = ex
        self._agree(problem, "open the checkpoint directory")
        self._metric = metric
        self.last_step: int | None = None
        self._last_save = time.monotonic()
        self._guard = RankSignalGuard((signal.SIGTERM,)).__enter__()
        self._closed = False

    def __repr__(self) -> str:
        return f"DistributedCheckpointer({self.directory!r}, rank={self.rank}, world={self.world})"

    # -- coordination (tensors on the gloo group: nothing pickled)
    def _all_max(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        if self._dist:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return [int(v) for v in t.tolist()]

    def _broadcast(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        if self._dist:
            dist.broadcast(t, src=0 if self._group is None else dist.get_global_rank(self._group, 0),
                           group=self._group)
        return int(t.item())

    def _agree(self, problem: BaseException | None, what: str, corrupt_ok: bool = False) -> bool:
        """Every rank learns whether any failed at ``what``: this rank's own error is raised
        as it is; a rank that did not fail raises a CheckpointError naming the ranks that did.
        With ``corrupt_ok``, when every failure is a CheckpointCorruptError, return True
        instead (the caller falls back) on every rank."""
        code = 0 if problem is None else (1 if isinstance(problem, CheckpointCorruptError) else 2)
        codes = self._all_max([code if r == self.rank else 0 for r in range(self.world)])
        failed = [r for r, c in enumerate(codes) if c]
        if not failed:
            return False
        if corrupt_ok and all(codes[r] == 1 for r in failed):
            return True
        if problem is not None:
            raise problem
        raise CheckpointError(f"{self.directory}: rank(s) {failed} failed to {what} (see their errors)")

    # -- the API
    @property
    def preempted(self) -> bool:
        """True on every rank once any rank got SIGTERM (collective: call it on every rank)."""
        return bool(self._all_max([int(self._guard.signum is not None)])[0])

    def due(self, step: int, every: int | None = None, interval: float | str | None = None) -> bool:
        """The Checkpointer's ``due``, agreed by all ranks (collective): True on every rank
        when any rank says so (a SIGTERM on one rank, or its clock's ``interval``)."""
        local = self._guard.signum is not None or Cadence(
            every, parse_interval(interval), _last=self._last_save).due(int(step))
        return bool(self._all_max([int(local)])[0])

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None) -> None:
        """Save ``state`` as step ``step`` (collective): each rank writes its part; rank 0
        commits once all are durable. Raises on every rank when any rank's part failed
        (the step is then not committed; earlier ones are untouched)."""
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        recorded = {str(k): metric_number(str(k), v) for k, v in (metrics or {}).items()}
        if self._metric and self._metric not in recorded and self._metric in state:
            recorded[self._metric] = metric_number(self._metric, state[self._metric])
        self._last_save = time.monotonic()
        start = time.perf_counter_ns()
        sd, _ = self._dcp_state(state, None)
        self._check_replicated(sd)
        self.wait()  # the previous background save is committed (or has failed) first
        writer = EpochalStorageWriter(self.directory, step=step, handler=self.handler, lock=False,
                                      metrics=recorded or None, deferred=self.async_save,
                                      staging=self._staging)
        try:
            with _quiet():
                dcp_save(sd, storage_writer=writer, process_group=self._group, no_dist=not self._dist)
        except CheckpointException as ex:
            raise _unwrap(ex, f"save step {step}") from None
        if self.async_save:  # this rank's snapshot is in host memory: write it in a thread
            self._pending = _Pending(step, writer, start)
            self._pending.thread.start()
            return
        self._committed(step, start)

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
            self._agree(problem, "choose the step to resume")
            step = self._broadcast(step)
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
                problem = _unwrap(ex, f"load step {step}")
            except Exception as ex:
                problem = ex
            touched = True
            if not self._agree(problem, f"load step {step}", corrupt_ok=True):
                break
            rejected = 1
            if self.handler is not None:
                rejected = int(self.handler.reject_epoch(step, str(problem or "damaged on another rank")))
            if not self._broadcast(rejected):
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
        if not self.async_save:
            return
        pending, self._pending = self._pending, None
        if self._dist:
            # every rank takes part, whether or not it had a save pending (all or none do)
            any_pending = self._all_max([int(pending is not None)])[0]
            if any_pending and pending is None:
                raise CheckpointError(f"{self!r}: another rank has a background save pending and this one not")
        if pending is None:
            return
        pending.thread.join()
        self._agree(pending.error, f"write step {pending.step} in the background")
        problem: BaseException | None = None
        try:
            pending.writer.commit_deferred()
        except Exception as ex:
            problem = ex
        self._agree(problem, f"commit step {pending.step}")
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
                # background save is joined here but not committed
                pending, self._pending = self._pending, None
                pending.thread.join()
        finally:
            self._closed = True
            self._guard.__exit__(None, None, None)
            self._close_handler()

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

    def _per_rank(self, name: str, value: Any) -> bool:
        return name in self.per_rank or type(value).__name__ in PER_RANK_TYPES

    def _dcp_state(self, state: Mapping[str, Any], saved: set[str] | None
                   ) -> tuple[dict[str, Any], dict[str, Callable[[Any], Any]]]:
        """The state dict DCP saves or loads into, and (for a load) what to do with each
        loaded entry, by key. ``saved``: the keys of the step being loaded (None: a save)."""
        if not isinstance(state, Mapping) or not state:
            raise ValueError(f"state must be a non-empty dict of name -> object, got {state!r}")
        modules = {n: v for n, v in state.items() if isinstance(v, torch.nn.Module)}
        sd: dict[str, Any] = {}
        after: dict[str, Callable[[Any], Any]] = {}
        skipped: list[str] = []
        for name, value in state.items():
            if not isinstance(name, str) or not name or name.startswith((INTERNAL_PREFIX, "__")):
                raise ValueError(f"state key {name!r} must be a non-empty str not starting with '__'")
            key = rank_key(self.rank, name) if self._per_rank(name, value) else name
            if saved is not None and key not in saved and not any(k.startswith(key + ".") for k in saved):
                skipped.append(name)
                continue
            if isinstance(value, torch.nn.Module):
                sd[key] = get_model_state_dict(value)
                after[key] = functools.partial(set_model_state_dict, value)
            elif isinstance(value, torch.optim.Optimizer):
                owner = _owner(name, value, modules)
                sd[key] = get_optimizer_state_dict(owner, value)
                after[key] = functools.partial(set_optimizer_state_dict, owner, value)
            elif isinstance(value, torch.Tensor):
                sd[key] = value  # DTensor or plain: loaded in place
            elif _stateful(value):
                sd[key] = Whole(value.state_dict() if saved is None else None)
                after[key] = value.load_state_dict
            else:
                sd[key] = Whole(value)
                after[key] = functools.partial(cast(MutableMapping[str, Any], state).__setitem__, name)
        if skipped:
            logger.warning("The step in %s has no %s for rank %d: they keep their current values "
                           "(per-rank values are restored only at the world size they were saved with)",
                           self.directory, ", ".join(map(repr, skipped)), self.rank)
        return sd, after

    def _check_replicated(self, sd: dict[str, Any]) -> None:
        """Plain values are written once (one rank's): ValueError on every rank, naming them,
        when they differ between ranks (before anything is written)."""
        names = sorted(k for k, v in sd.items() if isinstance(v, Whole) and not k.startswith("__rank"))
        if not self._dist or not names:
            return
        sums = [zlib.crc32(repr(sd[k].value).encode("utf-8", "backslashreplace")) for k in names]
        hi, lo = self._all_max(sums), [-v for v in self._all_max([-v for v in sums])]
        differ = [k for k, a, b in zip(names, hi, lo) if a != b]
        if differ:
            raise ValueError(
                f"state {differ} differ between ranks: a value that is neither a tensor nor a module or "
                "optimizer is saved once, as one rank's; make it the same on every rank (an all-reduced "
                "loss, say) or name it in per_rank= (DistributedCheckpointer) to keep each rank's own"
            )

    def _load(self, step: int, state: MutableMapping[str, Any]) -> None:
        reader = EpochalStorageReader(self.directory, step=step)
        saved = set(reader.read_metadata().state_dict_metadata)
        # the ranks that saved per-rank values: all of a world of the same size, or none
        ranks = {k[len("__rank"):].split("__/", 1)[0] for k in saved if k.startswith("__rank")}
        if ranks and ranks != {str(r) for r in range(self.world)}:
            saved = {k for k in saved if not k.startswith("__rank")}
        sd, after = self._dcp_state(state, saved)
        with _quiet():
            dcp_load(sd, storage_reader=reader, process_group=self._group, no_dist=not self._dist)
        for key, apply in after.items():
            apply(sd[key])


class _Pending:
    """A background save of this rank: the thread writing its snapshot, and what it raised."""

    def __init__(self, step: int, writer: EpochalStorageWriter, start: int) -> None:
        self.step, self.writer, self.start = step, writer, start
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"epochal-dist-save-{step}", daemon=True)

    def _run(self) -> None:
        try:
            self.writer.write_deferred()
        except BaseException as ex:  # handed to wait(), which raises it on every rank
            self.error = ex


class RankSignalGuard(SignalGuard):
    """SignalGuard for a rank: a second SIGTERM within :data:`DUPLICATE_SECONDS` of the first
    is the same one delivered twice (a scheduler signals every process, and torchrun forwards
    its own to its workers): ignored. A later one still stops at once."""

    _first = 0.0

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.signum is None:
            self._first = now
        elif now - self._first < DUPLICATE_SECONDS:
            logger.info("Received %s again within %ss: the same preemption, already saving",
                        signal.Signals(signum).name, DUPLICATE_SECONDS)
            return
        super()._handle(signum, frame)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _owner(name: str, opt: torch.optim.Optimizer, modules: Mapping[str, torch.nn.Module]) -> torch.nn.Module:
    """The module of ``state`` whose parameters ``opt`` updates (FQNs come from it)."""
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    for m in modules.values():
        if any(id(p) in ids for p in m.parameters()):
            return m
    raise CheckpointError(f"state[{name!r}]: an optimizer is saved by parameter name, which needs the "
                          "module holding its parameters in the state too")
