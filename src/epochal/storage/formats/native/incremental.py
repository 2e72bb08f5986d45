"""Incremental native saves: write only the bytes that differ from an older step's file.

:func:`write_incremental` lays the file out exactly as :func:`~.write.write_native` would (the
same logical bytes: superblock, segments, index) and streams it into an
:class:`~epochal.storage.io.extents.sink.ExtentSink`. Every segment of at least
``MIN_CHUNKED`` bytes is cut into content chunks of ``CHUNK_BYTES`` (from the segment's
start); each chunk is

* on this machine, when the base holds the same blob's same segment at the same length,
  compared with those bytes (no hashing: the copy the save that wrote the base kept, while
  its files are unchanged, :mod:`.kept`; else read through the page cache) in units of
  ``DIFF_UNIT``: equal throughout, a reference whole; equal runs references and changed runs
  stored (an embedding table with 2% of its rows changed writes about 2% of its bytes),
  unless more than ``DIFF_MAX`` of it changed;
* else a reference to the older bytes when its BLAKE2b-128 digest is one the base file
  records (a frozen layer, an optimizer state no step touched: whatever moved in the file);
* else, at a URL, compared with the base's same segment as above (a read there is a
  download: the digest comes first);
* else stored whole.

A chunk saved as runs records no digest (a later save compares its bytes). Compaction: a
chunk whose references would lie in more than ``incremental_sources`` older files or be cut
into more than ``incremental_pieces`` pieces (:mod:`epochal.knobs`; 8 and 2,048) is stored
whole again (so reads stay bounded).
References name stored bytes of older files (never another reference), so a step is read
with at most one hop; the base is the newest committed step before this one, whose own
references are carried over. Everything else (superblock, small segments, padding, index)
is stored. The logical file's checksums are those of a full save, so every read path checks
the referenced bytes too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .... import knobs
from ....errors import CheckpointError
from ...io.checksum import checksum_function, default_algorithm
from ...io.extents import ExtentSource, RefFile
from ...io.extents.sink import ExtentSink, digest
from ...io.seam import committed, is_url, store_for
from .kept import Keeper, KeptBytes
from .layout import SUPERBLOCK_SIZE
from .reads.ranges import RangedFile
from .write import Compressing
from .writer import finish, plan_file, write_data

logger = logging.getLogger("epochal")

__all__ = ["CHUNK_BYTES", "DIFF_MAX", "DIFF_UNIT", "MIN_CHUNKED", "write_incremental"]

#: the content chunk: a segment's bytes are matched in pieces of this size (from its start)
CHUNK_BYTES = 4 << 20
#: segments smaller than this are stored whole (their records would cost more than they save)
MIN_CHUNKED = 64 << 10
#: the unit in which a changed chunk is compared with the same bytes of the base step
DIFF_UNIT = 256  # (a multiple of 64, at least 128)
#: a chunk of which more than this fraction changed is stored whole
DIFF_MAX = 0.5


def _bounded(pieces: np.ndarray) -> bool:
    """Whether ``pieces`` stay within compaction's bounds (the ``incremental_sources`` and
    ``incremental_pieces`` knobs): else the chunk is stored whole again, so a restore reads a
    bounded number of files and a step's extent table stops growing once every row moved."""
    k = knobs.get()
    return len(pieces) <= k.incremental_pieces and _sources(pieces) <= k.incremental_sources


class _Base:
    """The base step's file: its chunks by digest, its blobs' segments by name, and where each
    of its logical bytes is stored."""

    def __init__(self, path: str, ranged: RangedFile, src: ExtentSource, refs: list[RefFile]) -> None:
        self.path, self.ranged, self.src, self.new_refs = path, ranged, src, refs
        ex = src.ex
        self.by_digest = {bytes(d): (int(o), int(n)) for o, n, d in
                          zip(ex.chunks["loff"].tolist(), ex.chunks["length"].tolist(), ex.chunks["digest"])}
        self.digest_of = {o: (n, d) for d, (o, n) in self.by_digest.items()}
        #: on this machine: a changed chunk is compared with the base's bytes (page cache)
        #: rather than hashed; at a URL it is hashed first (a read there is a download)
        self.local = not is_url(path)
        self.starts = ex.ext["loff"].astype(np.int64)
        self.ends = self.starts + ex.ext["length"].astype(np.int64)
        self.sources = ex.ext["source"].astype(np.int64)
        self.soffs = ex.ext["soff"].astype(np.int64)
        me = RefFile(os.path.basename(path), ex.size, ex.step)
        self.files = [me, *ex.refs]  # base source k -> the file it names
        self.ref_id: dict[str, int] = {}
        self._scratch: np.ndarray | None = None
        self._neq: np.ndarray | None = None  # (the comparison's word flags, reused too)
        self._acc: np.ndarray | None = None
        #: base source k -> this file's source for it (-1: not referenced yet)
        self.src_map = np.full(len(self.files), -1, dtype=np.int64)

    def _new_source(self, base_source: int) -> int:
        r = self.files[base_source]
        k = self.ref_id.get(r.file)
        if k is None:
            self.new_refs.append(r)
            k = self.ref_id[r.file] = len(self.new_refs)
        return k

    def resolve(self, loff: Any, length: Any, rel: Any) -> np.ndarray:
        """Pieces (int64 rows: offset in the chunk, length, source, offset there) referencing
        the stored bytes that hold the base's logical bytes ``loff[i] .. loff[i] + length[i]``,
        for chunk offsets ``rel[i]`` (arrays, or one of each): each range cut where the
        base's extents are, in one vectorised pass."""
        lo, n, r = (np.atleast_1d(np.asarray(x, dtype=np.int64)) for x in (loff, length, rel))
        hi = lo + n
        k0 = np.searchsorted(self.starts, lo, side="right") - 1
        k1 = np.searchsorted(self.starts, hi, side="left")
        cnt = k1 - k0
        total = int(cnt.sum())
        at = np.repeat(np.cumsum(cnt) - cnt, cnt)
        k = np.repeat(k0, cnt) + (np.arange(total) - at)
        plo = np.maximum(self.starts[k], np.repeat(lo, cnt))
        phi = np.minimum(self.ends[k], np.repeat(hi, cnt))
        src = self.sources[k]
        for b in np.unique(src[self.src_map[src] < 0]).tolist():
            self.src_map[b] = self._new_source(b)
        out = np.empty((total, 4), dtype=np.int64)
        out[:, 0] = np.repeat(r - lo, cnt) + plo
        out[:, 1] = phi - plo
        out[:, 2] = self.src_map[src]
        out[:, 3] = self.soffs[k] + plo - self.starts[k]
        return out

    def same_segment(self, name: str, j: int, length: int) -> int | None:
        """The base's logical offset of segment ``j`` of blob ``name`` when it has ``length``
        bytes there too."""
        i = self.ranged.index.find(name)
        if i is None:
            return None
        segs = self.ranged.index.seg_range(i)
        if j >= len(segs):
            return None
        row = self.ranged.index.segs[segs.start + j]
        return int(row["offset"]) if int(row["length"]) == length else None

    def digest_at(self, loff: int, length: int) -> bytes | None:
        """The base's digest of its chunk at ``loff`` of ``length`` bytes, when it has one."""
        hit = self.digest_of.get(loff)
        return hit[1] if hit is not None and hit[0] == length else None

    def read(self, loff: int, length: int) -> np.ndarray:
        """The base's logical bytes ``loff .. loff + length``, in a buffer reused from chunk
        to chunk (a fresh 4 MiB one per chunk cost a page fault per 4 KiB): valid until the
        next call."""
        if self._scratch is None or len(self._scratch) < length:
            self._scratch = np.empty(length, dtype=np.uint8)
        buf = self._scratch[:length]
        self.src.read_into([memoryview(buf.data)], loff)
        return buf

    def acc(self, units: int) -> np.ndarray:
        """A word per unit for the comparison, reused from chunk to chunk."""
        if self._acc is None or len(self._acc) < units:
            self._acc = np.empty(units, dtype=np.uint64)
        return self._acc[:units]

    def close(self) -> None:
        self.ranged.close()


def _open_base(base: str | None, path: str, refs: list[RefFile]) -> _Base | None:
    """The base file, when it is an incremental db other than ``path`` (a plain db, or none:
    nothing to reference; the file is then written whole, with its digests)."""
    if base is None or os.path.basename(base) == os.path.basename(path):
        return None
    try:
        ranged = RangedFile(base)
    except (CheckpointError, OSError) as e:  # (a full write is always right)
        logger.info("Incremental save of %s: base %s unreadable (%s); writing it whole", path, base, e)
        return None
    if not isinstance(ranged.src, ExtentSource):
        ranged.close()
        return None
    return _Base(base, ranged, ranged.src, refs)


def _diff(base: _Base, old_at: int, data: memoryview,
          old: np.ndarray | None = None) -> tuple[np.ndarray | None, np.ndarray]:
    """``data`` against the base's logical bytes at ``old_at`` (``old``: those bytes, kept
    from the save that wrote them; None: read), in units of ``DIFF_UNIT``: equal runs become
    references, changed ones are stored (pieces as int64 rows, in order; None when more than
    ``DIFF_MAX`` of it changed), and the changed flag per unit. Vectorised: the units
    compared as rows of words, runs found where the changed flag flips."""
    n = data.nbytes
    if old is None:
        old = base.read(old_at, n)
    new = np.frombuffer(data, dtype=np.uint8)
    units = -(-n // DIFF_UNIT)
    whole = n // DIFF_UNIT * DIFF_UNIT
    changed = np.empty(units, dtype=bool)
    if base._neq is None or len(base._neq) < whole // 8:
        base._neq = np.empty(whole // 8, dtype=bool)
    neq = base._neq[: whole // 8]  # (reused: no fresh pages per chunk)
    np.not_equal(new[:whole].view(np.uint64), old[:whole].view(np.uint64), out=neq)
    # a unit's word flags read as DIFF_UNIT // 64 words, OR-ed column by column (numpy's any
    # along a short axis cost several times more)
    cols = neq.view(np.uint64).reshape(-1, DIFF_UNIT // 64)
    acc = base.acc(len(cols))
    np.bitwise_or(cols[:, 0], cols[:, 1], out=acc)
    for j in range(2, DIFF_UNIT // 64):
        np.bitwise_or(acc, cols[:, j], out=acc)
    np.not_equal(acc, 0, out=changed[: whole // DIFF_UNIT])
    if whole < n:
        changed[-1] = not np.array_equal(new[whole:], old[whole:])
    if not changed.any():
        return base.resolve(old_at, n, 0), changed
    if changed.mean() > DIFF_MAX:
        return None, changed
    bounds = np.concatenate([[0], np.flatnonzero(changed[1:] != changed[:-1]) + 1, [units]])
    lo = bounds[:-1] * DIFF_UNIT
    hi = np.minimum(bounds[1:] * DIFF_UNIT, n)
    mine = changed[bounds[:-1]]
    kept = np.zeros((int(mine.sum()), 4), dtype=np.int64)
    kept[:, 0], kept[:, 1] = lo[mine], (hi - lo)[mine]
    refs = base.resolve(old_at + lo[~mine], (hi - lo)[~mine], lo[~mine])
    out = np.concatenate([kept, refs])
    return out[np.argsort(out[:, 0], kind="stable")], changed


def _sources(pieces: np.ndarray) -> int:
    """How many older files ``pieces`` take bytes from."""
    refs = pieces[:, 2][pieces[:, 2] != 0]
    return len(np.unique(refs)) if len(refs) else 0


def _pieces(base: _Base | None, counterpart: dict[int, int], keeper: Keeper | None, loff: int,
            data: memoryview) -> tuple[Any, bytes | None]:
    """How chunk ``data`` at logical ``loff`` is written, and its digest (see the module doc);
    its bytes kept for the next save (``keeper``; None: none kept)."""
    got, buf, changed = _decide(base, counterpart, keeper, loff, data)
    if keeper is not None:
        keeper.keep(loff, data, buf, changed, DIFF_UNIT)
    return got


def _decide(base: _Base | None, counterpart: dict[int, int], keeper: Keeper | None, loff: int,
            data: memoryview) -> tuple[tuple[Any, bytes | None], np.ndarray | None, np.ndarray | None]:
    """:func:`_pieces`' answer, with the base's kept buffer of the chunk (None: not kept) and
    the changed flags of its units (None: the buffer differs anywhere)."""
    n = data.nbytes
    whole = [(0, n, 0, 0)]
    if base is None:
        return (whole, digest(data)), None, None
    old_at = counterpart.get(loff)
    buf = keeper.old(old_at, n) if keeper is not None and old_at is not None else None
    changed = None
    if old_at is not None and base.local:  # the base's bytes are at hand: compare, no hashing
        pieces, changed = _diff(base, old_at, data, buf)
        if pieces is not None:
            if not _bounded(pieces):
                return (whole, digest(data)), buf, changed  # compaction: stored again, whole
            same = len(pieces) and bool(np.all(pieces[:, 2] != 0))
            return (pieces, (base.digest_at(old_at, n) if same else None)), buf, changed
    dig = digest(data)
    hit = base.by_digest.get(dig)
    if hit is not None and hit[1] == n:
        pieces = base.resolve(hit[0], n, 0)
        if _bounded(pieces):
            return (pieces, dig), buf, changed
    if old_at is not None and not base.local:
        pieces, _ = _diff(base, old_at, data)
        if pieces is not None and _bounded(pieces):
            return (pieces, dig), buf, changed
    return (whole, dig), buf, changed


def write_incremental(path: str | os.PathLike[str], blobs: Mapping[str, Any], *, base: str | None = None,
                      step: int = -1, algorithm: str | None = None, kept: KeptBytes | None = None) -> int:
    """Write ``blobs`` at ``path`` as an incremental db (module doc): the logical file is what
    :func:`~.write.write_native` writes; stored are only the bytes that ``base`` (the db of
    the newest committed step before this one, same folder; None: none) does not hold.
    ``kept``: the bytes the last save in this folder kept (:mod:`.kept`): compared with
    instead of the base's when they are still its; this save's are kept there once it
    commits. With compression, each segment is compressed as the stream reaches it (as
    write_native does), so its chunks are known only then. Atomic and durable as a full save.
    Returns the bytes written (the file's size)."""
    path = os.fspath(path)
    algorithm = algorithm or default_algorithm()
    fn = checksum_function(algorithm)
    plan = plan_file(blobs, fn=fn, defer=True)
    lazy = Compressing(plan, fn) if plan.lazy else None
    refs: list[RefFile] = []
    old = _open_base(base, path, refs)
    keeper = None if kept is None or is_url(path) else kept.take(
        path, base if old is not None else None, [f.file for f in old.files] if old is not None else [])
    try:
        counterpart: dict[int, int] = {}
        seg_blob = np.repeat(np.arange(len(plan.recs)), plan.recs["seg_count"].astype(np.int64))
        names: list[str] = []

        def chunks_of(s: int, off: int, ln: int) -> list[tuple[int, int]]:
            """The content chunks of segment ``s``, ``ln`` bytes at logical ``off``, and their
            counterparts in the base (its same blob's same segment, when as long)."""
            at = None
            if old is not None:
                if not names:
                    heap, recs = plan.names_heap, plan.recs
                    names.extend(heap[o:o + n].decode("utf-8", "surrogatepass")
                                 for o, n in zip(recs["name_off"].tolist(), recs["name_len"].tolist()))
                b = int(seg_blob[s])
                at = old.same_segment(names[b], s - int(plan.recs["seg_first"][b]), ln)
            if at is not None:
                counterpart.update((off + c, at + c) for c in range(0, ln, CHUNK_BYTES))
            return [(off + c, min(CHUNK_BYTES, ln - c)) for c in range(0, ln, CHUNK_BYTES)]

        big = np.flatnonzero(plan.segs["length"] >= MIN_CHUNKED).tolist()
        chunks: list[tuple[int, int]] = []
        if lazy is None:
            for s in big:
                chunks += chunks_of(s, int(plan.segs["offset"][s]), int(plan.segs["length"][s]))
        logical = None if lazy else plan.index_offset + plan.index_length  # (compressed: known at the end)
        inner = store_for(path).create(path, size=logical)
        try:
            out = ExtentSink(inner, algorithm, logical, chunks,
                             lambda lo, data: _pieces(old, counterpart, keeper, lo, data), refs,
                             step=step, breaks=[SUPERBLOCK_SIZE])
        except BaseException:
            inner.abort()
            raise

        def produce(k: int) -> tuple[Any, int, Any]:  # (a segment, when the stream reaches it)
            assert lazy is not None
            view, pad, done = lazy.produce(k)
            if view.nbytes >= MIN_CHUNKED:
                out.add_chunks(chunks_of(k, out.pos, view.nbytes))
            return view, pad, done

        with committed(out):
            if lazy is None:
                plan.checksummed(write_data(out, plan, algorithm, chunk=CHUNK_BYTES))
                finish(out, plan, algorithm, fn)
            else:  # (every chunked segment made when reached: its offset follows the stored lengths)
                finish(out, lazy.laid_out(lazy.stream(out, CHUNK_BYTES, tuple(big), produce)), algorithm, fn)
        if keeper is not None:
            keeper.commit(path, [r.file for r in refs])
        return out.phys
    finally:
        if old is not None:
            old.close()
