"""``save`` and ``restore`` of a pytree, through a :class:`~epochal.Checkpointer` directory.

A save is a Checkpointer save of the pytree as nested dicts (:mod:`.names`) of host tensors
(:mod:`.host`), so retention, async saves, URLs and the commit protocol are the
Checkpointer's. A restore opens the step's one db (committed, size and digest checked
against its manifest) and builds each array leaf with ``jax.make_array_from_callback`` for
the abstract leaf's sharding, each shard's region read and checked by :mod:`.reads`; the
distinct regions of one leaf are read by a few threads at once. Nothing is returned unless
every leaf was found, fit and checked.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from ..checkpoint.location.view import CheckpointDirectory
from ..checkpointer import Checkpointer
from ..checkpointer.parts import NODE
from ..errors import BlobMismatchError, CheckpointError, CheckpointNotFoundError, MissingBlobError
from ..storage.formats.native.layout import corrupt
from ..storage.formats.native.ranges import RangedFile
from .host import to_host
from .names import flat_leaves, leaf_label, nest
from .reads import DEFAULT_CHUNK, Stored, array_layout, read_plain, read_region, stored_leaves

__all__ = ["DEFAULT_CHUNK", "restore", "save"]

#: threads reading the regions of one leaf at once
READ_THREADS = 4


def save(path_or_checkpointer: str | os.PathLike[str] | Checkpointer, step: int, pytree: Any, *,
         metrics: Mapping[str, float] | None = None) -> None:
    """Save ``pytree`` (a container of ``jax.Array`` leaves, sharded or not, numpy arrays and
    plain values) as checkpoint ``step`` of a Checkpointer, or of a directory (a
    Checkpointer is opened for this one save). Each array's shards with ``replica_id == 0``
    are copied to host once; see :mod:`epochal.jax`."""
    state = nest(to_host(flat_leaves(pytree)))
    if isinstance(path_or_checkpointer, Checkpointer):
        path_or_checkpointer.save(step, state, metrics=metrics)
        return
    with Checkpointer(path_or_checkpointer, progress=False) as ckpt:
        ckpt.save(step, state, metrics=metrics)


def _step_db(path_or_checkpointer: str | os.PathLike[str] | Checkpointer, step: int | None) -> tuple[str, int]:
    if isinstance(path_or_checkpointer, Checkpointer):
        path_or_checkpointer.wait()  # a pending async save is committed first
        directory: str = path_or_checkpointer.directory
    else:
        directory = os.fspath(path_or_checkpointer)
    view = CheckpointDirectory(directory)
    if step is None:
        found = view.newest_committed()
        if found is None:
            raise CheckpointNotFoundError(f"{directory}: no committed step to restore")
        step = found[0]
    elif not view.is_committed(step):
        raise CheckpointNotFoundError(f"{directory}: step {step} is not committed")
    view.require_intact(step, "quick", nodes=[NODE], word="step")
    return view.db_path(NODE, step), step


def _fit(names: tuple[str, ...], want: Any, s: Stored, step: int, path: str) -> str:
    """What the abstract leaf ``want`` asks of stored ``s``: "array" or "plain";
    BlobMismatchError naming the leaf and step when they do not fit."""
    label = leaf_label(names)
    try:
        layout = array_layout(s)
    except ValueError as e:
        raise corrupt(path, f"leaf {label}: {e}", s.blob) from None
    if isinstance(want, (jax.ShapeDtypeStruct, jax.Array, np.ndarray)):
        wshape, wdtype = tuple(want.shape), np.dtype(want.dtype)
        if layout is None:
            raise BlobMismatchError(f"step {step}, leaf {label}: the checkpoint holds a {s.kind} value, "
                                    f"the abstract pytree an array {wshape} {wdtype}")
        dt, shape = layout
        if (shape, dt) != (wshape, wdtype):
            raise BlobMismatchError(f"step {step}, leaf {label}: the checkpoint holds shape {shape} "
                                    f"dtype {dt}, the abstract pytree shape {wshape} dtype {wdtype}")
        return "array"
    if layout is not None:
        raise BlobMismatchError(f"step {step}, leaf {label}: the checkpoint holds an array "
                                f"{layout[1]} {layout[0]}, the abstract pytree a plain {type(want).__name__}")
    return "plain"


def _sharding(want: Any) -> jax.sharding.Sharding:
    sh = getattr(want, "sharding", None)
    return sh if isinstance(sh, jax.sharding.Sharding) else jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _array(f: RangedFile, s: Stored, label: str, want: Any, chunk: int, pool: ThreadPoolExecutor) -> Any:
    shape = tuple(want.shape)
    if isinstance(want, np.ndarray):
        return read_region(f, s, label, (), chunk)
    sharding = _sharding(want)
    wanted = sharding.addressable_devices_indices_map(shape)
    regions: dict[Any, Any] = {}
    for idx in wanted.values():
        key = tuple((sl.start, sl.stop, sl.step) for sl in idx) if idx is not None else None
        if key not in regions:
            regions[key] = pool.submit(read_region, f, s, label, idx or (), chunk)
    got = {k: fut.result() for k, fut in regions.items()}  # every region checked first

    def cb(idx: Any) -> np.ndarray:
        return got[tuple((sl.start, sl.stop, sl.step) for sl in idx) if idx is not None else None]

    try:
        return jax.make_array_from_callback(shape, sharding, cb)
    finally:
        got.clear()


def restore(path_or_checkpointer: str | os.PathLike[str] | Checkpointer, abstract_pytree: Any,
            step: int | None = None, *, chunk_bytes: int = DEFAULT_CHUNK, partial: bool = False) -> Any:
    """The pytree of ``abstract_pytree``'s structure restored from ``step`` (None: the newest
    committed one) of a Checkpointer's directory: each ``jax.ShapeDtypeStruct`` or
    ``jax.Array`` leaf as a ``jax.Array`` of its shape, dtype and sharding (a struct without
    one: on the first device), each numpy array leaf as a numpy array, each other leaf as the
    stored plain value. Only the byte ranges of each shard are read, every range checked
    before use, with at most ``chunk_bytes`` (or one 4 MiB block, or one row) of scratch
    memory per reading thread beyond the arrays returned.

    Raises, naming the leaf (``params/w``) and the step: MissingBlobError for a leaf the
    checkpoint lacks; BlobMismatchError for another shape or dtype, or for leaves the
    checkpoint holds that the abstract pytree lacks (``partial=True`` ignores those);
    CheckpointCorruptError for damaged bytes; CheckpointNotFoundError when there is no
    such committed step."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes!r}")
    leaves = flat_leaves(abstract_pytree)
    path, step = _step_db(path_or_checkpointer, step)
    with RangedFile(path) as f:
        stored = stored_leaves(f)
        wanted = {names for names, _ in leaves}
        missing = [leaf_label(n) for n, _ in leaves if n not in stored]
        if missing:
            raise MissingBlobError(f"step {step} ({path}) lacks the leaves " + ", ".join(missing))
        extra = sorted(leaf_label(n) for n in stored if n not in wanted)
        if extra and not partial:
            raise BlobMismatchError(f"step {step} ({path}) holds leaves the abstract pytree lacks: "
                                    + ", ".join(extra) + " (restore(..., partial=True) leaves them out)")
        plans = [_fit(names, want, stored[names], step, path) for names, want in leaves]
        values: list[Any] = []
        with ThreadPoolExecutor(READ_THREADS) as pool:
            for (names, want), plan in zip(leaves, plans):
                s = stored[names]
                if plan == "array":
                    values.append(_array(f, s, leaf_label(names), want, chunk_bytes, pool))
                    continue
                try:
                    values.append(read_plain(f, s))
                except (ValueError, TypeError) as e:
                    if isinstance(e, CheckpointError):
                        raise
                    raise corrupt(path, f"leaf {leaf_label(names)}: {e}", s.blob) from None
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract_pytree), values)
