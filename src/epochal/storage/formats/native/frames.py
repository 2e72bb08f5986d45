"""The codec part of a version-3 index: which segments are compressed, and their streams.

A compressed segment's stored bytes (what its segment record's length, checksum and padding
describe, like any segment's) are its streams, concatenated; each frame of
:data:`~.layout.CODED_DTYPE`'s ``frame_bytes`` logical bytes is ``planes`` streams
(:mod:`epochal.storage.encoding.compress`). Each stream has its own checksum, so a ranged
read checks only the streams it reads. :class:`CodedTable` parses and validates the part
from the index bytes alone, like :class:`~.index.Index` the rest.
"""

from __future__ import annotations

import numpy as np

from ...encoding.compress import CODEC_PLANES, CODEC_ZSTD
from .layout import CODEC_HEAD, CODED_DTYPE, STREAM_DTYPE, corrupt

__all__ = ["MAX_EXPANSION", "MAX_FRAME", "CodedTable"]

#: a compressed segment's logical length is at most this many times its stored length
#: (zstd's own limit is about 32,000: a 128 KiB block of one repeated byte is 4 bytes), so a
#: forged index cannot make a reader allocate more than that for a small file
MAX_EXPANSION = 1 << 16
#: the most logical bytes of one frame a reader accepts (each stream is decoded whole)
MAX_FRAME = 64 << 20


class CodedTable:
    """The compressed segments of one file: the tables, a segment -> row map, and each
    row's stream offsets inside its segment."""

    def __init__(self, path: str, coded: np.ndarray, streams: np.ndarray) -> None:
        self.path = path
        self.coded = coded
        self.streams = streams
        self.row_of: dict[int, int] = {k: r for r, k in enumerate(coded["seg"].tolist())}

    @staticmethod
    def sizes(raw: bytes, pos: int) -> tuple[int, int, int]:
        """At ``pos`` (just after the metas text): the codec part's compressed-segment count,
        stream count and total size; the caller bounds them by the index length."""
        if pos + CODEC_HEAD.size > len(raw):
            return 0, 0, CODEC_HEAD.size
        ncoded, nstreams, _ = CODEC_HEAD.unpack_from(raw, pos)
        return ncoded, nstreams, CODEC_HEAD.size + ncoded * CODED_DTYPE.itemsize + nstreams * STREAM_DTYPE.itemsize

    @classmethod
    def parse(cls, path: str, raw: bytes, pos: int) -> CodedTable:
        ncoded, nstreams, _ = cls.sizes(raw, pos)
        pos += CODEC_HEAD.size
        coded = np.frombuffer(raw, dtype=CODED_DTYPE, count=ncoded, offset=pos)
        streams = np.frombuffer(raw, dtype=STREAM_DTYPE, count=nstreams, offset=pos + coded.nbytes)
        return cls(path, coded, streams)

    def validate(self, segs: np.ndarray, groups: np.ndarray) -> None:
        """Every record names a distinct segment, in order, with a known codec and layout;
        the streams of each tile its stored bytes exactly, and their count is its frames'
        times its planes; no checksum group covers a compressed segment (writers never group
        them, so that every read of one goes through its streams)."""
        c, path = self.coded, self.path
        if not len(c):
            if len(self.streams):
                raise corrupt(path, "codec part: streams without compressed segments")
            return
        seg = c["seg"].astype(np.int64)
        planes = c["planes"].astype(np.int64)
        fb = c["frame_bytes"].astype(np.int64)
        logical = c["logical"]
        codec = c["codec"]
        if (
            np.any(seg[1:] <= seg[:-1]) or seg[-1] >= len(segs)
            or np.any((codec != CODEC_ZSTD) & (codec != CODEC_PLANES))
            or np.any((codec == CODEC_ZSTD) & (planes != 1))
            or np.any((codec == CODEC_PLANES) & (planes != 2) & (planes != 4) & (planes != 8))
            or np.any(fb <= 0) or np.any(fb > MAX_FRAME) or np.any(fb % planes)
        ):
            raise corrupt(path, "codec part: a compressed segment record is inconsistent")
        stored = segs["length"][seg]
        if np.any(logical == 0) or np.any(logical > stored * np.uint64(MAX_EXPANSION)):
            raise corrupt(path, "codec part: absurd logical length of a compressed segment")
        lg = logical.astype(np.int64)
        if np.any(lg % planes):
            raise corrupt(path, "codec part: a compressed segment record is inconsistent")
        nstreams = -(-lg // fb) * planes
        first = c["stream_first"].astype(np.int64)
        if first[0] != 0 or np.any(first[1:] != (first + nstreams)[:-1]) or first[-1] + nstreams[-1] != len(self.streams):
            raise corrupt(path, "codec part: the stream table does not tile the compressed segments")
        if np.any(self.streams["length"] == 0):
            raise corrupt(path, "codec part: an empty stream")
        csum = np.concatenate([[0], np.cumsum(self.streams["length"].astype(np.int64))])
        if np.any(csum[first + nstreams] - csum[first] != stored.astype(np.int64)):
            raise corrupt(path, "codec part: streams do not add up to their segment's stored length")
        if len(groups):
            gf = groups["seg_first"].astype(np.int64)
            gl = gf + groups["seg_count"].astype(np.int64)
            at = np.searchsorted(gf, seg, side="right") - 1
            if np.any((at >= 0) & (seg < gl[np.maximum(at, 0)])):
                raise corrupt(path, "codec part: a checksum group covers a compressed segment")

    # ---- lookups
    def row(self, k: int) -> int | None:
        """The record of segment ``k``, or None when it is stored raw."""
        return self.row_of.get(k)

    def logical(self, r: int) -> int:
        return int(self.coded["logical"][r])

    def layout(self, r: int) -> tuple[int, int, int, int]:
        """codec, planes, frame_bytes, logical of record ``r``."""
        rec = self.coded[r]
        return int(rec["codec"]), int(rec["planes"]), int(rec["frame_bytes"]), int(rec["logical"])

    def stream_range(self, r: int, first_frame: int, end_frame: int) -> tuple[int, int, list[int], list[int]]:
        """For frames ``first_frame .. end_frame - 1`` of record ``r``: the byte range of
        their streams inside the segment (start, end), each stream's length and checksum."""
        rec = self.coded[r]
        p = int(rec["planes"])
        s0 = int(rec["stream_first"]) + first_frame * p
        s1 = int(rec["stream_first"]) + end_frame * p
        base = int(rec["stream_first"])
        lengths = self.streams["length"]
        start = int(lengths[base:s0].sum(dtype=np.int64))
        sl = lengths[s0:s1].tolist()
        return start, start + sum(sl), sl, self.streams["crc"][s0:s1].tolist()

    def frame_count(self, r: int) -> int:
        _, _, fb, lg = self.layout(r)
        return -(-lg // fb)
