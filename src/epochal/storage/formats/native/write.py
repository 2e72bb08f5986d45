"""Writing a native db file: :func:`write_native`, raw or compressed as the stream goes.

:func:`write_native` plans the whole file (:func:`~.writer.plan_file`: every blob encoded and
laid out before anything touches the disk), streams the data (:func:`~.writer.write_data`),
appends the index and fills in the superblock (:func:`~.writer.finish`), through the byte
store's atomic commit. With compression, :func:`~.writer.plan_file` with ``defer`` lays the
file out at its segments' raw lengths and marks those to compress
(:attr:`~.writer.Plan.lazy`); :class:`Compressing` compresses each when the stream reaches
it, gives its buffer back once its checksum is taken, and at the end lays the file out at
the stored lengths (:meth:`Compressing.laid_out`): the same bytes as compressing every
segment first, with one or two segments' compressed bytes in memory at a time. An
incremental save streams into its extent sink the same way (:mod:`.incremental`).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .... import knobs
from ...encoding.compress import WriteOptions, compress_segment
from ...encoding.planes import SPARES
from ...io import tuning
from ...io.checksum import checksum_function, default_algorithm
from ...io.seam import ByteSink, committed, store_for
from ..stream import stream_segments
from . import image
from .layout import ALIGN, CODED_DTYPE, STREAM_DTYPE, SUPERBLOCK_SIZE
from .writer import _NO_CODED, _ZEROS, Plan, finish, index_bytes, plan_file, write_data

__all__ = ["Compressing", "write_compressing", "write_native"]


def write_native(path: str | os.PathLike[str], blobs: Mapping[str, Any], *, algorithm: str | None = None,
                 options: WriteOptions | None = None) -> int:
    """Write ``blobs`` to a native db file at ``path`` atomically and durably; return its size.

    Every value is encoded first (UnsupportedBlobError naming the blob before anything touches
    the disk); then the data is streamed from the values' own memory in large sequential
    writes, checksummed on a background thread, followed by the index; the file is fsynced,
    renamed into place and the directory fsynced. A missing directory raises
    FileNotFoundError; too little free space raises OSError(ENOSPC) naming the file.
    ``options`` (default: the context's :data:`WRITE_OPTIONS`): compression (format 3.0)."""
    path = os.fspath(path)
    algorithm = algorithm or default_algorithm()
    fn = checksum_function(algorithm)
    plan = plan_file(blobs, options, fn, defer=True)
    if plan.lazy:
        return write_compressing(path, plan, algorithm, fn)
    try:
        return _write_planned(path, plan, algorithm, fn)
    finally:
        plan.release()


def _write_planned(path: str, plan: Plan, algorithm: str, fn: Any) -> int:
    file_size = plan.index_offset + plan.index_length
    store = store_for(path)
    create = store.create
    pinned_min = tuning.DIRECT_MIN_PINNED
    if (pinned_min is not None and file_size >= pinned_min and knobs.get().zero_copy
            and hasattr(store, "create_pinned")
            and image.data_image(plan.views, plan.segs, image.PAGE) is not None):
        create = store.create_pinned  # a snapshot arena: written from there (O_DIRECT)
    with committed(create(path, size=file_size)) as out:
        plan.checksummed(write_data(out, plan, algorithm))
        return finish(out, plan, algorithm, fn)


def write_compressing(path: str, plan: Plan, algorithm: str, fn: Any) -> int:
    """Write a file whose segments ``plan.lazy`` are compressed as the write reaches them,
    one at a time, each written and its buffer given back (once its checksum is taken) for
    the next: a compressed save holds one or two segments' compressed bytes, not the whole
    file's, and reuses their memory within the save. The layout is then that of the stored
    lengths (the same bytes as compressing every segment first): the index is written after
    the data and the superblock last, as always; the file's size is known only at the end."""
    lazy = Compressing(plan, fn)
    with committed(store_for(path).create(path)) as out:
        crcs = lazy.stream(out, tuning.CHUNK)
        return finish(out, lazy.laid_out(crcs), algorithm, fn)


class Compressing:
    """The segments ``plan.lazy`` of a write compressed as the stream reaches them
    (:func:`write_compressing`, and an incremental save's): :meth:`produce` gives a
    segment's stored bytes, :meth:`laid_out` the plan of the stored lengths once all are."""

    def __init__(self, plan: Plan, fn: Any) -> None:
        assert plan.options is not None
        self.plan, self.fn, self.options = plan, fn, plan.options
        self.lazy = frozenset(plan.lazy)
        #: per compressed segment: codec, planes, frame bytes, logical size, stream lengths
        #: and checksums (not its bytes: its buffer goes back once its checksum is taken)
        self.made: dict[int, tuple[int, int, int, int, list[int], list[int]]] = {}

    def produce(self, k: int) -> tuple[Any, int, Any]:
        """Segment ``k``'s stored bytes, their padding, and what to call once their checksum
        is taken (:func:`~epochal.storage.formats.stream.stream_segments`' ``produce``)."""
        v = self.plan.views[k]
        c = compress_segment(v, self.plan.widths[k], self.options, self.fn) if k in self.lazy else None
        if c is None:  # (stored raw)
            return v, -v.nbytes % ALIGN, None
        self.made[k] = (c.codec, c.planes, c.frame_bytes, c.logical, c.lengths, c.crcs)
        buf = c.buffer
        return c.data, -c.nbytes % ALIGN, (lambda: SPARES.give_back([buf])) if buf is not None else None

    def stream(self, out: ByteSink, chunk: int, also: tuple[int, ...] = (), produce: Any = None) -> list[int]:
        """Stream the file's data to ``out`` (big segments in ``chunk`` pieces), the segments
        ``plan.lazy`` and ``also`` made when reached (by ``produce``: default :meth:`produce`);
        the checksums as :func:`write_data`'s."""
        plan, g = self.plan, self.plan.groups
        return stream_segments(
            out, self.fn, plan.views, plan.segs["length"].tolist(), batch_bytes=tuning.BATCH_BYTES,
            pads=plan.segs["pad"].tolist(), head=[_ZEROS], big=tuning.BIG_SEGMENT, chunk=chunk,
            groups=list(zip(g["seg_first"].tolist(), g["seg_count"].tolist())),
            produce=produce or self.produce, lazy=sorted(self.lazy.union(also)),
        )

    def laid_out(self, crcs: list[int]) -> Plan:
        """The plan of the file as written: stored lengths and offsets, the codec records of
        the compressed segments, the data checksums ``crcs`` (:meth:`stream`'s)."""
        plan = self.plan
        segs = plan.segs.copy()
        rows: list[tuple[int, int, int, int, int, int]] = []
        lens: list[int] = []
        stream_crcs: list[int] = []
        for k in sorted(self.made):
            codec, planes, frame_bytes, logical, lengths, scrcs = self.made[k]
            rows.append((k, codec, planes, frame_bytes, len(lens), logical))
            lens.extend(lengths)
            stream_crcs.extend(scrcs)
            segs["length"][k] = sum(lengths)
        segs["pad"] = (-segs["length"].astype(np.int64)) % ALIGN
        padded = segs["length"] + segs["pad"]
        segs["offset"][0:1] = SUPERBLOCK_SIZE
        if len(segs) > 1:
            segs["offset"][1:] = SUPERBLOCK_SIZE + np.cumsum(padded[:-1])
        streams = np.zeros(len(lens), dtype=STREAM_DTYPE)
        streams["length"], streams["crc"] = lens, stream_crcs
        done = dataclasses.replace(
            plan, segs=segs, coded=np.array(rows, dtype=CODED_DTYPE) if rows else _NO_CODED, streams=streams,
            index_offset=SUPERBLOCK_SIZE + int(padded.sum()), data_bytes=int(segs["length"].sum()), lazy=(),
        )
        done.checksummed(crcs)
        return dataclasses.replace(done, index_length=len(index_bytes(done)))
