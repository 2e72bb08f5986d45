"""Read path: big segments into fresh buffers over tuning.IO_THREADS threads.

Taken by the general path (:mod:`.fill`) when the big segments of a load add up to
tuning.PARALLEL_MIN or more: several requests in flight keep a cold disk busy, where one
reader's speed swung 3x from run to run here. From a remote source (object storage) every
big segment comes here and is cut into tuning.REMOTE_PIECE pieces fetched
tuning.REMOTE_THREADS at a time, whatever blob they belong to (:func:`_read_pieces`): a
ranged GET per piece, the piece checksums combined into each segment's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np

from ....io import direct, tuning
from ....io.checksum import combined
from ....io.reads import read_bytes, read_exact
from ....io.threads import contiguous, run_parallel
from ...base import report_progress
from ..items import BigRead, Opened
from ..layout import DAMAGED_PAD, corrupt

__all__ = ["read_parallel"]


def read_parallel(f: Opened, par: list[BigRead], verify: bool, got: list[int]) -> None:
    """Read big segments into their buffers with IO_THREADS threads, each a contiguous part
    of the file, in READ_PIECE pieces, each piece checksummed by its thread right after it is
    read (CRC-32C releases the GIL); checksums go to ``got[slot]``, and a nonzero padding is
    reported naming the blob. When the segments are not cached, the whole pages of those
    placed congruent to their file offsets (see :func:`~epochal.storage.io.direct.placed`)
    are read with O_DIRECT, straight from the disk into them. Progress is reported by the calling thread (its own bytes as
    it goes, the others' at the end)."""
    if getattr(f.src, "remote", False):
        _read_pieces(f, par, verify, got)
        return
    path, src, fn = f.path, f.src, f.index.fn
    piece_size = tuning.READ_PIECE
    groups = contiguous([item.buf.nbytes for item in par], tuning.IO_THREADS)
    done = [0] * len(groups)
    # cold: whole pages straight from the disk into buffers placed congruent to their file
    # offsets (reader.allocate); cached: copied from the page cache, which is faster
    cold = getattr(src, "nowait", False) and not direct.looks_cached(src, [(p.off, p.buf.nbytes) for p in par])
    dfd = direct.open_read(path) if cold else -1

    def job(g: int) -> Callable[[], None]:
        def run() -> None:
            for k in groups[g]:
                item = par[k]
                buf, off, name = item.buf, item.off, item.name
                crc = direct.read_checked(src, dfd, buf, off, name, fn if verify else None, piece_size, g == 0)
                done[g] += buf.nbytes
                if verify:
                    got[item.slot] = crc
                    if item.pad and any(read_bytes(src, item.pad, off + buf.nbytes, "padding", name)):
                        raise corrupt(path, DAMAGED_PAD, name)
        return run

    try:
        run_parallel([job(g) for g in range(len(groups))])
    finally:
        if dfd >= 0:
            os.close(dfd)
    report_progress(sum(done[1:]))


def _read_pieces(f: Opened, par: list[BigRead], verify: bool, got: list[int]) -> None:
    """Remote: every segment of ``par`` in REMOTE_PIECE pieces (a segment's padding read with
    its last piece, no request of its own); pieces that follow each other in the file (the
    segments of the blobs a load wants side by side, each a few MiB) are fetched together,
    one ranged GET of up to REMOTE_PIECE bytes (a request costs a round trip: a 512 MiB db
    of 2 MiB tensors took 256 of them, one per segment). Requests are taken in file order by
    REMOTE_THREADS threads; each piece is checksummed by its thread, and the piece checksums
    of a segment are combined into ``got[slot]``
    (:func:`~epochal.storage.io.checksum.combined`); a nonzero padding is reported naming
    the blob."""
    path, src, fn = f.path, f.src, f.index.fn
    size = tuning.REMOTE_PIECE
    pieces: list[tuple[int, int, int]] = []  # (segment k, start in its buffer, length)
    requests: list[list[int]] = []  # piece indices, contiguous in the file
    end = req_bytes = -1
    for k in sorted(range(len(par)), key=lambda k: par[k].off):
        item = par[k]
        n = item.buf.nbytes
        for a in range(0, n, size):
            ln = min(size, n - a)
            last = a + ln == n
            span = ln + (item.pad if last else 0)
            if item.off + a != end or req_bytes + span > size:
                requests.append([])
                req_bytes = 0
            requests[-1].append(len(pieces))
            pieces.append((k, a, ln))
            req_bytes += span
            end = item.off + a + span
    crcs = np.zeros(len(pieces), dtype=np.uint32)
    pads = [bytearray(item.pad) if verify else bytearray(0) for item in par]
    taken = iter(requests)
    lock = threading.Lock()
    done = [0] * max(1, min(tuning.REMOTE_THREADS, len(requests)))

    def job(g: int) -> Callable[[], None]:
        def run() -> None:
            while True:
                with lock:
                    req = next(taken, None)
                if req is None:
                    return
                views: list[memoryview] = []
                for i in req:
                    k, a, n = pieces[i]
                    item = par[k]
                    views.append(item.buf[a : a + n])
                    if a + n == item.buf.nbytes and item.pad:
                        views.append(memoryview(pads[k]) if pads[k] else _pad_scratch(item.pad))
                k0, a0, _ = pieces[req[0]]
                names = sorted({par[pieces[i][0]].name for i in req})
                read_exact(src, views, par[k0].off + a0, ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""),
                           progress=g == 0)
                for i in req:
                    k, a, n = pieces[i]
                    if verify:
                        crcs[i] = fn(par[k].buf[a : a + n], 0)
                    done[g] += n
        return run

    run_parallel([job(g) for g in range(len(done))])
    report_progress(sum(done[1:]))
    if not verify or not pieces:
        return
    for k, item in enumerate(par):
        if any(pads[k]):
            raise corrupt(path, DAMAGED_PAD, item.name)
    group_of = np.array([k for k, _, _ in pieces], dtype=np.int64)
    lens = np.array([n for _, _, n in pieces], dtype=np.int64)
    whole = combined(fn, crcs, lens, np.zeros_like(lens), group_of, len(par))
    for k, item in enumerate(par):
        got[item.slot] = int(whole[k])


def _pad_scratch(n: int) -> memoryview:
    """Somewhere to read ``n`` bytes of padding that is not checked (a load without
    verification): a fresh buffer per request, so threads never share it."""
    return memoryview(bytearray(n))
