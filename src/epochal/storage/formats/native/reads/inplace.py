"""Read path: loads into live objects, straight into their memory (codecs' ``inplace_targets``).

Order of a load with live targets: :func:`direct_targets` asks the codecs which big segments
can go straight into live memory (a mismatch is reported before anything is read);
:func:`verify_direct` checks those segments' checksums and padding without writing any live
byte (on a read-only map, or streamed through a small ring when the store cannot map); the
other segments are read by the general path; only then :func:`read_direct` reads the
verified segments into the live memory, over a few threads for big loads.

A cold load from a local file is staged instead (:func:`stage_direct`): the
segments are read with O_DIRECT into fresh memory placed congruent to their file offsets and
checksummed by the reading threads; once every checksum of the load has passed,
:func:`read_direct` copies them into the live memory (threads, the GIL released). One read
from the disk and one copy, against a read into the page cache, a copy out of it to checksum
and a second copy out of it into the live memory; but the copies are fresh memory (as much
again as the segments), whose first-touch faults cost more than those copies where it was
measured, so it is off unless tuning.DIRECT_STAGE_MAX allows it (bench/RESULTS.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ....encoding import codecs as _codecs
from ....encoding.codecs import flat_writable
from ....io import direct as _direct
from ....io import tuning
from ....io.checksum import checksum_spans
from ....io.reads import Prefetcher, merged_ranges, read_bytes, read_exact
from ....io.threads import Worker, contiguous, cpu_threads, run_parallel
from ...base import report_progress
from ..items import Direct, LoadItem, Opened, raise_codec_error
from ..layout import DAMAGED_DATA, DAMAGED_PAD, corrupt

__all__ = ["cached", "direct_targets", "read_direct", "stage_direct", "verify_direct", "verify_direct_read", "verify_direct_streamed"]


def direct_targets(f: Opened, plan: list[LoadItem], existing: Mapping[str, Any]) -> list[Direct]:
    """Segments to read straight into live memory (codecs' ``inplace_targets``, see
    :mod:`epochal.storage.encoding.codecs`): big ones whose live target has exactly their size.
    Asking the codecs also checks that each live object fits (BlobMismatchError before
    anything is read). None when two targets overlap (the staged path keeps the order
    in which ``load_state_dict``/``copy_`` would write them)."""
    idx, path = f.index, f.path
    big = tuning.BIG_SEGMENT
    out: list[Direct] = []
    for pos, item in enumerate(plan):
        i, name, meta, codec, bufs = item.index, item.name, item.meta, item.codec, item.bufs
        live = existing.get(name)
        fn = getattr(codec, "inplace_targets", None) if live is not None else None
        if fn is None:
            continue
        try:
            targets = fn(meta, [b.nbytes for b in bufs], live)
        except Exception as e:
            raise_codec_error(path, item, e)
        if not targets or len(targets) != len(bufs):
            continue
        first = int(idx.recs["seg_first"][i])
        for j, t in enumerate(targets):
            if t is None:
                continue
            t = flat_writable(t)
            if t.readonly or t.nbytes != bufs[j].nbytes or t.nbytes < big:
                continue
            seg = idx.segs[first + j]
            out.append(Direct(pos, j, name, int(seg["offset"]), t.nbytes, int(seg["pad"]),
                               int(seg["crc"]), t, _codecs.buffer_address(t)))
    spans = sorted((d.addr, d.addr + d.size) for d in out)
    if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
        return []
    return out

def cached(f: Opened, direct: list[Direct], probes: int = 8) -> bool:
    """Whether the segments to be read in place look cached: a page at each end of up to
    ``probes`` of them is read with RWF_NOWAIT (False where that is unsupported)."""
    return _direct.looks_cached(f.src, [(d.off, d.size) for d in direct], probes)


def verify_direct(f: Opened, direct: list[Direct]) -> list[memoryview] | None:
    """Checksums (and padding) of the segments to be read in place, without writing any
    live byte; returns their staged copies when :func:`stage_direct` read them (a cold load
    from a local file, within the memory bound), for :func:`read_direct`. When cached: computed on a read-only map of the file (page-cache
    pages, no copy), segments spread over a few threads. When not (a cold resume):
    :func:`verify_direct_read`, whose big parallel reads keep the disk busy where the map's
    page faults read it a small window at a time (874 MiB cold, paired: the map pass 764 ms,
    4 threads of 8 MiB reads + CRC 376 ms, an O_DIRECT read 333 ms). Streamed
    through a small ring of buffers if mapping fails."""
    if getattr(f.src, "nowait", False) and not cached(f, direct):
        staged = stage_direct(f, direct)
        if staged is None:
            verify_direct_read(f, direct)
        return staged
    path = f.path
    mm = f.src.map(sequential=True)
    if mm is None:
        verify_direct_streamed(f, direct)
        return None
    try:
        crcs = checksum_spans(f.index.fn, mm, [(d.off, d.size) for d in direct], cpu_threads())
        whole = memoryview(mm)
        for d in direct:
            if d.pad and any(whole[d.off + d.size : d.off + d.size + d.pad]):
                raise corrupt(path, DAMAGED_PAD, d.name)
        whole.release()
    finally:
        try:
            mm.close()
        except BufferError:  # a view is still referenced (an exception in flight): GC
            pass
    for slot, d in enumerate(direct):
        if crcs[slot] != d.crc:
            raise corrupt(path, DAMAGED_DATA, d.name)
    return None

def _available() -> int:
    """MemAvailable of /proc/meminfo in bytes (where unknown: the free physical pages)."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0


def stage_direct(f: Opened, direct: list[Direct]) -> list[memoryview] | None:
    """Read the segments to be restored in place into fresh memory placed congruent to
    their file offsets, whole pages with O_DIRECT (tuning.IO_THREADS threads, each a
    contiguous run of the segments, READ_PIECE pieces checksummed right after each read),
    check every checksum and padding, and return those copies. None, with nothing read,
    where O_DIRECT is refused or the copies would take more than tuning.DIRECT_STAGE_MAX or
    half the memory available. No live byte is written here."""
    total = sum(d.size for d in direct)
    if not tuning.DIRECT_READ or not total or total > min(tuning.DIRECT_STAGE_MAX, _available() // 2):
        return None
    dfd = _direct.open_read(f.path)
    if dfd < 0:
        return None
    path, fn, src = f.path, f.index.fn, f.src
    crcs = [0] * len(direct)
    groups = contiguous([d.size for d in direct], tuning.IO_THREADS)
    try:
        staged = [_direct.placed(d.size, d.off) for d in direct]

        def job(g: int) -> Callable[[], None]:
            def run() -> None:
                for k in groups[g]:
                    d = direct[k]
                    crcs[k] = _direct.read_checked(src, dfd, staged[k], d.off, d.name, fn, tuning.READ_PIECE)
                    if d.pad and any(read_bytes(src, d.pad, d.off + d.size, "padding", d.name)):
                        raise corrupt(path, DAMAGED_PAD, d.name)
            return run

        run_parallel([job(g) for g in range(len(groups))])
    finally:
        os.close(dfd)
    for slot, d in enumerate(direct):
        if crcs[slot] != d.crc:
            raise corrupt(path, DAMAGED_DATA, d.name)
    return staged


def verify_direct_read(f: Opened, direct: list[Direct]) -> None:
    """:func:`verify_direct` by reads: tuning.IO_THREADS threads, each a contiguous run of the
    segments, read in tuning.READ_PIECE pieces into one reused buffer of its own and
    checksummed right after (CRC-32C releases the GIL). The pages read stay in the page
    cache, from which :func:`read_direct` then copies into the live memory."""
    path, fn, src = f.path, f.index.fn, f.src
    piece_size = tuning.READ_PIECE
    crcs = [0] * len(direct)
    groups = contiguous([d.size for d in direct], tuning.IO_THREADS)

    def job(g: int) -> Callable[[], None]:
        def run() -> None:
            scratch = memoryview(bytearray(min(piece_size, max(direct[k].size for k in groups[g]))))
            for k in groups[g]:
                d = direct[k]
                crc = 0
                for start in range(0, d.size, piece_size):
                    piece = scratch[: min(piece_size, d.size - start)]
                    read_exact(src, [piece], d.off + start, d.name, progress=False)
                    crc = fn(piece, crc)
                crcs[k] = crc
                if d.pad and any(read_bytes(src, d.pad, d.off + d.size, "padding", d.name)):
                    raise corrupt(path, DAMAGED_PAD, d.name)
        return run

    run_parallel([job(g) for g in range(len(groups))])
    for slot, d in enumerate(direct):
        if crcs[slot] != d.crc:
            raise corrupt(path, DAMAGED_DATA, d.name)


def verify_direct_streamed(f: Opened, direct: list[Direct]) -> None:
    """:func:`verify_direct` through a small ring of reusable buffers (one thread reads,
    a worker checksums)."""
    path, fn = f.path, f.index.fn
    chunk, nring = tuning.CHUNK, tuning.RING
    ring = [memoryview(bytearray(chunk)) for _ in range(nring)]
    free = threading.Semaphore(nring)
    crcs = [0] * len(direct)
    errors: list[BaseException] = []

    def step(slot: int, piece: memoryview) -> None:
        try:
            if not errors:
                crcs[slot] = fn(piece, crcs[slot])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
        finally:
            free.release()

    ahead = Prefetcher(f.src, merged_ranges([(d.off, d.off + d.size + d.pad) for d in direct]))
    worker = Worker()
    r = 0
    try:
        for slot, d in enumerate(direct):
            for start in range(0, d.size, chunk):
                n = min(chunk, d.size - start)
                free.acquire()
                piece = ring[r][:n]
                r = (r + 1) % nring
                try:
                    ahead.read([piece], d.off + start, d.name, progress=False)
                except BaseException:
                    free.release()
                    raise
                worker.submit(step, slot, piece)
            if d.pad and any(read_bytes(f.src, d.pad, d.off + d.size, "padding", d.name)):
                raise corrupt(path, DAMAGED_PAD, d.name)
        worker.wait()
    finally:
        worker.close()
    if errors:
        raise errors[0]
    for slot, d in enumerate(direct):
        if crcs[slot] != d.crc:
            raise corrupt(path, DAMAGED_DATA, d.name)

def read_direct(f: Opened, plan: list[LoadItem], direct: list[Direct], staged: list[memoryview] | None = None) -> None:
    """Read the (verified) segments into the live memory, split over a few threads in
    file order, or copy them there from their ``staged`` copies (:func:`stage_direct`,
    emptied here); the codecs' decode gets those views as buffers and sees that the bytes
    are in place. Progress is reported by the calling thread."""
    step = tuning.DIRECT_PIECE
    pieces = [
        (d.target[start : start + step], d.off + start, d.name, k)
        for k, d in enumerate(direct)
        for start in range(0, d.size, step)
    ]
    total = sum(p[0].nbytes for p in pieces)
    nthreads = cpu_threads() if total >= tuning.PARALLEL_MIN else 1
    groups = contiguous([p[0].nbytes for p in pieces], nthreads)
    done = [0] * len(groups)

    def job(g: int) -> Callable[[], None]:
        def run() -> None:
            for p in groups[g]:
                view, off, name, k = pieces[p]
                if staged is not None:  # a memcpy, without the GIL
                    start = off - direct[k].off
                    src = staged[k][start : start + view.nbytes]
                    np.copyto(np.frombuffer(view, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
                    if g == 0:
                        report_progress(view.nbytes)
                else:
                    read_exact(f.src, [view], off, name, progress=g == 0)
                done[g] += view.nbytes
        return run

    run_parallel([job(g) for g in range(len(groups))])
    if staged is not None:
        staged.clear()
    report_progress(sum(done[1:]))
    for d in direct:
        plan[d.pos].bufs[d.seg] = d.target
