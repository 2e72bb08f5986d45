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
    its last piece, no request of its own), pieces taken in file order by REMOTE_THREADS
    threads, each checksummed by its thread; the piece checksums of a segment are combined
    into ``got[slot]`` (:func:`~epochal.storage.io.checksum.combined`); a nonzero padding is
    reported naming the blob."""
    path, src, fn = f.path, f.src, f.index.fn
    size = tuning.REMOTE_PIECE
    pieces: list[tuple[int, int, int]] = []  # (segment k, start in its buffer, length)
    for k, item in enumerate(par):
        n = item.buf.nbytes
        pieces.extend((k, a, min(size, n - a)) for a in range(0, n, size))
    crcs = np.zeros(len(pieces), dtype=np.uint32)
    pads = [bytearray(item.pad) if verify else bytearray(0) for item in par]
    taken = iter(range(len(pieces)))
    lock = threading.Lock()
    done = [0] * max(1, min(tuning.REMOTE_THREADS, len(pieces)))

    def job(g: int) -> Callable[[], None]:
        def run() -> None:
            while True:
                with lock:
                    i = next(taken, None)
                if i is None:
                    return
                k, a, n = pieces[i]
                item = par[k]
                views = [item.buf[a : a + n]]
                if a + n == item.buf.nbytes and pads[k]:
                    views.append(memoryview(pads[k]))
                read_exact(src, views, item.off + a, item.name, progress=g == 0)
                if verify:
                    crcs[i] = fn(views[0], 0)
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
