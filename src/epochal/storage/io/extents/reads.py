"""The read plan of an incremental db's logical bytes: every source file's pieces in few reads.

:meth:`~.extents.ExtentSource.read_into` fills a window of the logical file from the extents
that tile it. :func:`gather` plans it with numpy over all the window's extents at once (no
Python step per extent): the source holding the most bytes, when its extents keep their
relative positions, is read in one span straight into place (the other sources' pieces then
overwrite what it held there); every other piece is grouped by source file, sorted by its
offset there and merged into spans (gaps of at most ``MERGE_GAP``, at most ``MERGE_SPAN``
long); each span is one ``preadv`` whose buffers are the pieces' places in the destination
(each gap to a scratch buffer). On a local file the ``iovec`` array is built by numpy and
handed to the kernel as it is (:func:`preadv_iov`); elsewhere each piece is a memoryview.
Nothing is checked here: the format's checksums cover the logical bytes.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["MAX_PIECES_READ", "MERGE_GAP", "MERGE_SPAN", "gather", "preadv_iov"]

#: a read takes the extents of one source in one span when they lie at most this far apart
MERGE_GAP = 256 << 10
#: ... and the span is at most this long
MERGE_SPAN = 16 << 20
#: the most buffers one read fills (under the kernel's IOV_MAX of 1024)
MAX_PIECES_READ = 1000

#: pieces are sorted by (source, offset there) packed in one int64: offsets below 2**47
_SOFF_BITS = 47

_libc: Any = None


def preadv_iov(fd: int, iov: np.ndarray, offset: int) -> int:
    """``preadv(fd, iov, offset)`` with ``iov`` a C-contiguous (n, 2) uint64 array of (address,
    length) rows, as the kernel takes it (no Python object per buffer); the GIL is released.
    Returns the bytes read; OSError on failure (EINTR retried)."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong]
        lib.preadv.restype = ctypes.c_ssize_t
        _libc = lib
    while True:
        n = int(_libc.preadv(fd, iov.ctypes.data, len(iov), offset))
        if n >= 0:
            return n
        e = ctypes.get_errno()
        if e != errno.EINTR:
            raise OSError(e, os.strerror(e))


def _address(view: memoryview) -> int:
    """The address of ``view``'s first byte (0 for an empty view; no ctypes object made)."""
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]) if view.nbytes else 0


#: read ``source``'s iovec rows ``iov`` from its offset ``off`` (``total`` bytes in all)
ReadIov = Callable[[int, np.ndarray, int, int], None]
#: read ``source``'s buffers ``parts`` from its offset ``off`` (``total`` bytes in all)
ReadParts = Callable[[int, list[memoryview], int, int], None]


def gather(dest: memoryview, offset: int, ext: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
           junk: memoryview, nsrc: int, direct: Sequence[bool], read_iov: ReadIov, read_parts: ReadParts) -> None:
    """Fill ``dest`` (flat bytes) with the logical bytes from ``offset`` (module doc).
    ``ext``: the extents' logical starts, ends, sources and offsets there (int64 arrays,
    logical order); ``junk``: where gaps go (``MERGE_GAP`` bytes, never read back);
    ``direct[k]``: source ``k`` takes iovec arrays (``read_iov``), else ``read_parts``."""
    starts, ends, srcs, soffs = ext
    end = offset + dest.nbytes
    k0 = int(np.searchsorted(starts, offset, side="right")) - 1
    k1 = int(np.searchsorted(starts, end, side="left"))
    if k1 - k0 == 1:  # one extent: one read
        s = int(srcs[k0])
        read_parts(s, [dest], int(soffs[k0]) + offset - int(starts[k0]), dest.nbytes)
        return
    lo = np.maximum(starts[k0:k1], offset)
    hi = np.minimum(ends[k0:k1], end)
    src = srcs[k0:k1]
    soff = soffs[k0:k1] + (lo - starts[k0:k1])
    dst = lo - offset
    ln = hi - lo
    counts = np.bincount(src, weights=ln, minlength=nsrc)
    bulk = int(np.argmax(counts))
    sel = src == bulk
    delta = soff[sel] - dst[sel]
    if delta.min() == delta.max():  # in place: one span, the others then overwrite its gaps
        a, b = int(dst[sel][0]), int(dst[sel][-1] + ln[sel][-1])
        read_parts(bulk, [dest[a:b]], a + int(delta[0]), b - a)
        rest = ~sel
    else:
        rest = np.ones(len(src), dtype=bool)
    idx = np.flatnonzero(rest)
    if len(idx) and int(soff.max()) < 1 << _SOFF_BITS:  # one key: a stable sort of nearly sorted keys
        idx = idx[np.argsort((src[idx] << _SOFF_BITS) | soff[idx], kind="stable")]
    else:
        idx = idx[np.lexsort((soff[idx], src[idx]))]
    r_src, r_soff, r_dst, r_len = src[idx], soff[idx], dst[idx], ln[idx]
    n = len(r_src)
    if not n:
        return
    # spans: one source, gaps of at most MERGE_GAP, no overlap, cut every MERGE_SPAN bytes
    cut = np.ones(n, dtype=bool)
    gap = np.zeros(n, dtype=np.int64)
    gap[1:] = r_soff[1:] - (r_soff + r_len)[:-1]
    cut[1:] = (r_src[1:] != r_src[:-1]) | (gap[1:] > MERGE_GAP) | (gap[1:] < 0)
    if int(r_soff.max()) - int(r_soff.min()) >= MERGE_SPAN:  # (else no span is that long)
        first = np.flatnonzero(cut)
        base = np.repeat(r_soff[first], np.diff(np.append(first, n)))
        part = (r_soff - base) // MERGE_SPAN
        cut[1:] |= part[1:] != part[:-1]
    gap[cut] = 0
    # the buffers of every span at once: piece k at row pos[k], a gap before it at pos[k] - 1
    has = gap > 0
    pos = np.arange(n) + np.cumsum(has)
    rows = n + int(has.sum())
    iov = np.empty((rows, 2), dtype=np.uint64)
    where = np.empty(rows, dtype=np.int64)  # each row's offset in its source
    rel = np.full(rows, -1, dtype=np.int64)  # each row's place in dest (-1: a gap)
    rel[pos] = r_dst
    iov[pos, 0] = np.uint64(_address(dest)) + r_dst.astype(np.uint64)
    iov[pos, 1] = r_len
    where[pos] = r_soff
    g = pos[has] - 1
    iov[g, 0] = _address(junk)
    iov[g, 1] = gap[has]
    where[g] = r_soff[has] - gap[has]
    span_first = pos[cut].tolist()
    span_src = r_src[cut].tolist()
    span_end = span_first[1:] + [rows]
    cum = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(iov[:, 1], out=cum[1:])
    for s, a0, b0 in zip(span_src, span_first, span_end):
        for a in range(a0, b0, MAX_PIECES_READ):
            b = min(b0, a + MAX_PIECES_READ)
            total = int(cum[b] - cum[a])
            if direct[s] and not dest.readonly:  # (a read-only buffer: refused below, as ever)
                read_iov(s, iov[a:b], int(where[a]), total)
            else:  # (a remote file: a memoryview per buffer)
                parts = [dest[d : d + m] if d >= 0 else junk[:m]
                         for d, m in zip(rel[a:b].tolist(), iov[a:b, 1].tolist())]
                read_parts(s, parts, int(where[a]), total)
