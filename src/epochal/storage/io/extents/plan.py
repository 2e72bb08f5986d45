"""One read plan per incremental db: every window of a restore served from it, no new planning.

A restore reads a db's logical bytes in windows of a few MiB (one per checksum piece); a plan
made per window (:func:`.reads.gather`) walks that window's extents again, a hundred numpy
calls each time on tables that the window's own bytes have pushed out of the cache. A
:class:`FilePlan` does that work once over the whole extent table, when the table allows it:

- the *bulk* source (the one holding the most bytes) keeps its bytes at one fixed distance
  from their logical offsets throughout (an older full step's file, where every byte is where
  the logical file has it), so a window's share of it is one read straight into place;
- every other source's extents lie in that source in logical order, without overlap (as a
  save writes them), so the pieces a window takes from one source are one run of that
  source's pieces, and its merged spans (gaps of at most ``MERGE_GAP``, at most
  ``MERGE_SPAN`` long) are runs of spans planned once.

A window then costs a few binary searches (all sources at once, on keys of source and
logical offset), its bulk read, and one ``iovec`` array gathered from the planned rows of
every source it touches (the pieces' addresses shifted to the window's buffer, each source's
first and last piece clipped to the window), read in one ``preadv`` per span. A table that
does not allow it (an extent read from another place of the bulk file, pieces of one source
out of order or overlapping there, a source that takes no iovec array: a remote one) is read
by :func:`.reads.gather`, planned window by window: the same bytes either way. Nothing is
checked here: the format's checksums cover the logical bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .reads import MAX_PIECES_READ, MERGE_GAP, MERGE_SPAN, ReadIov, ReadParts, address

__all__ = ["MIN_EXTENTS", "FilePlan"]


#: the rows of all non-bulk sources are keyed by (source, logical offset) packed in one int64
_KEY_BITS = 47
#: below this many extents in a window, the window is planned alone (:func:`.reads.gather`)
MIN_EXTENTS = 64


class FilePlan:
    """The read plan of a whole extent table (module doc); :attr:`usable` is False where the
    table does not allow one (then read window by window with :func:`.reads.gather`)."""

    def __init__(self, ext: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], nsrc: int,
                 direct: Sequence[bool], junk: memoryview) -> None:
        """``ext``: the extents' logical starts, ends, sources and offsets there (int64,
        logical order); ``direct[k]``: source ``k`` takes iovec arrays; ``junk``: where the
        gaps between the pieces of one read go (never read back)."""
        starts, ends, srcs, soffs = ext
        self._junk = junk
        self.usable = False
        self.bulk = -1
        self.delta = 0
        if not len(starts) or not all(direct) or int(ends[-1]) >= 1 << _KEY_BITS:
            return
        counts = np.bincount(srcs, weights=ends - starts, minlength=nsrc)
        bulk = int(np.argmax(counts))
        sel = srcs == bulk
        held = np.flatnonzero(sel)
        self._bulk_starts, self._bulk_ends = starts.take(held), ends.take(held)
        delta = soffs.take(held) - self._bulk_starts
        if int(delta.min()) != int(delta.max()):
            return
        self.bulk, self.delta = bulk, int(delta[0])
        rest = np.flatnonzero(~sel)
        small = np.uint16 if nsrc <= 1 << 16 else np.int64  # (a radix sort)
        order = rest[np.argsort(srcs[rest].astype(small), kind="stable")]  # by source, logical order within
        src, lo, hi, soff = srcs.take(order), starts.take(order), ends.take(order), soffs.take(order)
        n = len(order)
        ln = hi - lo
        new = np.ones(n, dtype=bool)  # a source's first piece
        new[1:] = src[1:] != src[:-1]
        gap = np.zeros(n, dtype=np.int64)
        gap[1:] = soff[1:] - (soff + ln)[:-1]
        if np.any(gap[~new] < 0):  # a source's pieces out of order there, or overlapping
            return
        cut = new | (gap > MERGE_GAP)
        if n and int((soff + ln).max() - soff.min()) >= MERGE_SPAN:
            first = np.flatnonzero(cut)
            base = np.repeat(soff[first], np.diff(np.append(first, n)))
            part = (soff - base) // MERGE_SPAN
            cut[1:] |= part[1:] != part[:-1]
        gap[cut] = 0
        has = gap > 0
        #: piece k at row pos[k], a gap before it at pos[k] - 1
        self._pos = pos = np.arange(n) + np.cumsum(has)
        rows = n + int(has.sum())
        #: per row: its iovec as far as the plan knows it (a piece: its logical start, to which
        #: a window adds its buffer's address less its offset; a gap: the junk buffer) and
        #: length, whether it is a piece (1) or a gap (0), its offset in its source, its
        #: source, and whether it starts a span
        self._iov = np.empty((rows, 2), dtype=np.uint64)
        self._piece = np.zeros(rows, dtype=np.uint64)
        self._where = np.empty(rows, dtype=np.int64)
        self._src = np.empty(rows, dtype=np.int64)
        self._span = np.zeros(rows, dtype=bool)
        g = pos[has] - 1
        self._iov[pos, 0], self._iov[pos, 1], self._piece[pos] = lo, ln, 1
        self._iov[g, 0], self._iov[g, 1] = address(junk), gap[has]
        self._where[pos], self._src[pos], self._span[pos] = soff, src, cut
        self._where[g], self._src[g] = soff[has] - gap[has], src[has]
        #: the pieces' (source, logical start) and (source, logical end) keys, sorted
        self._keys = src[new] << _KEY_BITS
        self._kstart = (src << _KEY_BITS) | lo
        self._kend = (src << _KEY_BITS) | hi
        self._lo, self._hi = lo, hi
        self.usable = True

    def read(self, dest: memoryview, offset: int, read_iov: ReadIov, read_parts: ReadParts) -> None:
        """Fill ``dest`` (flat, writable bytes) with the logical bytes from ``offset``: the
        bulk source's share in one read, then every other source's pieces over it."""
        end = offset + dest.nbytes
        bs, be = self._bulk_starts, self._bulk_ends
        a, b = int(be.searchsorted(offset, "right")), int(bs.searchsorted(end, "left"))
        if a < b:
            lo, hi = max(int(bs[a]), offset), min(int(be[b - 1]), end)
            read_parts(self.bulk, [dest[lo - offset : hi - offset]], lo + self.delta, hi - lo)
        if not len(self._keys):
            return
        first = self._kend.searchsorted(self._keys | offset, "right")  # each source's first piece here
        last = self._kstart.searchsorted(self._keys | end, "left")  # ... and the one after its last
        some = first < last
        if not some.any():
            return
        first, last = first[some], last[some]
        ra, rb = self._pos[first], self._pos[last - 1] + 1  # each source's rows here
        count = rb - ra
        at = np.zeros(len(count) + 1, dtype=np.int64)  # where each source's rows begin in iov
        np.cumsum(count, out=at[1:])
        idx = np.arange(int(at[-1])) + np.repeat(ra - at[:-1], count)
        iov = self._iov[idx]
        iov[:, 0] += self._piece[idx] * np.uint64(address(dest) - offset)
        head = np.maximum(offset - self._lo[first], 0)  # pieces begun before the window: clipped
        tail = np.maximum(self._hi[last - 1] - end, 0)  # ... and those ending after it
        top = at[:-1]
        iov[top, 0] += head.astype(np.uint64)
        iov[top, 1] -= head.astype(np.uint64)
        iov[at[1:] - 1, 1] -= tail.astype(np.uint64)
        span = self._span[idx]
        span[top] = True
        firsts = np.flatnonzero(span)
        where = self._where[idx[firsts]]
        where[np.searchsorted(firsts, top)] += head
        srcs = self._src[idx[firsts]].tolist()
        cum = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(iov[:, 1], out=cum[1:])
        bounds = firsts.tolist()
        for s, w, x0, y0 in zip(srcs, where.tolist(), bounds, [*bounds[1:], len(idx)]):
            for x in range(x0, y0, MAX_PIECES_READ):
                y = min(y0, x + MAX_PIECES_READ)
                read_iov(s, iov[x:y], w if x == x0 else int(self._where[idx[x]]), int(cum[y] - cum[x]))
