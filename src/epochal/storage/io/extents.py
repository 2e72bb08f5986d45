"""Incremental db files: a file's bytes stored partly in the files of older steps.

An *extent file* holds the bytes of one logical file (a native db, byte for byte what a full
save would have written), of which only some ranges are stored in it; every other range is a
reference to a range of an older step's file in the same folder. :func:`open_db` opens any
db: a plain file as it is, an extent file as an :class:`ExtentSource`, a
:class:`~epochal.storage.io.seam.ByteSource` of the logical bytes, so every format's read path
(restore, partial load, verify, inspect, export) reads it without knowing. References are
one level deep (they name stored bytes, never another reference) and are checked as they are
read (each whole referenced range by its checksum), and the format's own checksums cover the
logical bytes: a damaged older file is found before any live byte is written.

Layout (little-endian; docs/format.md, "Incremental db files")::

    head (64 bytes)   magic, version, checksum algorithm, logical size, table position,
                      counts, step, checksums of the tables and of the head
    stored bytes      the ranges kept in this file, in logical order
    extent table      per extent (logical order, tiling the logical file): u64 logical
                      offset, u64 length, u32 source (0: this file; k: the k-th reference),
                      u32 checksum of its bytes, u64 offset in its source
    chunk table       per content chunk: u64 logical offset, u64 length, 16-byte digest
                      (BLAKE2b-128): what a later save matches its own chunks against
    refs text         JSON array of the files referenced: {"file", "size", "step"}
"""

from __future__ import annotations

import bisect
import json
import os
import posixpath
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import CheckpointCorruptError
from . import seam
from .checksum import ALGORITHM_NAMES, checksum_function

__all__ = [
    "CHUNK_DTYPE", "EXT_DTYPE", "EXTENT_MAGIC", "ExtentSource", "Extents", "RefFile", "is_extent_file",
    "open_db", "parse_extents", "read_extents", "referenced_files",
]

EXTENT_MAGIC = b"\x89EPXT\r\n\x1a"
EXTENT_VERSION = 1
# magic, version, checksum algorithm id, reserved, logical size, table offset, extent count,
# chunk count, refs text length, step (-1: unknown), reserved, tables checksum, head checksum
HEAD = struct.Struct("<8sHHIQQIIIqIII")
HEAD_SIZE = HEAD.size  # 64
EXT_DTYPE = np.dtype([("loff", "<u8"), ("length", "<u8"), ("source", "<u4"), ("crc", "<u4"), ("soff", "<u8")])
CHUNK_DTYPE = np.dtype([("loff", "<u8"), ("length", "<u8"), ("digest", "V16")])
#: the largest refs text read (a few hundred file names)
MAX_REFS_TEXT = 1 << 24


def is_extent_file(head: bytes) -> bool:
    """True when ``head`` (a file's first bytes) starts with the extent file's magic."""
    return head[:8] == EXTENT_MAGIC


@dataclass(frozen=True)
class RefFile:
    """An older step's file that an extent file takes bytes from (same folder)."""

    file: str
    size: int
    step: int


@dataclass
class Extents:
    """The parsed tables of an extent file."""

    path: str
    algorithm: str
    logical_size: int
    step: int
    ext: np.ndarray
    chunks: np.ndarray
    refs: list[RefFile]
    #: physical size of the extent file itself
    size: int

    def where(self) -> str:
        return f"step {self.step} ({os.path.basename(self.path)})" if self.step >= 0 else self.path


def _corrupt(path: str, message: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(path, message)


def parse_extents(path: str, head: bytes, tables: bytes, size: int) -> Extents:
    """Check and decode an extent file's head and tables (``tables``: its bytes from the
    table offset to its end); CheckpointCorruptError naming the file on any inconsistency."""
    if len(head) < HEAD_SIZE or head[:8] != EXTENT_MAGIC:
        raise _corrupt(path, "not an incremental db file (bad magic number)")
    (_, version, algo_id, _, lsize, toff, next_, nchunk, nrefs, step, _, tcrc, hcrc) = HEAD.unpack(head[:HEAD_SIZE])
    algorithm = ALGORITHM_NAMES.get(algo_id)
    if algorithm is None:
        raise _corrupt(path, f"unknown checksum algorithm id {algo_id}")
    fn = checksum_function(algorithm)
    if fn(head[: HEAD_SIZE - 4], 0) != hcrc:
        raise _corrupt(path, "incremental db head checksum mismatch (header damaged)")
    if version != EXTENT_VERSION:
        raise _corrupt(path, f"unknown incremental db version {version}")
    want = next_ * EXT_DTYPE.itemsize + nchunk * CHUNK_DTYPE.itemsize + nrefs
    if toff < HEAD_SIZE or toff + want != size or len(tables) != want or nrefs > MAX_REFS_TEXT:
        raise _corrupt(path, f"incremental db tables do not fit the file ({size} bytes)")
    if fn(tables, 0) != tcrc:
        raise _corrupt(path, "incremental db table checksum mismatch (tables damaged)")
    ext = np.frombuffer(tables, EXT_DTYPE, next_, 0)
    chunks = np.frombuffer(tables, CHUNK_DTYPE, nchunk, ext.nbytes)
    try:
        raw = json.loads(bytes(tables[ext.nbytes + chunks.nbytes:]).decode("utf-8"))
        refs = [RefFile(str(r["file"]), int(r["size"]), int(r["step"])) for r in raw]
    except (ValueError, TypeError, KeyError) as e:
        raise _corrupt(path, f"incremental db refs are not valid: {e}") from None
    for r in refs:
        if not r.file or "/" in r.file or "\\" in r.file or r.file in (".", ".."):
            raise _corrupt(path, f"incremental db refers to {r.file!r}, not a file name in its folder")
    loff, ln = ext["loff"].astype(np.int64), ext["length"].astype(np.int64)
    src, soff = ext["source"].astype(np.int64), ext["soff"].astype(np.int64)
    if next_ and (
        ext["loff"].max() > lsize or ext["length"].max() > lsize or np.any(ln <= 0) or loff[0] != 0
        or np.any(loff[1:] != (loff + ln)[:-1]) or loff[-1] + ln[-1] != lsize or np.any(src > len(refs))
    ):
        raise _corrupt(path, "incremental db extents do not tile the logical file")
    if not next_ and lsize:
        raise _corrupt(path, "incremental db without extents")
    own = src == 0
    if np.any(own):
        o_off, o_len = soff[own], ln[own]
        if o_off[0] != HEAD_SIZE or np.any(o_off[1:] != (o_off + o_len)[:-1]) or o_off[-1] + o_len[-1] != toff:
            raise _corrupt(path, "incremental db stored extents do not tile its data area")
    elif toff != HEAD_SIZE:
        raise _corrupt(path, "incremental db data area without extents")
    for k, r in enumerate(refs, 1):
        sel = src == k
        if np.any(sel) and np.any(soff[sel] + ln[sel] > r.size):
            raise _corrupt(path, f"incremental db extent points past the end of {r.file}")
    return Extents(path, algorithm, int(lsize), int(step), ext, chunks, refs, size)


def read_extents(src: seam.ByteSource, path: str) -> Extents:
    """The tables of the extent file open as ``src``."""
    size = src.size()
    head = src.read(HEAD_SIZE, 0)
    if len(head) < HEAD_SIZE:
        raise _corrupt(path, "file is truncated inside the incremental db head")
    toff = HEAD.unpack(head)[5]
    if toff < HEAD_SIZE or toff > size:
        raise _corrupt(path, f"absurd incremental db table position {toff}")
    tables = bytearray(size - toff)
    got = 0
    while got < len(tables):
        n = src.read_into([memoryview(tables)[got:]], toff + got)
        if n <= 0:
            raise _corrupt(path, "file is truncated inside the incremental db tables")
        got += n
    return parse_extents(path, head, bytes(tables), size)


def _sibling(path: str, name: str) -> str:
    if seam.is_url(path):
        return posixpath.join(posixpath.dirname(path), name)
    return os.path.join(os.path.dirname(path), name)


class ExtentSource:
    """The logical bytes of an extent file, as a ByteSource (read-only; no map)."""

    nowait = False

    def __init__(self, path: str, own: seam.ByteSource, ex: Extents) -> None:
        self.name = path
        self.ex = ex
        self.remote = bool(getattr(own, "remote", False))
        self._srcs: list[seam.ByteSource] = [own]
        self._starts = ex.ext["loff"].tolist()
        self._lens = ex.ext["length"].tolist()
        self._sources = ex.ext["source"].tolist()
        self._soffs = ex.ext["soff"].tolist()
        self._crcs = ex.ext["crc"].tolist()
        self._fn = checksum_function(ex.algorithm)
        try:
            for r in ex.refs:  # every referenced file, there and of its recorded size, now
                self._srcs.append(self._open_ref(r))
        except BaseException:
            self.close()
            raise

    def _open_ref(self, r: RefFile) -> seam.ByteSource:
        ref_path = _sibling(self.name, r.file)
        what = f"step {r.step}'s db {r.file}, which {self.ex.where()} takes bytes from,"
        try:
            src = seam.store_for(ref_path).open_read(ref_path, what="db")
        except FileNotFoundError:
            raise _corrupt(self.name, f"{what} is missing ({ref_path})") from None
        except OSError as e:
            raise _corrupt(self.name, f"{what} cannot be opened ({ref_path}): {e}") from None
        size = src.size()
        if size != r.size:
            src.close()
            raise _corrupt(self.name, f"{what} is damaged or replaced: {size} bytes, expected {r.size} ({ref_path})")
        return src

    def size(self) -> int:
        return self.ex.logical_size

    def read(self, nbytes: int, offset: int) -> bytes:
        buf = bytearray(max(0, min(nbytes, self.ex.logical_size - offset)))
        n = self.read_into([memoryview(buf)], offset) if buf else 0
        return bytes(buf[:n])

    def read_into(self, views: Sequence[memoryview], offset: int, *, nowait: bool = False) -> int:
        """Fill ``views`` from logical ``offset``: each part from its extent's source; a
        referenced extent read whole is checked against its checksum (a damaged older file is
        named with both steps)."""
        end = min(offset + sum(v.nbytes for v in views), self.ex.logical_size)
        pos, k = offset, bisect.bisect_right(self._starts, offset) - 1
        flat = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
        vi, vo = 0, 0  # the view being filled and the bytes of it already filled
        while pos < end:
            start, ln, source = self._starts[k], self._lens[k], self._sources[k]
            stop = min(end, start + ln)
            parts: list[memoryview] = []
            need = stop - pos
            while need:
                v = flat[vi]
                take = min(need, v.nbytes - vo)
                parts.append(v[vo:vo + take])
                need -= take
                vo += take
                if vo == v.nbytes:
                    vi, vo = vi + 1, 0
            self._fill(source, parts, self._soffs[k] + pos - start)
            if source and pos == start and stop == start + ln:
                crc = 0
                for p in parts:
                    crc = self._fn(p, crc)
                if crc != self._crcs[k]:
                    r = self.ex.refs[source - 1]
                    raise _corrupt(self.name, f"bytes {self._soffs[k]}..{self._soffs[k] + ln} of step {r.step}'s "
                                   f"db {r.file}, which {self.ex.where()} takes bytes from, are damaged "
                                   "(checksum mismatch)")
            pos, k = stop, k + 1
        return max(0, end - offset)

    def _fill(self, source: int, parts: list[memoryview], off: int) -> None:
        src = self._srcs[source]
        while parts:
            n = src.read_into(parts, off)
            if n <= 0:
                name = self.name if not source else self.ex.refs[source - 1].file
                raise _corrupt(self.name, f"{name} is truncated at byte {off}")
            off += n
            while parts and n >= parts[0].nbytes:
                n -= parts[0].nbytes
                parts = parts[1:]
            if n and parts:
                parts[0] = parts[0][n:]

    def check_refs(self) -> None:
        """Read every referenced extent whole and check its checksum: the error names the
        older file whose bytes are damaged (a format's own checksum names only this one)."""
        for k, source in enumerate(self._sources):
            if source:
                buf = bytearray(self._lens[k])
                self.read_into([memoryview(buf)], self._starts[k])

    def map(self, *, sequential: bool = False) -> Any | None:
        return None

    def hint(self, offset: int, nbytes: int) -> bool:
        return False

    def close(self) -> None:
        for s in self._srcs:
            s.close()
        self._srcs = []


def open_db(path: str, *, what: str = "db") -> seam.ByteSource:
    """Open the db at ``path`` for reading: its bytes as they are, or, for an incremental db,
    the logical bytes it stands for (:class:`ExtentSource`)."""
    src = seam.store_for(path).open_read(path, what=what)
    try:
        if src.size() >= HEAD_SIZE and is_extent_file(src.read(8, 0)):
            return ExtentSource(path, src, read_extents(src, path))
    except BaseException:
        src.close()
        raise
    return src


def referenced_files(path: str) -> list[str] | None:
    """The names of the files the db at ``path`` takes bytes from ([] for a plain db); None
    when it cannot be read (then nothing it might reference may be deleted)."""
    try:
        src = seam.store_for(path).open_read(path, what="db")
    except OSError:
        return None
    try:
        if src.size() < HEAD_SIZE or not is_extent_file(src.read(8, 0)):
            return []
        return [r.file for r in read_extents(src, path).refs]
    except (OSError, CheckpointCorruptError):
        return None
    finally:
        src.close()
