"""The steps that checkpoint tasks run on a node's workspace.

Each is a small picklable object (not a closure), so a multi-machine session can ship it to
the node's own process and run it there, next to that node's workspace and disk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import CheckpointError, CheckpointNotFoundError, MissingBlobError
from ..storage.base import ReadStats, get_db_type
from ..storage.codecs import LOAD_OPTIONS

logger = logging.getLogger("epochal")

#: Blobs under this prefix are epochal's own bookkeeping (timers, sizes) and never checkpointed.
INTERNAL_PREFIX = "__epochal__/"


class GetBlobNames:
    """Store the sorted names of the workspace's own blobs (not a parent's) in ``output``."""

    def __init__(self, output: str) -> None:
        self.output = output

    def __call__(self, ws: Any) -> int:
        names = [n for n in ws.blobs if not n.startswith(INTERNAL_PREFIX)]
        if self.output not in names:
            names = sorted([*names, self.output])
        ws[self.output] = np.array(names, dtype=str)
        return 0


class LoadBlobs:
    """Load ``names`` (all listed in the db when None) from one db into the workspace.

    Live objects already in the workspace are passed to the codecs, which restore them in place
    (torch tensors, modules, optimizers); everything is verified before anything is restored.
    """

    def __init__(
        self,
        db: str,
        db_type: str,
        names: Sequence[str] | None,
        *,
        node: str,
        epoch: int,
        allow_incomplete: bool = False,
        keep_device: bool = False,
        map_location: Any = None,
        verify: bool = True,
    ) -> None:
        self.db, self.db_type = db, db_type
        self.names = list(names) if names is not None else None
        self.node, self.epoch = node, epoch
        self.allow_incomplete, self.keep_device = allow_incomplete, keep_device
        self.map_location, self.verify = map_location, verify

    def __call__(self, ws: Any) -> int:
        backend = get_db_type(self.db_type)
        if not backend.exists(self.db):
            raise CheckpointNotFoundError(
                f"checkpoint {self.db} (node {self.node!r}, epoch {self.epoch}) does not exist"
            )
        names = self.names
        existing = {n: ws[n] for n in (names or []) if n in ws}
        stats = ReadStats()
        opts = {"keep_device": self.keep_device, "map_location": self.map_location}
        token = LOAD_OPTIONS.set(opts)
        try:
            values = backend.read(
                self.db, names, allow_incomplete=self.allow_incomplete, existing=existing,
                verify=self.verify, stats=stats,
            )
        finally:
            LOAD_OPTIONS.reset(token)
        for name, value in values.items():
            ws[name] = value
        return stats.nbytes


class SaveBlobs:
    """Save ``names`` from the workspace to one db (created or replaced, atomically)."""

    def __init__(self, db: str, db_type: str, names: Sequence[str], *, node: str, epoch: int) -> None:
        self.db, self.db_type, self.names = db, db_type, list(names)
        self.node, self.epoch = node, epoch

    def _gather(self, ws: Any) -> dict[str, Any]:
        """The listed blobs, in list order; an error naming the first one missing."""
        if not self.names:
            raise CheckpointError(f"checkpoint {self.db}: nothing to save (empty blob list)")
        blobs: dict[str, Any] = {}
        for name in self.names:
            if name not in ws:
                raise MissingBlobError(
                    f"blob {name!r} of the blob list of node {self.node!r} is not in its workspace "
                    f"(saving {self.db}, epoch {self.epoch})"
                )
            blobs[name] = ws[name]
        return blobs

    def __call__(self, ws: Any) -> int:
        return int(get_db_type(self.db_type).write(self.db, self._gather(ws)))


class DbExists:
    """Set ``output`` to whether the db can be opened for reading."""

    def __init__(self, db: str, db_type: str, output: str) -> None:
        self.db, self.db_type, self.output = db, db_type, output

    def __call__(self, ws: Any) -> int:
        ws[self.output] = np.bool_(False)
        ws[self.output] = np.bool_(get_db_type(self.db_type).exists(self.db))
        return 0


class Timed:
    """Run ``op`` and record its duration (a 1-element int64 array of ns) and bytes moved."""

    def __init__(self, op: Any, ns_blob: str, bytes_blob: str) -> None:
        self.op, self.ns_blob, self.bytes_blob = op, ns_blob, bytes_blob
        self.name = getattr(op, "name", type(op).__name__)

    def __call__(self, ws: Any) -> None:
        start = time.perf_counter_ns()
        nbytes = self.op(ws)
        ws[self.ns_blob] = np.array([time.perf_counter_ns() - start], dtype=np.int64)
        ws[self.bytes_blob] = np.int64(nbytes or 0)


# ---------------------------------------------------------------- background saves
class _Pending:
    """A background write of one db: its future and when its snapshot started."""

    def __init__(self, future: Any, started_ns: int) -> None:
        self.future, self.started_ns = future, started_ns


_pending: dict[str, _Pending] = {}  # db path -> its write in flight, in this (node's) process
_executor: Any = None


def _write_in_background(db_type: str, db: str, blobs: dict[str, Any]) -> tuple[int, int]:
    nbytes = int(get_db_type(db_type).write(db, blobs))
    return nbytes, time.perf_counter_ns()


class SnapshotAndSave(SaveBlobs):
    """Snapshot the blobs now (encoded and copied: later updates can't reach them) and write
    them on a background thread of this node's process; :class:`JoinSave` waits for it.

    The snapshot costs a copy of the checkpoint in memory; the write overlaps the next epoch.
    """

    def __call__(self, ws: Any) -> int:
        global _executor
        from concurrent.futures import ThreadPoolExecutor

        from ..storage.codecs import Frozen

        started = time.perf_counter_ns()
        if self.db in _pending:
            raise CheckpointError(f"checkpoint {self.db}: a background save of it is still running")
        frozen = {name: Frozen(value, name) for name, value in self._gather(ws).items()}
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epochal-save")
        _pending[self.db] = _Pending(_executor.submit(_write_in_background, self.db_type, self.db, frozen), started)
        return sum(f.nbytes for f in frozen.values())


class JoinSave:
    """Wait for the background save of ``db``; record its whole duration (snapshot to durable
    file) and bytes like a synchronous save's; re-raise its error."""

    def __init__(self, db: str, ns_blob: str, bytes_blob: str) -> None:
        self.db, self.ns_blob, self.bytes_blob = db, ns_blob, bytes_blob
        self.name = "checkpoint_save"

    def __call__(self, ws: Any) -> None:
        pending = _pending.pop(self.db, None)
        if pending is None:
            raise CheckpointError(f"checkpoint {self.db}: no background save is pending")
        nbytes, done_ns = pending.future.result()
        ws[self.ns_blob] = np.array([done_ns - pending.started_ns], dtype=np.int64)
        ws[self.bytes_blob] = np.int64(nbytes)
