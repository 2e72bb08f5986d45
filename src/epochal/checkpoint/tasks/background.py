"""Background saves: take a snapshot now, write it on a thread of this process, join later.

A background save costs the training loop only the snapshot, a copy of the state in memory;
the write overlaps the next epoch. Two things decide how long that is and how fast the write
goes:

- **Snapshot memory**: arenas pooled per owner, reused, prepared off the training thread,
  a second one while a write is in flight (:mod:`.arenas`).
- **A writer the training thread does not starve.** The write releases the GIL in its system
  calls and checksums, but takes it back between each 2 MiB piece; with the training thread
  running Python, each take waits up to the interpreter's switch interval (5 ms), which made
  background writes several times slower than a sync save (bench/RESULTS.md, "bench_async.py:
  background saves"). While a write is in flight the saver lowers the switch interval to
  ``switch_interval`` (0.5 ms; the knob of that name, :mod:`epochal.knobs`) and puts it back
  after the last one.

State is per process: :func:`process_saver` gives this process's :class:`BackgroundSaver`
(the steps in :mod:`.steps` use it from whichever node process runs them);
:meth:`BackgroundSaver.close` shuts its thread down and frees the pool; the runner calls
:func:`close_process_saver` when ``train`` ends, and an ``atexit`` hook closes what is left.
"""

from __future__ import annotations

import atexit
import contextvars
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from ... import knobs
from ...errors import CheckpointError
from ...storage.encoding.codecs import Encoded, Frozen, copy_segments, encode
from ...storage.encoding.staged import staging_scope
from ...storage.formats.base import get_db_type
from .arenas import SnapshotPool, arena_bytes

__all__ = [
    "BackgroundSaver",
    "DEFAULT_SWITCH_INTERVAL",
    "SaveDone",
    "Snapshot",
    "SnapshotPool",
    "arena_bytes",
    "close_process_saver",
    "process_saver",
]

#: the switch interval (seconds) while a background write is in flight: the default of the
#: ``switch_interval`` knob (:mod:`epochal.knobs`), which a saver built without one follows
DEFAULT_SWITCH_INTERVAL = knobs.DEFAULT_SWITCH_INTERVAL
#: writes a db's blobs, returns the bytes written (a backend's ``write``)
Writer = Callable[[str, Mapping[str, Any]], int]


@dataclass
class Snapshot:
    """The blobs of one save, encoded and copied (a :class:`Frozen` each), ready to write."""

    blobs: dict[str, Frozen]
    nbytes: int
    started_ns: int
    snapshot_ns: int
    arena: Any = field(default=None, repr=False)


@dataclass(frozen=True)
class SaveDone:
    """What a finished background write reports: its bytes, when the snapshot began, when the
    file was durable, and how long the snapshot and the write itself took."""

    nbytes: int
    started_ns: int
    done_ns: int
    snapshot_ns: int
    write_ns: int


class _Switch:
    """Lowers the interpreter's switch interval while writes are in flight (see the module
    docstring) and puts the old value back after the last one, unless someone changed it."""

    def __init__(self, interval: float | None | Literal["knob"]) -> None:
        self.interval = interval  # "knob": the switch_interval knob's value at each first write
        self._count = 0
        self._old: float | None = None
        self._set = 0.0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self._count += 1
            interval = knobs.get().switch_interval if self.interval == "knob" else self.interval
            if self._count == 1 and interval is not None and sys.getswitchinterval() > interval:
                self._old = sys.getswitchinterval()
                sys.setswitchinterval(interval)
                self._set = sys.getswitchinterval()

    def exit(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count == 0 and self._old is not None:
                if sys.getswitchinterval() == self._set:  # nobody changed it meanwhile
                    sys.setswitchinterval(self._old)
                self._old = None


class BackgroundSaver:
    """The background saves of one process: a snapshot pool, one writer thread, the writes in
    flight by db path. ``max_host_bytes``: see :class:`SnapshotPool`; ``switch_interval``: see
    the module docstring (None: leave the interpreter's alone)."""

    def __init__(self, *, max_host_bytes: int | None = None,
                 switch_interval: float | None | Literal["knob"] = "knob") -> None:
        self.pool = SnapshotPool(max_host_bytes)
        self._switch = _Switch(switch_interval)
        #: reports of the newest writes joined, oldest first (for benches and diagnostics)
        self.recent: deque[SaveDone] = deque(maxlen=64)
        self._pending: dict[str, tuple[Future[SaveDone], Snapshot]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        #: saves written synchronously because a snapshot would not fit ``max_host_bytes``
        self.synchronous = 0

    @property
    def switch_interval(self) -> float | None:
        """The switch interval in force while a write is in flight (None: left alone)."""
        return knobs.get().switch_interval if self._switch.interval == "knob" else self._switch.interval

    @switch_interval.setter
    def switch_interval(self, value: float | None) -> None:
        self._switch.interval = value

    @property
    def running(self) -> bool:
        """True while the writer thread exists (from the first save or :meth:`prepare` to
        :meth:`close`)."""
        return self._executor is not None

    def busy(self) -> bool:
        """True while a background write started here has not ended (joined or not)."""
        with self._lock:
            return any(not future.done() for future, _ in self._pending.values())

    def pending(self, db: str) -> bool:
        """True when a background write of ``db`` was started and not joined."""
        return db in self._pending

    def snapshot(self, owner: str, blobs: Mapping[str, Any]) -> Snapshot:
        """Encode every blob (UnsupportedBlobError naming it before anything is copied) and
        copy the segments into an arena of the pool. ``owner``: whose state this is (a node
        and its checkpoint location), so each state's arena is found again next epoch."""
        started = time.perf_counter_ns()
        # segments an encoder copied already (a CUDA tensor's, in pinned host memory) are kept
        # as they are, out of the arena; their device copies land by own.settle()
        with staging_scope() as own:
            encoded: dict[str, Encoded] = {name: encode(value, name) for name, value in blobs.items()}
        try:
            nbytes = sum(s.nbytes for enc in encoded.values() for s in enc.segments)
            layout = tuple(s.nbytes for enc in encoded.values() for s in enc.segments if not own.has(s))
            if not self.pool.fits(owner, layout):
                # a copy would break max_host_bytes: no snapshot; :meth:`start` writes the live
                # state's segments at once, on this thread, once no other write holds memory
                self.pool.wait_idle()
                self.synchronous += 1
                return Snapshot({n: Frozen.of(enc) for n, enc in encoded.items()}, nbytes, started,
                                time.perf_counter_ns() - started, None)
            arena = self.pool.lease(owner, layout)
            try:
                frozen = {name: Frozen.of(copy_segments(enc, arena.take, own.has)) for name, enc in encoded.items()}
            except BaseException:
                self.pool.release(arena)
                raise
        finally:
            own.settle()  # (after the host copies: the device's ran alongside them)
        return Snapshot(frozen, nbytes, started, time.perf_counter_ns() - started, arena)

    def prepare(self, owner: str, blobs: Mapping[str, Any], arenas: int = 1) -> int:
        """Have ``arenas`` arenas for snapshots of ``blobs`` ready in the pool and faulted in
        on a thread now (see :meth:`SnapshotPool.prepare`), e.g. as a job with background
        saves starts, so that even its first snapshot copies into warm memory; the writer
        thread is started now too, so the first save's :meth:`start` only hands it the write.
        Nothing is copied; UnsupportedBlobError names a blob no codec takes. Returns the
        arenas queued."""
        with staging_scope() as own:  # (a state's device tensors need no arena: see snapshot)
            encoded = [encode(value, name) for name, value in blobs.items()]
        own.settle()
        layout = tuple(s.nbytes for enc in encoded for s in enc.segments if not own.has(s))
        del encoded
        queued = self.pool.prepare(owner, layout, arenas)
        with self._lock:
            self._writer().submit(int)  # the thread starts now and idles until the first write
        return queued

    def _writer(self) -> ThreadPoolExecutor:
        """(Lock held.) The writer thread's executor, created on first use."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epochal-save")
        return self._executor

    def start(self, db: str, db_type: str, snap: Snapshot, write: Writer | None = None) -> None:
        """Write ``snap`` to ``db`` on the writer thread; :meth:`join` waits for it. A snapshot
        without an arena (it did not fit ``max_host_bytes``: it holds the live state's own
        segments) is written here, before this returns. ``write(db, blobs)``: how (None: the
        db type's write; an incremental save passes its own)."""
        write = write or get_db_type(db_type).write
        if snap.arena is None:
            self._start_synchronous(db, write, snap)
            return
        with self._lock:
            if db in self._pending:
                self.pool.release(snap.arena)
                raise CheckpointError(f"checkpoint {db}: a background save of it is still running")
            executor = self._writer()
            self._switch.enter()
            try:
                self.pool.writing(snap.arena)
                # in the caller's context: the write reaches a URL with its step's Location
                future = executor.submit(contextvars.copy_context().run, self._write, write, db, snap)
            except BaseException:
                self._switch.exit()
                self.pool.release(snap.arena)
                raise
            self._pending[db] = (future, snap)

    def _start_synchronous(self, db: str, write: Writer, snap: Snapshot) -> None:
        """Write a snapshot that holds the live state's segments now, on this thread (its
        error is raised by :meth:`join`, as a background write's)."""
        if self.pending(db):
            raise CheckpointError(f"checkpoint {db}: a background save of it is still running")
        done: Future[SaveDone] = Future()
        try:
            start = time.perf_counter_ns()
            nbytes = int(write(db, snap.blobs))
            end = time.perf_counter_ns()
            done.set_result(SaveDone(nbytes, snap.started_ns, end, snap.snapshot_ns, end - start))
        except Exception as ex:
            done.set_exception(ex)
        with self._lock:
            self._pending[db] = (done, snap)

    def _write(self, write: Writer, db: str, snap: Snapshot) -> SaveDone:
        start = time.perf_counter_ns()
        try:
            nbytes = int(write(db, snap.blobs))
        finally:
            self.pool.release(snap.arena)
            self._switch.exit()
        done = time.perf_counter_ns()
        return SaveDone(nbytes, snap.started_ns, done, snap.snapshot_ns, done - start)

    def join(self, db: str) -> SaveDone:
        """Wait for the background write of ``db`` and return its report; re-raise its error.
        CheckpointError when none is pending."""
        with self._lock:
            entry = self._pending.pop(db, None)
        if entry is None:
            raise CheckpointError(f"checkpoint {db}: no background save is pending")
        done = entry[0].result()
        self.recent.append(done)
        return done

    def close(self) -> None:
        """Wait for the writes in flight (their errors stay with their futures: a later
        :meth:`join` still raises them), shut the writer thread down and free the pool."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self.pool.clear()


class _ProcessSavers:
    """This process's saver, created on first use; a forked child starts its own."""

    def __init__(self) -> None:
        self.pid = -1
        self.saver: BackgroundSaver | None = None
        self.lock = threading.Lock()

    def get(self) -> BackgroundSaver:
        with self.lock:
            if self.saver is None or self.pid != os.getpid():
                self.saver, self.pid = BackgroundSaver(), os.getpid()
            return self.saver

    def close(self, *, if_idle: bool = False) -> None:
        with self.lock:
            saver = self.saver if self.pid == os.getpid() else None
        if saver is not None and not (if_idle and saver._pending):
            saver.close()


_SAVERS = _ProcessSavers()
atexit.register(_SAVERS.close)


def process_saver() -> BackgroundSaver:
    """The :class:`BackgroundSaver` of this (node's) process."""
    return _SAVERS.get()


def close_process_saver(*, if_idle: bool = True) -> None:
    """Shut this process's writer thread down and free its snapshot pool (``if_idle``: only
    when no background write is waiting to be joined). A later save starts them again."""
    _SAVERS.close(if_idle=if_idle)
