"""Snapshot arenas: the memory a background save copies the state into, pooled and reused.

A background save's snapshot is a copy of the state in memory; how long it blocks the loop
is mostly how warm that memory is (:mod:`.background` takes the snapshot and writes it):

- **Snapshot buffers reused across epochs** (as PyTorch DCP's caching stager does). Fresh
  memory for every snapshot costs a page fault per page on first touch (on this machine a
  copy into fresh memory takes 1.5-20x a copy into memory already touched). A
  :class:`SnapshotPool` keeps *arenas* (a single zeroed buffer holding every segment of a
  snapshot, 64-byte aligned: the layout of a native file's data area, placed so that the
  file is written from it with O_DIRECT without a copy) per owner, and hands one out again
  to the owner's next snapshot whose layout (the segment sizes) fits its capacity; when the
  layout changed, only the new padding is zeroed (it may hold the old segments' bytes, and
  the zero-copy write needs it zero, as in the file). An arena is leased to the write that
  uses it and comes back only when that write ended (written or failed), so a write in
  flight never sees its bytes overwritten.
- **When the write outlasts the step**. The JobRunner and the Checkpointer join
  the write in flight before they take the next snapshot, so the arena is free again by
  then and what the loop waits for is the write itself: with 0.3 s epochs and a 256 MiB
  state it was the buffered write (copy into new page-cache pages, writeback) that
  outlasted the epoch, not the snapshot (the pool's counters: one arena, reused every
  epoch, nothing fresh). Hence the write of an arena goes O_DIRECT straight from its memory
  from ``tuning.DIRECT_MIN_PINNED`` (16 MiB) on, not only from DIRECT_MIN (512 MiB): 0.40x
  the write's time, 0.28x the wait (bench/RESULTS.md, "bench_async.py"). Where the disk is still
  slower than the cadence no policy avoids the wait without dropping saves: writes are
  serial on the disk, so a queue of snapshots only grows. The policy for a snapshot taken
  while the owner's arena is being written (a caller that snapshots before it joins):
  **a second arena** when ``max_host_bytes`` allows (the default bound is two arenas per
  owner, ``SnapshotPool.ARENAS``): the next snapshot neither waits for nor faults in fresh
  memory behind the write in flight, and the peak host memory is what a fresh copy would
  take anyway (a second copy must exist while the first is written); it stays pooled, so
  it is faulted in once. A caller that joins first never needs it and never gets it (the
  pool allocates on demand), so its extra memory stays one state. When the bound allows no
  further arena, the snapshot **waits** for the owner's write in flight to end and reuses
  its arena: host memory stays within ``max_host_bytes``, and that write is what the next
  save would wait for anyway. A state bigger than the bound alone is not copied: the saver
  writes it synchronously from the live state once no write holds memory
  (:meth:`SnapshotPool.fits`), so the bound holds whatever the state.
- **Arenas faulted in off the training thread.** :meth:`BackgroundSaver.prepare` (and
  :meth:`SnapshotPool.prepare`) allocates the arenas a state will need and has a thread
  fault them in (``madvise(MADV_POPULATE_WRITE)``, the GIL released; else a zero written per
  page), a step of 8 MiB at a time, from the arena's end to its front. A loop that calls
  it as its background saves start (its first snapshot then copies into warm memory) pays
  no first-touch fault on its training thread at all; :meth:`SnapshotPool.wait_warm` waits
  for the warmer. A snapshot that
  leases an arena still being warmed (a new JobRunner run prepares right before its init
  save) does **not** stop the warmer when it faults in with madvise, which never changes a
  byte: the warmer keeps faulting pages in from the back while the copy goes
  front to back on another core, faulting in what the warmer has not reached; they meet in
  the middle, so the first-touch faults are shared between two cores instead of all paid
  on the training thread. Only the zero-writing fallback is stopped (and waited for)
  before a copy.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from typing import Any

import numpy as np

__all__ = ["SnapshotPool", "arena_bytes"]

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


#: pages pre-faulted per step of the warmer (a lease waits at most for one step)
_WARM_STEP = 8 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable, contents unchanged


def _populate(view: np.ndarray) -> bool:
    """Fault in every page of ``view`` without changing a byte: one
    ``madvise(MADV_POPULATE_WRITE)``, the GIL released. False where the kernel lacks it (the
    warmer then writes a zero per page of fresh, zeroed memory, while nothing copies there)."""
    if not view.nbytes:
        return True
    addr = view.ctypes.data
    lo = addr - addr % _PAGE
    n = addr + view.nbytes - lo
    libc = _libc()
    return libc is not None and libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(n), _MADV_POPULATE_WRITE) == 0


_LIBC: list[Any] = []


def _libc() -> Any:
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


class _Arena:
    """One buffer holding the segments of one snapshot, handed out front to back.

    ``capacity``: its bytes; ``layout``: the segment sizes of its newest snapshot (a later
    snapshot of another layout may reuse it when that fits: :meth:`refit`). ``busy``: leased;
    ``writing``: its write was started (a lease may wait for that to end); ``cold``: the
    bytes at its front the warmer has not faulted in yet (it goes from the back, so that a
    copy that leases it mid-way, front to back, meets it in the middle; 0 once a copy went
    through it)."""

    __slots__ = ("buffer", "busy", "layout", "owner", "pooled", "writing", "cold", "warming", "_at")

    def __init__(self, owner: str, layout: tuple[int, ...], pooled: bool, capacity: int | None = None) -> None:
        self.owner, self.layout, self.pooled = owner, layout, pooled
        self.buffer = _arena_memory(max(capacity or 0, arena_bytes(layout)))
        self.busy = self.writing = self.warming = False
        self.cold = self.nbytes
        self._at = 0

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def rewind(self) -> None:
        self._at = 0

    def refit(self, layout: tuple[int, ...]) -> None:
        """Lay ``layout`` out in this arena (it fits): zero its padding, which may hold bytes of
        the old layout's segments (the O_DIRECT writer writes from here only where every padding
        byte is zero, as in the file: storage/native/image.py); segment bytes are all copied."""
        n = np.asarray(layout, dtype=np.int64)
        if len(n):
            padded = (n + _ALIGN - 1) // _ALIGN * _ALIGN
            pad = padded - n
            has = np.flatnonzero(pad)
            if len(has):
                ends = (np.cumsum(padded) - pad)[has]  # where each padding run starts
                p = pad[has]
                idx = np.repeat(ends - (np.cumsum(p) - p), p) + np.arange(int(p.sum()))
                self.buffer[idx] = 0
        self.layout = layout

    def take(self, nbytes: int) -> memoryview:
        """The next ``nbytes`` of the arena (segments come in layout order)."""
        at = self._at
        self._at = at + _padded(nbytes)
        return memoryview(self.buffer[at : at + nbytes])  # type: ignore[arg-type]


class SnapshotPool:
    """Snapshot arenas reused across epochs, bounded by ``max_host_bytes`` (None: two arenas
    per owner, twice the newest snapshot size of each). See the module docstring.

    Counters (for tests and benches): :attr:`pooled_bytes` (arenas held), :attr:`reused`
    (snapshots into a pooled arena), :attr:`refitted` (of those, into an arena of another
    layout that fitted), :attr:`allocated` (new pooled arenas), :attr:`fresh` (snapshots in
    unpooled memory), :attr:`waited` (leases that waited for a write in flight to end),
    :attr:`warmed` (arenas pre-faulted by the warmer thread), :attr:`shared` (leases of an
    arena the warmer was still faulting in, which it went on warming alongside the copy)."""

    #: arenas per owner the default bound allows: one written while the next snapshot is taken
    ARENAS = 2
    #: a lease of an arena still being warmed lets a madvise warmer go on alongside the copy
    #: (False: it stops the warmer, the older policy; bench_async.py compares the two)
    SHARE_WARMING = True

    def __init__(self, max_host_bytes: int | None = None) -> None:
        if max_host_bytes is not None and max_host_bytes < 0:
            raise ValueError(f"max_host_bytes must be >= 0 or None, got {max_host_bytes!r}")
        self.max_host_bytes = max_host_bytes
        self._arenas: list[_Arena] = []
        self._state_bytes: dict[str, int] = {}  # owner -> bytes of its newest snapshot
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # an arena's write ended, or warming did
        self._warmer: threading.Thread | None = None
        self._to_warm: deque[_Arena] = deque()
        self._warming_now: _Arena | None = None  # the arena the warmer is faulting in
        self._zeroing = False  # the warmer's step in progress writes zeros (no madvise)
        self._no_madvise = False  # madvise failed here: the warmer writes zeros (older kernel)
        self.reused = self.refitted = self.allocated = self.fresh = self.waited = self.warmed = 0
        self.shared = 0

    @property
    def pooled_bytes(self) -> int:
        """Bytes of the arenas the pool holds (leased or free)."""
        with self._lock:
            return sum(a.nbytes for a in self._arenas)

    @property
    def limit(self) -> int:
        """The bound in force: ``max_host_bytes``, or ARENAS x each owner's newest snapshot."""
        if self.max_host_bytes is not None:
            return self.max_host_bytes
        return self.ARENAS * sum(self._state_bytes.values())

    def fits(self, owner: str, layout: tuple[int, ...]) -> bool:
        """Whether a snapshot of ``layout`` fits the bound at all (with every other arena let
        go): False means a copy of it would break ``max_host_bytes``, so the save is written
        synchronously from the live state instead (:meth:`.background.BackgroundSaver.snapshot`).
        With the default bound (two states' worth) every state fits."""
        need = arena_bytes(layout)
        if self.max_host_bytes is None:
            return True
        return need <= self.max_host_bytes

    def wait_idle(self) -> None:
        """Wait until no arena is being written (a synchronous save then holds no snapshot
        memory beside the live state)."""
        with self._lock:
            while any(a.writing for a in self._arenas):
                self.waited += 1
                self._ended.wait()

    def _fitting(self, owner: str, need: int, layout: tuple[int, ...]) -> _Arena | None:
        """The owner's free arena for ``layout``: one of that layout, else the smallest that fits."""
        free = [a for a in self._arenas if a.owner == owner and not a.busy and a.nbytes >= need]
        same = [a for a in free if a.layout == layout]
        best = same or sorted(free, key=lambda a: a.nbytes)
        return best[0] if best else None

    def lease(self, owner: str, layout: tuple[int, ...]) -> _Arena:
        """An arena for a snapshot of ``layout`` (segment sizes, in order), marked busy:

        1. a free pooled arena of the owner that fits (its padding zeroed if the layout changed);
        2. else a new pooled arena when the bound allows it (after freeing the owner's idle
           arenas that are too small and other owners' idle arenas over the bound);
        3. else, when an arena of the owner that would fit is being written, that one once its
           write ended (host memory stays within the bound; the write in flight is what the
           next save would wait for anyway);
        4. else fresh unpooled memory, freed once written (only a caller that did not ask
           :meth:`fits` first: the saver writes such a state synchronously instead)."""
        need = arena_bytes(layout)
        with self._lock:
            self._state_bytes[owner] = need
            self._make_room(0)  # a state that shrank lowers the default bound: idle excess goes
            while True:
                arena = self._fitting(owner, need, layout)
                if arena is not None:
                    self._share_warming(arena)
                    arena.busy = True
                    arena.rewind()
                    if arena.layout != layout:
                        arena.refit(layout)
                        self.refitted += 1
                    self.reused += 1
                    return arena
                # the owner's idle arenas too small for this state are stale
                self._arenas = [a for a in self._arenas if a.busy or a.owner != owner]
                if self._make_room(need):
                    arena = _Arena(owner, layout, True)
                    arena.busy = True
                    self._arenas.append(arena)
                    self.allocated += 1
                    return arena
                if not any(a.owner == owner and a.writing and a.nbytes >= need for a in self._arenas):
                    break
                self.waited += 1
                self._ended.wait()
            self.fresh += 1
            arena = _Arena(owner, layout, False)
            arena.busy = True
            return arena

    def _make_room(self, need: int) -> bool:
        """(Lock held.) Drop idle arenas, oldest first, until ``need`` more bytes fit the
        bound; False when even then they don't (nothing is dropped then)."""
        limit = self.limit
        held = sum(a.nbytes for a in self._arenas)
        idle = sum(a.nbytes for a in self._arenas if not a.busy)
        if held - idle + need > limit:
            return False
        keep = []
        for a in self._arenas:
            if not a.busy and held + need > limit:
                self._stop_warming(a)
                held -= a.nbytes
            else:
                keep.append(a)
        self._arenas = keep
        return True

    def writing(self, arena: _Arena) -> None:
        """The write of ``arena`` started (a lease may now wait for it to end)."""
        with self._lock:
            arena.writing = True

    def release(self, arena: _Arena) -> None:
        """The write of ``arena`` ended (or it never started): it may be handed out again."""
        with self._lock:
            arena.busy = arena.writing = arena.warming = False
            arena.cold = 0  # every page was touched by the copy
            self._ended.notify_all()

    # -- pre-faulting, off the training thread
    def prepare(self, owner: str, layout: tuple[int, ...], arenas: int = 1) -> int:
        """Make sure ``owner`` has ``arenas`` pooled arenas that fit ``layout`` (within the
        bound) and have a thread fault their pages in now, so that the snapshots that take
        them copy at the speed of memory already touched. Returns the arenas queued to warm."""
        need = arena_bytes(layout)
        queued = 0
        with self._lock:
            self._state_bytes[owner] = need
            have = [a for a in self._arenas if a.owner == owner and a.nbytes >= need]
            for _ in range(max(0, arenas - len(have))):
                if not self._make_room(need):
                    break
                arena = _Arena(owner, layout, True)
                self._arenas.append(arena)
                self.allocated += 1
                arena.warming = True
                self._to_warm.append(arena)
                queued += 1
            if queued and self._warmer is None:
                self._warmer = threading.Thread(target=self._warm, name="epochal-warm", daemon=True)
                self._warmer.start()
        return queued

    def _stop_warming(self, arena: _Arena) -> None:
        """(Lock held.) Wait until the warmer no longer touches ``arena`` (at most one step)."""
        arena.warming = False
        while self._warming_now is arena:
            self._ended.wait()

    def _share_warming(self, arena: _Arena) -> None:
        """(Lock held.) ``arena`` is about to be copied into: the warmer may go on faulting it
        in alongside the copy when it does so with madvise (no byte changed); a warmer step
        that writes zeros is waited for, and with no madvise here the warming stops."""
        while arena.warming:
            if self._no_madvise or not self.SHARE_WARMING:
                self._stop_warming(arena)
            elif self._warming_now is arena and self._zeroing:
                self._ended.wait()
            else:
                self.shared += 1
                return

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait until the warmer has faulted in every arena queued (or stopped warming it);
        False when ``timeout`` (seconds) passed first."""
        with self._lock:
            return self._ended.wait_for(lambda: not any(a.warming for a in self._to_warm), timeout)

    def _warm(self) -> None:
        while True:
            with self._lock:
                while self._to_warm and not self._to_warm[0].warming:
                    self._to_warm.popleft()
                if not self._to_warm:
                    self._warmer = None
                    self._ended.notify_all()
                    return
                arena = self._to_warm[0]
                self._warming_now = arena
                hi = arena.cold
            lo = max(0, hi - _WARM_STEP)
            view = arena.buffer[lo:hi]
            done = _populate(view)
            if not done:  # no madvise: a zero per page, only while no copy goes on in there
                with self._lock:
                    self._no_madvise = True
                    self._zeroing = done = not arena.busy
                if done:
                    view[::_PAGE] = 0  # fresh arenas hold zeros: writing one keeps the contents
            with self._lock:
                self._warming_now = None
                self._zeroing = False
                arena.cold = min(arena.cold, lo)
                if not done:  # a copy in flight, which faults the rest in itself
                    arena.warming = False
                elif arena.cold == 0 and arena.warming:
                    arena.warming = False
                    self.warmed += 1
                self._ended.notify_all()

    def clear(self) -> None:
        """Free every idle arena and forget the state sizes (leased ones stay until released;
        :meth:`BackgroundSaver.close` waits for their writes first)."""
        with self._lock:
            for a in self._arenas:
                if not a.busy:
                    self._stop_warming(a)
            self._arenas = [a for a in self._arenas if a.busy]
            self._state_bytes.clear()
