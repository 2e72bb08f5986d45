"""Read path: the general fill of fresh buffers (every kind of blob, any segment size).

Adjacent small segments (and their padding) are coalesced into one read of about
tuning.BATCH_BYTES and checksummed inline right after, while still in cache (:class:`_Runs`);
big segments are read in tuning.READ_PIECE pieces whose checksums a background thread
computes while the next piece is read (:func:`_read_big`). When the big segments add up to
tuning.PARALLEL_MIN or more (from a remote source: any) they go to :mod:`.parallel`
instead; a remote source's small segments are coalesced into reads of tuning.REMOTE_BATCH.
Every checksum is compared at the end (:func:`_check`), before anything is decoded.
"""

from __future__ import annotations

from collections.abc import Iterator, Set

from ....io import atomic, tuning
from ....io.checksum import Checksummer, checksum_function
from ....io.reads import Prefetcher, merged_ranges, read_bytes
from ..index import Columns
from ..items import BigRead, LoadItem, Opened
from ..layout import ALIGN, DAMAGED_DATA, DAMAGED_PAD, corrupt
from . import parallel

__all__ = ["fill"]

# where padding goes when it is read without being checked (contents never used)
_SCRATCH = memoryview(bytearray(ALIGN))
_ZERO_AREA = bytes(ALIGN * atomic.IOV_MAX)

#: one segment to read: checksum slot, buffer, file offset, padding, checksum, blob name
_Segment = tuple[int, memoryview, int, int, int, str]


def fill(f: Opened, plan: list[LoadItem], verify: bool, skip: Set[tuple[int, int]] = frozenset()) -> None:
    """Phase 2 (reads): read every segment of ``plan`` straight into its buffer and, unless
    ``verify`` is False, check every checksum and padding. ``skip``: (plan position, segment)
    pairs read elsewhere (in place, after this)."""
    idx = f.index
    cols = idx.columns() if len(plan) > tuning.MANY_BLOBS else None
    big = tuning.BIG_SEGMENT
    big_total = sum(
        b.nbytes for pos, item in enumerate(plan) for j, b in enumerate(item.bufs)
        if b.nbytes >= big and (pos, j) not in skip
    )
    remote = getattr(f.src, "remote", False)  # object storage: every big segment in parallel
    parallel_big = big_total >= tuning.PARALLEL_MIN or bool(remote and big_total)
    nslots = sum(len(item.bufs) for item in plan)
    ck = Checksummer(idx.fn, nslots) if verify and big_total and not parallel_big else None
    got = [0] * nslots
    expected: list[tuple[int, str]] = []  # per slot: (crc, blob name)
    par: list[BigRead] = []
    ahead = Prefetcher(f.src, _prefetch_ranges(f, plan, cols, parallel_big))
    runs = _Runs(f, ahead, verify, got)
    try:
        for slot, buf, off, pad, crc, name in _segments(f, plan, cols, skip):
            if verify:
                expected.append((crc, name))
            if buf.nbytes < big:
                runs.add(slot, buf, off, pad, name)
            elif parallel_big:
                par.append(BigRead(slot, buf, off, pad, name))
            else:
                runs.end()
                _read_big(f, ahead, ck, slot, buf, off, pad, name, verify)
        runs.end()
        if par:
            parallel.read_parallel(f, par, verify, got)
        if verify:
            _check(f.path, got, ck, expected)
    finally:
        if ck is not None:
            ck.close()


def _segments(
    f: Opened, plan: list[LoadItem], cols: Columns | None, skip: Set[tuple[int, int]]
) -> Iterator[_Segment]:
    """Every segment to read, in plan (file) order, numbered by checksum slot."""
    idx = f.index
    slot = 0
    for pos, item in enumerate(plan):
        bufs = item.bufs
        nb = len(bufs)
        if cols is not None:
            first = cols.seg_first[item.index]
            offs = cols.offsets[first : first + nb]
            pads = cols.pads[first : first + nb]
            crcs = cols.crcs[first : first + nb]
        else:
            first = int(idx.recs["seg_first"][item.index])
            sl = idx.segs[first : first + nb]
            offs, pads, crcs = sl["offset"].tolist(), sl["pad"].tolist(), sl["crc"].tolist()
        for j, (buf, off, pad, crc) in enumerate(zip(bufs, offs, pads, crcs)):
            if skip and (pos, j) in skip:
                continue  # read in place after every checksum is verified
            yield slot, buf, off, pad, crc, item.name
            slot += 1


def _prefetch_ranges(
    f: Opened, plan: list[LoadItem], cols: Columns | None, parallel_big: bool
) -> list[tuple[int, int]]:
    """The file ranges this load reads (for read-ahead hints), when it is big enough to
    want hints; the big segments of a parallel pass need none."""
    total = sum(b.nbytes for item in plan for b in item.bufs)
    if total < tuning.PREFETCH_MIN:
        return []
    idx, big = f.index, tuning.BIG_SEGMENT
    spans: list[tuple[int, int]] = []
    for item in plan:
        i = item.index
        ks = idx.seg_range(i) if cols is None else range(cols.seg_first[i], cols.seg_first[i] + cols.seg_count[i])
        for k in ks:
            if cols is not None:
                o, ln, pd = cols.offsets[k], cols.lengths[k], cols.pads[k]
            else:
                o, ln, pd = (int(idx.segs[c][k]) for c in ("offset", "length", "pad"))
            if parallel_big and ln >= big:
                continue  # read by the parallel pass, which needs no hints
            spans.append((o, o + ln + pd))
    return merged_ranges(spans)


def _read_big(
    f: Opened, ahead: Prefetcher, ck: Checksummer | None, slot: int, buf: memoryview,
    off: int, pad: int, name: str, verify: bool,
) -> None:
    """One big segment in READ_PIECE pieces, each handed to the background checksummer."""
    piece_size = tuning.READ_PIECE
    for start in range(0, buf.nbytes, piece_size):
        piece = buf[start : start + piece_size]
        ahead.read([piece], off + start, name)
        if ck is not None:
            ck.submit([(slot, piece)])
    if pad and verify and any(read_bytes(f.src, pad, off + buf.nbytes, "padding", name)):
        raise corrupt(f.path, DAMAGED_PAD, name)


def _check(path: str, got: list[int], ck: Checksummer | None, expected: list[tuple[int, str]]) -> None:
    """Compare every slot's checksum (inline ones in ``got``, big ones from ``ck``)."""
    if ck is not None:
        got = [a or b for a, b in zip(got, ck.results())]
    for slot, (want, name) in enumerate(expected):
        if got[slot] != want:
            raise corrupt(path, DAMAGED_DATA, name)


class _Runs:
    """Coalesces file-adjacent small segments into one read of about BATCH_BYTES (at most
    IOV_MAX buffers), checksummed inline right after it, while the bytes are in cache. The
    padding of a run is read into one zeroed scratch area and checked to be zero."""

    def __init__(self, f: Opened, ahead: Prefetcher, verify: bool, got: list[int]) -> None:
        self.path = f.path
        self.ahead = ahead
        self.verify = verify
        self.got = got
        self.fn = checksum_function(f.index.header.algorithm, inline=True)
        self.batch = tuning.REMOTE_BATCH if getattr(f.src, "remote", False) else tuning.BATCH_BYTES
        self.views: list[memoryview] = []
        self.todo: list[tuple[int, memoryview]] = []
        self.start = self.stop = -1  # file range of the current run
        self.blob = ""
        self._new_pad_area()

    def _new_pad_area(self) -> None:
        self.pad_area = bytearray(ALIGN * atomic.IOV_MAX) if self.verify else bytearray(0)
        self.pad_view = memoryview(self.pad_area)
        self.pad_names: list[str] = []

    def add(self, slot: int, buf: memoryview, off: int, pad: int, name: str) -> None:
        """Append one small segment (and its padding) to the run, starting a new run when
        it is not adjacent or the run is full."""
        if self.stop != off or len(self.views) >= atomic.IOV_MAX - 2 or off - self.start >= self.batch:
            if self.views:
                self.flush()
            self.start = off
            self.blob = name
        views = self.views
        if buf.nbytes:
            views.append(buf)
            if self.verify:
                self.todo.append((slot, buf))
        if pad:
            if self.verify:
                k = len(self.pad_names)
                views.append(self.pad_view[k * ALIGN : k * ALIGN + pad])
                self.pad_names.append(name)
            else:
                views.append(_SCRATCH[:pad])
        self.stop = off + buf.nbytes + pad

    def end(self) -> None:
        """Read the current run (if any); the next segment starts a new one."""
        if self.views:
            self.flush()
            self.stop = -1

    def flush(self) -> None:
        """Read the run, checksum its segments, check its padding."""
        self.ahead.read(self.views, self.start, self.blob)
        got, fn = self.got, self.fn
        for slot, buf in self.todo:
            got[slot] = fn(buf, got[slot])
        if self.pad_names:
            if self.pad_area != _ZERO_AREA:
                area = self.pad_area
                for k, name in enumerate(self.pad_names):
                    if any(area[k * ALIGN : (k + 1) * ALIGN]):
                        raise corrupt(self.path, DAMAGED_PAD, name)
            self._new_pad_area()
        self.views, self.todo = [], []
