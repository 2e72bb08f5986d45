"""Measurement helpers for the format benchmarks: timing, peak RSS, fsync, cache eviction.

Peak memory uses Linux's resettable high-water mark: writing ``5`` to
``/proc/self/clear_refs`` resets ``VmHWM`` in ``/proc/self/status``, so the peak RSS of one
operation is exact (not sampled). Elsewhere a 1 ms sampling thread is used instead.

Cold-cache reads: a file is fsynced and then dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (only that file, so other users of the machine keep
their caches); ``drop_caches=True`` also writes ``1`` to ``/proc/sys/vm/drop_caches`` when
permitted (root).
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

GiB = 1 << 30
MiB = 1 << 20


def fsync_path(path: str) -> None:
    """fsync a file by name (for libraries that write and close it themselves)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(path: str, drop_caches: bool = False) -> None:
    """Drop ``path`` from the page cache (after flushing it) so the next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if drop_caches:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
        except OSError:
            pass


def warm(path: str) -> None:
    """Read ``path`` twice so it is in the page cache *and* on the active LRU list.

    A page read once sits on the inactive list and is the first to be reclaimed when the timed
    load allocates memory; a file read by two variants (native with and without verification)
    would otherwise be "warmer" than a file read by one."""
    buf = bytearray(8 * MiB)
    for _ in range(2):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def rss() -> int:
    """Current resident set size in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """``with PeakMemory() as m: ...`` then ``m.extra`` = peak RSS minus RSS at entry."""

    def __init__(self) -> None:
        self.base = 0
        self.peak = 0
        self._hwm_ok = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        gc.collect()
        self.base = rss()
        self._hwm_ok = _reset_hwm() and _hwm() is not None
        if not self._hwm_ok:
            self.peak = self.base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: object) -> None:
        if self._hwm_ok:
            self.peak = max(_hwm() or 0, rss())
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self.peak = max(self.peak, rss())

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)


@dataclass
class Sample:
    seconds: float
    extra_bytes: int


@dataclass
class Series:
    """All samples of one measured operation across rounds."""

    name: str
    nbytes: int
    samples: list[Sample] = field(default_factory=list)

    def median_seconds(self) -> float:
        return statistics.median(s.seconds for s in self.samples)

    def gbps(self) -> float:
        return self.nbytes / self.median_seconds() / 1e9

    def peak_extra(self) -> int:
        return max(s.extra_bytes for s in self.samples)


def measure(fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> tuple[Sample, Any]:
    """Run ``before()`` untimed, then time ``fn()`` and its peak extra memory."""
    if before is not None:
        before()
    gc.collect()
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        result = fn()
        dt = time.perf_counter() - t0
    return Sample(dt, mem.extra), result


def paired_ratio(a: Series, b: Series, higher_is_better: bool = True) -> float:
    """Median over rounds of throughput(a)/throughput(b) (i.e. time(b)/time(a)) — pairing the
    samples of the same round cancels most of a noisy machine's drift."""
    ratios = [sb.seconds / sa.seconds for sa, sb in zip(a.samples, b.samples)]
    return statistics.median(ratios)


@contextmanager
def gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def touch_memory(nbytes: int) -> None:
    """Fault in and free ``nbytes`` of memory, so a VM has backed it before timing starts."""
    import numpy as np

    chunk = 256 * MiB
    bufs = []
    for _ in range(max(1, nbytes // chunk)):
        a = np.empty(chunk, dtype=np.uint8)
        a.fill(1)
        bufs.append(a)
    del bufs
    gc.collect()


def recycle_memory() -> bool:
    """Make glibc keep freed memory and serve big allocations from it (``M_MMAP_MAX=0``,
    ``M_TRIM_THRESHOLD`` huge), so a timed load reuses memory the process already touched.

    On a VM, first-touch page faults of fresh memory vary by 5x from one run to the next and
    would drown the I/O being measured; with recycling every variant reads "into new arrays"
    whose pages are already resident (as with torch's caching allocator). Returns False where
    mallopt is unavailable.

    It also stops numpy from asking for transparent huge pages on big arrays
    (``madvise(MADV_HUGEPAGE)``): with THP ``defrag=madvise`` (this VM), a page fault in such
    an array may compact memory synchronously, and a 2 GiB load into new arrays took 0.6 s
    or 2-5 s at random, whichever variant it was (paired warm runs, N=8: every variant
    bimodal; with the hint off all three took 0.95 s +- 5%)."""
    set_hugepage = getattr(getattr(np, "_core", np).multiarray, "_set_madvise_hugepage", None)
    if set_hugepage is not None:
        set_hugepage(False)
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        ok1 = libc.mallopt(M_MMAP_MAX, 0)
        ok2 = libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
        return bool(ok1 and ok2)
    except (OSError, AttributeError):
        return False


def preadv_runs(fd: int, items: list[tuple[int, Any]]) -> None:
    """Fill each array of ``items`` (``(file offset, array)``, in file order) from ``fd``:
    adjacent ones coalesced into one ``preadv`` of up to 64 MiB / 1022 buffers, gaps under
    64 bytes (alignment padding) read into a scratch buffer. The raw-read baseline."""
    scratch = memoryview(bytearray(64))
    views: list[Any] = []
    start = end = nbytes = 0
    for off, a in items:
        if views and (len(views) >= 1022 or nbytes >= 64 * MiB or not 0 <= off - end < 64):
            os.preadv(fd, views, start)
            views, nbytes = [], 0
        if not views:
            start = end = off
        if off > end:
            views.append(scratch[: off - end])
        views.append(a)
        nbytes += a.nbytes
        end = off + a.nbytes
    if views:
        os.preadv(fd, views, start)


def direct_write(path: str, nbytes: int, threads: int = 4, piece: int = 8 * MiB) -> float:
    """Seconds to write ``nbytes`` to a new file at ``path`` with ``O_DIRECT`` (bypassing the
    page cache) from ``threads`` threads, each a contiguous part in ``piece``-sized
    ``pwrite`` calls, then fsync: the disk's own write speed for a save of that size (the
    file is removed afterwards). Falls back to buffered writes where O_DIRECT is refused."""
    import mmap

    nbytes = max(piece, nbytes // piece * piece)
    buf = mmap.mmap(-1, piece)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(4096) * (piece // 4096))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        fd = os.open(path, flags, 0o644)
    npieces = nbytes // piece
    parts = [(k * npieces // threads, (k + 1) * npieces // threads) for k in range(threads)]
    errors: list[BaseException] = []

    def run(a: int, b: int) -> None:
        try:
            for i in range(a, b):
                if os.pwrite(fd, buf, i * piece) != piece:
                    raise OSError("short O_DIRECT write")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        t0 = time.perf_counter()
        ts = [threading.Thread(target=run, args=p) for p in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
        os.unlink(path)
    if errors:
        raise errors[0]
    return dt


def memcpy_times(arrays: list[np.ndarray], into: list[np.ndarray]) -> tuple[float, float]:
    """Seconds to copy ``arrays`` into the already-allocated (and touched) ``into``, and into
    fresh memory (new arrays: first-touch page faults included)."""
    t0 = time.perf_counter()
    for src, dst in zip(arrays, into):
        np.copyto(dst, src)
    allocated = time.perf_counter() - t0
    t0 = time.perf_counter()
    fresh = [a.copy() for a in arrays]
    dt = time.perf_counter() - t0
    del fresh
    return allocated, dt


class DirectReader:
    """A parallel ``O_DIRECT`` read of a whole file into memory allocated (and touched) once:
    the disk's own read speed for those bytes, the limit of any load of them. ``threads``
    threads each read a contiguous part in ``piece``-sized ``preadv`` calls."""

    def __init__(self, nbytes: int, threads: int = 4, piece: int = 8 * MiB) -> None:
        import mmap

        self.size = (nbytes + piece - 1) // piece * piece
        self.buf = mmap.mmap(-1, self.size)  # page-aligned, as O_DIRECT needs
        self.buf.write(b"\1" * self.size)  # touched: no first-touch faults in the timing
        self.threads, self.piece = threads, piece

    def read(self, path: str) -> int:
        flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
        fd = os.open(path, flags)
        try:
            n = os.fstat(fd).st_size
            pieces = (n + self.piece - 1) // self.piece
            view = memoryview(self.buf)
            errors: list[BaseException] = []

            def run(a: int, b: int) -> None:
                try:
                    for i in range(a, b):
                        at = i * self.piece
                        os.preadv(fd, [view[at : at + self.piece]], at)
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            k = self.threads
            ts = [threading.Thread(target=run, args=(j * pieces // k, (j + 1) * pieces // k)) for j in range(k)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            view.release()
            if errors:
                raise errors[0]
            return n
        finally:
            os.close(fd)
