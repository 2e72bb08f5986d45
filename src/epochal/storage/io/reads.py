"""Reading exact byte ranges from a :class:`~epochal.storage.io.seam.ByteSource`, and keeping
the store fetching ahead of the reader (:class:`Prefetcher`).

Errors name the file and the blob: a file that ends early is corrupt, not an OSError.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ...errors import CheckpointCorruptError
from . import tuning
from .progress import report_progress
from .seam import ByteSource

__all__ = ["Prefetcher", "merged_ranges", "read_bytes", "read_exact"]


def read_exact(
    src: ByteSource, views: Sequence[memoryview], offset: int, blob: str | None,
    progress: bool = True, got: int | None = None,
) -> int:
    """Fill ``views`` from ``offset`` on; a file ending early is reported as corrupt, naming
    ``blob``. ``got``: bytes already read into the views by the caller (the rest is read
    here). ``progress``: report the bytes to the active progress display."""
    want = sum(v.nbytes for v in views)
    if got is None:
        got = src.read_into(views, offset)
    if progress:
        report_progress(want)
    if got == want:
        return want
    # short read: continue buffer by buffer (rare: EOF, or a signal)
    pos = 0
    for v in views:
        end = pos + v.nbytes
        if got < end:
            done = max(0, got - pos)
            while done < v.nbytes:
                n = src.read_into([v[done:]], offset + pos + done)
                if n <= 0:
                    raise CheckpointCorruptError(
                        src.name, f"file is truncated (read stopped at byte {offset + pos + done})", blob
                    )
                done += n
            got = end
        pos = end
    return want


def read_bytes(src: ByteSource, nbytes: int, offset: int, what: str, blob: str | None = None) -> bytes:
    """Exactly ``nbytes`` bytes at ``offset`` (``what`` they are, for the truncation error)."""
    data = src.read(nbytes, offset)
    while len(data) < nbytes:
        more = src.read(nbytes - len(data), offset + len(data))
        if not more:
            raise CheckpointCorruptError(
                src.name, f"file is truncated: {what} needs bytes {offset}..{offset + nbytes}", blob
            )
        data += more
    return data


def merged_ranges(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Consecutive ``(start, end)`` spans that touch, merged into one."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class Prefetcher:
    """Reads ranges of a source and keeps the store fetching ahead of us.

    While every read so far came from the page cache (tried with ``nowait``), no hint is
    given: a hint costs ~8 ms per 64 MiB even when the file is cached. From the first read
    the cache cannot serve on, :meth:`ByteSource.hint` covers the next PREFETCH_WINDOW bytes
    of the ranges being loaded (only those), so a cold read is served by big asynchronous
    disk requests while we copy and checksum, instead of one modest synchronous request per
    read. ``advance`` may be called from another thread."""

    def __init__(self, src: ByteSource, ranges: list[tuple[int, int]]) -> None:
        self.src = src
        self.ranges = ranges
        self.ri = 0
        self.done_to = ranges[0][0] if ranges else 0
        self.enabled = bool(ranges)
        self.cached = src.nowait  # every read so far was served by the page cache
        self._lock = threading.Lock()

    def read(self, views: list[memoryview], offset: int, blob: str, progress: bool = True) -> None:
        """:func:`read_exact` of ``views`` at ``offset``, hinting ahead once the file is
        found not to be cached."""
        if self.cached:
            try:
                got = self.src.read_into(views, offset, nowait=True)
            except OSError:  # EAGAIN: not cached; or a filesystem without RWF_NOWAIT
                got = 0
            if got == sum(v.nbytes for v in views):
                if progress:
                    report_progress(got)
                return
            self.cached = False
            self.advance(offset + got)
            read_exact(self.src, views, offset, blob, progress, got)
            return
        self.advance(offset)
        read_exact(self.src, views, offset, blob, progress)

    def advance(self, pos: int) -> None:
        """Hint the ranges up to PREFETCH_WINDOW bytes past ``pos`` (once not cached)."""
        if self.cached or not self.enabled or pos + tuning.PREFETCH_STEP < self.done_to:
            return
        with self._lock:
            self._advance(pos)

    def _advance(self, pos: int) -> None:
        target = pos + tuning.PREFETCH_WINDOW
        ranges = self.ranges
        self.done_to = max(self.done_to, pos)
        while self.done_to < target and self.ri < len(ranges):
            a, b = ranges[self.ri]
            start = max(a, self.done_to)
            if start >= b:
                self.ri += 1
                continue
            end = min(b, max(target, start + tuning.PREFETCH_STEP))
            if not self.src.hint(start, end - start):
                self.enabled = False
                return
            self.done_to = end
            if end >= b:
                self.ri += 1
