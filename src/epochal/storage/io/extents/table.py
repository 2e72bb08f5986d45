"""Decoding an incremental db's extent table (version 2: zlib-compressed byte planes).

The table arrives as columns split into byte planes (all first bytes, then all second bytes,
...): each plane is written straight into its byte of the parsed rows (EXT_DTYPE), a plane of
zeros skipped (the high bytes of lengths and sources mostly are), so no column is assembled
and copied again. The same pass gives the int64 columns that the checks and the read plan
work on (logical start, length, source, offset in the source), once per parse.
"""

from __future__ import annotations

import zlib

import numpy as np

from ....errors import CheckpointCorruptError

__all__ = ["Columns", "PACKED_COLUMNS", "PACKED_ROW", "columns_of", "unpack_extents"]

#: version 2's extent columns: length, source, checksum, offset in the source less the logical one
PACKED_COLUMNS = (("length", "<u8"), ("source", "<u4"), ("crc", "<u4"), ("rel", "<i8"))
PACKED_ROW = sum(np.dtype(t).itemsize for _, t in PACKED_COLUMNS)
#: the largest extent length accepted (offsets and sums of lengths stay far from int64's end)
MAX_LENGTH = 1 << 62

#: an extent table's logical starts, lengths, sources and offsets in the source, as int64
Columns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _corrupt(path: str, message: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(path, message)


def columns_of(ext: np.ndarray) -> Columns:
    """The int64 columns of parsed rows ``ext`` (version 1's raw rows; their values were
    checked to lie within the logical size before this)."""
    return (ext["loff"].astype(np.int64), ext["length"].astype(np.int64),
            ext["source"].astype(np.int64), ext["soff"].astype(np.int64))


def unpack_extents(path: str, packed: bytes, count: int, dtype: np.dtype) -> tuple[np.ndarray, Columns]:
    """Version 2's table ``packed`` of ``count`` extents: the rows (``dtype``: EXT_DTYPE) and
    their int64 columns; CheckpointCorruptError naming ``path`` when it does not decode to
    exactly its extents, a length is absurd or an extent points before its source's start."""
    want = count * PACKED_ROW
    d = zlib.decompressobj()
    try:
        raw = d.decompress(packed, want + 1)
    except zlib.error as e:
        raise _corrupt(path, f"incremental db extent table cannot be decoded: {e}") from None
    if len(raw) != want or d.unconsumed_tail or not d.eof:
        raise _corrupt(path, "incremental db extent table does not hold its extents")
    ext = np.zeros(count, dtype=dtype)
    rows = ext.view(np.uint8).reshape(count, dtype.itemsize)
    planes = np.frombuffer(raw, np.uint8)
    pos = 0
    for name, t in PACKED_COLUMNS:
        size = np.dtype(t).itemsize
        at = dtype.fields["soff" if name == "rel" else name][1]  # type: ignore[index]
        for j in range(size):  # plane j: byte j of every value (little-endian)
            plane = planes[pos : pos + count]
            if plane.any():
                rows[:, at + j] = plane
            pos += count
    ln = ext["length"].astype(np.int64)  # (u8 over 2**63: negative, refused below)
    if count and (int(ln.min()) <= 0 or int(ln.max()) > MAX_LENGTH):
        raise _corrupt(path, "incremental db extents do not tile the logical file")
    loff = np.zeros(count, dtype=np.int64)
    if count:
        np.cumsum(ln[:-1], out=loff[1:])
    soff = ext["soff"].view(np.int64) + loff  # (the field holds the relative offset here)
    if count and int(soff.min()) < 0:
        raise _corrupt(path, "incremental db extent points before the start of its source")
    ext["loff"], ext["soff"] = loff, soff
    return ext, (loff, ln, ext["source"].astype(np.int64), soff)
