"""Forging checkpoint files on purpose, with valid checksums (for tests/test_fuzz_quick.py and
bench/fuzz.py): what an attacker (or a buggy writer) could hand epochal.

``NativeParts.parse(raw)`` splits a native file into its tables (numpy copies), names heap,
metas text and data area; ``.pack()`` puts them back with every checksum recomputed (the
index, the superblock and the checksum groups of format 2.0; segment checksums are the
forger's to set), so only the structural and semantic checks of the reader stand between a
forgery and a load. For
safetensors, ``st_parts(raw)`` / ``st_pack(header, data)`` do the same with the JSON header
and ``st_blobs_crc`` recomputes the blob list checksum.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from epochal.storage.formats.native.layout import (
    GROUP_DTYPE,
    INDEX_HEAD,
    INDEX_MAGIC,
    MOFF_DTYPE,
    ORDER_DTYPE,
    REC_DTYPE,
    SEG_DTYPE,
    SUPER,
    SUPERBLOCK_SIZE,
    pack_superblock,
)
from epochal.storage.io.checksum import ALGORITHM_IDS, ALGORITHM_NAMES, checksum_function


@dataclass
class NativeParts:
    algorithm: str
    data: bytes  # bytes 64 .. index_offset
    recs: np.ndarray
    segs: np.ndarray
    moffs: np.ndarray
    order: np.ndarray
    names: bytes
    metas: bytes
    data_bytes: int
    groups: np.ndarray
    version: tuple[int, int]

    @classmethod
    def parse(cls, raw: bytes) -> NativeParts:
        f = SUPER.unpack(raw[:SUPERBLOCK_SIZE])
        major, minor, algo, ioff, nblobs, nsegs, dbytes = f[1], f[2], f[3], f[5], f[8], f[9], f[10]
        index = raw[ioff:]
        _, _, nlen, mlen, nmetas, ngroups = INDEX_HEAD.unpack_from(index, 0)
        ngroups = ngroups if major >= 2 else 0
        pos = INDEX_HEAD.size

        def take(dtype: np.dtype, count: int) -> np.ndarray:
            nonlocal pos
            arr = np.frombuffer(index, dtype=dtype, count=count, offset=pos).copy()
            pos += arr.nbytes
            return arr

        recs, segs = take(REC_DTYPE, nblobs), take(SEG_DTYPE, nsegs)
        groups = take(GROUP_DTYPE, ngroups)
        moffs, order = take(MOFF_DTYPE, nmetas), take(ORDER_DTYPE, nblobs)
        names = index[pos : pos + nlen]
        metas = index[pos + nlen : pos + nlen + mlen]
        return cls(ALGORITHM_NAMES[algo], raw[SUPERBLOCK_SIZE:ioff], recs, segs, moffs, order,
                   names, metas, dbytes, groups, (major, minor))

    def set_metas(self, entries: list[Any]) -> None:
        """Replace the metas text by ``entries`` (a list of [kind, meta]) and rebuild the table."""
        parts = [json.dumps(e, separators=(",", ":")) for e in entries]
        text = "[" + ",".join(parts) + "]"
        moffs = np.zeros(len(parts), dtype=MOFF_DTYPE)
        off = 1
        for k, p in enumerate(parts):
            moffs[k] = (off, len(p))
            off += len(p) + 1
        self.metas, self.moffs = text.encode("ascii"), moffs

    def fix_groups(self) -> None:
        """Recompute each checksum group's checksum from the data area (groups whose
        segments lie outside the table or the data are left as they are)."""
        fn = checksum_function(self.algorithm)
        for g in self.groups:
            a, n = int(g["seg_first"]), int(g["seg_count"])
            if n < 1 or a + n > len(self.segs):
                continue
            last = self.segs[a + n - 1]
            lo = int(self.segs[a]["offset"]) - SUPERBLOCK_SIZE
            hi = int(last["offset"]) + int(last["length"]) + int(last["pad"]) - SUPERBLOCK_SIZE
            if 0 <= lo <= hi <= len(self.data):
                g["crc"] = fn(self.data[lo:hi], 0)

    def pack(self, *, fix_groups: bool = True) -> bytes:
        """The file, with the index and superblock checksums (and, with ``fix_groups``, the
        group checksums) recomputed."""
        fn = checksum_function(self.algorithm)
        if fix_groups:
            self.fix_groups()
        ngroups = len(self.groups) if self.version[0] >= 2 else 0
        index = b"".join([
            INDEX_HEAD.pack(INDEX_MAGIC, 0, len(self.names), len(self.metas), len(self.moffs), ngroups),
            self.recs.tobytes(), self.segs.tobytes(), self.groups[:ngroups].tobytes(),
            self.moffs.tobytes(), self.order.tobytes(), self.names, self.metas,
        ])
        ioff = SUPERBLOCK_SIZE + len(self.data)
        size = ioff + len(index)
        sb = pack_superblock(ALGORITHM_IDS[self.algorithm], ioff, len(index), size, len(self.recs),
                             len(self.segs), self.data_bytes, fn(index, 0), fn, self.version)
        return sb + self.data + index


def st_parts(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's JSON header (a dict) and its data area."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def st_blobs_crc(header: dict[str, Any]) -> None:
    """Recompute the checksum of ``__metadata__["epochal.blobs"]`` (after forging it)."""
    meta = header["__metadata__"]
    fn = checksum_function(meta.get("epochal.checksum", "crc32c"))
    meta["epochal.blobs.crc"] = f"{fn(meta['epochal.blobs'].encode(), 0):08x}"


def st_pack(header: dict[str, Any], data: bytes, text: bytes | None = None) -> bytes:
    """A safetensors file of ``header`` (or the raw header ``text``) and ``data``."""
    raw = text if text is not None else json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + data
