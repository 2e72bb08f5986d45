"""Big local files written around the page cache (``O_DIRECT``), through reused buffers.

A training loop saves a new file every epoch and retention deletes old ones, so a buffered
write lands in page-cache pages the kernel must find, zero and later write back; on a VM
whose host reclaims freed guest memory (free-page reporting) every such page is also a host
page fault on first touch. :class:`DirectSink` copies the stream into a
few page-aligned buffers that stay allocated across saves (warm memory, no faults) and hands
each full buffer to writer threads that ``pwrite`` it with ``O_DIRECT``: the disk works
while the next buffer is filled, and no page-cache memory is taken at all. Used for files of at least
``tuning.DIRECT_MIN`` bytes (512 MiB by default; None turns it off): on a quiet machine it
was 1.6-4.8x the buffered speed and steady; under heavy load from other processes the gain
was smaller and sometimes a loss (bench/RESULTS.md).

Same contract as :class:`~epochal.storage.io.local.LocalSink` (temp name, fsync, rename,
directory fsync through :class:`~epochal.storage.io.atomic.AtomicFile`); the bytes on disk are
identical. The first buffer is held back until commit so that :meth:`DirectSink.patch` (the
header filled in at the end) is a copy into memory, not a read-modify-write of the disk.
The tail is written padded to the alignment and the file truncated to its real size. Where
the filesystem refuses ``O_DIRECT`` (tmpfs, some network filesystems), at open or at the
first write (EINVAL), the same buffers are written with plain ``pwrite`` instead.

:meth:`DirectSink.write_pinned` skips the copy for a buffer that stays unchanged until the
commit (a background save's snapshot arena, laid out as the file's data area: see
:mod:`epochal.storage.formats.native.image`): where its address is congruent to its file offset
modulo the page size, its whole pages are handed to the same threads straight from its
memory (4 MiB pieces, at most DIRECT_BUFFERS in flight); only its unaligned ends are copied.

Reads: :func:`open_read` opens a local file for ``O_DIRECT`` reads, :func:`placed`
allocates fresh memory congruent to a file offset modulo the page size, and
:func:`read_checked` reads a segment into such memory (its whole pages with ``O_DIRECT``,
straight from the disk into it, its unaligned ends with plain reads) and checksums it in the
reading thread. A cold load then costs the disk's read and the page faults of its own
memory: no page-cache pages to allocate and no copy out of them.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...errors import CheckpointCorruptError
from . import atomic, tuning
from .progress import report_progress

__all__ = ["DirectSink", "direct_supported", "looks_cached", "open_read", "placed", "read_checked", "stats"]

#: O_DIRECT offsets, lengths and buffer addresses are multiples of this (the page size
#: covers every common logical block size)
ALIGN = 4096

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)

_pool_lock = threading.Lock()
#: free page-aligned buffers of tuning.DIRECT_BUFFER bytes, kept across saves (bounded)
_pool: list[mmap.mmap] = []


class _Stats:
    """Bytes the sinks copied into their buffers and wrote from callers' memory, and bytes
    read with O_DIRECT by :func:`read_checked` (tests, benches)."""

    def __init__(self) -> None:
        self.copied = 0
        self.pinned = 0
        self.read = 0

    def reset(self) -> None:
        self.copied = self.pinned = self.read = 0


stats = _Stats()
_stats_lock = threading.Lock()


def _bytes_view(buffer: Any) -> memoryview:
    src = memoryview(buffer)
    if src.ndim != 1 or src.format != "B":
        src = src.cast("B")
    return src


def direct_supported() -> bool:
    return bool(_O_DIRECT) and hasattr(os, "pwrite")


def _take(n: int) -> list[mmap.mmap]:
    size = tuning.DIRECT_BUFFER
    with _pool_lock:
        got = [b for b in _pool if len(b) == size][:n]
        for b in got:
            _pool.remove(b)
    return got + [mmap.mmap(-1, size) for _ in range(n - len(got))]


def _give(bufs: list[mmap.mmap]) -> None:
    with _pool_lock:
        keep = max(0, tuning.DIRECT_BUFFERS - len(_pool))
        _pool.extend(bufs[:keep])
        for b in bufs[keep:]:
            b.close()


class DirectSink:
    """A new local file written with ``O_DIRECT`` from reused aligned buffers (see the
    module doc); a :class:`~epochal.storage.io.seam.ByteSink`."""

    def __init__(self, path: str, size: int | None = None) -> None:
        self.name = path
        self._file = atomic.AtomicFile(path, size=size)
        self._file.__enter__()
        self._dfd = -1  # the O_DIRECT descriptor (closed at the end)
        try:
            self._dfd = os.open(self._file.temp_path, os.O_WRONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            pass  # refused (tmpfs...): plain pwrite of the same buffers
        self._direct = self._dfd >= 0
        try:
            self._bufs = _take(max(2, tuning.DIRECT_BUFFERS))
        except BaseException:  # e.g. MemoryError: no temp file left behind
            self._close_direct()
            self._file.abort()
            raise
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        for b in self._bufs[1:]:
            self._free.put(b)
        self._head = self._bufs[0]  # file offset 0, written at commit (after patch)
        self._head_len = len(self._head)  # its bytes to write (fewer once a pinned write follows)
        self._cur: mmap.mmap = self._head
        self._cur_off = 0  # file offset of self._cur
        self._fill = 0  # bytes in self._cur
        # (bytes, file offset, the staging buffer to free after, or None), or None: stop
        self._todo: queue.SimpleQueue[tuple[memoryview, int, mmap.mmap | None] | None] = queue.SimpleQueue()
        # pieces of callers' memory queued or being written (bounded like the buffers)
        self._pinned = threading.Semaphore(max(2, tuning.DIRECT_BUFFERS))
        self._error: BaseException | None = None
        self._late: list[tuple[int, bytes]] = []  # patches beyond the first buffer
        self._threads = [
            threading.Thread(target=self._run, name="epochal-direct-write", daemon=True)
            for _ in range(max(1, tuning.DIRECT_THREADS))
        ]
        for t in self._threads:
            t.start()
        self._closed = False

    @property
    def pin_align(self) -> int:
        """:meth:`write_pinned` writes from the caller's memory where its address is congruent
        to the file offset modulo this; 0 when the file is not open with ``O_DIRECT``."""
        return ALIGN if self._direct else 0

    # ---- the writer threads
    def _pwrite(self, view: memoryview, offset: int) -> None:
        nbytes = view.nbytes
        done = 0
        while done < nbytes:
            direct = self._direct
            try:
                n = os.pwrite(self._dfd if direct else self._file.fd, view[done:], offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL or not direct:
                    raise
                self._direct = False  # O_DIRECT refused at write time: plain writes from now
                continue
            if n <= 0:  # pragma: no cover - regular files do not return 0
                raise OSError(errno.EIO, "write returned 0")
            done += n

    def _run(self) -> None:
        while True:
            job = self._todo.get()
            if job is None:
                return
            view, offset, buf = job
            try:
                if self._error is None:
                    self._pwrite(view, offset)
            except BaseException as e:  # noqa: BLE001 - re-raised by the stream (_check)
                self._error = e
            finally:
                view.release()
                if buf is None:
                    self._pinned.release()
                elif buf is not self._head:
                    self._free.put(buf)

    def _check(self) -> None:
        if isinstance(self._error, OSError):
            raise self._file._named(self._error)
        if self._error is not None:
            raise self._error

    # ---- the stream
    def _queue(self, buf: mmap.mmap, offset: int, nbytes: int) -> None:
        self._todo.put((memoryview(buf)[:nbytes], offset, buf))

    def _flush(self) -> None:
        """Hand the current buffer's bytes (a multiple of ALIGN) to the writers and take a
        free one; the first buffer waits for :meth:`commit`."""
        fill = self._fill
        if self._cur is self._head:
            self._head_len = fill
        else:
            self._queue(self._cur, self._cur_off, fill)
        self._check()
        self._cur = self._free.get()
        self._cur_off += fill
        self._fill = 0

    def _copy(self, src: memoryview) -> None:
        n, done = src.nbytes, 0
        while done < n:
            if self._fill == len(self._cur):
                self._flush()
            k = min(n - done, len(self._cur) - self._fill)
            self._cur[self._fill : self._fill + k] = src[done : done + k]
            self._fill += k
            done += k
        stats.copied += n

    def write(self, buffer: Any) -> int:
        views: Sequence[Any]
        if not isinstance(buffer, (list, tuple)):
            views = [buffer]
        elif len(buffer) > 8:  # many small pieces: one C-level gather, then one copy each
            views = [b"".join(buffer)]
        else:
            views = buffer
        total = 0
        for b in views:
            src = _bytes_view(b)
            self._copy(src)
            total += src.nbytes
        return total

    def write_pinned(self, buffer: Any) -> int:
        """Append ``buffer`` (one bytes-like object); its page-aligned middle is written by
        the writer threads from its own memory, so it must stay alive and unchanged until
        :meth:`commit` or :meth:`abort` returns. Parts that cannot be (the unaligned head and
        tail, all of it when the address is not congruent to the file offset modulo ALIGN or
        the file is not open with O_DIRECT) are copied as :meth:`write` does."""
        src = _bytes_view(buffer)
        n = src.nbytes
        pos = self._cur_off + self._fill
        try:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(src)) if n else 0
        except TypeError:  # read-only memory: copied
            addr = pos + 1
        if not self._direct or (addr - pos) % ALIGN:
            self._copy(src)
            return n
        lead = -pos % ALIGN or (ALIGN if pos == 0 else 0)  # the first page stays patchable
        lead = min(lead, n)
        self._copy(src[:lead])
        middle = (n - lead) // ALIGN * ALIGN
        if middle:
            if self._fill:
                self._flush()  # the bytes before, up to this page boundary
            at = lead
            step = max(ALIGN, tuning.DIRECT_BUFFER // ALIGN * ALIGN)
            while at < lead + middle:
                k = min(step, lead + middle - at)
                self._pinned.acquire()
                self._todo.put((src[at : at + k], self._cur_off, None))
                self._cur_off += k
                at += k
                stats.pinned += k
                self._check()
        self._copy(src[lead + middle :])
        return n

    def patch(self, offset: int, data: Any) -> None:
        src = memoryview(data).cast("B")
        end = offset + src.nbytes
        if offset < 0 or end > self._cur_off + self._fill:
            raise ValueError(f"{self.name}: patch at {offset}+{src.nbytes} is past the end written")
        cut = min(end, self._head_len)
        if offset < cut:  # the first buffer is still in memory
            self._head[offset:cut] = src[: cut - offset]
        if end > cut:  # the rest is written at commit, once the data is on disk
            self._late.append((max(offset, cut), bytes(src[max(offset, cut) - offset :])))

    def commit(self) -> None:
        try:
            size = self._cur_off + self._fill
            tail = self._fill
            padded = -(-tail // ALIGN) * ALIGN
            self._cur[tail:padded] = bytes(padded - tail)
            if self._cur is self._head:
                self._head_len = padded
            elif padded:
                self._queue(self._cur, self._cur_off, padded)
            self._queue(self._head, 0, self._head_len)
            self._stop()
            self._check()
            for offset, data in self._late:
                os.pwrite(self._file.fd, data, offset)
            if padded != tail:
                os.ftruncate(self._file.fd, size)
            self._close_direct()
            self._file.commit()
        except BaseException:
            self.abort()
            raise
        finally:
            self._release()

    def abort(self) -> None:
        self._stop()
        self._close_direct()
        self._file.abort()
        self._release()

    # ---- cleanup
    def _stop(self) -> None:
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._todo.put(None)
            for t in self._threads:
                t.join()

    def _close_direct(self) -> None:
        if self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1

    def _release(self) -> None:
        if self._bufs:
            bufs, self._bufs = self._bufs, []
            _give(bufs)


# ---------------------------------------------------------------- reads
def open_read(path: str) -> int:
    """A read-only ``O_DIRECT`` descriptor of the local file ``path``, or -1 where that is
    refused (tmpfs, no O_DIRECT) or turned off (``tuning.DIRECT_READ`` False)."""
    if not _O_DIRECT or not tuning.DIRECT_READ:
        return -1
    try:
        return os.open(path, os.O_RDONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1


def placed(nbytes: int, offset: int) -> memoryview:
    """Fresh writable memory of ``nbytes`` bytes whose address is congruent to ``offset``
    modulo ALIGN: the whole pages of a segment at that file offset can be read into it with
    ``O_DIRECT``. Costs at most ALIGN bytes more than the segment (numpy's allocator, not
    zeroed; pages faulted in by the read)."""
    phase = offset % ALIGN
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    at = (phase - raw.ctypes.data) % ALIGN
    return memoryview(raw[at : at + nbytes])  # type: ignore[arg-type]


def looks_cached(src: Any, spans: Sequence[tuple[int, int]], probes: int = 8) -> bool:
    """Whether the file ranges ``spans`` (offset, size) look cached: a page at each end of up
    to ``probes`` of them is read with RWF_NOWAIT (False where that is unsupported)."""
    if not spans or not getattr(src, "nowait", False):
        return False
    page = memoryview(bytearray(ALIGN))
    step = max(1, len(spans) // probes)
    for off, size in spans[::step]:
        for at in (off, off + max(0, size - ALIGN)):
            n = min(ALIGN, size)
            try:
                if src.read_into([page[:n]], at, nowait=True) != n:
                    return False
            except OSError:  # EAGAIN: not cached
                return False
    return True


def read_checked(
    src: Any, dfd: int, buf: memoryview, offset: int, blob: str,
    fn: Callable[[Any, int], int] | None, piece: int, progress: bool = False,
) -> int:
    """Read the segment at ``offset`` into ``buf`` and return its checksum by ``fn`` (0 when
    None), computed piece by piece in this thread right after each read (CRC-32C releases
    the GIL). Where ``dfd`` is an O_DIRECT descriptor and ``buf``'s address is congruent to
    ``offset`` modulo ALIGN (:func:`placed`), its whole pages are read with ``O_DIRECT``
    (straight into ``buf``), the unaligned head and tail from ``src``; otherwise, or when the
    kernel refuses O_DIRECT (EINVAL), all of it from ``src``. A file ending early is
    CheckpointCorruptError naming ``blob``."""
    n = buf.nbytes
    head = mid = 0
    if dfd >= 0 and n >= 2 * ALIGN:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        if (addr - offset) % ALIGN == 0:
            head = -offset % ALIGN
            mid = (n - head) // ALIGN * ALIGN
    crc = 0
    at = 0
    while at < n:
        if head <= at < head + mid:  # whole pages: O_DIRECT
            view = buf[at : min(at + piece, head + mid)]
            try:
                got = _pread_all(dfd, view, offset + at)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                mid = 0  # refused: the rest through the page cache
                continue
            if got != view.nbytes:  # the file ends early (or a signal): named below
                _read_rest(src, view, offset + at, blob, got)
            with _stats_lock:  # (threads: an exact count for tests)
                stats.read += view.nbytes
            if progress:
                report_progress(view.nbytes)
        else:
            end = head if at < head else n
            view = buf[at : min(at + piece, end)]
            _read_rest(src, view, offset + at, blob, 0)
            if progress:
                report_progress(view.nbytes)
        if fn is not None:
            crc = fn(view, crc)
        at += view.nbytes
    return crc


def _read_rest(src: Any, view: memoryview, offset: int, blob: str, done: int) -> None:
    """Fill ``view[done:]`` from ``src`` (through the page cache); CheckpointCorruptError naming
    the file and ``blob`` where the file ends first. (Not io.reads.read_exact: the seam
    imports this module.)"""
    while done < view.nbytes:
        k = src.read_into([view[done:]], offset + done)
        if k <= 0:
            raise CheckpointCorruptError(src.name, f"file is truncated (read stopped at byte {offset + done})", blob)
        done += k


def _pread_all(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < view.nbytes:
        k = os.preadv(fd, [view[done:]], offset + done)
        if k <= 0:
            break
        done += k
    return done

