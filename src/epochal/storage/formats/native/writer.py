"""The native writer's layers: plan the whole file, stream its data, write its index.

:func:`plan_file` encodes every blob and lays the file out (offsets, tables, names, metas)
before anything touches the disk, so an unsupported blob is reported first. :func:`write_data`
streams the superblock placeholder and the segments in large sequential writes, straight
from the values' memory, checksummed on a background thread; :func:`finish` appends the
index and fills in the superblock. :mod:`.write` puts them together (``write_native``,
and compression as the stream reaches each segment); :mod:`.incremental` streams the same
plan into an extent file.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .... import knobs
from ....errors import UnsupportedBlobError
from ...encoding import codecs as _codecs
from ...encoding.codecs import flat_segment
from ...encoding.compress import (
    MIN_BYTES,
    WRITE_OPTIONS,
    WriteOptions,
    compress_segment,
    numpy_width,
    plane_widths,
)
from ...encoding.planes import SPARES
from ...io import tuning
from ...io.checksum import ALGORITHM_IDS, checksum_function, default_algorithm
from ...io.seam import ByteSink, PinnedSink
from ..stream import stream_segments
from . import image
from .layout import (
    ALIGN,
    CODEC_HEAD,
    CODED_DTYPE,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    GROUP_DTYPE,
    INDEX_HEAD,
    INDEX_MAGIC,
    MAX_U32,
    MOFF_DTYPE,
    REC_DTYPE,
    SEG_DTYPE,
    STREAM_DTYPE,
    SUPERBLOCK_SIZE,
    V1,
    V2,
    pack_superblock,
)

__all__ = ["Plan", "finish", "index_bytes", "plan_file", "write_data"]

_ZEROS = memoryview(bytes(ALIGN))
_EMPTY = memoryview(b"")

#: the writer's checksum groups (format 2.0): runs of adjacent segments of fewer than
#: GROUP_SEGMENT bytes each, cut every GROUP_TARGET bytes, kept when they hold at least
#: GROUP_MIN segments, in files of at least GROUP_FILE_MIN such segments (readers accept any
#: grouping). 20,000 small arrays are then ~300 group checksums for a full load to check
#: instead of 20,000 (bench/RESULTS.md); a file of a few dozen blobs, which
#: loads blob by blob, has none and stays a 1.0 file. GROUP_TARGET = 0 writes no groups.
GROUP_SEGMENT = 1 << 20
GROUP_TARGET = 1 << 20
GROUP_MIN = 16
GROUP_FILE_MIN = 64


@dataclass(frozen=True)
class Plan:
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
    #: checksum groups (GROUP_DTYPE, checksums filled in after the data is written)
    groups: np.ndarray
    #: the compressed segments (CODED_DTYPE) and their streams (STREAM_DTYPE), version 3
    coded: np.ndarray
    streams: np.ndarray
    #: the buffers the compressed segments lie in: given back (:meth:`release`) once the
    #: file is written, for the next save's segments
    spare: tuple[np.ndarray, ...] = ()
    #: segments left to compress as the write reaches them (:func:`write_native`), with the
    #: float width of each segment and the options: laid out here at their raw lengths
    lazy: tuple[int, ...] = ()
    widths: tuple[int, ...] = ()
    options: WriteOptions | None = None

    def checksummed(self, crcs: list[int]) -> None:
        """Fill in the data checksums ``crcs`` (:func:`write_data`'s: the segments', then the
        groups')."""
        nseg = len(self.segs)
        self.segs["crc"] = np.asarray(crcs[:nseg], dtype=np.uint64) if nseg else 0
        self.groups["crc"] = np.asarray(crcs[nseg:], dtype=np.uint64) if len(self.groups) else 0

    def release(self) -> None:
        """Give the compressed segments' buffers back for reuse (after the write ended;
        :attr:`views` of compressed segments must not be read after this)."""
        SPARES.give_back(self.spare)

    @property
    def version(self) -> tuple[int, int]:
        """The oldest format version that describes the file: 1.0 without groups, 2.0 with
        them, 3.0 with a compressed segment."""
        if len(self.coded):
            return (FORMAT_MAJOR, FORMAT_MINOR)
        return V2 if len(self.groups) else V1


def plan_file(blobs: Mapping[str, Any], options: WriteOptions | None = None, fn: Any = None,
              *, defer: bool = False) -> Plan:
    """Encode every blob and lay the file out; UnsupportedBlobError before anything is written.
    With ``options.compression`` (default: the context's :data:`WRITE_OPTIONS`), segments
    are compressed here (:mod:`epochal.storage.encoding.compress`), each stream checksummed
    with ``fn``, so the layout has their stored lengths; with ``defer``, those of at least
    MIN_BYTES are only marked (:attr:`Plan.lazy`), for the write to compress one at a time."""
    options = options or WRITE_OPTIONS.get()
    compress = options.compression is not None
    widths: list[int] = []
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
    # meta dict / repr; metas are deduplicated by (dtype, shape). Per dtype object (keyed
    # by id: every value, so its dtype, stays alive during the call) it is decided once
    # whether it is plain, what its JSON is and whether its buffer casts straight to bytes.
    fast_nd = _codecs.plain_ndarray_codec() is not None
    nd_mids: dict[tuple[int, tuple[int, ...]], int] = {}
    nd_dtypes: dict[int, tuple[np.dtype, bool, str, bool]] = {}
    text_ids: dict[str, int] = {}
    ndarray = np.ndarray
    for name, value in blobs.items():
        if not isinstance(name, str):
            raise UnsupportedBlobError(f"blob name {name!r} is not a str")
        if fast_nd and type(value) is ndarray:
            dt = value.dtype
            dinfo = nd_dtypes.get(id(dt))
            if dinfo is None:
                plain = dt.fields is None and dt.subdtype is None and not dt.hasobject
                dinfo = nd_dtypes[id(dt)] = (
                    dt, plain, dumps(_codecs.dtype_to_json(dt)) if plain else "",
                    dt.kind in "biufcSU",  # buffer formats memoryview casts to bytes
                )
            if dinfo[1]:
                shape = value.shape
                dkey = (id(dt), shape)
                mid = nd_mids.get(dkey)
                if mid is None:  # first of its kind: the meta text NdarrayCodec's meta dumps to
                    text = f'["ndarray",{{"dtype":{dinfo[2]},"shape":[{",".join(map(str, shape))}]}}]'
                    mid = text_ids.get(text)
                    if mid is None:
                        mid = text_ids[text] = len(meta_texts)
                        meta_texts.append(text)
                    nd_mids[dkey] = mid
                names_b.append(name.encode("utf-8", "surrogatepass"))
                rec_meta.append(mid)
                rec_nseg.append(1)
                try:
                    mv = memoryview(value).cast("B") if dinfo[3] else None  # type: ignore[arg-type]
                except TypeError:  # not C-contiguous
                    mv = None
                if mv is None:
                    if not value.flags.c_contiguous:
                        value = np.ascontiguousarray(value)
                    mv = memoryview(value.reshape(-1).view(np.uint8)) if value.size else _EMPTY  # type: ignore[arg-type]
                views.append(mv)
                if compress:
                    widths.append(numpy_width(dt))
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
        if compress:
            widths.extend(plane_widths(enc.kind, enc.meta, len(segments)))
        for seg in segments:
            if type(seg) is memoryview and seg.ndim == 1 and seg.format == "B":
                views.append(seg)
            else:
                views.append(flat_segment(seg))

    n, nseg = len(names_b), len(views)
    lazy: tuple[int, ...] = ()
    spare: tuple[np.ndarray, ...]
    if compress and defer:
        coded, streams, spare = _NO_CODED, _NO_STREAMS, ()
        lazy = tuple(k for k, v in enumerate(views) if v.nbytes >= MIN_BYTES)
    elif compress:
        coded, streams, spare = _compress(views, widths, options, fn)
    else:
        coded, streams, spare = _NO_CODED, _NO_STREAMS, ()
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
    if max(len(names_heap), len(metas_text), n, nseg) > MAX_U32:
        raise UnsupportedBlobError("too many blobs or names for one native db file")

    order = np.asarray(sorted(range(n), key=names_b.__getitem__), dtype="<u4")
    groups = plan_groups(lengths, padded, list(lazy) or coded["seg"])
    index_length = (
        INDEX_HEAD.size
        + recs.nbytes
        + segs.nbytes
        + groups.nbytes
        + moffs.nbytes
        + order.nbytes
        + len(names_heap)
        + len(metas_text)
        + (CODEC_HEAD.size + coded.nbytes + streams.nbytes if len(coded) else 0)
    )
    return Plan(
        views, recs, segs, moffs, order, names_heap, metas_text, index_offset, index_length,
        int(lengths.sum()), groups, coded, streams, spare, lazy, tuple(widths) if lazy else (),
        options if lazy else None,
    )


_NO_CODED = np.zeros(0, dtype=CODED_DTYPE)
_NO_STREAMS = np.zeros(0, dtype=STREAM_DTYPE)


def _compress(views: list[memoryview], widths: list[int], options: WriteOptions,
              fn: Any) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
    """Compress the segments ``views`` in place (each replaced by its streams, joined, when
    that is smaller); their codec records and streams, and the buffers they lie in."""
    fn = fn or checksum_function(default_algorithm())
    rows: list[tuple[int, int, int, int, int, int]] = []
    lens: list[int] = []
    crcs: list[int] = []
    spare: list[np.ndarray] = []
    for k, v in enumerate(views):
        c = compress_segment(v, widths[k], options, fn)
        if c is None:
            continue
        if c.buffer is not None:
            spare.append(c.buffer)
        rows.append((k, c.codec, c.planes, c.frame_bytes, len(lens), c.logical))
        lens.extend(c.lengths)
        crcs.extend(c.crcs)
        views[k] = c.data
    coded = np.array(rows, dtype=CODED_DTYPE) if rows else _NO_CODED
    streams = np.zeros(len(lens), dtype=STREAM_DTYPE)
    streams["length"] = lens
    streams["crc"] = crcs
    return coded, streams, tuple(spare)


def plan_groups(lengths: np.ndarray, padded: np.ndarray, coded: Any = ()) -> np.ndarray:
    """The checksum groups of a file whose segments have these lengths and padded lengths:
    each run of adjacent segments under GROUP_SEGMENT bytes, cut where its bytes cross a
    multiple of GROUP_TARGET; groups of fewer than GROUP_MIN segments are dropped (their
    segments' own checksums are cheap enough). The ``coded`` (compressed) segments are never
    grouped: they are always read through their streams."""
    none = np.zeros(0, dtype=GROUP_DTYPE)
    if GROUP_TARGET <= 0:
        return none
    small = lengths < np.uint64(GROUP_SEGMENT)
    small[np.asarray(coded, dtype=np.int64)] = False
    k = np.flatnonzero(small)
    if len(k) < max(GROUP_FILE_MIN, GROUP_MIN, 2):
        return none
    pad64 = padded.astype(np.int64)
    before = (np.cumsum(pad64) - pad64)[k]  # data-area offset of each small segment
    run_start = np.ones(len(k), dtype=bool)
    run_start[1:] = k[1:] != k[:-1] + 1
    run_id = np.cumsum(run_start) - 1
    in_run = before - before[run_start][run_id]
    key = run_id * (1 << 40) + in_run // GROUP_TARGET
    new = np.ones(len(k), dtype=bool)
    new[1:] = key[1:] != key[:-1]
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, len(k)))
    keep = counts >= max(GROUP_MIN, 2)
    groups = np.zeros(int(keep.sum()), dtype=GROUP_DTYPE)
    groups["seg_first"] = k[starts[keep]]
    groups["seg_count"] = counts[keep]
    return groups


def write_data(out: ByteSink, plan: Plan, algorithm: str, *, chunk: int = 0) -> list[int]:
    """Stream the superblock placeholder and every segment (with its padding) to ``out``;
    return the segment checksums, then the group checksums
    (:func:`~epochal.storage.formats.stream.stream_segments`: ``writev`` batches of about
    tuning.BATCH_BYTES, big segments in tuning.CHUNK pieces, checksums on a background
    thread while the kernel copies each batch). When the views already lie in memory laid
    out as the data area (a background save's snapshot arena) and ``out`` writes from
    callers' memory (``O_DIRECT``), the data area is written from there without a copy
    (:mod:`.image`; off with the ``zero_copy`` knob, :mod:`epochal.knobs`); the bytes are the same.
    ``chunk``: the pieces of a big segment (default tuning.CHUNK; an incremental save passes
    its content chunk, so that each piece is one chunk and is matched without a copy)."""
    g = plan.groups
    groups = list(zip(g["seg_first"].tolist(), g["seg_count"].tolist()))
    fn = checksum_function(algorithm)
    if knobs.get().zero_copy and isinstance(out, PinnedSink) and out.pin_align:
        data = image.data_image(plan.views, plan.segs, out.pin_align)
        if data is not None:
            return image.write_image(out, fn, data, plan.segs, head=[_ZEROS],
                                     piece=tuning.DIRECT_BUFFER, groups=groups)
        image.stats.refused += 1
    return stream_segments(
        out, fn, plan.views, plan.segs["length"].tolist(),
        batch_bytes=tuning.BATCH_BYTES, pads=plan.segs["pad"].tolist(), head=[_ZEROS],
        big=tuning.BIG_SEGMENT, chunk=chunk or tuning.CHUNK, groups=groups,
    )


def index_bytes(plan: Plan) -> bytes:
    head = INDEX_HEAD.pack(
        INDEX_MAGIC, 0, len(plan.names_heap), len(plan.metas_text), len(plan.moffs),
        len(plan.groups),
    )
    return b"".join(
        [
            head,
            plan.recs.tobytes(),
            plan.segs.tobytes(),
            plan.groups.tobytes(),
            plan.moffs.tobytes(),
            plan.order.tobytes(),
            plan.names_heap,
            plan.metas_text,
            *(
                [CODEC_HEAD.pack(len(plan.coded), len(plan.streams), 0), plan.coded.tobytes(), plan.streams.tobytes()]
                if len(plan.coded) else []
            ),
        ]
    )


def finish(out: ByteSink, plan: Plan, algorithm: str, fn: Any) -> int:
    """Append the index of ``plan`` (its data checksums filled in) to ``out`` after the data
    and fill in the superblock; return the file's size."""
    index = index_bytes(plan)
    assert len(index) == plan.index_length
    file_size = plan.index_offset + len(index)
    out.write(index)
    out.patch(0, pack_superblock(
        ALGORITHM_IDS[algorithm], plan.index_offset, len(index), file_size, len(plan.recs), len(plan.segs),
        plan.data_bytes, fn(index, 0), fn, plan.version,
    ))
    return file_size
