"""Writing an incremental db: a ByteSink of the logical file that stores an extent file.

The format's writer streams the logical file (a native db) into an :class:`ExtentSink` as it
would into a plain sink. Bytes outside content chunks go straight through to the file; each
content chunk (a range the caller names: a piece of a big segment) is gathered, given its
handed to ``decide``, which says which parts of it are references to older files' bytes and
which are stored, and gives its digest when it has one. On commit the tables and the head are written
(:mod:`.extents`), and the inner sink commits: the whole file appears at once or not at all.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..checksum import ALGORITHM_IDS, checksum_function
from ..seam import ByteSink
from . import (
    CHUNK_DTYPE,
    EXT_DTYPE,
    EXTENT_MAGIC,
    EXTENT_VERSION,
    HEAD,
    HEAD_SIZE,
    RefFile,
    pack_extents,
)

__all__ = ["ExtentSink", "Piece", "digest"]

#: (offset in the chunk, length, source: 0 stored here / k the k-th ref, offset in the source)
Piece = tuple[int, int, int, int]
#: (chunk's logical offset, its bytes) -> its pieces (a list of :data:`Piece`, or an int64
#: array of such rows), in order, tiling the chunk; and its digest (None: not computed, the
#: chunk is then absent from the chunk table: a later save compares its bytes instead)
Decide = Callable[[int, memoryview], tuple[Any, bytes | None]]


#: pieces shorter than this are checksummed keeping the GIL (see ``ExtentSink.fn_small``)
_SMALL = 64 << 10


def digest(data: Any) -> bytes:
    """A chunk's content identity: BLAKE2b-128 (hashlib; releases the GIL on big buffers)."""
    return hashlib.blake2b(data, digest_size=16).digest()


class ExtentSink:
    """A ByteSink for a logical file of ``logical_size`` bytes (None: as many as are written)
    that writes an extent file to ``inner``. ``chunks``: sorted, disjoint ``(logical offset,
    length)`` content chunks (more may follow, :meth:`add_chunks`); ``breaks``: logical offsets
    where a stored extent must end (so a later :meth:`patch` of the range before one replaces
    a whole extent); ``refs``: the referenced files, filled in by ``decide`` as it references
    them."""

    def __init__(self, inner: ByteSink, algorithm: str, logical_size: int | None, chunks: Sequence[tuple[int, int]],
                 decide: Decide, refs: list[RefFile], *, step: int = -1, breaks: Sequence[int] = ()) -> None:
        self.inner, self.name = inner, inner.name
        self.algorithm, self.fn = algorithm, checksum_function(algorithm)
        #: for the changed runs (a row or a few, thousands a save): on this thread, keeping
        #: the GIL (releasing it per piece hands it to the file's checksum thread and waits)
        self.fn_small = checksum_function(algorithm, inline=True)
        self.logical_size, self.step = logical_size, step
        self.chunks, self.decide, self.refs = list(chunks), decide, refs
        self.breaks = sorted(set(breaks))
        self.pos = 0  # logical bytes received
        self.phys = HEAD_SIZE  # physical bytes written (after the head placeholder)
        self.ext: list[tuple[int, ...]] = []  # loff, len, source, crc, soff (the newest rows)
        self._parts: list[np.ndarray] = []  # the older rows, in blocks (int64, same columns)
        self.chunk_rows: list[tuple[int, int, bytes]] = []
        self._open: list[int] | None = None  # the stored extent being written: loff, len, crc, soff
        self._ci = 0
        self._buf: bytearray | None = None
        self._filled = 0
        self.stored_bytes = 0
        self._patches: list[tuple[int, bytes]] = []
        inner.write(bytes(HEAD_SIZE))

    # ---- the stream
    def add_chunks(self, chunks: Sequence[tuple[int, int]]) -> None:
        """More content chunks, after the known ones and at or past the bytes received (a
        segment whose stored length is known only when the stream reaches it)."""
        last = self.chunks[-1][0] + self.chunks[-1][1] if self.chunks else 0
        for start, ln in chunks:
            if start < max(last, self.pos) or ln <= 0:
                raise ValueError(f"{self.name}: content chunk at {start} overlaps what came before")
            self.chunks.append((start, ln))
            last = start + ln

    def write(self, buffer: Any) -> int:
        bufs = buffer if isinstance(buffer, (list, tuple)) else [buffer]
        total = 0
        for b in bufs:
            mv = memoryview(b).cast("B") if not isinstance(b, memoryview) or b.format != "B" or b.ndim != 1 else b
            total += mv.nbytes
            while mv.nbytes:
                mv = self._take(mv)
        return total

    def _take(self, mv: memoryview) -> memoryview:
        """Consume a prefix of ``mv``; return the rest."""
        if self._ci < len(self.chunks):
            start, ln = self.chunks[self._ci]
            if self.pos >= start:  # inside a chunk: gather it
                if self._filled == 0 and mv.nbytes >= ln:  # whole in this buffer: no copy
                    self.pos += ln
                    self._chunk_done(start, mv[:ln])
                    self._ci += 1
                    return mv[ln:]
                if self._buf is None:
                    self._buf = bytearray(ln)
                n = min(mv.nbytes, ln - self._filled)
                self._buf[self._filled:self._filled + n] = mv[:n]
                self._filled += n
                self.pos += n
                if self._filled == ln:
                    self._chunk_done(start, memoryview(self._buf))
                    self._buf, self._filled, self._ci = None, 0, self._ci + 1
                return mv[n:]
            limit = start
        else:
            limit = self.logical_size if self.logical_size is not None else self.pos + mv.nbytes
        for b in self.breaks:
            if b > self.pos:
                limit = min(limit, b)
                break
        n = min(mv.nbytes, limit - self.pos) if limit > self.pos else mv.nbytes
        self._store(mv[:n])
        if self.pos in self.breaks:
            self._close()
        return mv[n:]

    def _store(self, mv: memoryview) -> None:
        if self._open is None:
            self._open = [self.pos, 0, 0, self.phys]
        self._open[1] += mv.nbytes
        self._open[2] = self.fn(mv, self._open[2])
        self.inner.write(mv)
        self.pos += mv.nbytes
        self.phys += mv.nbytes
        self.stored_bytes += mv.nbytes

    def _close(self) -> None:
        if self._open is not None and self._open[1]:
            loff, ln, crc, soff = self._open
            self.ext.append((loff, ln, 0, crc, soff))
        self._open = None

    def _chunk_done(self, start: int, data: memoryview) -> None:
        got, dig = self.decide(start, data)
        if dig is not None:
            self.chunk_rows.append((start, data.nbytes, dig))
        p = np.asarray(got, dtype=np.int64).reshape(-1, 4)
        rel, ln, source, soff = p[:, 0], p[:, 1], p[:, 2], p[:, 3]
        if not len(p) or rel[0] != 0 or np.any(rel[1:] != (rel + ln)[:-1]) or rel[-1] + ln[-1] != data.nbytes:
            raise AssertionError("decide must tile its chunk")
        # runs of pieces that make one extent: stored pieces side by side, or references to
        # one source whose bytes follow each other there
        new = np.ones(len(p), dtype=bool)
        new[1:] = (source[1:] != source[:-1]) | ((source[1:] != 0) & (soff[1:] != (soff + ln)[:-1]))
        first = np.flatnonzero(new)
        rows = np.zeros((len(first), 5), dtype=np.int64)  # loff, length, source, crc, soff
        rows[:, 0] = start + rel[first]
        rows[:, 1] = np.add.reduceat(ln, first)
        rows[:, 2] = source[first]
        rows[:, 4] = soff[first]
        keep = np.ones(len(rows), dtype=bool)
        si = np.flatnonzero(rows[:, 2] == 0)  # the stored runs (thousands a save: numpy, no loop over rows)
        lns = rows[si, 1].tolist()
        stored = [data[a:a + n] for a, n in zip((rows[si, 0] - start).tolist(), lns)]
        fn, small = self.fn, self.fn_small
        cont = 0  # (1: the first run continues the stored extent before it)
        if len(si) and si[0] == 0 and self._open is not None:
            self._open[1] += lns[0]
            self._open[2] = (fn if lns[0] >= _SMALL else small)(stored[0], self._open[2])
            keep[0], cont = False, 1
        if len(si) > cont:
            rows[si[cont:], 3] = [(fn if n >= _SMALL else small)(mv, 0) for mv, n in zip(stored[cont:], lns[cont:])]
            at = np.cumsum(rows[si, 1]) - rows[si, 1]
            rows[si[cont:], 4] = self.phys + at[cont:]
        self.phys += sum(lns)
        self.stored_bytes += sum(lns)
        if keep[0] or len(rows) > 1:  # (the open extent, maybe just grown, precedes the rest)
            self._close()
        tail = rows[-1].tolist() if rows[-1, 2] == 0 and keep[-1] else None
        if tail is not None:  # a stored run at the end stays open: the next bytes may continue it
            keep[-1] = False
        block = rows[keep]
        if len(block):
            if block[0, 2] != 0:  # a reference that continues the last one joins it
                last = self._last()
                b0 = block[0].tolist()
                if last is not None and last[2] == b0[2] and last[0] + last[1] == b0[0] and last[4] + last[1] == b0[4]:
                    self._set_last((last[0], last[1] + b0[1], last[2], 0, last[4]))
                    block = block[1:]
            if self.ext and len(block):
                self._parts.append(np.asarray(self.ext, dtype=np.int64).reshape(-1, 5))
                self.ext = []
            if len(block):
                self._parts.append(block)
        if tail is not None:
            self._open = [tail[0], tail[1], tail[3], tail[4]]
        for i in range(0, len(stored), 512):  # (writev: at most IOV_MAX buffers a call)
            self.inner.write(stored[i:i + 512])
        self.pos = start + data.nbytes

    def _last(self) -> tuple[int, ...] | None:
        if self.ext:
            return self.ext[-1]
        return tuple(self._parts[-1][-1].tolist()) if self._parts else None

    def _set_last(self, row: tuple[int, int, int, int, int]) -> None:
        if self.ext:
            self.ext[-1] = row
        else:
            self._parts[-1][-1] = row

    def _all_extents(self) -> np.ndarray:
        """Every extent so far, in logical order (int64 rows: loff, length, source, crc, soff)."""
        self._close()
        blocks = [*self._parts, np.asarray(self.ext, dtype=np.int64).reshape(-1, 5)]
        return np.concatenate(blocks) if len(blocks) > 1 else blocks[0]

    # ---- the end
    def patch(self, offset: int, data: Any) -> None:
        """Overwrite a whole stored extent (a header filled in last; see ``breaks``)."""
        mv = memoryview(data).cast("B")
        ext = self._all_extents()
        self._parts, self.ext = [ext], []
        hit = np.flatnonzero((ext[:, 0] == offset) & (ext[:, 1] == mv.nbytes) & (ext[:, 2] == 0))
        if len(hit):
            i = int(hit[0])
            self._patches.append((int(ext[i, 4]), bytes(mv)))  # (written after the tables)
            ext[i, 3] = self.fn(mv, 0)
            return
        raise ValueError(f"{self.name}: a patch must replace one whole stored extent (at {offset})")

    def tables(self) -> tuple[bytes, bytes]:
        """The head and the tables (extents, chunks, refs text), for the bytes written."""
        rows = self._all_extents()
        ext = np.zeros(len(rows), dtype=EXT_DTYPE)
        for j, c in enumerate(("loff", "length", "source", "crc", "soff")):
            ext[c] = rows[:, j]
        ch = np.zeros(len(self.chunk_rows), dtype=CHUNK_DTYPE)
        if self.chunk_rows:
            ch["loff"] = [r[0] for r in self.chunk_rows]
            ch["length"] = [r[1] for r in self.chunk_rows]
            ch["digest"] = [np.void(r[2]) for r in self.chunk_rows]
        refs = json.dumps([{"file": r.file, "size": r.size, "step": r.step} for r in self.refs],
                          separators=(",", ":")).encode("utf-8")
        packed = pack_extents(ext)
        tables = packed + ch.tobytes() + refs
        body = HEAD.pack(EXTENT_MAGIC, EXTENT_VERSION, ALGORITHM_IDS[self.algorithm], 0, self.logical_size,
                         self.phys, len(ext), len(ch), len(refs), self.step, len(packed), self.fn(tables, 0), 0)
        head = body[:HEAD_SIZE - 4] + self.fn(body[:HEAD_SIZE - 4], 0).to_bytes(4, "little")
        return head, tables

    def commit(self) -> None:
        if self.logical_size is None:
            self.logical_size = self.pos
        if self.pos != self.logical_size:
            raise ValueError(f"{self.name}: {self.pos} of {self.logical_size} logical bytes written")
        head, tables = self.tables()
        self.inner.write(tables)
        self.phys += len(tables)
        for off, data in self._patches:
            self.inner.patch(off, data)
        self.inner.patch(0, head)
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()
