"""Background saves: take a snapshot now, write it on a thread of this process, join later.

A background save costs the training loop only the snapshot, a copy of the state in memory;
the write overlaps the next epoch. Two things decide how long that is and how fast the write
goes (issue 17.2):

- **Snapshot buffers reused across epochs** (as PyTorch DCP's caching stager does). Fresh
  memory for every snapshot costs a page fault per page on first touch (on this machine a
  copy into fresh memory takes 1.5-20x a copy into memory already touched). A
  :class:`SnapshotPool` keeps one *arena* (a single zeroed buffer holding every segment of
  a snapshot, 64-byte aligned: the layout of a native file's data area, placed so that a
  big file is written from it with O_DIRECT without a copy) per owner and layout (the segment sizes), and hands it out
  again when the next snapshot has the same layout, which a training state has from epoch to
  epoch. An arena is leased to the write that uses it and comes back only when that write
  ended (written or failed), so a write in flight never sees its bytes overwritten.
  ``max_host_bytes`` bounds the pooled arenas; a snapshot that would go over it, or whose
  arena is still being written, gets fresh memory that is freed once written (it never
  waits). By default the bound is one state's worth: the newest snapshot size of each owner.
- **A writer the training thread does not starve.** The write releases the GIL in its system
  calls and checksums, but takes it back between each 2 MiB piece; with the training thread
  running Python, each take waits up to the interpreter's switch interval (5 ms), which made
  background writes several times slower than a sync save (bench/RESULTS.md, "Background
  saves"). While a write is in flight the saver lowers the switch interval to
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
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ... import knobs
from ...errors import CheckpointError
from ...storage.encoding.codecs import Encoded, Frozen, copy_segments, encode
from ...storage.formats.base import get_db_type

__all__ = [
    "BackgroundSaver",
    "DEFAULT_SWITCH_INTERVAL",
    "SaveDone",
    "Snapshot",
    "SnapshotPool",
    "close_process_saver",
    "process_saver",
]

#: the switch interval (seconds) while a background write is in flight: the default of the
#: ``switch_interval`` knob (:mod:`epochal.knobs`), which a saver built without one follows
DEFAULT_SWITCH_INTERVAL = knobs.DEFAULT_SWITCH_INTERVAL
#: segments start at multiples of this in an arena (cache lines; aligned copies): the
#: native format's alignment, so an arena is laid out as a native file's data area
_ALIGN = 64
#: an arena's byte 0 sits this far past a page boundary: where a native file's data area
#: starts (its superblock is 64 bytes), so each page of the arena is a page of the file and
#: the O_DIRECT writer can write it from the arena's memory (storage/native/image.py)
_PAGE, _PAGE_SHIFT = 4096, 64


def _padded(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _arena_memory(nbytes: int) -> np.ndarray:
    """``nbytes`` zeroed bytes whose address is _PAGE_SHIFT past a page boundary (zeroed, so
    the padding between segments, which copies never write, is zero as in the file)."""
    raw = np.zeros(nbytes + _PAGE, dtype=np.uint8)
    at = (_PAGE_SHIFT - raw.ctypes.data) % _PAGE
    return raw[at : at + nbytes]


def arena_bytes(layout: tuple[int, ...]) -> int:
    """The bytes of an arena holding segments of these sizes (each 64-byte aligned)."""
    return sum(_padded(n) for n in layout)


class _Arena:
    """One buffer holding the segments of one snapshot, handed out front to back."""

    __slots__ = ("buffer", "busy", "layout", "owner", "pooled", "_at")

    def __init__(self, owner: str, layout: tuple[int, ...], pooled: bool) -> None:
        self.owner, self.layout, self.pooled = owner, layout, pooled
        self.buffer = _arena_memory(arena_bytes(layout))
        self.busy = False
        self._at = 0

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def rewind(self) -> None:
        self._at = 0

    def take(self, nbytes: int) -> memoryview:
        """The next ``nbytes`` of the arena (segments come in layout order)."""
        at = self._at
        self._at = at + _padded(nbytes)
        return memoryview(self.buffer[at : at + nbytes])  # type: ignore[arg-type]


class SnapshotPool:
    """Snapshot arenas reused across epochs, bounded by ``max_host_bytes`` (None: one state's
    worth, the newest snapshot size of each owner). See the module docstring.

    Counters (for tests and benches): :attr:`pooled_bytes` (arenas held), :attr:`reused`,
    :attr:`allocated` (new pooled arenas), :attr:`fresh` (snapshots in unpooled memory)."""

    def __init__(self, max_host_bytes: int | None = None) -> None:
        if max_host_bytes is not None and max_host_bytes < 0:
            raise ValueError(f"max_host_bytes must be >= 0 or None, got {max_host_bytes!r}")
        self.max_host_bytes = max_host_bytes
        self._arenas: list[_Arena] = []
        self._state_bytes: dict[str, int] = {}  # owner -> bytes of its newest snapshot
        self._lock = threading.Lock()
        self.reused = self.allocated = self.fresh = 0

    @property
    def pooled_bytes(self) -> int:
        """Bytes of the arenas the pool holds (leased or free)."""
        with self._lock:
            return sum(a.nbytes for a in self._arenas)

    @property
    def limit(self) -> int:
        """The bound in force: ``max_host_bytes``, or the sum of each owner's newest snapshot."""
        if self.max_host_bytes is not None:
            return self.max_host_bytes
        return sum(self._state_bytes.values())

    def lease(self, owner: str, layout: tuple[int, ...]) -> _Arena:
        """An arena for a snapshot of ``layout`` (segment sizes, in order), marked busy: a free
        pooled one of that layout, else a new pooled one when the bound allows (after freeing
        this owner's arenas of other layouts and any idle arena over the bound), else fresh
        unpooled memory."""
        need = arena_bytes(layout)
        with self._lock:
            self._state_bytes[owner] = need
            for arena in self._arenas:
                if arena.owner == owner and arena.layout == layout and not arena.busy:
                    arena.busy = True
                    arena.rewind()
                    self.reused += 1
                    return arena
            # this owner's state changed shape: its idle arenas of other layouts are stale
            self._arenas = [a for a in self._arenas if a.busy or a.owner != owner]
            limit = self.limit
            held = sum(a.nbytes for a in self._arenas)
            if held + need > limit:  # drop idle arenas of other owners, oldest first
                keep = []
                for a in self._arenas:
                    if not a.busy and held + need > limit:
                        held -= a.nbytes
                    else:
                        keep.append(a)
                self._arenas = keep
            pooled = held + need <= limit
            arena = _Arena(owner, layout, pooled)
            arena.busy = True
            if pooled:
                self._arenas.append(arena)
                self.allocated += 1
            else:
                self.fresh += 1
            return arena

    def release(self, arena: _Arena) -> None:
        """The write of ``arena`` ended: it may be handed out again."""
        with self._lock:
            arena.busy = False

    def clear(self) -> None:
        """Free every idle arena and forget the state sizes (leased ones stay until released;
        :meth:`BackgroundSaver.close` waits for their writes first)."""
        with self._lock:
            self._arenas = [a for a in self._arenas if a.busy]
            self._state_bytes.clear()


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

    @property
    def switch_interval(self) -> float | None:
        """The switch interval in force while a write is in flight (None: left alone)."""
        return knobs.get().switch_interval if self._switch.interval == "knob" else self._switch.interval

    @switch_interval.setter
    def switch_interval(self, value: float | None) -> None:
        self._switch.interval = value

    @property
    def running(self) -> bool:
        """True while the writer thread exists (between the first save and :meth:`close`)."""
        return self._executor is not None

    def pending(self, db: str) -> bool:
        """True when a background write of ``db`` was started and not joined."""
        return db in self._pending

    def snapshot(self, owner: str, blobs: Mapping[str, Any]) -> Snapshot:
        """Encode every blob (UnsupportedBlobError naming it before anything is copied) and
        copy the segments into an arena of the pool. ``owner``: whose state this is (a node
        and its checkpoint location), so each state's arena is found again next epoch."""
        started = time.perf_counter_ns()
        encoded: dict[str, Encoded] = {name: encode(value, name) for name, value in blobs.items()}
        layout = tuple(s.nbytes for enc in encoded.values() for s in enc.segments)
        arena = self.pool.lease(owner, layout)
        try:
            frozen = {name: Frozen.of(copy_segments(enc, arena.take)) for name, enc in encoded.items()}
        except BaseException:
            self.pool.release(arena)
            raise
        return Snapshot(frozen, sum(layout), started, time.perf_counter_ns() - started, arena)

    def start(self, db: str, db_type: str, snap: Snapshot) -> None:
        """Write ``snap`` to ``db`` on the writer thread; :meth:`join` waits for it."""
        with self._lock:
            if db in self._pending:
                self.pool.release(snap.arena)
                raise CheckpointError(f"checkpoint {db}: a background save of it is still running")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epochal-save")
            self._switch.enter()
            try:
                # in the caller's context: the write reaches a URL with its step's Location
                future = self._executor.submit(contextvars.copy_context().run, self._write, db_type, db, snap)
            except BaseException:
                self._switch.exit()
                self.pool.release(snap.arena)
                raise
            self._pending[db] = (future, snap)

    def _write(self, db_type: str, db: str, snap: Snapshot) -> SaveDone:
        start = time.perf_counter_ns()
        try:
            nbytes = int(get_db_type(db_type).write(db, snap.blobs))
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
