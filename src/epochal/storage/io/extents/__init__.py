"""Incremental db files: a file's bytes stored partly in the files of older steps.

An *extent file* holds the bytes of one logical file (a native db, byte for byte what a full
save would have written), of which only some ranges are stored in it; every other range is a
reference to a stored range of an older step's file in the same folder (one level deep).
:func:`open_db` opens any db: a plain file as it is, an extent file as an
:class:`ExtentSource` of the logical bytes, so every format's read path reads it without
knowing; the format's own checksums cover the logical bytes, so a damaged older file is
found before any live byte is written. The table's decoding is :mod:`.table`'s; the read plan
of a range, :mod:`.reads`'s; the sink that writes an extent file, :mod:`.sink`'s.

Layout (little-endian; docs/format.md, "Incremental db files")::

    head (64 bytes)   magic, version, checksum algorithm, logical size, table position,
                      counts, step, packed extent table length, checksums of the tables
                      and of the head
    stored bytes      the ranges kept in this file, in logical order
    extent table      per extent (logical order, tiling the logical file): length, source
                      (0: this file; k: the k-th reference), checksum of its bytes (stored
                      extents; 0 for a reference), offset in its source less its logical
                      offset; as columns split into byte planes, zlib-compressed (version
                      2; version 1: raw rows of u64 logical offset, u64 length, u32 source,
                      u32 checksum, u64 offset in its source, every extent checked)
    chunk table       per content chunk: u64 logical offset, u64 length, 16-byte digest
                      (BLAKE2b-128): what a later save matches its own chunks against
    refs text         JSON array of the files referenced: {"file", "size", "step"}

A reference (version 2) carries no checksum of its own: the bytes it names are a stored
extent of the referenced file, checked by that file's table (:meth:`ExtentSource.check_refs`,
run when the format's checksums of the logical bytes fail, names the older file at fault).
"""

from __future__ import annotations

import json
import os
import posixpath
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ....errors import CheckpointCorruptError
from .. import seam
from ..checksum import ALGORITHM_NAMES, checksum_function
from . import reads as extent_reads
from .table import PACKED_COLUMNS, columns_of, unpack_extents

__all__ = [
    "CHUNK_DTYPE", "EXT_DTYPE", "EXTENT_MAGIC", "ExtentSource", "Extents", "RefFile", "blame_refs",
    "is_extent_file", "open_db", "pack_extents", "parse_extents", "read_extents", "referenced_files",
]

EXTENT_MAGIC = b"\x89EPXT\r\n\x1a"
EXTENT_VERSION = 2
# magic, version, checksum algorithm id, reserved, logical size, table offset, extent count,
# chunk count, refs text length, step (-1: unknown), packed extent table length (version 2),
# tables checksum, head checksum
HEAD = struct.Struct("<8sHHIQQIIIqIII")
HEAD_SIZE = HEAD.size  # 64
EXT_DTYPE = np.dtype([("loff", "<u8"), ("length", "<u8"), ("source", "<u4"), ("crc", "<u4"), ("soff", "<u8")])
CHUNK_DTYPE = np.dtype([("loff", "<u8"), ("length", "<u8"), ("digest", "V16")])
#: the largest refs text read (a few hundred file names)
MAX_REFS_TEXT = 1 << 24
def pack_extents(ext: np.ndarray) -> bytes:
    """Version 2's extent table: the columns of ``ext`` (EXT_DTYPE) split into byte planes and
    zlib-compressed (delta-like columns compress well; a step's table is a few bytes per extent)."""
    cols = {"length": ext["length"], "source": ext["source"], "crc": ext["crc"],
            "rel": ext["soff"].astype(np.int64) - ext["loff"].astype(np.int64)}
    planes = b"".join(np.ascontiguousarray(cols[c].astype(t)).view(np.uint8).reshape(len(ext), -1).T.tobytes()
                      for c, t in PACKED_COLUMNS)
    return zlib.compress(planes, 1)  # (level 6: 17% smaller, 6x the time)


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
    #: the format version (1: every extent carries its checksum; 2: stored extents only)
    version: int = EXTENT_VERSION
    #: the extents' logical starts, ends, sources and offsets there, as int64 (set by the parse)
    columns: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def where(self) -> str:
        return f"step {self.step} ({os.path.basename(self.path)})" if self.step >= 0 else self.path


def _corrupt(path: str, message: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(path, message)


def parse_extents(path: str, head: bytes, tables: bytes, size: int) -> Extents:
    """Check and decode an extent file's head and tables (``tables``: its bytes from the
    table offset to its end); CheckpointCorruptError naming the file on any inconsistency."""
    if len(head) < HEAD_SIZE or head[:8] != EXTENT_MAGIC:
        raise _corrupt(path, "not an incremental db file (bad magic number)")
    (_, version, algo_id, _, lsize, toff, next_, nchunk, nrefs, step, packed, tcrc, hcrc) = HEAD.unpack(head[:HEAD_SIZE])
    algorithm = ALGORITHM_NAMES.get(algo_id)
    if algorithm is None:
        raise _corrupt(path, f"unknown checksum algorithm id {algo_id}")
    fn = checksum_function(algorithm)
    if fn(head[: HEAD_SIZE - 4], 0) != hcrc:
        raise _corrupt(path, "incremental db head checksum mismatch (header damaged)")
    if version not in (1, EXTENT_VERSION):
        raise _corrupt(path, f"unknown incremental db version {version}")
    ext_bytes = next_ * EXT_DTYPE.itemsize if version == 1 else packed
    want = ext_bytes + nchunk * CHUNK_DTYPE.itemsize + nrefs
    if toff < HEAD_SIZE or toff + want != size or len(tables) != want or nrefs > MAX_REFS_TEXT:
        raise _corrupt(path, f"incremental db tables do not fit the file ({size} bytes)")
    if fn(tables, 0) != tcrc:
        raise _corrupt(path, "incremental db table checksum mismatch (tables damaged)")
    if version == 1:
        ext = np.frombuffer(tables, EXT_DTYPE, next_, 0)
        cols = columns_of(ext)
    else:
        ext, cols = unpack_extents(path, tables[:ext_bytes], next_, EXT_DTYPE)
    chunks = np.frombuffer(tables, CHUNK_DTYPE, nchunk, ext_bytes)
    try:
        raw = json.loads(bytes(tables[ext_bytes + chunks.nbytes:]).decode("utf-8"))
        refs = [RefFile(str(r["file"]), int(r["size"]), int(r["step"])) for r in raw]
    except (ValueError, TypeError, KeyError) as e:
        raise _corrupt(path, f"incremental db refs are not valid: {e}") from None
    for r in refs:
        if not r.file or "/" in r.file or "\\" in r.file or r.file in (".", ".."):
            raise _corrupt(path, f"incremental db refers to {r.file!r}, not a file name in its folder")
    loff, ln, src, soff = cols  # (int64: a value over 2**63 is negative here, refused below)
    if next_ and (
        int(loff.min()) < 0 or int(loff.max()) > lsize or int(ln.max()) > lsize or int(ln.min()) <= 0
        or loff[0] != 0 or np.any(loff[1:] != (loff + ln)[:-1]) or loff[-1] + ln[-1] != lsize
        or int(src.max()) > len(refs)
    ):
        raise _corrupt(path, "incremental db extents do not tile the logical file")
    if not next_ and lsize:
        raise _corrupt(path, "incremental db without extents")
    if next_ and int(soff.min()) < 0:
        raise _corrupt(path, "incremental db extent points before the start of its source")
    own = src == 0
    if np.any(own):
        o_off, o_len = soff[own], ln[own]
        if o_off[0] != HEAD_SIZE or np.any(o_off[1:] != (o_off + o_len)[:-1]) or o_off[-1] + o_len[-1] != toff:
            raise _corrupt(path, "incremental db stored extents do not tile its data area")
    elif toff != HEAD_SIZE:
        raise _corrupt(path, "incremental db data area without extents")
    if refs and next_:  # every reference within its file (as its size was recorded)
        limit = np.array([toff, *(r.size for r in refs)], dtype=np.int64)
        past = soff > limit[src] - ln
        if np.any(past):
            bad = refs[int(src[past].min()) - 1]
            raise _corrupt(path, f"incremental db extent points past the end of {bad.file}")
    end = loff + ln
    ex = Extents(path, algorithm, int(lsize), int(step), ext, chunks, refs, size, version)
    ex.columns = (loff, end, src, soff)
    return ex


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


def _options_of(path: str) -> dict[str, Any] | None:
    """The storage options this file was reached with (a URL), for its siblings: the CLI
    records ``-o`` options for the one file it was given, not for its folder."""
    if not seam.is_url(path):
        return None
    from ..remote.fsspec_store import storage_options_for

    return storage_options_for(path) or None


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
        if ex.columns is None:
            loff, ln, src, soff = columns_of(ex.ext)
            ex.columns = (loff, loff + ln, src, soff)
        #: the extents' logical starts, ends, sources and offsets there (the read plan's input)
        self._ext = ex.columns
        self._fn = checksum_function(ex.algorithm)
        #: where the gaps between the pieces of one read go (never read back: shared by threads)
        self._junk = memoryview(bytearray(extent_reads.MERGE_GAP))
        try:
            for r in ex.refs:  # every referenced file, there and of its recorded size, now
                self._srcs.append(self._open_ref(r))
            #: sources read with an iovec array built by numpy (a local file's descriptor)
            self._direct = [isinstance(getattr(x, "fd", None), int) and not getattr(x, "remote", False)
                            for x in self._srcs]
        except BaseException:
            self.close()
            raise

    def _open_ref(self, r: RefFile) -> seam.ByteSource:
        ref_path = _sibling(self.name, r.file)
        what = f"step {r.step}'s db {r.file}, which {self.ex.where()} takes bytes from,"
        try:
            src = seam.store_for(ref_path, _options_of(self.name)).open_read(ref_path, what="db")
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
        """Fill ``views`` from logical ``offset``, each source file read in few calls: the
        source with the most bytes in the range straight into place in one span when its
        extents keep their relative positions, every other source's extents in merged spans,
        one read each whose buffers are the pieces' places (gaps to a scratch buffer).
        Unchecked here: the format's checksums cover the logical bytes, and
        on a mismatch :meth:`check_refs` names the older file at fault."""
        want = sum(v.nbytes for v in views)
        end = min(offset + want, self.ex.logical_size)
        if end <= offset:
            return 0
        flat = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
        if len(flat) == 1:
            self._gather(flat[0][: end - offset], offset)
        else:  # (several views: rare; through one buffer)
            tmp = bytearray(end - offset)
            self._gather(memoryview(tmp), offset)
            pos = 0
            for v in flat:
                n = min(v.nbytes, len(tmp) - pos)
                v[:n] = tmp[pos:pos + n]
                pos += n
        return end - offset

    def _gather(self, dest: memoryview, offset: int) -> None:
        extent_reads.gather(dest, offset, self._ext, self._junk, len(self._srcs), self._direct,
                            self._fill_iov, self._fill)

    def _fill_iov(self, source: int, iov: np.ndarray, off: int, total: int) -> None:
        """Read the buffers of ``iov`` ((address, length) rows) in order from ``off`` of
        local ``source``: one ``preadv``, more only after a short read."""
        fd = self._srcs[source].fd  # type: ignore[attr-defined]
        while True:
            n = extent_reads.preadv_iov(fd, iov, off)
            if n == total:
                return
            if n <= 0:
                name = self.name if not source else self.ex.refs[source - 1].file
                raise _corrupt(self.name, f"{name} is truncated at byte {off}")
            cum = np.cumsum(iov[:, 1].astype(np.int64))
            k = int(np.searchsorted(cum, n, side="right"))  # the first buffer not filled
            iov = iov[k:].copy()
            done = n - (int(cum[k - 1]) if k else 0)
            iov[0, 0] += np.uint64(done)
            iov[0, 1] -= np.uint64(done)
            off, total = off + n, total - n

    def _fill(self, source: int, parts: list[memoryview], off: int, total: int = -1) -> None:
        """Read ``parts`` in order from ``off`` of ``source`` (``total``: their bytes, when
        known: a read that returns them all needs no walk over the parts)."""
        src = self._srcs[source]
        k = 0
        while k < len(parts):
            n = src.read_into(parts[k:] if k else parts, off)
            if n <= 0:
                name = self.name if not source else self.ex.refs[source - 1].file
                raise _corrupt(self.name, f"{name} is truncated at byte {off}")
            if not k and n == total:
                return
            off += n
            while k < len(parts) and n >= parts[k].nbytes:
                n -= parts[k].nbytes
                k += 1
            if n and k < len(parts):
                parts[k] = parts[k][n:]

    def check_refs(self) -> None:
        """Check every byte this file takes from older files against the checksum that covers
        it (version 1: the reference's own; version 2: the referenced file's stored extent):
        CheckpointCorruptError naming the older file whose bytes are damaged (the format's own
        checksums name only this one)."""
        loff, lend, srcs, soffs = self._ext
        for k, r in enumerate(self.ex.refs, 1):
            sel = np.flatnonzero(srcs == k)
            if not len(sel):
                continue
            if self.ex.version == 1:
                spans = list(zip(soffs[sel].tolist(), (lend - loff)[sel].tolist(), self.ex.ext["crc"][sel].tolist()))
            else:
                spans = self._covering(k, soffs[sel], soffs[sel] + lend[sel] - loff[sel])
            for soff, ln, crc in spans:
                buf = bytearray(ln)
                self._fill(k, [memoryview(buf)], soff)
                if self._fn(buf, 0) != crc:
                    raise _corrupt(self.name, f"bytes {soff}..{soff + ln} of step {r.step}'s db {r.file}, which "
                                   f"{self.ex.where()} takes bytes from, are damaged (checksum mismatch)")

    def _covering(self, k: int, lo: np.ndarray, hi: np.ndarray) -> list[tuple[int, int, int]]:
        """The stored extents (offset, length, checksum) of referenced file ``k`` that hold
        its bytes ``lo[i] .. hi[i]``."""
        r = self.ex.refs[k - 1]
        try:
            theirs = read_extents(self._srcs[k], _sibling(self.name, r.file))
        except CheckpointCorruptError as e:
            raise _corrupt(self.name, f"step {r.step}'s db {r.file}, which {self.ex.where()} takes bytes from, "
                           f"is damaged: {e}") from None
        own = theirs.ext[theirs.ext["source"] == 0]
        start = own["soff"].astype(np.int64)
        end = start + own["length"].astype(np.int64)
        first = np.searchsorted(end, lo, side="right")
        last = np.searchsorted(start, hi, side="left")
        if np.any(first >= len(own)) or np.any(start[np.minimum(first, len(own) - 1)] > lo):
            raise _corrupt(self.name, f"{self.ex.where()} takes bytes of step {r.step}'s db {r.file} "
                           "that it does not store")
        hit = sorted({j for a, b in zip(first.tolist(), last.tolist()) for j in range(a, b)})
        return [(int(start[j]), int(own["length"][j]), int(own["crc"][j])) for j in hit]

    def map(self, *, sequential: bool = False) -> Any | None:
        return None

    def hint(self, offset: int, nbytes: int) -> bool:
        return False

    def close(self) -> None:
        for s in self._srcs:
            s.close()
        self._srcs = []


#: tables parsed by a header-only open, kept for the next open of the same file (a restore
#: stats a step's db, then reads it: one parse): path -> (identity, tables); a few at most
_KEPT: dict[str, tuple[tuple[int, ...], Extents]] = {}
_KEPT_MAX = 4
_kept_lock = threading.Lock()


def _identity(src: seam.ByteSource) -> tuple[int, ...] | None:
    """A local file's identity (device, inode, size, modification and change times: any
    rewrite or replacement changes it); None elsewhere (nothing kept)."""
    fd = getattr(src, "fd", None)
    if not isinstance(fd, int) or getattr(src, "remote", False):
        return None
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _tables(src: seam.ByteSource, path: str, keep: bool) -> Extents:
    """The extent file's tables: those a header-only open of this very file kept (taken, so
    they serve one later open), else parsed; kept again when ``keep``."""
    ident = _identity(src)
    key = os.path.abspath(path) if ident is not None else ""
    with _kept_lock:
        hit = _KEPT.pop(key, None) if ident is not None else None
    ex = hit[1] if hit is not None and hit[0] == ident else read_extents(src, path)
    if keep and ident is not None:
        with _kept_lock:
            _KEPT[key] = (ident, ex)
            while len(_KEPT) > _KEPT_MAX:
                del _KEPT[next(iter(_KEPT))]
    return ex


def open_db(path: str, *, what: str = "db", whole: bool = False, keep: bool = False) -> seam.ByteSource:
    """The db at ``path`` for reading: its bytes, or an incremental db's logical bytes
    (:class:`ExtentSource`). ``whole``: (nearly) every byte will be read: a remote source is
    told so before the first read, and may fetch the whole object in one wave. ``keep``: the
    caller reads only the header (a stat before a load): an incremental db's parsed tables
    are kept for the next open of the same unchanged file, which takes them."""
    src = seam.store_for(path).open_read(path, what=what)
    try:
        if whole and getattr(src, "remote", False):
            src.hint(0, src.size())
        if src.size() < HEAD_SIZE:
            return src
        head = src.read(HEAD_SIZE, 0)  # (a native db's superblock is as long: see _HeadKept)
        if is_extent_file(head):
            return ExtentSource(path, src, _tables(src, path, keep))
    except BaseException:
        src.close()
        raise
    return _HeadKept(src, head) if getattr(src, "remote", False) else src


class _HeadKept:
    """A remote source whose head was read to tell an extent file: the reader's read of it (the
    native superblock) served from memory, so an open at a URL stays one round trip."""

    def __init__(self, src: seam.ByteSource, head: bytes) -> None:
        self._src, self._head = src, head

    def read(self, nbytes: int, offset: int) -> bytes:
        if offset + nbytes <= len(self._head):
            return self._head[offset:offset + nbytes]
        return self._src.read(nbytes, offset)

    def __getattr__(self, name: str) -> Any:  # everything else as the source does it
        return getattr(self._src, name)


def blame_refs(src: seam.ByteSource | None, exc: BaseException | None) -> None:
    """On a reader's way out with ``exc``: when an incremental db's logical bytes failed their
    checksums, raise the error naming the older file at fault (:meth:`ExtentSource.check_refs`)."""
    if isinstance(exc, CheckpointCorruptError) and isinstance(src, ExtentSource) and src._srcs:
        src.check_refs()


def referenced_files(path: str) -> list[str] | None:
    """Files the db at ``path`` takes bytes from ([]: a plain or missing db; None: unreadable)."""
    try:
        src = open_db(path)
    except FileNotFoundError:
        return []
    except (OSError, CheckpointCorruptError):
        return None
    try:
        return [r.file for r in src.ex.refs] if isinstance(src, ExtentSource) else []
    finally:
        src.close()
