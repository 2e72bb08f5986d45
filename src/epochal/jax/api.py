"""``save`` and ``restore`` of a pytree, through a :class:`~epochal.Checkpointer` directory.

A save is a Checkpointer save of the pytree as nested dicts (:mod:`.names`) of host tensors
(:mod:`.host`), so retention, async saves, URLs and the commit protocol are the
Checkpointer's (its local tier too: a restore tries the local copy of a step first); in a
job of several processes each writes its own shards into a db of its own and process 0
commits the step (:mod:`.multiprocess`). A restore opens the step's one
db, or the dbs of every process that saved it, or for a step ``dcp.save`` wrote its rank dbs
and DCP's metadata (:mod:`.sources`; committed, size and digest checked against its
manifest), and builds each array leaf with ``jax.make_array_from_callback`` for
the abstract leaf's sharding, each shard's region read and checked by :mod:`.reads`; the
distinct regions of one leaf are read by a few threads at once. Nothing is returned unless
every leaf was found, fit and checked.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from ..checkpoint.location.retention import RetentionPolicy
from ..checkpoint.location.view import CheckpointDirectory
from ..checkpointer import Checkpointer
from ..checkpointer.parts import NODE, RestoreReport, check_ranked
from ..errors import (
    BlobMismatchError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    MissingBlobError,
)
from ..storage.encoding.compress import check_compression
from ..storage.io.location import location_for
from ..storage.io.seam import local_path
from .background import PendingSave, join_pending, one_process_pending
from .dcp import is_dcp_step
from .host import HostChunks, HostTensor, to_host
from .mapping import NameMap, Target, map_leaves
from .multiprocess import plain_digest, process_nodes, save_processes
from .names import Leaf, flat_leaves, leaf_label, nest
from .reads import DEFAULT_CHUNK, Task, aligned_empty
from .sources import DcpSource, LocalSource, ProcessesSource, Source

__all__ = ["DEFAULT_CHUNK", "host_state", "restore", "save", "wait"]

logger = logging.getLogger("epochal")

#: threads reading the regions of one leaf at once
READ_THREADS = 4


def keystrs(tree: Any) -> list[str]:
    """``jax.tree_util.keystr`` of each leaf's path, in jax's order."""
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def stored_as(leaves: list[Leaf], targets: list[Target]) -> list[Leaf]:
    """Host leaves (:func:`~.host.to_host`) under their stored names, the transposed ones
    transposed (a copy: the stored array is C-contiguous)."""
    out: list[Leaf] = []
    for (_, v), t in zip(leaves, targets):
        if t.transpose:
            if isinstance(v, HostChunks) and len(v.shape) >= 2:
                v = v.transposed(leaf_label(t.names))
            elif isinstance(v, HostTensor) and v.array.ndim >= 2:
                v = HostTensor(np.ascontiguousarray(v.array.T), leaf_label(t.names))
            else:
                raise ValueError(f"names: leaf {t.label} is not an array of 2 or more axes to transpose")
        out.append((t.names, v))
    return out


def host_state(pytree: Any, names: NameMap | None = None, *, copy: bool = False,
               process: tuple[int, int] | None = None) -> dict[str, Any]:
    """The state a Checkpointer saves for ``pytree``: nested dicts of the stored names
    (``names``: :mod:`.mapping`), arrays on host (:func:`~.host.to_host`; ``copy``: none
    sharing memory with a live buffer, for a write after the caller goes on; ``process``:
    ``(i, n)``, only process ``i``'s part of a save of ``n`` processes)."""
    leaves = flat_leaves(pytree)
    targets = map_leaves(leaves, keystrs(pytree), names)
    hosted = to_host(leaves, copy=copy, process=process)  # (a process's part: some leaves left out)
    at = {n: t for (n, _), t in zip(leaves, targets)}
    return nest(stored_as(hosted, [at[n] for n, _ in hosted]))


def save(path_or_checkpointer: str | os.PathLike[str] | Checkpointer, step: int, pytree: Any, *,
         metrics: Mapping[str, float] | None = None, names: NameMap | None = None,
         keep_last: int | None = None, keep_best: int | None = None, metric: str | None = None,
         mode: str = "min", async_save: bool = False, storage_options: dict[str, Any] | None = None,
         compression: str | None = None, incremental: bool = False) -> PendingSave | None:
    """Save ``pytree`` (a container of ``jax.Array`` leaves, sharded or not, numpy arrays and
    plain values) as checkpoint ``step`` of a Checkpointer, or of a directory (a
    Checkpointer is opened for this one save). Each array's shards with ``replica_id == 0``
    are written once, from their host views, never assembled (:mod:`.host`). ``names``:
    the stored name of each leaf (:mod:`.mapping`; default: the pytree's own).

    ``keep_last``/``keep_best``/``metric``/``mode`` (retention), ``async_save`` and
    ``storage_options`` (fsspec's, for a URL), ``compression`` (None, ``"zstd"`` or
    ``"auto"``: each array stored losslessly compressed, docs/pytorch.md) and
    ``incremental`` (only the bytes the step before lacks written; the rest references) are
    the Checkpointer's options, for a save to a directory (given a Checkpointer, its own hold):
    with ``async_save`` the save returns once the arrays are copied to host, with a
    :class:`~.background.PendingSave` whose ``wait()`` commits it; the next save, a
    restore, :func:`wait` or the end of the process joins it too.

    In a job of several processes (``jax.process_count() > 1``) every process calls it with
    the same directory, step and options: each writes its own shards into a db of its own
    and process 0 commits the step once every db is durable, then applies the retention
    (:mod:`.multiprocess`; async: :mod:`.background`)."""
    check_compression(compression)
    options = {"keep_last": keep_last, "keep_best": keep_best, "metric": metric, "storage_options": storage_options,
               "compression": compression}
    given = ([k for k, v in options.items() if v is not None] + (["async_save"] if async_save else [])
             + (["incremental"] if incremental else []))
    if isinstance(path_or_checkpointer, Checkpointer) and given:
        raise ValueError(f"epochal.jax.save: {', '.join(given)} are options of a save to a directory; a "
                         f"Checkpointer's own hold for its saves ({path_or_checkpointer!r})")
    if jax.process_count() > 1:
        if isinstance(path_or_checkpointer, Checkpointer):
            raise ValueError("epochal.jax.save in a job of several processes takes the directory (every process "
                             "the same), not a Checkpointer: a Checkpointer holds its directory for one process; "
                             "pass its options (keep_last=, async_save=, ...) to save")
        policy = RetentionPolicy(keep_last=keep_last, keep_best=keep_best, metric=metric, mode=mode)
        check_ranked(policy, step, pytree if isinstance(pytree, Mapping) else {}, metrics)
        i, n = jax.process_index(), jax.process_count()
        return save_processes(path_or_checkpointer, step,
                              lambda: host_state(pytree, names, copy=async_save, process=(i, n)),
                              plain_digest(flat_leaves(pytree)), metrics=metrics, policy=policy,
                              background=async_save, storage_options=storage_options, compression=compression,
                              incremental=incremental)
    join_pending()
    state = host_state(pytree, names)
    if isinstance(path_or_checkpointer, Checkpointer):
        path_or_checkpointer.save(step, state, metrics=metrics)
        return None
    ckpt = Checkpointer(path_or_checkpointer, progress=False, async_save=async_save, keep_last=keep_last,
                        keep_best=keep_best, metric=metric, mode=mode, storage_options=storage_options,
                        compression=compression, incremental=incremental)
    try:
        ckpt.save(step, state, metrics=metrics)
    except BaseException:
        ckpt.close()
        raise
    if async_save:  # committed by the close, where it is joined
        return one_process_pending(ckpt.directory, step, ckpt.close)
    ckpt.close()
    return None


def wait() -> None:
    """Wait for this process's async save in flight (:func:`save` with ``async_save``), if
    any, and raise its error: at the end of a job, or before reading its step elsewhere."""
    join_pending()


def _places(path_or_checkpointer: str | os.PathLike[str] | Checkpointer, step: int | None,
            storage_options: dict[str, Any] | None = None) -> list[tuple[int | None, str, str]]:
    """(step, place, directory) to restore from, in order: a Checkpointer's places (with a
    local tier, docs/tiers.md, the local copy of a step first), or the one directory given."""
    if not isinstance(path_or_checkpointer, Checkpointer):
        directory = local_path(path_or_checkpointer)
        location_for(directory, storage_options).remember()  # (a URL's: for the dbs opened by path)
        return [(step, "durable", directory)]
    return path_or_checkpointer._places(step)


def _step_source(directory: str, step: int | None, storage_options: dict[str, Any] | None = None
                 ) -> tuple[Source, int]:
    """The source of committed ``step`` (None: the newest) of ``directory``, its dbs checked
    against the manifest: a Checkpointer's db, the dbs of the processes of a JAX job, or the
    rank dbs of a ``dcp.save`` (:mod:`.dcp`)."""
    view = CheckpointDirectory(directory, storage_options=storage_options)
    if step is None:
        found = view.newest_committed()
        if found is None:
            raise CheckpointNotFoundError(f"{directory}: no committed step to restore")
        step = found[0]
    elif not view.is_committed(step):
        raise CheckpointNotFoundError(f"{directory}: step {step} is not committed")
    if is_dcp_step(view, step):
        return DcpSource(directory, step), step
    nodes = process_nodes(view.read_manifest(step).nodes)
    if nodes:  # a save of several processes: a db each
        view.require_intact(step, "quick", nodes=nodes, word="step")
        return ProcessesSource({n: view.db_path(n, step) for n in nodes}), step
    view.require_intact(step, "quick", nodes=[NODE], word="step")
    return LocalSource(view.db_path(NODE, step)), step


def _fit(t: Target, want: Any, src: Source, step: int) -> str:
    """What the abstract leaf ``want`` asks of its stored leaf: "array" or "plain";
    BlobMismatchError naming the leaf and step when they do not fit."""
    label = t.label
    key = src.key(t.names)
    layout = src.layout(key, label)
    if isinstance(want, (jax.ShapeDtypeStruct, jax.Array, np.ndarray)):
        wshape, wdtype = tuple(want.shape), np.dtype(want.dtype)
        if layout is None:
            raise BlobMismatchError(f"step {step}, leaf {label}: the checkpoint holds a {src.kind(key)} value, "
                                    f"the abstract pytree an array {wshape} {wdtype}")
        dt, shape = layout
        if t.transpose:
            if len(wshape) < 2:
                raise ValueError(f"names: leaf {label} is not an array of 2 or more axes to transpose")
            wshape = wshape[::-1]
        if (shape, dt) != (wshape, wdtype):
            hint = ""
            if dt == wdtype and shape == wshape[::-1] and len(shape) > 1:
                hint = (" (its transpose: nothing is transposed unless names= says so, "
                        "with epochal.jax.transposed(name))")
            raise BlobMismatchError(f"step {step}, leaf {label}: the checkpoint holds shape {shape} "
                                    f"dtype {dt}, the abstract pytree shape {wshape} dtype {wdtype}{hint}")
        return "array"
    if layout is not None:
        raise BlobMismatchError(f"step {step}, leaf {label}: the checkpoint holds an array "
                                f"{layout[1]} {layout[0]}, the abstract pytree a plain {type(want).__name__}")
    if t.transpose:
        raise ValueError(f"names: leaf {label} is a plain value, it cannot be transposed")
    return "plain"


def _sharding(want: Any) -> jax.sharding.Sharding:
    sh = getattr(want, "sharding", None)
    return sh if isinstance(sh, jax.sharding.Sharding) else jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _regions(src: Source, t: Target, ndim: int, indices: list[tuple[Any, ...]], chunk: int,
             run: Callable[[list[Task]], None]) -> list[np.ndarray]:
    """The regions ``indices`` of the leaf (of its transpose when stored transposed), checked,
    in aligned buffers (:func:`~.reads.aligned_empty`)."""
    key = src.key(t.names)
    if not t.transpose:
        return src.regions(key, t.label, indices, chunk, run)
    flipped = [(tuple(idx) + (slice(None),) * (ndim - len(idx)))[::-1] for idx in indices]
    out = []
    for stored in src.regions(key, t.label, flipped, chunk, run):
        mine = aligned_empty(stored.shape[::-1], stored.dtype)
        np.copyto(mine, stored.T)
        out.append(mine)
    return out


def _index_key(idx: Any) -> Any:
    return tuple((sl.start, sl.stop, sl.step) for sl in idx) if idx is not None else None


def _array(src: Source, t: Target, want: Any, chunk: int, pool: ThreadPoolExecutor) -> Any:
    """One array leaf for ``want``'s sharding: each distinct shard region read (every byte
    once, by the pool's threads, all checked before any becomes an array), then put on its
    devices. On a CPU device JAX adopts the aligned region buffer as it is (no copy), so the
    host memory of a restore is the arrays it returns plus each reading thread's scratch;
    a region that several devices hold (replicas) is copied for all but the first (each
    device owns its buffer)."""
    shape = tuple(want.shape)

    def run(tasks: list[Task]) -> None:
        for fut in [pool.submit(task) for task in tasks]:
            fut.result()

    if isinstance(want, np.ndarray):
        return _regions(src, t, len(shape), [()], chunk, run)[0]
    sharding = _sharding(want)
    wanted = sharding.addressable_devices_indices_map(shape)
    distinct = {_index_key(idx): idx or () for idx in wanted.values()}
    got = dict(zip(distinct, _regions(src, t, len(shape), list(distinct.values()), chunk, run)))
    placed: list[jax.Array] = []
    used: set[Any] = set()
    for dev, idx in wanted.items():
        key = _index_key(idx)
        buf = got[key]
        if key in used:
            buf = aligned_empty(buf.shape, buf.dtype)
            np.copyto(buf, got[key])
        used.add(key)
        placed.append(jax.device_put(buf, dev))
    got.clear()
    return jax.make_array_from_single_device_arrays(shape, sharding, placed)


def restore(path_or_checkpointer: str | os.PathLike[str] | Checkpointer, abstract_pytree: Any,
            step: int | None = None, *, chunk_bytes: int = DEFAULT_CHUNK, partial: bool = False,
            names: NameMap | None = None, storage_options: dict[str, Any] | None = None) -> Any:
    """The pytree of ``abstract_pytree``'s structure restored from ``step`` (None: the newest
    committed one) of a Checkpointer's directory: each ``jax.ShapeDtypeStruct`` or
    ``jax.Array`` leaf as a ``jax.Array`` of its shape, dtype and sharding (a struct without
    one: on this process's first device), each numpy array leaf as a numpy array, each other leaf as the
    stored plain value. Only the byte ranges of each shard are read, every range checked
    before use, with at most ``chunk_bytes`` (or one row) of scratch memory per reading
    thread (:data:`READ_THREADS`) beyond the arrays returned: on CPU devices the arrays
    are the buffers read into (no copy), so a restore's host memory is bounded by the
    arrays plus ``READ_THREADS * chunk_bytes``. ``names``: where each leaf is
    stored (:mod:`.mapping`; default: under its own names). ``storage_options``: fsspec's,
    for a URL directory (a Checkpointer's own hold for it).

    Raises, naming the leaf (``params/w``) and the step: MissingBlobError for a leaf the
    checkpoint lacks; BlobMismatchError for another shape or dtype, or for leaves the
    checkpoint holds that the abstract pytree lacks (``partial=True`` ignores those);
    CheckpointCorruptError for damaged bytes; CheckpointNotFoundError when there is no
    such committed step; ValueError or TypeError for a bad ``names``."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes!r}")
    if storage_options is not None and isinstance(path_or_checkpointer, Checkpointer):
        raise ValueError(f"epochal.jax.restore: storage_options are for a directory; a Checkpointer's own hold "
                         f"({path_or_checkpointer!r})")
    join_pending()  # this process's async save in flight is committed first
    t0 = time.perf_counter()
    order = _places(path_or_checkpointer, step, storage_options)
    for i, (at, place, directory) in enumerate(order):
        try:
            got, found = _restore(directory, at, abstract_pytree, chunk_bytes, partial, names, storage_options)
        except (CheckpointCorruptError, CheckpointNotFoundError) as ex:
            if i + 1 == len(order):
                raise
            logger.warning("The %s copy of step %s (%s) is damaged: %s; restoring from the %s copy of step %s "
                           "instead", place, at, directory, ex, order[i + 1][1], order[i + 1][0])
            continue
        if isinstance(path_or_checkpointer, Checkpointer):
            path_or_checkpointer.last_restore = RestoreReport(found, time.perf_counter() - t0, source=place)
        return got
    raise AssertionError("unreachable: _places returns at least one place")


def _restore(directory: str, step: int | None, abstract_pytree: Any, chunk_bytes: int, partial: bool,
             names: NameMap | None, storage_options: dict[str, Any] | None) -> tuple[Any, int]:
    """:func:`restore` from one directory; the pytree and the step restored."""
    leaves = flat_leaves(abstract_pytree)
    targets = map_leaves(leaves, keystrs(abstract_pytree), names)
    src, step = _step_source(directory, step, storage_options)
    try:
        keys = [src.key(t.names) for t in targets]
        have = set(src.keys())
        missing = [t.label for t, k in zip(targets, keys) if k not in have]
        if missing:
            raise MissingBlobError(f"step {step} ({src.path}) lacks the leaves " + ", ".join(missing))
        extra = sorted(leaf_label(k) for k in have - set(keys))
        if extra and not partial:
            raise BlobMismatchError(f"step {step} ({src.path}) holds leaves the abstract pytree lacks: "
                                    + ", ".join(extra) + " (restore(..., partial=True) leaves them out)")
        plans = [_fit(t, want, src, step) for t, (_, want) in zip(targets, leaves)]
        src.prefetch([k for k, plan in zip(keys, plans) if plan == "array"])
        values: list[Any] = []
        with ThreadPoolExecutor(READ_THREADS) as pool:
            for t, k, (_, want), plan in zip(targets, keys, leaves, plans):
                if plan == "array":
                    values.append(_array(src, t, want, chunk_bytes, pool))
                else:
                    values.append(src.plain(k, t.label))
    finally:
        src.close()
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract_pytree), values), step
