"""Byte ranges of one blob's segments, for readers that need a part of a big array.

A reader restoring a sharded array (the JAX door) wants rows ``a..b`` of a leaf, not the
leaf: :class:`RangedFile` opens a native db as :class:`~.reader.NativeFile` does (the
superblock and the index, both checksummed), finds a blob by bisection and gives each of
its segments' file offset, length and checksum, and reads any byte range of a segment
into a caller's buffer. Checking what was read is the caller's: against the segment's
checksum when it reads the whole segment (in chunks, :meth:`RangedFile.stream`), or
against per-block checksums a codec recorded in the blob's meta (which the index checksum
covers). Nothing here decodes a value or runs code from the file.

A blob with a compressed segment (format 3.0) is read, checked and decoded whole when it is
found (:mod:`.coded`) and held in memory until the file is closed; its segments are then
given at offsets past the end of the file (never a file offset), with the checksum of their
decoded bytes, and read from there: the caller reads and checks them as any other.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ....io.checksum import checksum_function
from ....io.extents import blame_refs, open_db
from ....io.reads import Prefetcher, merged_ranges, read_bytes, read_exact
from ....io.seam import ByteSource
from ..index import Index
from ..items import Opened
from ..layout import SUPERBLOCK_SIZE, corrupt, parse_superblock
from . import coded

__all__ = ["RangedFile", "Segment"]

#: one segment of a blob: (file offset, length, checksum of its data)
Segment = tuple[int, int, int]


class RangedFile:
    """An open native db read by ranges (see the module doc); a context manager."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.src: ByteSource = open_db(self.path, what="native db")
        try:
            self.header = parse_superblock(self.path, self.src.read(SUPERBLOCK_SIZE, 0), self.src.size())
            raw = read_bytes(self.src, self.header.index_length, self.header.index_offset, "the index")
            self.index = Index(self.path, self.header, raw)
        except BaseException:
            self.src.close()
            raise
        #: the file's checksum function (``fn(data, previous=0)``), releasing the GIL
        self.fn: Callable[..., int] = checksum_function(self.header.algorithm)
        #: decoded compressed blobs: blob index -> its segments; (start, bytes) of each
        self._found: dict[int, list[Segment]] = {}
        self._decoded: list[tuple[int, memoryview]] = []
        self._next = self.header.file_size
        self._prefetch: Prefetcher | None = None

    def prefetch(self, spans: list[tuple[int, int]]) -> None:
        """The file ranges ``(offset, length)`` the reads that follow will want, about in
        order: once a read finds the file not cached, the kernel is asked to read ahead of
        it along these ranges (:class:`~epochal.storage.io.reads.Prefetcher`), so a cold read
        is served by big asynchronous disk requests. Ranges past the file (decoded
        segments) are left out."""
        inside = sorted((a, a + n) for a, n in spans if n > 0 and a + n <= self.header.file_size)
        self._prefetch = Prefetcher(self.src, merged_ranges(inside)) if inside else None

    def close(self) -> None:
        self.src.close()

    def __enter__(self) -> RangedFile:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        try:
            blame_refs(self.src, exc)  # an incremental db: name the older file at fault
        finally:
            self.close()

    def find(self, name: str) -> tuple[str, dict[str, Any], list[Segment]] | None:
        """``(kind, meta, segments)`` of blob ``name`` (its meta parsed alone), None when absent."""
        i = self.index.find(name)
        if i is None:
            return None
        kind, meta = self.index.entry(i)
        if self.index.coded is not None and self.index.is_coded(i):
            return kind, meta, self._decode(i)
        rows = self.index.segs[self.index.seg_range(i).start : self.index.seg_range(i).stop]
        segs = [(int(r["offset"]), int(r["length"]), int(r["crc"])) for r in rows]
        return kind, meta, segs

    def _decode(self, i: int) -> list[Segment]:
        """Blob ``i``'s segments, read, checked and decoded (once), at offsets past the file."""
        segs = self._found.get(i)
        if segs is None:
            segs = []
            for buf in coded.read_coded_bytes(Opened(self.path, self.src, self.index), i, True):
                self._decoded.append((self._next, buf))
                segs.append((self._next, buf.nbytes, self.fn(buf, 0)))
                self._next += buf.nbytes + 1  # (+1: no two share an offset, empty ones neither)
            self._found[i] = segs
        return segs

    def names(self) -> list[str]:
        """Every blob's name, in file order."""
        return list(self.index.names())

    def read_into(self, view: memoryview, offset: int, blob: str | None = None) -> None:
        """Fill ``view`` (flat bytes) from file ``offset`` on; a short file is corrupt. Offsets
        past the file are of decoded segments (see the module doc)."""
        if offset >= self.header.file_size and self._decoded:
            for start, buf in self._decoded:
                if start <= offset and offset + view.nbytes <= start + buf.nbytes:
                    view[:] = buf[offset - start : offset - start + view.nbytes]
                    return
        if self._prefetch is not None:
            self._prefetch.read([view], offset, blob or "", progress=False)
            return
        read_exact(self.src, [view], offset, blob, progress=False)

    def stream(self, seg: Segment, scratch: memoryview, blob: str,
               use: Callable[[int, memoryview], None], what: str = "") -> None:
        """Read all of ``seg`` in pieces of ``scratch``'s size, calling ``use(start, piece)``
        for each (``start``: its offset in the segment), then check the segment's checksum:
        CheckpointCorruptError naming the file, ``blob`` and ``what`` (the value in it) when
        it does not match. What
        ``use`` copied must not be used before this returns."""
        offset, length, want = seg
        crc, pos, size = 0, 0, scratch.nbytes
        if size <= 0 and length:
            raise ValueError("stream needs a scratch buffer of at least one byte")
        while pos < length:
            n = min(size, length - pos)
            piece = scratch[:n]
            self.read_into(piece, offset + pos, blob)
            crc = self.fn(piece, crc)
            use(pos, piece)
            pos += n
        if crc != want:
            raise corrupt(self.path, f"{what}: data checksum mismatch" if what else "data checksum mismatch", blob)

