"""Read path: read-only views of a memory map (``open_native(mmap=True)``, :func:`map_views`;
:func:`verified_views` for a caller that copies parts of whole blobs out).

Nothing is copied up front: arrays decoded from the views are read-only and share the page
cache. Every checksum and padding is still checked before any value is decoded.
"""

from __future__ import annotations

from typing import Any

from ....io import direct as _direct
from ....io import tuning
from ....io.checksum import checksum_spans
from ....io.threads import cpu_threads
from ...base import report_progress
from ..items import LoadItem, Opened
from ..layout import DAMAGED_DATA, DAMAGED_PAD, corrupt

__all__ = ["MappedViews", "map_views", "verified_views"]


def map_views(f: Opened, mm: Any, plan: list[LoadItem], verify: bool) -> None:
    """Phase 2 (mmap): append each segment's view of ``mm`` to its item, after verifying."""
    idx = f.index
    whole = memoryview(mm)
    segs = idx.segs
    for item in plan:
        bufs = item.bufs
        for k in idx.seg_range(item.index):
            off, ln, pad = int(segs["offset"][k]), int(segs["length"][k]), int(segs["pad"][k])
            view = whole[off : off + ln]
            report_progress(ln)
            if verify:
                if idx.fn(view, 0) != int(segs["crc"][k]):
                    raise corrupt(f.path, DAMAGED_DATA, item.name)
                if pad and any(whole[off + ln : off + ln + pad]):
                    raise corrupt(f.path, DAMAGED_PAD, item.name)
            bufs.append(view)


class MappedViews:
    """Verified read-only views of whole blobs on a map of their file (name -> bytes), from
    :func:`verified_views`. :meth:`close` (or leaving the ``with``) lets the views and the
    map go; a view still referenced then keeps the map until it is freed."""

    def __init__(self, mm: Any, views: dict[str, memoryview]) -> None:
        self._mm = mm
        self.views = views

    def close(self) -> None:
        """Release the views and close the map."""
        views, self.views = self.views, {}
        for v in views.values():
            try:
                v.release()
            except BufferError:  # an array made from it is alive: it goes with that array
                pass
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass
            self._mm = None

    def __enter__(self) -> MappedViews:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def verified_views(f: Opened, ids: list[int]) -> MappedViews | None:
    """Read-only views of the blobs ``ids`` (one segment each) on a map of the file, every
    checksum and padding verified (CRC-32C over the page-cache pages, spread over a few
    threads for big sets: no memory allocated, nothing copied). None, with nothing read,
    where a blob has another number of segments than one, the segments do not look cached
    (a map reads a cold file a small window at a time, where big reads keep the disk busy)
    or the store cannot map. A damaged one: CheckpointCorruptError naming file and blob."""
    idx = f.index
    segs = idx.segs
    spans: list[tuple[int, int, int, int, str]] = []  # offset, length, pad, crc, name
    for i in ids:
        ks = idx.seg_range(i)
        if len(ks) != 1:
            return None
        k = ks.start
        spans.append((int(segs["offset"][k]), int(segs["length"][k]), int(segs["pad"][k]), int(segs["crc"][k]),
                      idx.name(i)))
    if not spans or not _direct.looks_cached(f.src, [(s[0], s[1] + s[2]) for s in spans]):
        return None
    mm = f.src.map()
    if mm is None:
        return None
    out = MappedViews(mm, {})
    whole = memoryview(mm)
    views = [whole[off : off + ln] for off, ln, _, _, _ in spans]
    try:
        sizes = [s[1] for s in spans]
        threads = cpu_threads() if sum(sizes) >= tuning.PARALLEL_MIN else 1
        crcs = checksum_spans(idx.fn, mm, [(s[0], s[1]) for s in spans], threads)
        for (off, ln, pad, crc, name), got in zip(spans, crcs):
            if got != crc:
                raise corrupt(f.path, DAMAGED_DATA, name)
            if pad and any(whole[off + ln : off + ln + pad]):
                raise corrupt(f.path, DAMAGED_PAD, name)
        out.views = {s[4]: v for s, v in zip(spans, views)}
        report_progress(sum(sizes))
    except BaseException:
        for v in views:
            v.release()
        whole.release()
        out.close()
        raise
    whole.release()
    return out
