"""A save of a JAX job of several processes: a db per process, one commit.

Every process calls :func:`save_processes` with the same directory and step. Each writes
what it holds (:func:`~.host.to_host` with ``process=(i, n)``: its replica-0 shards of
the arrays spread over processes, and on process 0 everything else) into a db of its own,
node ``proc<i>`` (``<dir>/proc<i>.<step>``: the way ranks of ``torch.distributed`` write
``rank<r>.<step>``; at a URL ``proc<i>.<step>.<token>``, one writer token per save, drawn
by process 0, so no other writer's save can produce the name). The processes agree over
the JAX job itself, by ``multihost_utils.process_allgather`` of a few integers (no
transport of their own):

1. before anything is written: every process could take its part, all save the same step,
   it is not committed yet, and the plain values are the same everywhere (their digests);
2. after the writes: every db is written, fsynced and in place;
3. process 0 then commits the step: one manifest naming every process's db with its size and
   digest, then applies the retention asked for (both under the directory's writer lock, at
   a URL its fenced lease), and all learn whether it committed.

With ``background`` (an async save) the first agreement is made on the calling thread, over
host copies of the shards; the write, the other two agreements and the commit run on a
thread, agreeing through the job's coordination service rather than a JAX collective
(:mod:`.background`); the next save, a restore or :func:`~.background.join_pending` joins it.

A failure at any point raises on every process (the failing one its own error, the others
CheckpointError naming the processes that failed) and leaves the step uncommitted; a process
that dies leaves the others waiting in the next agreement (in the background, for at most
:data:`~.background.AGREE_SECONDS`), so nothing is committed and the
previous step stays the newest. A restore reads every process's db together
(:class:`~.sources.ProcessesSource`), on any number of processes.
"""

from __future__ import annotations

import os
import re
import secrets
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ..checkpoint.handler.directory import DirectoryMetadataHandler
from ..checkpoint.handler.metadata import DbReport
from ..checkpoint.location.retention import RetentionPolicy
from ..checkpoint.location.view import CheckpointDirectory
from ..errors import CheckpointError
from ..storage.encoding.compress import WriteOptions, write_options
from ..storage.formats.native.incremental import write_incremental
from ..storage.formats.native.reader import stat_native
from ..storage.formats.native.write import write_native
from ..storage.io.location import location_for
from ..storage.io.seam import local_path
from .background import Agree, PendingSave, agree_off_thread, join_pending, start_pending
from .names import Leaf

__all__ = ["PROCESS_NODE", "plain_digest", "process_nodes", "save_processes"]

#: the node of process ``i``'s db: ``proc<i>``
PROCESS_NODE = "proc{}"
_NODE_RE = re.compile(r"proc(\d+)")
_LOW = (1 << 31) - 1


def process_nodes(nodes: Iterable[str]) -> list[str]:
    """The nodes of a step saved by several processes (``proc0``, ``proc1``, ..., by process
    index), or [] when ``nodes`` are not all of that kind."""
    nodes = list(nodes)
    if not nodes or not all(_NODE_RE.fullmatch(n) for n in nodes):
        return []
    return sorted(nodes, key=lambda n: int(n[4:]))


def _gather(values: list[int]) -> np.ndarray:
    """Every process's ``values`` (non-negative ints below 2**62), one row per process: each
    sent as two int32 halves (JAX's default integers are 32 bits)."""
    halves = np.array([[v >> 31, v & _LOW] for v in values], dtype=np.int32).reshape(-1)
    got = np.asarray(multihost_utils.process_allgather(halves)).reshape(jax.process_count(), len(values), 2)
    return (got[..., 0].astype(np.int64) << 31) | got[..., 1].astype(np.int64)


def _settle(flags: np.ndarray, problem: BaseException | None, directory: str, step: int, what: str) -> None:
    """Raise on every process when any failed ``what``: the failing one its own error, the
    others CheckpointError naming the processes that failed."""
    if problem is not None:
        raise problem
    bad = [int(p) for p in np.nonzero(flags)[0]]
    if bad:
        raise CheckpointError(f"{directory}: step {step} was not saved: process(es) {bad} failed to {what} "
                              "(the step is not committed; earlier steps are untouched)")


def plain_digest(leaves: Iterable[Leaf]) -> int:
    """A CRC-32 of the names and values (their repr) of the plain leaves (not arrays): the
    same on every process when they hold the same values."""
    plain = [(names, repr(v)) for names, v in leaves if not isinstance(v, (jax.Array, np.ndarray))]
    return zlib.crc32(repr(plain).encode("utf-8", "backslashreplace"))


def save_processes(directory: str | os.PathLike[str], step: int, build: Callable[[], dict[str, Any]], plain: int,
                   *, metrics: Mapping[str, float] | None = None, policy: RetentionPolicy | None = None,
                   background: bool = False, storage_options: dict[str, Any] | None = None,
                   compression: str | None = None, incremental: bool = False) -> PendingSave | None:
    """Save step ``step`` in ``directory`` from every process of the job (collective; see the
    module doc). ``build``: this process's part of the state (nested dicts of host values;
    with ``background``, none sharing memory with a live buffer); ``plain``: the
    :func:`plain_digest` of its pytree's plain values (saved once, process 0's: ValueError
    on every process when they differ). ``policy``: the retention process 0 applies after
    the commit (None: every step kept). ``background``: the first agreement here, the write,
    the other two agreements and the commit on a thread (:mod:`.background`); its handle is
    returned. A save still in flight from an earlier call is joined first (its error raised).
    ``storage_options``: fsspec's, for a URL ``directory`` (every process's db is named with
    one writer token, process 0's, as the ranks of a ``dcp.save`` name theirs).
    ``compression``: how each process's db is written (:class:`WriteOptions`; None: raw).
    ``incremental``: each process writes its db against its own db of the newest step
    committed before (docs/format.md, "Incremental db files"; none there: whole), the
    location marked incremental first, so retention keeps what a kept step references."""
    join_pending()
    i = jax.process_index()
    path = local_path(directory)
    problem: BaseException | None = None
    state: dict[str, Any] = {}
    token = 0
    try:
        location = location_for(path, storage_options)
        location.remember()  # (a URL's options: for every db and record under it, on any thread)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if background:
            agree_off_thread()  # (the job's coordination service: RuntimeError when there is none)
        if location.is_local:
            os.makedirs(path, exist_ok=True)
        elif i == 0:
            token = secrets.randbits(48)  # the save's writer token, every process's db named with it
        if i == 0 and CheckpointDirectory(path, storage_options=storage_options).is_committed(step):
            raise CheckpointError(f"{path}: step {step} is already committed (a save never replaces one)")
        state = build()
    except Exception as ex:
        problem = ex
    sent = step if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < (1 << 62) else 0
    got = _gather([int(problem is not None), sent, plain, token, int(background), int(incremental)])
    _settle(got[:, 0], problem, path, step, "prepare their part")
    if len(set(got[:, 1].tolist())) > 1:
        raise CheckpointError(f"{path}: the processes passed different steps to save ({got[:, 1].tolist()}, by "
                              "process); every process must save the same step (nothing was written)")
    if len(set(got[:, 4].tolist())) > 1:
        raise ValueError(f"{path}: step {step}: async_save differs between the processes ({got[:, 4].tolist()}, "
                         "by process); every process must save alike (nothing was written)")
    if len(set(got[:, 5].tolist())) > 1:
        raise ValueError(f"{path}: step {step}: incremental differs between the processes ({got[:, 5].tolist()}, "
                         "by process); every process must save alike (nothing was written)")
    if len(set(got[:, 2].tolist())) > 1:
        raise ValueError(f"{path}: step {step}: the plain values of the pytree (not arrays) differ between "
                         "processes; they are saved once, as process 0's: make them the same on every process "
                         "(nothing was written)")
    d = CheckpointDirectory(path, storage_options=storage_options)
    tok = None if d.location.is_local else f"w{int(got[0, 3]):012x}"
    dbs = [d.token_db_path(PROCESS_NODE.format(r), step, tok) for r in range(jax.process_count())]

    write = WriteOptions(compression)
    base: str | None = None
    if incremental:
        try:
            d.mark_incremental()  # (each process: once marked, it stays; the write is idempotent)
            base = d.base_db(PROCESS_NODE.format(i), step)
        except Exception as ex:
            problem = ex
        _settle(_gather([int(problem is not None)])[:, 0], problem, path, step, "find the step before")

    def finish(agree: Agree) -> None:
        _finish(d, path, step, state, dbs, agree, metrics, policy, storage_options, write,
                (base,) if incremental else None)

    if not background:
        finish(lambda phase, failed: _gather([int(failed)])[:, 0])
        return None
    return start_pending(path, step, finish)


def _finish(d: CheckpointDirectory, path: str, step: int, state: dict[str, Any], dbs: list[str], agree: Agree,
            metrics: Mapping[str, float] | None, policy: RetentionPolicy | None,
            options: dict[str, Any] | None, write: WriteOptions | None = None,
            incremental: tuple[str | None] | None = None) -> None:
    """Every process: write its db (of ``dbs``, by process; as ``write`` says; given
    ``incremental``, ``(base,)``: an incremental db on that base, None: none), agree;
    process 0: commit (and apply ``policy``); agree."""
    i, n = jax.process_index(), jax.process_count()
    problem: BaseException | None = None
    try:
        if incremental is not None:
            with write_options(write or WriteOptions()):
                write_incremental(dbs[i], state, base=incremental[0], step=step)
        else:
            write_native(dbs[i], state, options=write)  # temp file, fsync, rename, dir fsync (at a URL: an upload, then in place)
    except Exception as ex:
        problem = ex
    finally:
        state.clear()  # the host views (or copies) of the shards are let go
    _settle(agree("written", problem is not None), problem, path, step, "write their db")
    if i == 0:
        try:
            _commit(d, path, step, {PROCESS_NODE.format(r): dbs[r] for r in range(n)}, metrics, policy, options,
                    incremental is not None)
        except Exception as ex:
            problem = ex
    _settle(agree("committed", problem is not None), problem, path, step, "commit the step")


def _commit(d: CheckpointDirectory, path: str, step: int, nodes: dict[str, str],
            metrics: Mapping[str, float] | None, policy: RetentionPolicy | None,
            options: dict[str, Any] | None, incremental: bool = False) -> None:
    """Process 0: the manifest of ``step`` naming every process's db (each db's size and
    digest read from its header; ``incremental``: the bytes each stores), then ``policy``'s retention (the handler's: the dropped
    steps' manifests first, then every process's db of them; never a newer step's files),
    all under the directory's writer lock (at a URL its fenced lease)."""
    reports = {}
    for node, db in nodes.items():
        st = stat_native(db)  # (an incremental db: the bytes stored, what a check of the records finds)
        size = d.records.size(db) if incremental else st.file_bytes
        reports[node] = DbReport(size, st.digest, file=os.path.basename(db))
    p = policy or RetentionPolicy()
    h = DirectoryMetadataHandler(keep_last=p.keep_last, keep_every=p.keep_every, keep_best=p.keep_best,
                                 metric=p.metric, mode=p.mode, storage_options=options)
    h.set_params(db_prefix=path, db_type="native", node_names=list(nodes), path_prefix=None, path_type=None)
    h.acquire_lock()  # CheckpointLockedError naming the holder when another writer has it
    try:
        if d.is_committed(step):
            raise CheckpointError(f"{path}: step {step} was committed by another writer while this save ran")
        h.report_dbs(step, reports)
        h.write(step, metrics=dict(metrics) if metrics else None)
    finally:
        h.release_lock()
