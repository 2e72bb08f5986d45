"""The native file layout: the spec of docs/format.md in code (constants, tables, superblock).

One file per (node, epoch)::

    [superblock: 64 bytes] [segment 0][pad] [segment 1][pad] ... [index]

Everything here works on bytes alone (no files): the writer packs with it, the reader and
any tool parse with it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ....errors import CheckpointCorruptError, CheckpointError, CheckpointVersionError
from ...io.checksum import ALGORITHM_NAMES, ChecksumFn, checksum_function

MAGIC = b"\x89EPCK\r\n\x1a"
#: the newest version this code reads and writes; a file is written in the oldest version
#: that describes it: 1.0 without checksum groups, 2.0 with them, 3.0 with compressed
#: segments (docs/format.md)
FORMAT_MAJOR = 3
FORMAT_MINOR = 0
#: the version of files without checksum groups (byte-identical to what 1.0 writers wrote)
V1 = (1, 0)
#: the version of files with checksum groups and no compressed segment
V2 = (2, 0)
#: every segment starts at a multiple of ALIGN bytes and owns the zero padding up to the next
ALIGN = 64
INDEX_MAGIC = b"EPIX"

# magic, major, minor, checksum algorithm id, log2(alignment), index offset, index length,
# file size, blob count, segment count, data bytes, index checksum, superblock checksum
SUPER = struct.Struct("<8sHHHHQQQIIQII")
SUPERBLOCK_SIZE = SUPER.size  # 64
#: the superblock's checksum covers its first SUPER_CHECKED bytes
SUPER_CHECKED = SUPERBLOCK_SIZE - 4
# magic, flags, names heap length, metas text length, meta count, group count (version 2;
# reserved and 0 in version 1)
INDEX_HEAD = struct.Struct("<4sIQQII")

#: one record per blob, in file order
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
#: one record per segment, in file order
SEG_DTYPE = np.dtype([("offset", "<u8"), ("length", "<u8"), ("crc", "<u4"), ("pad", "<u4")])
#: one record per checksum group (version 2): a run of adjacent small segments whose data and
#: padding, as one contiguous range of the file, have one more checksum, so that a reader of
#: the whole run checks it with one call instead of one per segment
GROUP_DTYPE = np.dtype([("seg_first", "<u4"), ("seg_count", "<u4"), ("crc", "<u4"), ("flags", "<u4")])
#: version 3: the head of the codec part (after the metas text): compressed segment count,
#: stream count, 8 reserved bytes (0)
CODEC_HEAD = struct.Struct("<IIQ")
#: version 3: one record per compressed segment, in file order: its segment, codec (1: zstd
#: frames, 2: byte planes of rotated words, then zstd), planes per frame (1, or the word
#: size), logical bytes per frame, its first stream, its logical (decoded) length
CODED_DTYPE = np.dtype(
    [
        ("seg", "<u4"),
        ("codec", "<u2"),
        ("planes", "<u2"),
        ("frame_bytes", "<u4"),
        ("stream_first", "<u4"),
        ("logical", "<u8"),
    ]
)
#: version 3: one record per stream (one zstd frame), in file order: stored length, checksum
STREAM_DTYPE = np.dtype([("length", "<u4"), ("crc", "<u4")])
#: where each distinct ``[kind, meta]`` JSON text sits in the metas array
MOFF_DTYPE = np.dtype([("off", "<u4"), ("len", "<u4")])
#: name-sorted permutation of the blob records (for bisection)
ORDER_DTYPE = np.dtype("<u4")
MAX_U32 = 0xFFFFFFFF


def pad_for(end: int) -> int:
    """Zero bytes after a segment ending at ``end`` up to the next ALIGN boundary."""
    return (-end) % ALIGN


@dataclass(frozen=True)
class Header:
    """The decoded superblock."""

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
        """``native<major>:<algorithm>:<index checksum>:<file size>``: the content's identity
        (the index checksum covers every data checksum)."""
        return f"native{self.major}:{self.algorithm}:{self.index_crc:08x}:{self.file_size}"


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

    @classmethod
    def of(cls, path: str, h: Header) -> NativeStat:
        return cls(
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


#: what every read path says of damaged data (one wording, whichever path found it)
DAMAGED_DATA = "data checksum mismatch (blob damaged)"
DAMAGED_PAD = "nonzero padding after the data (blob damaged)"
DAMAGED_GROUP = "checksum group mismatch (its segments verify: index and data disagree)"


def corrupt(path: str, message: str, blob: str | None = None) -> CheckpointCorruptError:
    return CheckpointCorruptError(path, message, blob)


def is_native(head: bytes) -> bool:
    """True when ``head`` (a file's first bytes) starts with the native magic number."""
    return head[: len(MAGIC)] == MAGIC


def pack_superblock(
    algo_id: int, index_offset: int, index_length: int, file_size: int, nblobs: int,
    nsegs: int, data_bytes: int, index_crc: int, fn: ChecksumFn,
    version: tuple[int, int] = (FORMAT_MAJOR, FORMAT_MINOR),
) -> bytes:
    """The 64-byte superblock, its own checksum (with ``fn``) last."""
    fields = (
        MAGIC, version[0], version[1], algo_id, ALIGN.bit_length() - 1, index_offset,
        index_length, file_size, nblobs, nsegs, data_bytes, index_crc,
    )
    body = SUPER.pack(*fields, 0)[:SUPER_CHECKED]
    return body + struct.pack("<I", fn(body, 0))


def parse_superblock(path: str, raw: bytes, actual_size: int) -> Header:
    """Check and decode the 64-byte superblock against the file's real size."""
    if len(raw) < SUPERBLOCK_SIZE:
        raise corrupt(path, f"file is truncated ({actual_size} bytes): not a complete native db")
    if raw[:8] != MAGIC:
        raise corrupt(path, "not an epochal native db file (bad magic number)")
    (_, major, minor, algo_id, align_log2, ioff, ilen, fsize, nblobs, nsegs, dbytes, icrc,
     scrc) = SUPER.unpack(raw[:SUPERBLOCK_SIZE])
    if major > FORMAT_MAJOR:
        raise CheckpointVersionError(
            path,
            f"written by native format version {major}.{minor}, but this epochal reads only "
            f"major version {FORMAT_MAJOR}; upgrade epochal to read it",
        )
    if major < 1:
        raise corrupt(path, f"unknown native format version {major}.{minor}")
    algorithm = ALGORITHM_NAMES.get(algo_id)
    if algorithm is None:
        raise corrupt(path, f"unknown checksum algorithm id {algo_id}")
    try:
        fn = checksum_function(algorithm)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if fn(raw[:SUPER_CHECKED], 0) != scrc:
        raise corrupt(path, "superblock checksum mismatch (header damaged)")
    if align_log2 != ALIGN.bit_length() - 1:
        raise corrupt(path, f"unsupported alignment 2**{align_log2}")
    if fsize != actual_size:
        kind = "truncated" if actual_size < fsize else "longer than recorded"
        raise corrupt(path, f"file is {kind}: {actual_size} bytes, header says {fsize}")
    if ioff < SUPERBLOCK_SIZE or ioff % ALIGN or ioff + ilen != fsize or ilen < INDEX_HEAD.size:
        raise corrupt(path, f"absurd index position {ioff}+{ilen} in a {fsize}-byte file")
    if dbytes > ioff:
        raise corrupt(path, f"absurd data size {dbytes}")
    return Header(major, minor, algorithm, ioff, ilen, fsize, nblobs, nsegs, dbytes, icrc)
