"""The native reader: open (superblock + index), resolve names, allocate, choose a read
path, decode.

A load runs in phases, so that every checksum is verified before any value is decoded or
any live object is touched:

1. :meth:`NativeFile._resolve`: names -> blob indices, in file order;
2. :func:`allocate`: each blob's codec allocates fresh buffers (a :class:`LoadItem` each);
3. a read path fills and verifies them: :mod:`.batch` (many small plain arrays),
   :mod:`.mapped` (views of a memory map), :mod:`.inplace` (big segments straight into
   live memory, verified first) and :mod:`.fill` (everything else, which hands big loads
   to :mod:`.parallel`);
4. :func:`decode`: the codecs build the values (or restore live objects).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ....errors import CheckpointError, MissingBlobError
from ...encoding import codecs as _codecs
from ...encoding.codecs import flat_writable
from ...encoding.fit import check_all_live
from ...io import direct as _direct
from ...io import tuning
from ...io.checksum import checksum_function
from ...io.extents import blame_refs, open_db
from ...io.reads import read_bytes, read_exact
from ...io.seam import ByteSource
from ..base import BlobInfo, ReadStats
from .checks import GroupSums, check_meta
from .index import Index
from .items import DECODE_ERRORS, LoadItem, Opened, raise_codec_error
from .layout import (
    DAMAGED_DATA,
    DAMAGED_GROUP,
    DAMAGED_PAD,
    SUPERBLOCK_SIZE,
    Header,
    NativeStat,
    corrupt,
    parse_superblock,
)
from .reads import batch, coded, fill, inplace, mapped

__all__ = ["NativeFile", "allocate", "decode", "open_native", "stat_native"]


def _open(path: str, whole: bool = False) -> ByteSource:
    return open_db(path, what="native db", whole=whole)


def _read_header(path: str, src: ByteSource) -> Header:
    size = src.size()
    return parse_superblock(path, src.read(SUPERBLOCK_SIZE, 0), size)


class NativeFile:
    """An open native db: verified index in memory, data read on demand.

    ``open_native(path)`` returns one. It reads only the 64-byte superblock and the index at
    open (and verifies both checksums), so inspecting a huge checkpoint or loading a few blobs
    of it is cheap. With ``mmap=True`` values are decoded from read-only views of a memory map
    (arrays are then read-only and share the page cache, nothing is copied up front; a store
    that cannot map reads instead); with ``mmap=False`` they are read into fresh buffers.
    Either way the checksums of the requested blobs are verified before any value is
    decoded, unless ``verify=False``. ``whole``: (nearly) every byte will be read (a full
    load, a verify): a remote source is told so before the superblock is read, and may then
    fetch the whole object in one wave of requests instead of the open's round trip first.
    """

    def __init__(self, path: str | os.PathLike[str], *, mmap: bool = False, whole: bool = False) -> None:
        self.path = os.fspath(path)
        self._src: ByteSource | None = _open(self.path, whole)  # (told before its first read)
        self._mm: Any = None
        try:
            self.header = _read_header(self.path, self._src)
            h = self.header
            raw = read_bytes(self._src, h.index_length, h.index_offset, "the index")
            self._index = Index(self.path, h, raw)
            if mmap:
                self._mm = self._src.map()
        except BaseException:
            self._src.close()
            self._src = None
            raise
        self._f = Opened(self.path, self._src, self._index)

    # ---- lifecycle
    def close(self) -> None:
        """Close the file. Arrays already returned from a memory map keep it alive."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # values still reference the map; it closes when they are freed
            self._mm = None
        if self._src is not None:
            self._src.close()
            self._src = None

    def __enter__(self) -> NativeFile:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        try:
            blame_refs(self._src, exc)  # an incremental db: name the older file at fault
        finally:
            self.close()

    # ---- inspection
    @property
    def mmap(self) -> bool:
        return self._mm is not None

    def stat(self) -> NativeStat:
        """Header summary: version, algorithm, counts and sizes, digest."""
        return NativeStat.of(self.path, self.header)

    def names(self) -> list[str]:
        """Blob names in file order."""
        return list(self._index.names())

    def __len__(self) -> int:
        return self.header.blob_count

    def __iter__(self) -> Iterator[str]:
        return iter(self._index.names())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._index.find(name) is not None

    def info(self, name: str) -> BlobInfo:
        """What the index says about ``name`` (MissingBlobError if absent)."""
        return self._index.info(self._lookup(name))

    def describe(self) -> list[BlobInfo]:
        """Every blob's :class:`BlobInfo`, in file order."""
        self._index.parse_all_metas()
        self._index.names()
        return [self._index.info(i) for i in range(self.header.blob_count)]

    def digest(self) -> str:
        return self.header.digest()

    def _lookup(self, name: str) -> int:
        i = self._index.find(name)
        if i is None:
            raise MissingBlobError(f"{self.path}: no blob {name!r} in this db")
        return i

    # ---- loading
    def __getitem__(self, name: str) -> Any:
        return self.read([name])[name]

    def read(
        self,
        names: Sequence[str] | None = None,
        *,
        allow_incomplete: bool = False,
        existing: Mapping[str, Any] | None = None,
        verify: bool = True,
        stats: ReadStats | None = None,
    ) -> dict[str, Any]:
        """Load ``names`` (all when None); see :meth:`DbBackend.read`. Only the requested
        blobs' bytes are read; all of their checksums are verified before anything is decoded."""
        if self._src is None:
            raise ValueError(f"{self.path}: native db is closed")
        # A bulk load creates tens of thousands of acyclic objects (parsed metas, names,
        # arrays, tuples), each batch of which would trigger a cyclic-GC pass over every
        # live object of the process (~10-15 ms for 20,000 small arrays). Pause the
        # collector for the load; the previous state is restored, nothing else changes.
        pause_gc = (
            self._mm is None and (names is None or len(names) > tuning.MANY_BLOBS) and gc.isenabled()
        )
        if pause_gc:
            gc.disable()
        try:
            return self._read(names, allow_incomplete, existing, verify, stats)
        finally:
            if pause_gc:
                gc.enable()

    def _read(
        self,
        names: Sequence[str] | None,
        allow_incomplete: bool,
        existing: Mapping[str, Any] | None,
        verify: bool,
        stats: ReadStats | None,
    ) -> dict[str, Any]:
        f = self._f
        ids = self._resolve(names, allow_incomplete)
        if existing:
            self._check_live(ids, existing)
        packed = self._index.coded_blobs(ids)
        if packed:  # compressed blobs: read, verified and decoded into fresh buffers first
            got = coded.read_coded(f, sorted(packed), verify)
            plain = self._read([self._index.name(i) for i in ids if i not in packed], False, existing, verify,
                               stats) if len(packed) < len(ids) else {}
            slow, nbytes = decode(f, got, existing)
            if stats is not None:
                stats.nbytes += nbytes
                stats.blobs += len(got)
            return {self._index.name(i): slow[i] if i in packed else plain[self._index.name(i)] for i in ids}
        small: dict[str, np.ndarray] = {}
        total = 0
        # checksum groups read whole whose stored checksum is not what their segments' combine
        # to: their segments are checked one by one, and the load refused as verify refuses it
        suspect = self._index.disagreeing_groups(ids, checksum_function(self._index.header.algorithm, inline=True)) \
            if verify else []
        if self._mm is None and len(ids) > tuning.MANY_BLOBS:
            small, rest, total = batch.read_small_arrays(f, ids, verify, set(suspect))
        else:
            rest = ids
        plan = allocate(f, rest, mapped=self._mm is not None)
        direct: list[Any] = []
        staged = None
        if self._mm is not None:
            mapped.map_views(f, self._mm, plan, verify)
        else:
            if existing and not getattr(f.src, "remote", False):  # (remote: verify, then
                # read again into live memory would fetch every byte twice; the staged path
                # fetches once, in parallel pieces, and copies into the live objects)
                direct = inplace.direct_targets(f, plan, existing)
            if direct and verify:  # before any live memory is written (cold: read, staged)
                staged = inplace.verify_direct(f, direct)
            fill.fill(f, plan, verify, {(d.pos, d.seg) for d in direct})
        if suspect:  # every segment verified one by one: so the group's own checksum is wrong
            g = int(suspect[0])
            first = int(self._index.groups["seg_first"][g])
            raise corrupt(self.path, DAMAGED_GROUP, self._index.name(self._index.blob_of_segment(first)))
        if direct:  # every requested checksum is verified: read into the live memory
            inplace.read_direct(f, plan, direct, staged)
        slow, nbytes = decode(f, plan, existing)
        total += nbytes
        out: dict[str, Any] = {}
        if small and not plan:
            out = small  # built in file order, which is the order of ids
        elif small:
            names_ = self._index.names()
            for i in ids:  # a blob whose value is None is in slow, not small
                nm_ = names_[i]
                out[nm_] = slow[i] if i in slow else small[nm_]
        else:
            for item in plan:
                out[item.name] = slow[item.index]
        if stats is not None:
            stats.nbytes += total
            stats.blobs += len(plan) + len(small)
        return out

    def _check_live(self, ids: list[int], existing: Mapping[str, Any]) -> None:
        """Every live object this load restores fits its blob, or BlobMismatchError naming
        all that do not, before anything is read into or restored over them."""
        live = {n: v for n, v in existing.items() if not isinstance(v, _codecs.PLAIN_VALUES)}
        if not live:
            return
        idx = self._index
        wanted = set(ids)
        found = [(n, i) for n in live if (i := idx.find(n)) is not None and i in wanted]
        where = _codecs.LOAD_OPTIONS.get().where or f"checkpoint {self.path}"
        check_all_live(((n, *idx.entry(i), live[n]) for n, i in sorted(found, key=lambda p: p[1])), where)

    def _resolve(self, names: Sequence[str] | None, allow_incomplete: bool) -> list[int]:
        """Blob indices to load, in file order (so reads go forward through the file)."""
        idx = self._index
        n = self.header.blob_count
        if names is None:
            if self._mm is not None or n <= tuning.MANY_BLOBS:
                idx.names()  # decoded once (a full load uses them): duplicates refused here
            # (else the bulk paths decode and check them before anything is read into a
            # value: the batch path's worker while the first reads are in flight, or
            # allocate() for the blobs it leaves)
            return list(range(n))
        if isinstance(names, str):
            names = [names]
        if len(names) > tuning.MANY_BLOBS and len(names) * 8 > n:
            idx.build_ids()
        found: dict[int, None] = {}
        for nm in names:
            i = idx.find(nm) if isinstance(nm, str) else None
            if i is None:
                if allow_incomplete:
                    continue
                raise MissingBlobError(f"{self.path}: no blob {nm!r} in this db")
            found[i] = None
        return sorted(found)

    def views(self, names: Sequence[str]) -> mapped.MappedViews | None:
        """Verified read-only views of the whole blobs ``names`` on a map of the file, for a
        caller that copies parts of them out: no memory allocated, no copy (see
        :func:`.mapped.verified_views`; None where that path does not apply). Close it after."""
        if self._src is None:
            raise ValueError(f"{self.path}: native db is closed")
        ids = self._resolve(names, False)
        if self._index.coded_blobs(ids):
            return None  # compressed bytes are no views of the blob
        return mapped.verified_views(self._f, ids)

    def read_range(self, name: str, start: int, stop: int, *, verify: bool = True) -> bytes:
        """Bytes ``start .. stop`` of the one-segment blob ``name`` (an array's buffer),
        checked: of a compressed blob only the frames holding them are read and decoded
        (:func:`.coded.read_range`)."""
        if self._src is None:
            raise ValueError(f"{self.path}: native db is closed")
        return coded.read_range(self._f, self._lookup(name), start, stop, verify)

    def verify(self, names: Sequence[str] | None = None) -> None:
        """Re-check the data checksums of ``names`` (all when None) without decoding or
        allocating the values: data streams through a small reusable buffer. Each blob's
        meta is checked too (strict JSON, a known kind, an array meta that fits its length),
        and so is every checksum group all of whose segments belong to those blobs (all
        groups when None), so a file that verifies also loads."""
        idx = self._index
        assert self._src is not None, "native db is closed"
        src = self._src
        # in file order (blob records are): a group is checked only when read in order
        ids = range(self.header.blob_count) if names is None else sorted({self._lookup(n) for n in names})
        if names is None:
            idx.names()  # every name decoded once: duplicates and the name order checked
        segs = idx.segs
        chunk = tuning.CHUNK
        scratch = memoryview(bytearray(chunk))
        groups = GroupSums(idx, None if names is None else {k for i in ids for k in idx.seg_range(i)})
        for i in ids:
            check_meta(self.path, idx, i)
            for k in idx.seg_range(i):
                if idx.coded is not None and idx.coded.row(k) is not None:  # (never in a group)
                    coded.verify_coded(self._f, k, idx.name(i), idx.fn)
                    continue
                off = int(segs["offset"][k])
                left = int(segs["length"][k])
                pad = int(segs["pad"][k])
                crc = 0
                g = groups.slot(k)
                while left:
                    n = min(left, chunk)
                    piece = scratch[:n]
                    read_exact(src, [piece], off, idx.name(i))
                    crc = idx.fn(piece, crc)
                    if g is not None:
                        groups.add(g, piece)
                    off += n
                    left -= n
                if crc != int(segs["crc"][k]):
                    raise corrupt(self.path, DAMAGED_DATA, idx.name(i))
                if pad:
                    tail = read_bytes(src, pad, off, "padding", idx.name(i))
                    if any(tail):
                        raise corrupt(self.path, DAMAGED_PAD, idx.name(i))
                    if g is not None:
                        groups.add(g, tail)
                if g is not None and not groups.end(g, k):
                    raise corrupt(
                        self.path,
                        DAMAGED_GROUP,
                        idx.name(idx.blob_of_segment(int(groups.first[g]))),
                    )


def allocate(f: Opened, ids: list[int], mapped: bool = False) -> list[LoadItem]:
    """Phase 1: the codec of each blob allocates its buffers (nothing is read yet); with
    ``mapped`` the buffers stay empty (the mmap path appends views)."""
    idx = f.index
    cols = idx.columns() if len(ids) > tuning.MANY_BLOBS else None
    codec_cache: dict[str, Any] = {}
    plan: list[LoadItem] = []
    path = f.path
    all_names = idx.names() if cols is not None else None
    entries = idx.all_entries() if cols is not None else None
    meta_ids = idx.recs["meta_id"].tolist() if cols is not None else None
    # big segments of codecs whose decode takes any fresh buffer are placed congruent to
    # their file offsets, so that a cold read can fill them with O_DIRECT (io/direct.py)
    place = not mapped and tuning.DIRECT_READ and getattr(f.src, "nowait", False)
    for i in ids:
        if all_names is not None and entries is not None and meta_ids is not None:
            name = all_names[i]
            kind, meta = entries[meta_ids[i]]
        else:
            name = idx.name(i)
            kind, meta = idx.entry(i)
        if cols is not None:
            first, cnt = cols.seg_first[i], cols.seg_count[i]
            sizes = cols.lengths[first : first + cnt]
        else:
            first, cnt = int(idx.recs["seg_first"][i]), int(idx.recs["seg_count"][i])
            sizes = idx.segs["length"][first : first + cnt].tolist()
        codec = codec_cache.get(kind)
        if codec is None:
            try:
                codec = codec_cache[kind] = _codecs.codec_for_kind(kind)
            except ValueError as e:
                raise corrupt(path, str(e), name) from None
        if mapped:
            bufs: list[memoryview] = []
        else:
            try:
                bufs = codec.allocate(meta, sizes)
            except CheckpointError:
                raise
            except (*DECODE_ERRORS, MemoryError) as e:
                raise corrupt(path, f"bad {kind} meta: {e}", name) from None
            if len(bufs) != cnt:
                raise corrupt(path, f"codec wants {len(bufs)} segments, file has {cnt}", name)
            for j, b in enumerate(bufs):
                if type(b) is not memoryview or b.ndim != 1 or b.format != "B":
                    b = bufs[j] = flat_writable(b)
                if b.nbytes != sizes[j] or b.readonly:
                    raise corrupt(path, f"codec buffer of {b.nbytes} bytes for a {sizes[j]}-byte segment", name)
            if place and getattr(codec, "placeable", False):
                _place(idx, cols, first, bufs)
        plan.append(LoadItem(i, name, kind, meta, codec, bufs))
    return plan


def _place(idx: Index, cols: Any, first: int, bufs: list[memoryview]) -> None:
    for j, b in enumerate(bufs):
        if b.nbytes >= tuning.BIG_SEGMENT:
            off = cols.offsets[first + j] if cols is not None else int(idx.segs["offset"][first + j])
            if (_codecs.buffer_address(b) - off) % _direct.ALIGN:
                bufs[j] = _direct.placed(b.nbytes, off)


def decode(f: Opened, plan: list[LoadItem], existing: Mapping[str, Any] | None) -> tuple[dict[int, Any], int]:
    """Phase 3: every buffer is read and verified; the codecs build the values (in file
    order), restoring ``existing`` live objects where they can. Returns ``{blob index:
    value}`` and the bytes decoded."""
    out: dict[int, Any] = {}
    total = 0
    item = None
    try:
        for item in plan:
            bufs = item.bufs
            live = existing.get(item.name) if existing is not None else None
            out[item.index] = item.codec.decode(item.meta, bufs, live)
            for b in bufs:
                total += b.nbytes
    except Exception as e:
        assert item is not None
        raise_codec_error(f.path, item, e)
    return out, total


def open_native(path: str | os.PathLike[str], *, mmap: bool = True) -> NativeFile:
    """Open a native db lazily for inspection or partial loading (memory-mapped by default).

    Only the superblock and the index are read (both checksums verified); blob data is read
    and verified on ``read``/``[]``. Use as a context manager."""
    return NativeFile(path, mmap=mmap)


def stat_native(path: str | os.PathLike[str]) -> NativeStat:
    """Header-only summary of a native db (one 64-byte read): format version, checksum
    algorithm, blob and segment counts, data/index/file sizes and the digest. Raises
    CheckpointCorruptError on a damaged superblock or a size mismatch (truncation)."""
    p = os.fspath(path)
    src = open_db(p, what="native db", keep=True)  # (an incremental db's tables kept for a load)
    try:
        return NativeStat.of(p, _read_header(p, src))
    finally:
        src.close()
