"""Fast, GIL-releasing checksums for checkpoint files, and a background checksummer.

Two algorithms are known, each identified by a small integer recorded in every file so a
reader always uses the writer's algorithm:

* ``crc32c`` (id 1): CRC-32C (Castagnoli) through ICRAR's ``crc32c`` package, hardware
  accelerated (SSE4.2 / ARMv8) at >10 GB/s, and it releases the GIL, so checksumming can run
  in a thread overlapped with disk I/O. This is the default whenever the package imports.
* ``crc32`` (id 2): zlib's CRC-32, the fallback when ``crc32c`` is missing, so the core still
  works with numpy alone. zlib also releases the GIL for buffers larger than a few KiB.

Both are incremental: ``fn(data, previous_value)`` continues a running checksum, which lets a
segment be checksummed in chunks, in order, while it is still being read or written.

:class:`Checksummer` runs checksum work on one daemon thread, strictly in submission order.
The I/O thread submits a chunk right after reading it (or right before writing it) and goes on
with the next system call; both release the GIL, so on two cores the checksum is nearly free.
"""

from __future__ import annotations

import queue
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .threads import balanced, run_parallel

try:  # pragma: no cover - depends on the environment
    import crc32c as _crc32c_mod

    def _crc32c(data: Any, value: int = 0) -> int:
        # gil_release_mode=1: always release the GIL (the default only does so above 32 KiB),
        # so a background checksum never blocks the I/O thread.
        return int(_crc32c_mod.crc32c(data, value, 1))

    #: for small buffers checksummed on the calling thread: the C function itself (no Python
    #: frame per call: 20,000 small segments are 20,000 calls), whose default mode keeps the
    #: GIL below 32 KiB, where releasing and re-taking it would cost more than the checksum
    _crc32c_inline: Callable[[Any, int], int] = _crc32c_mod.crc32c

    HAVE_CRC32C = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_CRC32C = False


def _crc32(data: Any, value: int = 0) -> int:
    return zlib.crc32(data, value) & 0xFFFFFFFF


ChecksumFn = Callable[[Any, int], int]

#: algorithm name -> id stored in files
ALGORITHM_IDS: dict[str, int] = {"crc32c": 1, "crc32": 2}
#: id stored in files -> algorithm name
ALGORITHM_NAMES: dict[int, str] = {v: k for k, v in ALGORITHM_IDS.items()}


def default_algorithm() -> str:
    """The algorithm new files use: ``crc32c`` when its package imports, else ``crc32``."""
    return "crc32c" if HAVE_CRC32C else "crc32"


def checksum_function(algorithm: str, *, inline: bool = False) -> ChecksumFn:
    """The incremental function ``fn(data, value=0) -> int`` for ``algorithm``.

    ``inline=True`` gives a variant for small buffers on the calling thread (it keeps the
    GIL); the default releases the GIL, for big buffers and background threads. Raises
    ValueError for an unknown name, or when ``crc32c`` is asked for but its package is not
    installed (the message says what to install)."""
    if algorithm == "crc32c":
        if not HAVE_CRC32C:
            raise ValueError("this file uses CRC-32C checksums: pip install crc32c to read it")
        return _crc32c_inline if inline else _crc32c
    if algorithm == "crc32":
        return zlib.crc32 if inline else _crc32  # unsigned in Python 3 either way
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def checksum(data: Any, algorithm: str | None = None, value: int = 0) -> int:
    """Checksum of the bytes-like ``data`` (continuing ``value``) with ``algorithm``."""
    return checksum_function(algorithm or default_algorithm())(data, value)


def format_checksum(algorithm: str, value: int) -> str:
    """The printable form used in :class:`~epochal.storage.formats.base.BlobInfo`: ``crc32c:1a2b3c4d``."""
    return f"{algorithm}:{value & 0xFFFFFFFF:08x}"


def checksum_spans(fn: ChecksumFn, buf: Any, spans: Sequence[tuple[int, int]], threads: int) -> list[int]:
    """The checksum by ``fn`` (one that releases the GIL) of each ``(offset, length)`` span of
    ``buf`` (e.g. a memory map of a file: page-cache pages, nothing copied), the spans spread
    over ``threads`` threads balanced by size."""
    whole = memoryview(buf)
    out = [0] * len(spans)

    def job(slots: list[int]) -> Callable[[], None]:
        def run() -> None:
            for s in slots:
                off, n = spans[s]
                out[s] = fn(whole[off : off + n], 0)
        return run

    try:
        run_parallel([job(g) for g in balanced([n for _, n in spans], threads)])
    finally:
        whole.release()
    return out


class Checksummer:
    """Checksums segments on a background thread, in submission order.

    ``submit(slot, chunks)`` continues the running checksum of ``slot`` (an index into the
    result list) over ``chunks``; ``results()`` waits for all submitted work and returns the
    checksum of every slot. Work is processed strictly in order, so the chunks of one slot may
    be submitted across several calls. An exception in the worker is re-raised by
    ``results()``. Use as a context manager so the thread always ends.
    """

    def __init__(self, fn: ChecksumFn, nslots: int) -> None:
        self._fn = fn
        self._values = [0] * nslots
        self._queue: queue.SimpleQueue[list[tuple[int, Any]] | Callable[[], None] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="epochal-checksum", daemon=True)
        self._thread.start()
        self._closed = False

    def _run(self) -> None:
        values = self._values
        fn = self._fn
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            if callable(batch):  # (after(): the work queued before it is done)
                try:
                    batch()
                except BaseException as e:  # noqa: BLE001 - re-raised in results()
                    self._error = self._error or e
                continue
            if self._error is not None:
                continue
            try:
                for slot, data in batch:
                    if type(data) is list:  # several buffers in order, one running checksum
                        v = values[slot]
                        for part in data:
                            v = fn(part, v)
                        values[slot] = v
                    else:
                        values[slot] = fn(data, values[slot])
            except BaseException as e:  # noqa: BLE001 - re-raised in results()
                self._error = e

    def submit(self, batch: Sequence[tuple[int, Any]]) -> None:
        """Queue ``(slot, bytes-like)`` pairs (or ``(slot, [bytes-like, ...])``: several in
        order); each continues that slot's checksum."""
        self._queue.put(list(batch))

    def after(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the worker once the work queued so far is done (a buffer
        whose checksums are queued can then be reused: the callback gives it back)."""
        self._queue.put(callback)

    def results(self) -> list[int]:
        """Wait for all queued work; the checksum of every slot."""
        self.close()
        if self._error is not None:
            raise self._error
        return self._values

    def close(self) -> None:
        """Stop the worker after the queued work (idempotent)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()

    def __enter__(self) -> Checksummer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- combining CRCs: the CRC of A+B from the CRCs of A and B and B's length
# CRC combination, vectorized: what the checksum of a run of pieces must be, given each
# piece's own checksum and length, without reading a byte.
#
# A native file (format 2.0) checks a run of small segments with one checksum per group; the
# segment checksums stored beside it must agree, or the file would load whole (group checked)
# and yet not verify (segments checked). :func:`combined` computes, from the index alone, the
# group checksum its segments imply, for many groups at once in numpy (a few ms for 20,000
# segments), so a load checks that agreement without one checksum call per segment.
#
# For the CRCs used (CRC-32C and zlib's CRC-32: init and final xor all ones) the checksum of a
# concatenation is ``C(A || B) = L_|B|(C(A)) ^ C(B)``, with ``L_n`` the linear map that advances
# a CRC over ``n`` zero bytes. ``L_n`` is learnt from the checksum function itself (its images
# of the 32 unit vectors over one zero byte), composed by squaring, and applied as four
# byte-indexed tables per base-256 digit of ``n``.
__all__ = ["checksum_spans", "combined"]

def _tables(images: np.ndarray) -> np.ndarray:
    """The ``(..., 4, 256)`` byte tables of the linear maps whose images of the 32 unit
    vectors are ``images`` (``(..., 32)``): ``map(c) = T[0][c & 255] ^ ... ^ T[3][c >> 24]``."""
    per_byte = images.reshape(images.shape[:-1] + (4, 8))
    out = np.zeros(images.shape[:-1] + (4, 256), dtype=np.uint32)
    for bit in range(8):  # bytes with this top bit: those below it, xor this bit's image
        n = 1 << bit
        out[..., n : 2 * n] = out[..., :n] ^ per_byte[..., bit, None]
    return out


def _apply(t: np.ndarray, c: np.ndarray) -> np.ndarray:
    """One map's tables ``t`` (``(4, 256)``) applied to the uint32 values ``c``."""
    return t[0][c & 255] ^ t[1][(c >> 8) & 255] ^ t[2][(c >> 16) & 255] ^ t[3][c >> 24]


class _Shifter:
    """``L_(m * unit)`` of one checksum function, for counts ``m``, as tables per base-256
    digit position of ``m`` (built as far as the digits asked for reach)."""

    def __init__(self, fn: Any, unit: int) -> None:
        self.fn = fn
        zeros = bytes(unit)
        zero = fn(zeros, 0)
        images = np.array([fn(zeros, 1 << i) ^ zero for i in range(32)], dtype=np.uint32)
        self._units = [images]  # per position p: the images of L_(unit * 256**p)
        self._images: list[np.ndarray] = []  # per position: images of L_(d * unit * 256**p), d = 0, 1, ...
        self._digits: list[np.ndarray] = []  # per position: their (d, 4, 256) tables
        self._lock = threading.Lock()

    def _digit(self, p: int, top: int) -> np.ndarray:
        """The tables of position ``p`` for every digit up to ``top``."""
        with self._lock:
            while len(self._units) <= p:  # L_(256 k) = L_k applied 256 times: square 8 times
                sq = self._units[-1]
                for _ in range(8):
                    sq = _apply(_tables(sq), sq)
                self._units.append(sq)
            while len(self._images) <= p:
                self._images.append((np.uint32(1) << np.arange(32, dtype=np.uint32))[None, :])
                self._digits.append(_tables(self._images[-1]))
            have = self._images[p]
            if len(have) <= top:
                unit = _tables(self._units[p])
                while len(have) <= top:  # digits [n, 2n) = L_n applied to digits [0, n)
                    step = _tables(_apply(unit, have[-1]))  # L_n = L_1 after L_(n-1)
                    more = _apply(step, have)
                    self._digits[p] = np.concatenate([self._digits[p], _tables(more)])
                    have = np.concatenate([have, more])
                self._images[p] = have
            return self._digits[p]

    def shift(self, c: np.ndarray, m: np.ndarray) -> np.ndarray:
        """``L_(m[i] * unit)(c[i])`` for every i (uint32 values, non-negative counts)."""
        m = m.astype(np.uint64)
        top = int(m.max()) if len(m) else 0
        p = 0
        while top >> (8 * p):
            d = ((m >> np.uint64(8 * p)) & np.uint64(255)).astype(np.intp)
            t = self._digit(p, int(d.max()))
            c = t[d, 0, c & 255] ^ t[d, 1, (c >> 8) & 255] ^ t[d, 2, (c >> 16) & 255] ^ t[d, 3, c >> 24]
            p += 1
        return c


_SHIFTERS: dict[tuple[Any, int], _Shifter] = {}
_SHIFTERS_LOCK = threading.Lock()
_ZEROS: dict[tuple[Any, int], int] = {}
#: files align segments to 64 bytes: shifts by multiples of it need fewer digits
_ALIGN = 64


def _shifter(fn: Any, unit: int) -> _Shifter:
    with _SHIFTERS_LOCK:
        s = _SHIFTERS.get((fn, unit))
        if s is None:
            s = _SHIFTERS[(fn, unit)] = _Shifter(fn, unit)
        return s


def _zeros(fn: Any, n: int) -> int:
    """The checksum of ``n`` zero bytes."""
    got = _ZEROS.get((fn, n))
    if got is None:
        got = _ZEROS[(fn, n)] = int(fn(bytes(n), 0))
    return got


def combined(fn: Any, crcs: np.ndarray, lens: np.ndarray, pads: np.ndarray, group_of: np.ndarray,
             ngroups: int) -> np.ndarray:
    """The checksum (with ``fn``, a CRC-32 or CRC-32C function ``fn(data, value)``) of each of
    ``ngroups`` groups of pieces laid end to end: piece ``i`` is ``lens[i]`` bytes whose
    checksum is ``crcs[i]``, then ``pads[i]`` zero bytes, in group ``group_of[i]`` (pieces of
    a group adjacent and in order, groups in order; every group has a piece)."""
    lens = lens.astype(np.int64)
    pads = pads.astype(np.int64)
    group_of = group_of.astype(np.int64)
    size = lens + pads
    ends = np.cumsum(size)
    starts_i = np.flatnonzero(np.r_[True, group_of[1:] != group_of[:-1]])
    if len(starts_i) != ngroups:
        raise ValueError("every group needs a piece")
    gend = ends[np.r_[starts_i[1:] - 1, len(size) - 1]]  # each group's end (cumulative)
    after = np.repeat(gend, np.diff(np.r_[starts_i, len(size)])) - ends  # bytes after each padding
    # each piece with its padding: C(data || zeros) = L_pad(C(data)) ^ C(zeros)
    c = crcs.astype(np.uint32)
    if pads.any():
        uniq, inv = np.unique(pads, return_inverse=True)
        zs = np.array([_zeros(fn, int(p)) for p in uniq.tolist()], dtype=np.uint32)[inv]
        c = _shifter(fn, 1).shift(c, pads) ^ zs
    if not np.any(after % _ALIGN):
        c = _shifter(fn, _ALIGN).shift(c, after // _ALIGN)
    else:
        c = _shifter(fn, 1).shift(c, after)
    return np.bitwise_xor.reduceat(c, starts_i)
