"""The ``native`` db_type: epochal's own checkpoint file format (see docs/format.md).

One file per (node, epoch)::

    [superblock: 64 bytes] [segment 0][pad] [segment 1][pad] ... [index]

* Blob data is written raw, straight from the arrays' memory, each segment starting at a
  multiple of 64 bytes, so a reader can ``readinto`` a fresh array or memory-map it.
* The index at the end holds fixed-size binary tables (blobs, segments, a name-sorted
  permutation for bisection) plus a names heap and one compact JSON array of the distinct
  ``[kind, meta]`` pairs. Nothing is ever pickled or evaluated.
* Every byte of the file is covered by a checksum (CRC-32C, or zlib CRC-32 when the crc32c
  package is missing; the algorithm is recorded): the superblock's own, the index's, and one
  per segment (covering its padding too). Data checksums are computed on a background thread
  overlapped with the disk I/O.
* Files are written under a temp name, fsynced and renamed into place (:mod:`.atomic`).

Public entry points: :class:`NativeBackend` (registered as ``db_type="native"``),
:func:`open_native` (a lazy, optionally memory-mapped reader for inspection and partial
loads) and :func:`stat_native` (a header-only summary).
"""

from __future__ import annotations

import errno
import gc
import json
import mmap as _mmap
import os
import queue
import struct
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import (
    BlobMismatchError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    MissingBlobError,
    UnsupportedBlobError,
)
from . import atomic
from . import codecs as _codecs
from .base import BlobInfo, DbBackend, ReadStats, register_db_type, report_progress
from .checksum import (
    ALGORITHM_IDS,
    ALGORITHM_NAMES,
    Checksummer,
    checksum_function,
    default_algorithm,
    format_checksum,
)

__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "MAGIC",
    "NativeBackend",
    "NativeFile",
    "NativeStat",
    "open_native",
    "stat_native",
]

MAGIC = b"\x89EPCK\r\n\x1a"
FORMAT_MAJOR = 1
FORMAT_MINOR = 0
ALIGN = 64
INDEX_MAGIC = b"EPIX"

# magic, major, minor, checksum algorithm id, log2(alignment), index offset, index length,
# file size, blob count, segment count, data bytes, index checksum, superblock checksum
_SUPER = struct.Struct("<8sHHHHQQQIIQII")
SUPERBLOCK_SIZE = _SUPER.size  # 64
# magic, flags, names heap length, metas text length, meta count, reserved
_INDEX_HEAD = struct.Struct("<4sIQQII")

REC_DTYPE = np.dtype(
    [
        ("name_off", "<u4"),
        ("name_len", "<u4"),
        ("meta_id", "<u4"),
        ("seg_first", "<u4"),
        ("seg_count", "<u4"),
        ("flags", "<u4"),
    ]
)
SEG_DTYPE = np.dtype([("offset", "<u8"), ("length", "<u8"), ("crc", "<u4"), ("pad", "<u4")])
MOFF_DTYPE = np.dtype([("off", "<u4"), ("len", "<u4")])

#: segments at least this big are read/written on their own, in CHUNK-sized pieces
BIG_SEGMENT = 1 << 20
#: piece size for big segments (checksum of piece i, on a thread, overlaps the I/O of
#: piece i+1; small enough that the piece is still in cache when it is checksummed)
CHUNK = 2 << 20
#: piece size for big segments read into fresh buffers (cold 2 GiB loads, paired: 8 MiB
#: pieces 1.16x and 1.00x the speed of 2 MiB pieces in two runs of N=6 and 8; fewer calls)
READ_PIECE = 8 << 20
#: a load of at least this many bytes asks the kernel to read PREFETCH_WINDOW bytes ahead
PREFETCH_MIN = 4 << 20
PREFETCH_WINDOW = 64 << 20
PREFETCH_STEP = 16 << 20
#: small segments are coalesced into one writev/preadv of about this many bytes (small
#: enough to stay in the CPU cache between the copy and the inline checksum)
BATCH_BYTES = 1 << 20
#: loads of many small plain arrays read adjacent segments in groups of about this many
#: bytes, one ``preadv`` into one buffer per group (the arrays are views of it)
GROUP_BYTES = 16 << 20
_MAX_U32 = 0xFFFFFFFF
_ZEROS = memoryview(bytes(ALIGN))
# where padding goes when it is read without being checked (contents never used)
_SCRATCH = memoryview(bytearray(ALIGN))
_ZERO_AREA = bytes(ALIGN * 1024)


def _flat(seg: Any) -> memoryview:
    """A flat unsigned-byte view of a segment (copied only if it is not contiguous)."""
    mv = memoryview(seg)
    if mv.ndim == 1 and mv.format == "B":
        return mv
    if not mv.c_contiguous:
        return memoryview(mv.tobytes())
    return mv.cast("B")


_EMPTY = memoryview(b"")


def _builtin_ndarray_codec() -> _codecs.NdarrayCodec | None:
    """The built-in NdarrayCodec when it is the codec for plain arrays (both ways), else None
    (someone registered their own; the fast paths then step aside)."""
    codec = _codecs._by_kind.get("ndarray")
    if type(codec) is not _codecs.NdarrayCodec:
        return None
    for c in _codecs._codecs:
        if c is codec:
            return codec
        if c.accepts(_PROBE):  # a codec ahead of it claims plain arrays
            return None
    return None


_PROBE = np.zeros(1, dtype=np.float32)


def _pad_for(end: int) -> int:
    return (-end) % ALIGN


# ====================================================================== writing
@dataclass
class _Plan:
    """Everything about a file except the data checksums, computed before any write."""

    views: list[memoryview]
    recs: np.ndarray
    segs: np.ndarray
    moffs: np.ndarray
    order: np.ndarray
    names_heap: bytes
    metas_text: bytes
    index_offset: int
    index_length: int
    data_bytes: int


def _plan(blobs: Mapping[str, Any]) -> _Plan:
    """Encode every blob and lay the file out; UnsupportedBlobError before anything is written."""
    names_b: list[bytes] = []
    meta_ids: dict[tuple[str, str], int] = {}
    meta_texts: list[str] = []
    rec_meta: list[int] = []
    rec_nseg: list[int] = []
    views: list[memoryview] = []
    dumps = json.JSONEncoder(separators=(",", ":"), sort_keys=True, allow_nan=False).encode
    encode = _codecs.encode
    # Fast path for plain numpy arrays (the common case of many small blobs): the same kind,
    # meta and bytes NdarrayCodec.encode gives, without the codec lookup and the per-blob
    # meta dict / repr; metas are deduplicated by (dtype, shape).
    fast_nd = _builtin_ndarray_codec() is not None
    nd_mids: dict[tuple[np.dtype, tuple[int, ...]], int] = {}
    nd_dtypes: dict[np.dtype, str] = {}
    text_ids: dict[str, int] = {}
    ndarray = np.ndarray
    for name, value in blobs.items():
        if not isinstance(name, str):
            raise UnsupportedBlobError(f"blob name {name!r} is not a str")
        if (
            fast_nd
            and type(value) is ndarray
            and value.dtype.fields is None
            and value.dtype.subdtype is None
            and not value.dtype.hasobject
        ):
            dkey = (value.dtype, value.shape)
            mid = nd_mids.get(dkey)
            if mid is None:  # first of its kind: the meta text NdarrayCodec's meta dumps to
                dt_text = nd_dtypes.get(value.dtype)
                if dt_text is None:
                    dt_text = nd_dtypes[value.dtype] = dumps(_codecs.dtype_to_json(value.dtype))
                text = f'["ndarray",{{"dtype":{dt_text},"shape":[{",".join(map(str, value.shape))}]}}]'
                mid = text_ids.get(text)
                if mid is None:
                    mid = text_ids[text] = len(meta_texts)
                    meta_texts.append(text)
                nd_mids[dkey] = mid
            names_b.append(name.encode("utf-8", "surrogatepass"))
            rec_meta.append(mid)
            rec_nseg.append(1)
            if not value.flags.c_contiguous:
                value = np.ascontiguousarray(value)
            views.append(memoryview(value.reshape(-1).view(np.uint8)) if value.size else _EMPTY)  # type: ignore[arg-type]
            continue
        enc = encode(value, name)
        # dedupe metas by repr (cheap) and JSON-encode only the distinct ones
        key = (enc.kind, repr(enc.meta))
        mid = meta_ids.get(key)
        if mid is None:
            try:
                text = dumps([enc.kind, enc.meta])
            except (TypeError, ValueError) as e:
                raise UnsupportedBlobError(f"blob {name!r}: codec meta is not JSON: {e}") from None
            mid = meta_ids[key] = len(meta_texts)
            meta_texts.append(text)
        names_b.append(name.encode("utf-8", "surrogatepass"))
        rec_meta.append(mid)
        segments = enc.segments
        rec_nseg.append(len(segments))
        for seg in segments:
            if type(seg) is memoryview and seg.ndim == 1 and seg.format == "B":
                views.append(seg)
            else:
                views.append(_flat(seg))

    n, nseg = len(names_b), len(views)
    lengths = np.fromiter((v.nbytes for v in views), dtype=np.uint64, count=nseg)
    # every segment starts at a multiple of ALIGN and owns the zero padding up to the next
    padded = (lengths + np.uint64(ALIGN - 1)) // np.uint64(ALIGN) * np.uint64(ALIGN)
    offsets = np.empty(nseg, dtype=np.uint64)
    if nseg:
        offsets[0] = SUPERBLOCK_SIZE
        np.cumsum(padded[:-1], out=offsets[1:])
        offsets[1:] += np.uint64(SUPERBLOCK_SIZE)
    index_offset = SUPERBLOCK_SIZE + int(padded.sum())

    segs = np.zeros(nseg, dtype=SEG_DTYPE)
    segs["offset"] = offsets
    segs["length"] = lengths
    segs["pad"] = padded - lengths

    name_lens = np.fromiter((len(b) for b in names_b), dtype=np.int64, count=n)
    names_heap = b"".join(names_b)
    nseg_arr = np.asarray(rec_nseg, dtype=np.int64)
    recs = np.zeros(n, dtype=REC_DTYPE)
    if n:
        recs["name_off"][1:] = np.cumsum(name_lens)[:-1]
        recs["seg_first"][1:] = np.cumsum(nseg_arr)[:-1]
    recs["name_len"] = name_lens
    recs["meta_id"] = np.asarray(rec_meta, dtype=np.int64)
    recs["seg_count"] = nseg_arr

    metas_text = ("[" + ",".join(meta_texts) + "]").encode("ascii")
    mlens = np.fromiter((len(t) for t in meta_texts), dtype=np.int64, count=len(meta_texts))
    moffs = np.zeros(len(meta_texts), dtype=MOFF_DTYPE)
    if len(meta_texts):
        moffs["off"][0] = 1
        moffs["off"][1:] = 1 + np.cumsum(mlens + 1)[:-1]
    moffs["len"] = mlens
    if max(len(names_heap), len(metas_text), n, nseg) > _MAX_U32:
        raise UnsupportedBlobError("too many blobs or names for one native db file")

    order = np.asarray(sorted(range(n), key=names_b.__getitem__), dtype="<u4")
    index_length = (
        _INDEX_HEAD.size
        + recs.nbytes
        + segs.nbytes
        + moffs.nbytes
        + order.nbytes
        + len(names_heap)
        + len(metas_text)
    )
    return _Plan(
        views, recs, segs, moffs, order, names_heap, metas_text, index_offset, index_length,
        int(lengths.sum()),
    )


def _write_data(out: atomic.AtomicFile, plan: _Plan, algorithm: str) -> list[int]:
    """Stream the superblock placeholder and every segment (with its padding) to ``out``;
    return the segment checksums.

    Segments go out in ``writev`` batches of about BATCH_BYTES (big ones in CHUNK pieces);
    each batch is handed to a background thread for checksumming just before it is written,
    so the checksums run on the other core while the kernel copies the batch."""
    views, pads = plan.views, plan.segs["pad"].tolist()
    ck = Checksummer(checksum_function(algorithm), len(views))
    try:
        bufs: list[Any] = [_ZEROS]  # superblock placeholder, rewritten at the end
        todo: list[tuple[int, memoryview]] = []
        nbytes = SUPERBLOCK_SIZE
        for i, mv in enumerate(views):
            pad = pads[i]
            size = mv.nbytes
            if size >= BIG_SEGMENT:
                if bufs:
                    ck.submit(todo)
                    out.write(bufs)
                    report_progress(nbytes)
                    bufs, todo, nbytes = [], [], 0
                for start in range(0, size, CHUNK):
                    piece = mv[start : start + CHUNK]
                    ck.submit([(i, piece)])
                    out.write(piece)
                    report_progress(piece.nbytes)
                if pad:
                    bufs.append(_ZEROS[:pad])
                    nbytes += pad
                continue
            if size:
                todo.append((i, mv))
                bufs.append(mv)
            if pad:
                bufs.append(_ZEROS[:pad])
            nbytes += size + pad
            if nbytes >= BATCH_BYTES or len(bufs) >= atomic.IOV_MAX - 2:
                ck.submit(todo)
                out.write(bufs)
                report_progress(nbytes)
                bufs, todo, nbytes = [], [], 0
        if bufs:
            ck.submit(todo)
            out.write(bufs)
            report_progress(nbytes)
        return ck.results()
    finally:
        ck.close()


def _index_bytes(plan: _Plan) -> bytes:
    head = _INDEX_HEAD.pack(
        INDEX_MAGIC, 0, len(plan.names_heap), len(plan.metas_text), len(plan.moffs), 0
    )
    return b"".join(
        [
            head,
            plan.recs.tobytes(),
            plan.segs.tobytes(),
            plan.moffs.tobytes(),
            plan.order.tobytes(),
            plan.names_heap,
            plan.metas_text,
        ]
    )


def _superblock(
    algo_id: int, index_offset: int, index_length: int, file_size: int, nblobs: int,
    nsegs: int, data_bytes: int, index_crc: int, fn: Any,
) -> bytes:
    fields = (
        MAGIC, FORMAT_MAJOR, FORMAT_MINOR, algo_id, ALIGN.bit_length() - 1, index_offset,
        index_length, file_size, nblobs, nsegs, data_bytes, index_crc,
    )
    body = _SUPER.pack(*fields, 0)[:-4]
    return body + struct.pack("<I", fn(body, 0))


def write_native(path: str | os.PathLike[str], blobs: Mapping[str, Any], *, algorithm: str | None = None) -> int:
    """Write ``blobs`` to a native db file at ``path`` atomically and durably; return its size.

    Every value is encoded first (UnsupportedBlobError naming the blob before anything touches
    the disk); then the data is streamed from the values' own memory in large sequential
    writes, checksummed on a background thread, followed by the index; the file is fsynced,
    renamed into place and the directory fsynced. A missing directory raises
    FileNotFoundError; too little free space raises OSError(ENOSPC) naming the file."""
    path = os.fspath(path)
    algorithm = algorithm or default_algorithm()
    fn = checksum_function(algorithm)
    plan = _plan(blobs)
    file_size = plan.index_offset + plan.index_length
    with atomic.AtomicFile(path, size=file_size) as out:
        crcs = _write_data(out, plan, algorithm)
        plan.segs["crc"] = np.asarray(crcs, dtype=np.uint64) if crcs else 0
        index = _index_bytes(plan)
        assert len(index) == plan.index_length
        index_crc = fn(index, 0)
        out.write(index)
        sb = _superblock(
            ALGORITHM_IDS[algorithm], plan.index_offset, plan.index_length, file_size,
            len(plan.recs), len(plan.segs), plan.data_bytes, index_crc, fn,
        )
        out.seek(0)
        out.write(sb)
    return file_size


# ====================================================================== reading
@dataclass(frozen=True)
class NativeStat:
    """A header-only summary of a native db file (what ``epochal inspect`` shows first)."""

    path: str
    format_version: str
    major: int
    minor: int
    checksum_algorithm: str
    blob_count: int
    segment_count: int
    data_bytes: int
    index_bytes: int
    file_bytes: int
    digest: str


@dataclass(frozen=True)
class _Header:
    major: int
    minor: int
    algorithm: str
    index_offset: int
    index_length: int
    file_size: int
    blob_count: int
    seg_count: int
    data_bytes: int
    index_crc: int

    def digest(self) -> str:
        return (
            f"native{self.major}:{self.algorithm}:{self.index_crc:08x}:{self.file_size}"
        )


def _corrupt(path: str, message: str, blob: str | None = None) -> CheckpointCorruptError:
    return CheckpointCorruptError(path, message, blob)


def _open_fd(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointNotFoundError(errno.ENOENT, "no such native db file", path) from None


def _pread_exact(path: str, fd: int, n: int, offset: int, what: str, blob: str | None = None) -> bytes:
    data = os.pread(fd, n, offset)
    while len(data) < n:
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            raise _corrupt(path, f"file is truncated: {what} needs bytes {offset}..{offset + n}", blob)
        data += more
    return data


def _parse_superblock(path: str, raw: bytes, actual_size: int) -> _Header:
    """Check and decode the 64-byte superblock against the file's real size."""
    if len(raw) < SUPERBLOCK_SIZE:
        raise _corrupt(path, f"file is truncated ({actual_size} bytes): not a complete native db")
    if raw[:8] != MAGIC:
        raise _corrupt(path, "not an epochal native db file (bad magic number)")
    (_, major, minor, algo_id, align_log2, ioff, ilen, fsize, nblobs, nsegs, dbytes, icrc,
     scrc) = _SUPER.unpack(raw[:SUPERBLOCK_SIZE])
    if major > FORMAT_MAJOR:
        raise CheckpointVersionError(
            path,
            f"written by native format version {major}.{minor}, but this epochal reads only "
            f"major version {FORMAT_MAJOR}; upgrade epochal to read it",
        )
    if major < 1:
        raise _corrupt(path, f"unknown native format version {major}.{minor}")
    algorithm = ALGORITHM_NAMES.get(algo_id)
    if algorithm is None:
        raise _corrupt(path, f"unknown checksum algorithm id {algo_id}")
    try:
        fn = checksum_function(algorithm)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if fn(raw[:60], 0) != scrc:
        raise _corrupt(path, "superblock checksum mismatch (header damaged)")
    if align_log2 != ALIGN.bit_length() - 1:
        raise _corrupt(path, f"unsupported alignment 2**{align_log2}")
    if fsize != actual_size:
        kind = "truncated" if actual_size < fsize else "longer than recorded"
        raise _corrupt(path, f"file is {kind}: {actual_size} bytes, header says {fsize}")
    if ioff < SUPERBLOCK_SIZE or ioff % ALIGN or ioff + ilen != fsize or ilen < _INDEX_HEAD.size:
        raise _corrupt(path, f"absurd index position {ioff}+{ilen} in a {fsize}-byte file")
    if dbytes > ioff:
        raise _corrupt(path, f"absurd data size {dbytes}")
    return _Header(major, minor, algorithm, ioff, ilen, fsize, nblobs, nsegs, dbytes, icrc)


def _read_header(path: str, fd: int) -> _Header:
    size = os.fstat(fd).st_size
    raw = os.pread(fd, SUPERBLOCK_SIZE, 0)
    return _parse_superblock(path, raw, size)


@dataclass
class _Columns:
    seg_first: list[int]
    seg_count: list[int]
    offsets: list[int]
    lengths: list[int]
    pads: list[int]
    crcs: list[int]


class _Index:
    """The parsed, verified index of one file. Tables are numpy views of the index bytes."""

    def __init__(self, path: str, header: _Header, raw: bytes) -> None:
        self.path = path
        self.header = header
        self.fn = checksum_function(header.algorithm)
        if len(raw) != header.index_length:
            raise _corrupt(path, "file is truncated inside the index")
        if self.fn(raw, 0) != header.index_crc:
            raise _corrupt(path, "index checksum mismatch (header damaged)")
        magic, _flags, names_len, metas_len, nmetas, _ = _INDEX_HEAD.unpack_from(raw, 0)
        n, nseg = header.blob_count, header.seg_count
        if magic != INDEX_MAGIC:
            raise _corrupt(path, "bad index magic")
        expect = (
            _INDEX_HEAD.size + n * REC_DTYPE.itemsize + nseg * SEG_DTYPE.itemsize
            + nmetas * MOFF_DTYPE.itemsize + n * 4 + names_len + metas_len
        )
        if expect != len(raw):
            raise _corrupt(path, f"absurd index counts ({n} blobs, {nseg} segments, {nmetas} metas)")
        pos = _INDEX_HEAD.size

        def table(dtype: np.dtype, count: int) -> np.ndarray:
            nonlocal pos
            arr = np.frombuffer(raw, dtype=dtype, count=count, offset=pos)
            pos += arr.nbytes
            return arr

        self.recs = table(REC_DTYPE, n)
        self.segs = table(SEG_DTYPE, nseg)
        self.moffs = table(MOFF_DTYPE, nmetas)
        self.order = table(np.dtype("<u4"), n)
        self.names_heap = raw[pos : pos + names_len]
        self.metas_text = raw[pos + names_len :]
        self._validate()
        self._names: list[str] | None = None
        self._ids: dict[str, int] | None = None
        self._metas: list[Any] | None = None
        self._meta_cache: dict[int, tuple[str, dict[str, Any]]] = {}
        self._cols: _Columns | None = None
        self._entries: list[tuple[str, dict[str, Any]]] | None = None
        self._meta_id_list: list[int] | None = None

    def _validate(self) -> None:
        """Structural checks (the checksum catches damage; these catch a writer bug or a
        crafted file, so that no length can point outside the file or overlap)."""
        path, recs, segs = self.path, self.recs, self.segs
        n, nseg = len(recs), len(segs)
        off = segs["offset"].astype(np.int64)
        length = segs["length"].astype(np.int64)
        pad = segs["pad"].astype(np.int64)
        if nseg:
            ends = off + length + pad
            if (
                off[0] != SUPERBLOCK_SIZE
                or np.any(off % ALIGN)
                or np.any(pad >= ALIGN)
                or np.any(length < 0)
                or np.any(ends[:-1] != off[1:])
                or ends[-1] != self.header.index_offset
            ):
                raise _corrupt(path, "segment table does not tile the data area")
        elif self.header.index_offset != SUPERBLOCK_SIZE:
            raise _corrupt(path, "data area without segments")
        if int(length.sum()) != self.header.data_bytes:
            raise _corrupt(path, "segment lengths do not add up to the data size")
        if n:
            cnt = recs["seg_count"].astype(np.int64)
            first = recs["seg_first"].astype(np.int64)
            noff = recs["name_off"].astype(np.int64)
            nlen = recs["name_len"].astype(np.int64)
            if (
                first[0] != 0
                or np.any(first[1:] != (first + cnt)[:-1])
                or first[-1] + cnt[-1] != nseg
                or np.any(noff + nlen > len(self.names_heap))
                or np.any(recs["meta_id"] >= len(self.moffs))
                or np.any(self.order >= n)
            ):
                raise _corrupt(path, "blob table is inconsistent")
        elif nseg:
            raise _corrupt(path, "segments without blobs")
        mo = self.moffs["off"].astype(np.int64) + self.moffs["len"].astype(np.int64)
        if len(mo) and np.any(mo > len(self.metas_text)):
            raise _corrupt(path, "meta table points outside the index")

    # ---- names
    def name(self, i: int) -> str:
        if self._names is not None:
            return self._names[i]
        r = self.recs[i]
        return self._decode_name(int(r["name_off"]), int(r["name_len"]))

    def _decode_name(self, off: int, ln: int) -> str:
        try:
            return self.names_heap[off : off + ln].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise _corrupt(self.path, "blob name is not UTF-8") from None

    def names(self) -> list[str]:
        if self._names is None:
            heap = self.names_heap
            try:
                self._names = [
                    heap[o : o + ln].decode("utf-8", "surrogatepass")
                    for o, ln in zip(self.recs["name_off"].tolist(), self.recs["name_len"].tolist())
                ]
            except UnicodeDecodeError:
                raise _corrupt(self.path, "blob name is not UTF-8") from None
        return self._names

    def find(self, name: str) -> int | None:
        """The blob index of ``name``: a dict once all names are decoded, else a bisection of
        the name-sorted table that touches only ~log2(n) names."""
        if self._ids is not None:
            return self._ids.get(name)
        key = name.encode("utf-8", "surrogatepass")
        heap, order = self.names_heap, self.order
        offs, lens = self.recs["name_off"], self.recs["name_len"]
        lo, hi = 0, len(order)
        while lo < hi:
            mid = (lo + hi) // 2
            i = int(order[mid])
            o = int(offs[i])
            cand = heap[o : o + int(lens[i])]
            if cand < key:
                lo = mid + 1
            elif cand > key:
                hi = mid
            else:
                return i
        return None

    def build_ids(self) -> dict[str, int]:
        if self._ids is None:
            self._ids = {nm: i for i, nm in enumerate(self.names())}
        return self._ids

    # ---- metas
    def entry(self, i: int) -> tuple[str, dict[str, Any]]:
        """``(kind, meta)`` of blob ``i``, parsed from only that blob's JSON when few are used."""
        mid = int(self.recs["meta_id"][i])
        got = self._meta_cache.get(mid)
        if got is not None:
            return got
        try:
            if self._metas is not None:
                item = self._metas[mid]
            else:
                o, ln = int(self.moffs["off"][mid]), int(self.moffs["len"][mid])
                item = json.loads(self.metas_text[o : o + ln])
        except (ValueError, RecursionError, IndexError):
            raise _corrupt(self.path, "blob meta is not valid JSON", self.name(i)) from None
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], dict)
        ):
            raise _corrupt(self.path, "blob meta is not a [kind, meta] pair", self.name(i))
        got = (item[0], item[1])
        self._meta_cache[mid] = got
        return got

    def all_entries(self) -> list[tuple[str, dict[str, Any]]]:
        """``(kind, meta)`` of every distinct meta entry, by meta id (validated once each)."""
        if self._entries is None:
            self.parse_all_metas()
            assert self._metas is not None
            out = []
            for item in self._metas:
                if (
                    not isinstance(item, list)
                    or len(item) != 2
                    or not isinstance(item[0], str)
                    or not isinstance(item[1], dict)
                ):
                    raise _corrupt(self.path, "blob meta is not a [kind, meta] pair")
                out.append((item[0], item[1]))
            self._entries = out
        return self._entries

    def parse_all_metas(self) -> None:
        """Parse the whole metas array at once (faster than one by one for full loads)."""
        if self._metas is None:
            try:
                metas = json.loads(self.metas_text)
            except (ValueError, RecursionError):
                raise _corrupt(self.path, "index metas are not valid JSON") from None
            if not isinstance(metas, list) or len(metas) != len(self.moffs):
                raise _corrupt(self.path, "index metas do not match the meta table")
            self._metas = metas

    def meta_ids(self) -> list[int]:
        """Every blob's meta id, as a list (cached)."""
        if self._meta_id_list is None:
            self._meta_id_list = self.recs["meta_id"].tolist()
        return self._meta_id_list

    def columns(self) -> _Columns:
        """The tables as Python lists (fast per-blob access when many blobs are loaded)."""
        if self._cols is None:
            r, g = self.recs, self.segs
            self._cols = _Columns(
                r["seg_first"].tolist(), r["seg_count"].tolist(), g["offset"].tolist(),
                g["length"].tolist(), g["pad"].tolist(), g["crc"].tolist(),
            )
        return self._cols

    def seg_range(self, i: int) -> range:
        r = self.recs[i]
        first = int(r["seg_first"])
        return range(first, first + int(r["seg_count"]))

    def info(self, i: int) -> BlobInfo:
        kind, meta = self.entry(i)
        segs = self.seg_range(i)
        lengths = self.segs["length"][segs.start : segs.stop]
        crcs = self.segs["crc"][segs.start : segs.stop].tolist()
        dtype = meta.get("dtype")
        if dtype is not None and not isinstance(dtype, str):
            dtype = json.dumps(dtype, separators=(",", ":"))
        shape = meta.get("shape")
        try:
            shape_t = _codecs.check_shape(shape) if shape is not None else None
        except ValueError:
            shape_t = None
        checksum = (
            format_checksum(self.header.algorithm, crcs[0]) + "".join(f"+{c:08x}" for c in crcs[1:])
            if crcs
            else None
        )
        return BlobInfo(self.name(i), kind, dtype, shape_t, int(lengths.sum()), checksum, meta)


def _preadv_exact(
    path: str, fd: int, views: list[memoryview], offset: int, blob: str, progress: bool = True,
    got: int | None = None,
) -> int:
    """Fill ``views`` from ``offset`` on; a file ending early is reported as corrupt.
    ``got``: bytes already read into the views by the caller (the rest is read here)."""
    want = sum(v.nbytes for v in views)
    if got is None:
        got = os.preadv(fd, views, offset)
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
                n = os.preadv(fd, [v[done:]], offset + pos + done)
                if n <= 0:
                    raise _corrupt(path, f"file is truncated (read stopped at byte {offset + pos + done})", blob)
                done += n
            got = end
        pos = end
    return want


@dataclass
class _Direct:
    """A segment read straight into live memory: plan position, segment number in its blob,
    blob name, file offset, size, padding, checksum, target view and its address."""

    pos: int
    seg: int
    name: str
    off: int
    size: int
    pad: int
    crc: int
    target: memoryview
    addr: int


#: scratch buffers of CHUNK bytes in the ring that verifies in-place segments
_RING = 4
#: in-place segments are read in pieces of this size (progress reports)
_DIRECT_PIECE = 8 * CHUNK


#: in-place reads, and loads of big segments, of at least this many bytes are split over a
#: few threads
_PARALLEL_MIN = 64 << 20
#: threads reading big segments into fresh buffers: for requests in flight, not for cores
#: (cold 2 GiB, paired, N=8: 4 threads 1.27x one thread's speed, and steady: 0.99-1.12 s)
_IO_THREADS = 4


def _threads() -> int:
    """Threads for the in-place load passes: the usable cores, at most 4."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(4, n))


def _balanced(sizes: list[int], n: int) -> list[list[int]]:
    """Indices of ``sizes`` in ``n`` groups of about equal total (largest first, greedy),
    each group in increasing order; empty groups dropped."""
    groups: list[list[int]] = [[] for _ in range(max(1, n))]
    totals = [0] * len(groups)
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        g = totals.index(min(totals))
        groups[g].append(k)
        totals[g] += sizes[k]
    return [sorted(g) for g in groups if g]


def _contiguous(sizes: list[int], n: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into at most ``n`` consecutive runs of about equal total."""
    total = sum(sizes)
    groups: list[list[int]] = [[]]
    acc = 0
    for k, sz in enumerate(sizes):
        if groups[-1] and len(groups) < n and acc >= total * len(groups) / n:
            groups.append([])
        groups[-1].append(k)
        acc += sz
    return groups


def _run_parallel(jobs: list[Any]) -> None:
    """Run ``jobs[0]`` on this thread and the others on their own threads; re-raise the
    first exception once all have ended."""
    errors: list[BaseException] = []

    def guarded(fn: Any) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(fn,), name="epochal-inplace", daemon=True)
               for fn in jobs[1:]]
    for t in threads:
        t.start()
    try:
        if jobs:
            guarded(jobs[0])
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


#: ``preadv`` flag: fail (EAGAIN) rather than wait for the disk (Linux 4.14+)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


class _Prefetcher:
    """Reads ranges of a file and keeps the kernel reading ahead of us.

    While every read so far came from the page cache (tried with ``RWF_NOWAIT``), no hint is
    given: a hint costs ~8 ms per 64 MiB even when the file is cached. From the first read
    the cache cannot serve on, ``posix_fadvise(WILLNEED)`` covers the next PREFETCH_WINDOW
    bytes of the ranges being loaded (only those), so a cold read is served by big
    asynchronous disk requests while we copy and checksum, instead of one modest synchronous
    request per ``preadv``. ``advance`` may be called from another thread."""

    def __init__(self, fd: int, ranges: list[tuple[int, int]]) -> None:
        self.fd = fd
        self.ranges = ranges
        self.ri = 0
        self.done_to = ranges[0][0] if ranges else 0
        self.enabled = hasattr(os, "posix_fadvise") and bool(ranges)
        self.cached = bool(_RWF_NOWAIT)  # every read so far was served by the page cache
        self._lock = threading.Lock()

    def read(self, path: str, views: list[memoryview], offset: int, blob: str, progress: bool = True) -> None:
        """:func:`_preadv_exact` of ``views`` at ``offset``, hinting ahead once the file is
        found not to be cached."""
        if self.cached:
            try:
                got = os.preadv(self.fd, views, offset, _RWF_NOWAIT)
            except OSError:  # EAGAIN: not cached; or a filesystem without RWF_NOWAIT
                got = 0
            if got == sum(v.nbytes for v in views):
                if progress:
                    report_progress(got)
                return
            self.cached = False
            self.advance(offset + got)
            _preadv_exact(path, self.fd, views, offset, blob, progress, got)
            return
        self.advance(offset)
        _preadv_exact(path, self.fd, views, offset, blob, progress)

    def advance(self, pos: int) -> None:
        if self.cached or not self.enabled or pos + PREFETCH_STEP < self.done_to:
            return
        with self._lock:
            self._advance(pos)

    def _advance(self, pos: int) -> None:
        target = pos + PREFETCH_WINDOW
        ranges = self.ranges
        self.done_to = max(self.done_to, pos)
        while self.done_to < target and self.ri < len(ranges):
            a, b = ranges[self.ri]
            start = max(a, self.done_to)
            if start >= b:
                self.ri += 1
                continue
            end = min(b, max(target, start + PREFETCH_STEP))
            try:
                os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_WILLNEED)
            except OSError:
                self.enabled = False
                return
            self.done_to = end
            if end >= b:
                self.ri += 1


class _Worker:
    """One background thread running submitted calls in order (checksums of the batch
    path, overlapped with the next ``preadv``); ``wait`` re-raises a call's exception."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Any, tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="epochal-verify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._done.set()
                return
            if self._error is None:
                try:
                    item[0](*item[1])
                except BaseException as e:  # noqa: BLE001 - re-raised in wait()
                    self._error = e

    def submit(self, fn: Any, *args: Any) -> None:
        self._q.put((fn, args))

    def wait(self) -> None:
        self.close()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        if not self._done.is_set():
            self._q.put(None)
            self._thread.join()
            self._done.set()


def _merged_ranges(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


_DECODE_ERRORS = (ValueError, TypeError, KeyError, IndexError, OverflowError, UnicodeError, struct.error, RecursionError)


class NativeFile:
    """An open native db: verified index in memory, data read on demand.

    ``open_native(path)`` returns one. It reads only the 64-byte superblock and the index at
    open (and verifies both checksums), so inspecting a huge checkpoint or loading a few blobs
    of it is cheap. With ``mmap=True`` values are decoded from read-only views of a memory map
    (arrays are then read-only and share the page cache, nothing is copied up front); with
    ``mmap=False`` they are read with ``preadv`` into fresh buffers. Either way the checksums
    of the requested blobs are verified before any value is decoded, unless ``verify=False``.
    """

    def __init__(self, path: str | os.PathLike[str], *, mmap: bool = False) -> None:
        self.path = os.fspath(path)
        self._fd = _open_fd(self.path)
        self._mm: _mmap.mmap | None = None
        try:
            self.header = _read_header(self.path, self._fd)
            h = self.header
            raw = _pread_exact(self.path, self._fd, h.index_length, h.index_offset, "the index")
            self._index = _Index(self.path, h, raw)
            if mmap:
                self._mm = _mmap.mmap(self._fd, 0, access=_mmap.ACCESS_READ)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise

    # ---- lifecycle
    def close(self) -> None:
        """Close the file. Arrays already returned from a memory map keep it alive."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # values still reference the map; it closes when they are freed
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> NativeFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if self._fd >= 0:
                os.close(self._fd)
        except (AttributeError, OSError):
            pass

    # ---- inspection
    @property
    def mmap(self) -> bool:
        return self._mm is not None

    def stat(self) -> NativeStat:
        """Header summary: version, algorithm, counts and sizes, digest."""
        return _stat_from_header(self.path, self.header)

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
        if self._fd < 0:
            raise ValueError(f"{self.path}: native db is closed")
        # A bulk load creates tens of thousands of acyclic objects (parsed metas, names,
        # arrays, tuples), each batch of which would trigger a cyclic-GC pass over every
        # live object of the process (~10-15 ms for 20,000 small arrays). Pause the
        # collector for the load; the previous state is restored, nothing else changes.
        pause_gc = (
            self._mm is None and (names is None or len(names) > 64) and gc.isenabled()
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
        ids = self._resolve(names, allow_incomplete)
        small: dict[str, np.ndarray] = {}
        total = 0
        if self._mm is None and len(ids) > 64:
            small, rest, total = self._read_small_arrays(ids, verify)
        else:
            rest = ids
        plan = self._allocate(rest)
        if self._mm is not None:
            self._map(plan, verify)
        else:
            direct = self._direct_targets(plan, existing) if existing else []
            if direct and verify:
                self._verify_direct(direct)  # before any live memory is written
            self._fill(plan, verify, {(d.pos, d.seg) for d in direct})
            if direct:  # every requested checksum is verified: read into the live memory
                self._read_direct(plan, direct)
        # everything is read and verified: decode (in file order)
        slow: dict[int, Any] = {}
        path = self.path
        for i, name, kind, meta, codec, bufs in plan:
            live = existing.get(name) if existing is not None else None
            try:
                slow[i] = codec.decode(meta, bufs, live)
            except BlobMismatchError as e:
                raise BlobMismatchError(f"{path}, blob {name!r}: {e}") from e
            except CheckpointError:
                raise
            except _DECODE_ERRORS as e:
                raise _corrupt(path, f"cannot decode {kind} blob: {e}", name) from None
            for b in bufs:
                total += b.nbytes
        out: dict[str, Any] = {}
        if small and not plan:
            out = small  # built in file order, which is the order of ids
        elif small:
            names_ = self._index.names()
            for i in ids:
                got = slow.get(i)
                nm_ = names_[i]
                out[nm_] = small[nm_] if got is None else got
        else:
            for entry in plan:
                out[entry[1]] = slow[entry[0]]
        if stats is not None:
            stats.nbytes += total
            stats.blobs += len(plan) + len(small)
        return out

    def _read_small_arrays(
        self, ids: list[int], verify: bool
    ) -> tuple[dict[str, np.ndarray], list[int], int]:
        """The batch path for many small plain numpy arrays (pread only).

        Blobs whose codec is the built-in NdarrayCodec and whose one segment is small are
        read in groups of adjacent segments (about GROUP_BYTES each) with one ``preadv``
        into one fresh buffer per group; each segment's checksum and padding are checked;
        the arrays are writable, non-overlapping views of that buffer, exactly the dtype,
        shape and bytes NdarrayCodec would give. Returns ``{name: array}`` in file order,
        the blob indices left to the general path (other kinds, big or empty segments,
        metas that do not fit: the general path reports those) and the data bytes read.

        The calling thread only issues the ``preadv`` calls (candidates are chosen from the
        segment table alone); a worker thread meanwhile parses the metas, then per group
        (in order, as each is read) checks the checksums and padding of the blobs that fit
        and builds their views. Candidates whose meta does not fit are left to the general
        path (their bytes here are not used)."""
        if _builtin_ndarray_codec() is None:
            return {}, ids, 0
        idx, path, fd = self._index, self.path, self._fd
        ids_arr = np.asarray(ids, dtype=np.int64)
        recs, segs = idx.recs, idx.segs
        first = recs["seg_first"][ids_arr].astype(np.int64)
        seg_len = segs["length"][first].astype(np.int64)
        cand = (recs["seg_count"][ids_arr] == 1) & (seg_len > 0) & (seg_len < BIG_SEGMENT)
        if int(cand.sum()) < 2:
            return {}, ids, 0
        cand_ids = ids_arr[cand]
        ks = first[cand]
        offs = segs["offset"][ks].astype(np.int64)
        lens = seg_len[cand]
        pads = segs["pad"][ks].astype(np.int64)
        ends = offs + lens + pads
        # groups of file-adjacent segments, cut where the file is not contiguous or a
        # GROUP_BYTES boundary is crossed
        cut = np.ones(len(ks), dtype=bool)
        cut[1:] = (offs[1:] != ends[:-1]) | (offs[1:] // GROUP_BYTES != offs[:-1] // GROUP_BYTES)
        starts_j = np.flatnonzero(cut).tolist()
        bounds = list(zip(starts_j, [*starts_j[1:], len(ks)]))
        offs_l, ends_l = offs.tolist(), ends.tolist()
        ranges = _merged_ranges([(offs_l[a], ends_l[b - 1]) for a, b in bounds])
        ahead = _Prefetcher(fd, ranges if int(lens.sum()) >= PREFETCH_MIN else [])
        fn = checksum_function(idx.header.algorithm, inline=True)
        cols64 = np.arange(ALIGN, dtype=np.int64)
        bad: list[str] = []
        out: dict[str, np.ndarray] = {}
        # filled by prepare() on the worker
        st: dict[str, Any] = {}

        def prepare() -> None:
            entries = idx.all_entries()
            st["names"] = idx.names()
            # per distinct meta: (dtype, shape) when it is a well-formed ndarray meta
            layouts: list[tuple[np.dtype, tuple[int, ...]] | None] = []
            nbytes_of = np.full(len(entries) + 1, -1, dtype=np.int64)
            dtypes: dict[Any, np.dtype] = {}
            for mid, (kind, meta) in enumerate(entries):
                lay: tuple[np.dtype, tuple[int, ...]] | None = None
                if kind == "ndarray":
                    d, sh = meta.get("dtype"), meta.get("shape")
                    dt = dtypes.get(d) if type(d) is str else None
                    if (  # the common 1-D case, checked as check_shape would
                        dt is not None and type(sh) is list and len(sh) == 1
                        and type(sh[0]) is int and 0 <= sh[0] <= _codecs.MAX_DIM
                    ):
                        nbytes_of[mid] = sh[0] * dt.itemsize
                        lay = (dt, (sh[0],))
                    else:
                        try:
                            dt = _codecs.dtype_from_json(d)
                            shape = _codecs.check_shape(sh)
                            nbytes_of[mid] = _codecs.expected_nbytes(dt, shape)
                            lay = (dt, shape)
                            if type(d) is str:
                                dtypes[d] = dt
                        except ValueError:
                            lay = None  # the general path raises the error, naming the blob
                layouts.append(lay)
            mids = recs["meta_id"][cand_ids].astype(np.int64)
            fit = nbytes_of[mids] == lens
            st["layouts"] = layouts
            st["fit"] = fit
            st["mids_l"] = mids.tolist()
            st["fast_l"] = cand_ids.tolist()
            st["lens_l"] = lens.tolist()
            st["crcs_l"] = segs["crc"][ks].tolist() if verify else None
            # fitting blobs per group: sel_lists[g] = relative indices j of fitting segments
            fj = np.flatnonzero(fit)
            st["fj"] = fj.tolist()
            st["gcut"] = np.searchsorted(fj, np.asarray(starts_j + [len(ks)], dtype=np.int64)).tolist()

        def check(g: int, buf: np.ndarray, start: int) -> None:
            # runs on the worker thread, overlapped with the next group's preadv
            if bad:
                return
            a, b = bounds[g]
            fj_l, gcut = st["fj"], st["gcut"]
            sel_j = fj_l[gcut[g] : gcut[g + 1]]
            if not sel_j:
                return
            crcs_l = st["crcs_l"]
            lens_l = st["lens_l"]
            mv = memoryview(buf)  # type: ignore[arg-type]
            if crcs_l is not None:
                for j in sel_j:
                    rel = offs_l[j] - start
                    if fn(mv[rel : rel + lens_l[j]], 0) != crcs_l[j]:
                        bad.append(f"d{j}")
                        return
                # each padding is the tail of the 64-byte block that ends where it ends
                fit_g = st["fit"][a:b]
                p_ = np.where(fit_g, pads[a:b], 0)
                sel = np.flatnonzero(p_)
                if len(sel):
                    rows = buf.reshape(-1, ALIGN)[(ends[a:b][sel] - start) // ALIGN - 1]
                    badm = (rows != 0) & (cols64[None, :] >= ALIGN - p_[sel][:, None])
                    if badm.any():
                        bad.append(f"p{a + int(sel[int(np.flatnonzero(badm.any(axis=1))[0])])}")
                        return
            names, layouts, mids_l, fast_l = st["names"], st["layouts"], st["mids_l"], st["fast_l"]
            new_array = np.ndarray
            for j in sel_j:
                i = fast_l[j]
                dt, shape = layouts[mids_l[j]]
                out[names[i]] = new_array(shape, dtype=dt, buffer=buf, offset=offs_l[j] - start)

        worker = _Worker()
        cand_l = cand_ids.tolist()
        try:
            worker.submit(prepare)
            for g, (a, b) in enumerate(bounds):
                start = offs_l[a]
                buf = np.empty(ends_l[b - 1] - start, dtype=np.uint8)
                ahead.read(path, [memoryview(buf)], start, idx.name(cand_l[a]))  # type: ignore[arg-type]
                if not ahead.cached and g + 1 < len(bounds):
                    # later hints from the worker, which has time to spare
                    worker.submit(ahead.advance, offs_l[bounds[g + 1][0]])
                worker.submit(check, g, buf, start)
            worker.wait()
        finally:
            worker.close()
        if bad:
            what, j = bad[0][0], int(bad[0][1:])
            msg = ("data checksum mismatch (blob damaged)" if what == "d"
                   else "nonzero padding after the data (blob damaged)")
            raise _corrupt(path, msg, st["names"][cand_l[j]])
        fit = st["fit"]
        if not fit.all():
            rest_ids = np.sort(np.concatenate([ids_arr[~cand], cand_ids[~fit]]))
        else:
            rest_ids = ids_arr[~cand]
        total = int(lens[fit].sum())
        return out, rest_ids.tolist(), total

    def _resolve(self, names: Sequence[str] | None, allow_incomplete: bool) -> list[int]:
        """Blob indices to load, in file order (so reads go forward through the file)."""
        idx = self._index
        n = self.header.blob_count
        if names is None:
            return list(range(n))
        if isinstance(names, str):
            names = [names]
        if len(names) > 64 and len(names) * 8 > n:
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

    def _allocate(self, ids: list[int]) -> list[tuple[int, str, str, dict[str, Any], Any, list[memoryview]]]:
        """Phase 1: the codec of each blob allocates its buffers (nothing is read yet)."""
        idx = self._index
        cols = idx.columns() if len(ids) > 64 else None
        codec_cache: dict[str, Any] = {}
        plan = []
        mapped = self._mm is not None
        path = self.path
        all_names = idx.names() if cols is not None else None
        entries = idx.all_entries() if cols is not None else None
        meta_ids = idx.recs["meta_id"].tolist() if cols is not None else None
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
                    raise _corrupt(path, str(e), name) from None
            if mapped:
                bufs: list[memoryview] = []
            else:
                try:
                    bufs = codec.allocate(meta, sizes)
                except CheckpointError:
                    raise
                except (*_DECODE_ERRORS, MemoryError) as e:
                    raise _corrupt(path, f"bad {kind} meta: {e}", name) from None
                if len(bufs) != cnt:
                    raise _corrupt(path, f"codec wants {len(bufs)} segments, file has {cnt}", name)
                for j, b in enumerate(bufs):
                    if type(b) is not memoryview or b.ndim != 1 or b.format != "B":
                        b = bufs[j] = _flat_writable(b)
                    if b.nbytes != sizes[j] or b.readonly:
                        raise _corrupt(path, f"codec buffer of {b.nbytes} bytes for a {sizes[j]}-byte segment", name)
            plan.append((i, name, kind, meta, codec, bufs))
        return plan

    def _direct_targets(self, plan: list[Any], existing: Mapping[str, Any]) -> list[_Direct]:
        """Segments to read straight into live memory (codecs' ``inplace_targets``, see
        :mod:`epochal.storage.codecs`): big ones whose live target has exactly their size.
        Asking the codecs also checks that each live object fits (BlobMismatchError before
        anything is read). None when two targets overlap (the staged path keeps the order
        in which ``load_state_dict``/``copy_`` would write them)."""
        idx, path = self._index, self.path
        out: list[_Direct] = []
        for pos, (i, name, kind, meta, codec, bufs) in enumerate(plan):
            live = existing.get(name)
            fn = getattr(codec, "inplace_targets", None) if live is not None else None
            if fn is None:
                continue
            try:
                targets = fn(meta, [b.nbytes for b in bufs], live)
            except BlobMismatchError as e:
                raise BlobMismatchError(f"{path}, blob {name!r}: {e}") from e
            except CheckpointError:
                raise
            except _DECODE_ERRORS as e:
                raise _corrupt(path, f"cannot decode {kind} blob: {e}", name) from None
            if not targets or len(targets) != len(bufs):
                continue
            first = int(idx.recs["seg_first"][i])
            for j, t in enumerate(targets):
                if t is None:
                    continue
                t = _flat_writable(t)
                if t.readonly or t.nbytes != bufs[j].nbytes or t.nbytes < BIG_SEGMENT:
                    continue
                seg = idx.segs[first + j]
                out.append(_Direct(pos, j, name, int(seg["offset"]), t.nbytes, int(seg["pad"]),
                                   int(seg["crc"]), t, _codecs.buffer_address(t)))
        spans = sorted((d.addr, d.addr + d.size) for d in out)
        if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
            return []
        return out

    def _verify_direct(self, direct: list[_Direct]) -> None:
        """Checksums (and padding) of the segments to be read in place, without fresh memory:
        computed on a read-only map of the file (page-cache pages, no copy), segments spread
        over a few threads; streamed through a small ring of buffers if mapping fails."""
        path = self.path
        try:
            mm = _mmap.mmap(self._fd, 0, access=_mmap.ACCESS_READ)
        except (OSError, ValueError):
            return self._verify_direct_streamed(direct)
        fn = self._index.fn
        crcs = [0] * len(direct)
        try:
            if hasattr(mm, "madvise") and hasattr(_mmap, "MADV_SEQUENTIAL"):
                mm.madvise(_mmap.MADV_SEQUENTIAL)
            whole = memoryview(mm)

            def job(slots: list[int]) -> Any:
                def run() -> None:
                    for s_ in slots:
                        d = direct[s_]
                        crcs[s_] = fn(whole[d.off : d.off + d.size], 0)
                return run

            _run_parallel([job(g) for g in _balanced([d.size for d in direct], _threads())])
            for d in direct:
                if d.pad and any(whole[d.off + d.size : d.off + d.size + d.pad]):
                    raise _corrupt(path, "nonzero padding after the data (blob damaged)", d.name)
            whole.release()
        finally:
            try:
                mm.close()
            except BufferError:  # a view is still referenced (an exception in flight): GC
                pass
        for slot, d in enumerate(direct):
            if crcs[slot] != d.crc:
                raise _corrupt(path, "data checksum mismatch (blob damaged)", d.name)
        return None

    def _verify_direct_streamed(self, direct: list[_Direct]) -> None:
        """:meth:`_verify_direct` through a small ring of reusable buffers (one thread reads,
        a worker checksums)."""
        path, fd, fn = self.path, self._fd, self._index.fn
        ring = [memoryview(bytearray(CHUNK)) for _ in range(_RING)]
        free = threading.Semaphore(_RING)
        crcs = [0] * len(direct)
        errors: list[BaseException] = []

        def step(slot: int, piece: memoryview) -> None:
            try:
                if not errors:
                    crcs[slot] = fn(piece, crcs[slot])
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
            finally:
                free.release()

        ahead = _Prefetcher(fd, _merged_ranges([(d.off, d.off + d.size + d.pad) for d in direct]))
        worker = _Worker()
        r = 0
        try:
            for slot, d in enumerate(direct):
                for start in range(0, d.size, CHUNK):
                    n = min(CHUNK, d.size - start)
                    free.acquire()
                    piece = ring[r][:n]
                    r = (r + 1) % _RING
                    try:
                        ahead.read(path, [piece], d.off + start, d.name, progress=False)
                    except BaseException:
                        free.release()
                        raise
                    worker.submit(step, slot, piece)
                if d.pad and any(_pread_exact(path, fd, d.pad, d.off + d.size, "padding", d.name)):
                    raise _corrupt(path, "nonzero padding after the data (blob damaged)", d.name)
            worker.wait()
        finally:
            worker.close()
        if errors:
            raise errors[0]
        for slot, d in enumerate(direct):
            if crcs[slot] != d.crc:
                raise _corrupt(path, "data checksum mismatch (blob damaged)", d.name)

    def _read_direct(self, plan: list[Any], direct: list[_Direct]) -> None:
        """Read the (verified) segments into the live memory, split over a few threads in
        file order; the codecs' decode gets those views as buffers and sees that the bytes
        are in place. Progress is reported by the calling thread."""
        path, fd = self.path, self._fd
        pieces = [
            (d.target[start : start + _DIRECT_PIECE], d.off + start, d.name)
            for d in direct
            for start in range(0, d.size, _DIRECT_PIECE)
        ]
        total = sum(p[0].nbytes for p in pieces)
        nthreads = _threads() if total >= _PARALLEL_MIN else 1
        groups = _contiguous([p[0].nbytes for p in pieces], nthreads)
        done = [0] * len(groups)

        def job(g: int) -> Any:
            def run() -> None:
                for k in groups[g]:
                    view, off, name = pieces[k]
                    _preadv_exact(path, fd, [view], off, name, progress=g == 0)
                    done[g] += view.nbytes
            return run

        _run_parallel([job(g) for g in range(len(groups))])
        report_progress(sum(done[1:]))
        for d in direct:
            plan[d.pos][5][d.seg] = d.target

    def _read_parallel(self, par: list[tuple[int, memoryview, int, int, str]], verify: bool, got: list[int]) -> None:
        """Read big segments into their buffers with _IO_THREADS threads, each a contiguous
        part of the file, in READ_PIECE pieces, each piece checksummed by its thread right
        after it is read (CRC-32C releases the GIL); checksums go to ``got[slot]``, and a
        nonzero padding is reported naming the blob. Progress is reported by the calling
        thread (its own bytes as it goes, the others' at the end)."""
        path, fd, fn = self.path, self._fd, self._index.fn
        groups = _contiguous([item[1].nbytes for item in par], _IO_THREADS)
        done = [0] * len(groups)

        def job(g: int) -> Any:
            def run() -> None:
                for k in groups[g]:
                    slot, buf, off, pad, name = par[k]
                    crc = 0
                    for start in range(0, buf.nbytes, READ_PIECE):
                        piece = buf[start : start + READ_PIECE]
                        _preadv_exact(path, fd, [piece], off + start, name, progress=g == 0)
                        if verify:
                            crc = fn(piece, crc)
                        done[g] += piece.nbytes
                    if verify:
                        got[slot] = crc
                        if pad and any(_pread_exact(path, fd, pad, off + buf.nbytes, "padding", name)):
                            raise _corrupt(path, "nonzero padding after the data (blob damaged)", name)
            return run

        _run_parallel([job(g) for g in range(len(groups))])
        report_progress(sum(done[1:]))

    def _fill(self, plan: list[Any], verify: bool, skip: set[tuple[int, int]] | frozenset[tuple[int, int]] = frozenset()) -> None:
        """Phase 2 (pread): read every segment straight into its buffer.

        Adjacent small segments (and their padding) are coalesced into one ``preadv`` of
        about BATCH_BYTES and checksummed inline right after, while still in cache; big
        segments are read in READ_PIECE pieces whose checksums a background thread computes
        while the next piece is read. When the big segments add up to _PARALLEL_MIN or more,
        they are read by _IO_THREADS threads instead (contiguous parts of the file, each
        thread checksumming its own pieces): several requests in flight keep a cold disk busy,
        where one reader's speed swung 3x from run to run here."""
        idx, path, fd = self._index, self.path, self._fd
        cols = idx.columns() if len(plan) > 64 else None
        fn_inline = checksum_function(idx.header.algorithm, inline=True)
        nslots = sum(len(p[5]) for p in plan)
        big_total = sum(
            b.nbytes for pos, p in enumerate(plan) for j, b in enumerate(p[5])
            if b.nbytes >= BIG_SEGMENT and (pos, j) not in skip
        )
        parallel = big_total >= _PARALLEL_MIN
        ck = Checksummer(idx.fn, nslots) if verify and big_total and not parallel else None
        par: list[tuple[int, memoryview, int, int, str]] = []  # (slot, buffer, offset, pad, blob)
        got = [0] * nslots
        expected: list[tuple[int, str]] = []  # per slot: (crc, blob name)
        total = sum(b.nbytes for p in plan for b in p[5])
        spans: list[tuple[int, int]] = []
        if total >= PREFETCH_MIN:
            for p in plan:
                for k in idx.seg_range(p[0]) if cols is None else range(
                    cols.seg_first[p[0]], cols.seg_first[p[0]] + cols.seg_count[p[0]]
                ):
                    if cols is not None:
                        o, ln, pd = cols.offsets[k], cols.lengths[k], cols.pads[k]
                    else:
                        o, ln, pd = (int(idx.segs[c][k]) for c in ("offset", "length", "pad"))
                    if parallel and ln >= BIG_SEGMENT:
                        continue  # read by the parallel pass, which needs no hints
                    spans.append((o, o + ln + pd))
        ahead = _Prefetcher(fd, _merged_ranges(spans))
        try:
            views: list[memoryview] = []
            todo: list[tuple[int, Any]] = []
            run_start = run_end = -1  # file range of the current coalesced run
            run_blob = ""
            slot = 0
            # padding of a run is read into one zeroed scratch area and checked to be zero
            pad_area = bytearray(ALIGN * atomic.IOV_MAX) if verify else bytearray(0)
            pad_view = memoryview(pad_area)
            pad_used = 0
            pad_names: list[str] = []

            def flush() -> None:
                nonlocal pad_area, pad_view, pad_used
                ahead.read(path, views, run_start, run_blob)
                for s_, b_ in todo:
                    got[s_] = fn_inline(b_, got[s_])
                if pad_used:
                    if pad_area != _ZERO_AREA:
                        for k, nm in enumerate(pad_names):
                            if any(pad_area[k * ALIGN : (k + 1) * ALIGN]):
                                raise _corrupt(path, "nonzero padding after the data (blob damaged)", nm)
                    pad_area = bytearray(ALIGN * atomic.IOV_MAX)
                    pad_view = memoryview(pad_area)
                    pad_used = 0
                    pad_names.clear()

            for pos, (i, name, _kind, _meta, _codec, bufs) in enumerate(plan):
                nb = len(bufs)
                if cols is not None:
                    first = cols.seg_first[i]
                    offs = cols.offsets[first : first + nb]
                    pads = cols.pads[first : first + nb]
                    crcs = cols.crcs[first : first + nb]
                else:
                    first = int(idx.recs["seg_first"][i])
                    sl = idx.segs[first : first + nb]
                    offs, pads, crcs = sl["offset"].tolist(), sl["pad"].tolist(), sl["crc"].tolist()
                for j, (buf, off, pad, crc) in enumerate(zip(bufs, offs, pads, crcs)):
                    if skip and (pos, j) in skip:
                        continue  # read in place after every checksum is verified
                    if verify:
                        expected.append((crc, name))
                    size = buf.nbytes
                    if size >= BIG_SEGMENT and parallel:
                        par.append((slot, buf, off, pad, name))
                        slot += 1
                        continue
                    if size >= BIG_SEGMENT:
                        if views:
                            flush()
                            views, todo, run_end = [], [], -1
                        for start in range(0, size, READ_PIECE):
                            piece = buf[start : start + READ_PIECE]
                            ahead.read(path, [piece], off + start, name)
                            if ck is not None:
                                ck.submit([(slot, piece)])
                        if pad and verify:
                            tail = _pread_exact(path, fd, pad, off + size, "padding", name)
                            if any(tail):
                                raise _corrupt(path, "nonzero padding after the data (blob damaged)", name)
                        slot += 1
                        continue
                    if run_end != off or len(views) >= atomic.IOV_MAX - 2 or off - run_start >= BATCH_BYTES:
                        if views:
                            flush()
                            views, todo = [], []
                        run_start = off
                        run_blob = name
                    if size:
                        views.append(buf)
                        if verify:
                            todo.append((slot, buf))
                    if pad:
                        if verify:
                            views.append(pad_view[pad_used * ALIGN : pad_used * ALIGN + pad])
                            pad_used += 1
                            pad_names.append(name)
                        else:
                            views.append(_SCRATCH[:pad])
                    run_end = off + size + pad
                    slot += 1
            if views:
                flush()
            if par:
                self._read_parallel(par, verify, got)
            if verify:
                if ck is not None:
                    bg = ck.results()
                    got = [a or b for a, b in zip(got, bg)]
                for s_, (want, name) in enumerate(expected):
                    if got[s_] != want:
                        raise _corrupt(path, "data checksum mismatch (blob damaged)", name)
        finally:
            if ck is not None:
                ck.close()

    def _map(self, plan: list[Any], verify: bool) -> None:
        """Phase 2 (mmap): hand read-only views of the map to the codecs, after verifying."""
        assert self._mm is not None
        idx = self._index
        whole = memoryview(self._mm)
        segs = idx.segs
        for entry in plan:
            i, name = entry[0], entry[1]
            bufs: list[memoryview] = entry[5]
            for k in idx.seg_range(i):
                off, ln, pad = int(segs["offset"][k]), int(segs["length"][k]), int(segs["pad"][k])
                view = whole[off : off + ln]
                report_progress(ln)
                if verify:
                    if idx.fn(view, 0) != int(segs["crc"][k]):
                        raise _corrupt(self.path, "data checksum mismatch (blob damaged)", name)
                    if pad and any(whole[off + ln : off + ln + pad]):
                        raise _corrupt(self.path, "nonzero padding after the data (blob damaged)", name)
                bufs.append(view)

    def verify(self, names: Sequence[str] | None = None) -> None:
        """Re-check the data checksums of ``names`` (all when None) without decoding or
        allocating the values: data streams through a small reusable buffer."""
        idx = self._index
        ids = range(self.header.blob_count) if names is None else [self._lookup(n) for n in names]
        segs = idx.segs
        scratch = memoryview(bytearray(CHUNK))
        for i in ids:
            for k in idx.seg_range(i):
                off = int(segs["offset"][k])
                left = int(segs["length"][k])
                pad = int(segs["pad"][k])
                crc = 0
                while left:
                    n = min(left, CHUNK)
                    piece = scratch[:n]
                    _preadv_exact(self.path, self._fd, [piece], off, idx.name(i))
                    crc = idx.fn(piece, crc)
                    off += n
                    left -= n
                if crc != int(segs["crc"][k]):
                    raise _corrupt(self.path, "data checksum mismatch (blob damaged)", idx.name(i))
                if pad and any(_pread_exact(self.path, self._fd, pad, off, "padding", idx.name(i))):
                    raise _corrupt(self.path, "nonzero padding after the data (blob damaged)", idx.name(i))


def _flat_writable(b: Any) -> memoryview:
    mv = memoryview(b)
    if mv.ndim == 1 and mv.format == "B":
        return mv
    return mv.cast("B")


def _stat_from_header(path: str, h: _Header) -> NativeStat:
    return NativeStat(
        path=path,
        format_version=f"{h.major}.{h.minor}",
        major=h.major,
        minor=h.minor,
        checksum_algorithm=h.algorithm,
        blob_count=h.blob_count,
        segment_count=h.seg_count,
        data_bytes=h.data_bytes,
        index_bytes=h.index_length,
        file_bytes=h.file_size,
        digest=h.digest(),
    )


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
    fd = _open_fd(p)
    try:
        return _stat_from_header(p, _read_header(p, fd))
    finally:
        os.close(fd)


class NativeBackend(DbBackend):
    """``db_type="native"``: the format of this module (docs/format.md)."""

    name = "native"

    def write(self, path: str, blobs: Mapping[str, Any]) -> int:
        return write_native(path, blobs)

    def read(
        self,
        path: str,
        names: Sequence[str] | None = None,
        *,
        allow_incomplete: bool = False,
        existing: Mapping[str, Any] | None = None,
        verify: bool = True,
        stats: ReadStats | None = None,
    ) -> dict[str, Any]:
        with NativeFile(path, mmap=False) as f:
            return f.read(
                names, allow_incomplete=allow_incomplete, existing=existing, verify=verify,
                stats=stats,
            )

    def describe(self, path: str) -> list[BlobInfo]:
        with NativeFile(path, mmap=False) as f:
            return f.describe()

    def digest(self, path: str) -> str | None:
        """``native1:<algorithm>:<index checksum>:<file size>``: read from the superblock only;
        the index checksum covers every data checksum, so it identifies the content."""
        return stat_native(path).digest

    def verify(self, path: str) -> None:
        with NativeFile(path, mmap=False) as f:
            f.verify()


register_db_type("native", NativeBackend)
