"""Byte planes of float words, zstd frames of raw blocks, and the spare output buffers
of compressed segments, for :mod:`.compress`.

A float word of ``w`` bytes (little-endian) is rotated left by one bit, so that the sign
bit moves to bit 0 and the exponent fills the top byte, and cut into ``w`` byte planes.
A plane that does not compress is stored as a zstd frame of raw blocks, written straight
from the words into its place in the segment's stored bytes. Each thread reuses scratch
arrays from frame to frame (a fresh array costs a page fault per 4 KiB), and the writer
gives a segment's output buffer back once its file is written (:class:`SpareBuffers`), for
the next save.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ... import knobs

_UINT: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_scratch = threading.local()
#: the largest scratch array kept per thread and slot (a 4 MiB frame needs 8 MiB at most)
_SCRATCH_MAX = 8 << 20


def _buf(slot: int, dtype: Any, n: int) -> np.ndarray:
    """This thread's scratch array number ``slot`` of ``n`` items of ``dtype``, reused from
    frame to frame: a fresh array per frame costs a page fault per 4 KiB, which on a 4 MiB
    frame took longer than the arithmetic. Valid until the next call with the same slot.
    A thread keeps about 12 MiB of them for 4 MiB frames (two word arrays and the planes)."""
    if n * np.dtype(dtype).itemsize > _SCRATCH_MAX:  # (frames of others' files: not kept)
        return np.empty(n, dtype=dtype)
    cache = getattr(_scratch, "b", None)
    if cache is None:
        cache = _scratch.b = {}
    a = cache.get(slot)
    if a is None or a.dtype != dtype or len(a) < n:
        a = cache[slot] = np.empty(max(n, 1), dtype=dtype)
    return a[:n]  # type: ignore[no-any-return]


def _words(frame: np.ndarray, w: int) -> Iterator[np.ndarray]:
    """The rotated words of ``frame`` (uint8, a multiple of w), shifted right by 8 bits
    from one item to the next so that item ``j`` holds byte plane ``j`` in its low byte:
    a plane is cut from it by a truncating cast (one vectorised pass per plane; a strided
    transpose of the bytes, or a lookup table, measured several times slower). One array
    of this thread's scratch, changed in place: use each item before taking the next."""
    x = frame.view(_UINT[w])
    n = len(x)
    r, t = _buf(0, x.dtype, n), _buf(1, x.dtype, n)
    np.left_shift(x, 1, out=r)
    np.right_shift(x, 8 * w - 1, out=t)
    r |= t
    for j in range(w):
        if j:
            r >>= 8
        yield r


def _split(frame: np.ndarray, w: int) -> list[np.ndarray]:
    """The ``w`` byte planes of the rotated words of ``frame``, in this thread's scratch
    arrays (valid until its next split: the caller compresses them first)."""
    out = []
    for j, r in enumerate(_words(frame, w)):
        p = _buf(2 + j, np.uint8, len(r))
        np.copyto(p, r, casting="unsafe")  # (keeps the low byte)
        out.append(p)
    return out


def _merge(planes: Sequence[bytes], out: np.ndarray, w: int) -> None:
    """Inverse of :func:`_split`: the planes' bytes into ``out`` (uint8), words rotated back."""
    x = out.view(_UINT[w])
    t = _buf(1, x.dtype, len(x))
    np.copyto(x, np.frombuffer(planes[w - 1], dtype=np.uint8), casting="unsafe")
    for j in range(w - 2, -1, -1):
        x <<= 8
        np.copyto(t, np.frombuffer(planes[j], dtype=np.uint8), casting="unsafe")
        x |= t
    # rotate right by one bit: the sign bit back from bit 0 to the top
    np.left_shift(x, 8 * w - 1, out=t)
    x >>= 1
    x |= t



#: zstd's largest block (RFC 8878: Block_Maximum_Size is at most 128 KiB)
_BLOCK = 128 << 10


def raw_frame(data: Any) -> bytearray:
    """``data`` as one zstd frame of raw (stored) blocks: any zstd decoder returns it with a
    copy. Magic, a single-segment header with a 4-byte content size, then blocks of at most
    128 KiB, each behind its 3-byte header (last-block bit, type 0, size): 9 bytes plus 3 per
    128 KiB, against zstd's own attempt at compressing a plane that does not compress."""
    mv = memoryview(data).cast("B")
    out = bytearray(_raw_size(mv.nbytes))
    _raw_frame_into(np.frombuffer(out, dtype=np.uint8), np.frombuffer(mv, dtype=np.uint8), mv.nbytes)
    return out


def _raw_size(n: int) -> int:
    """The bytes of :func:`raw_frame` of ``n`` bytes."""
    return 9 + 3 * max(1, -(-n // _BLOCK)) + n


def _raw_frame_into(buf: np.ndarray, values: np.ndarray, n: int) -> int:
    """Write the raw zstd frame (:func:`raw_frame`) of the low bytes of the ``n`` items of
    ``values`` at the start of ``buf`` (uint8); its length. ``values`` may be of any
    unsigned dtype: each item is cast to its low byte as it is copied into place, so a byte
    plane goes from the words into the frame in one pass."""
    if n >= 1 << 32:
        raise ValueError("a raw zstd frame of 4 GiB or more")
    full, rem = divmod(n, _BLOCK)
    blocks = full + (rem > 0 or n == 0)
    buf[:9] = np.frombuffer(b"\x28\xb5\x2f\xfd\xa0" + n.to_bytes(4, "little"), dtype=np.uint8)
    step = _BLOCK + 3
    sizes = np.full(blocks, _BLOCK << 3, dtype="<u4")
    sizes[-1] = ((rem if rem or n == 0 else _BLOCK) << 3) | 1  # (the last block's bit)
    heads = np.lib.stride_tricks.as_strided(buf[9:], shape=(blocks, 3), strides=(step, 1))
    heads[:] = sizes.view(np.uint8).reshape(blocks, 4)[:, :3]
    if full:
        body = np.lib.stride_tricks.as_strided(buf[12:], shape=(full, _BLOCK), strides=(step, 1))
        np.copyto(body, values[:full * _BLOCK].reshape(full, _BLOCK), casting="unsafe")
    if rem:
        at = 9 + full * step + 3
        np.copyto(buf[at:at + rem], values[full * _BLOCK:n], casting="unsafe")
    return 9 + 3 * blocks + n


#: outputs of at least this many bytes get an anonymous map of their own (:func:`_fresh`);
#: (so a save holds at most one map per 64 MiB of compressed segments: the kernel caps
#: a process's maps, at 65,530 by default)
_MAP_MIN = 64 << 20
#: outputs of fewer bytes are neither kept nor taken from the spares (malloc reuses its own)
SPARE_MIN = 1 << 20


def _fresh(n: int) -> np.ndarray:
    """``n`` bytes of fresh memory (uint8), untouched until written, so only the pages
    written are ever resident. A large one is an anonymous map of 4 KiB pages: numpy asks
    for huge pages for a large array, measured faster on a 256 MiB segment when the kernel
    had them at hand but about three times slower in the rounds where it compacted memory
    first; 4 KiB pages are steady."""
    if n < _MAP_MIN:
        return np.empty(n, dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)


class SpareBuffers:
    """Output buffers of compressed segments, given back by the writer once their file is
    written and handed out again to the next save's segments of about the same size.

    Fresh memory costs a page fault per 4 KiB page on first touch: on this machine, writing
    170 MB into fresh pages took 8x the time of writing it into pages touched before, and
    the faults were about 40% of compressing a 256 MiB bf16 segment (bench/RESULTS.md,
    "bench_bytes.py"). A save in a loop compresses segments of the same sizes every time, so
    it reuses its own buffers. Kept at most :attr:`~epochal.knobs.Knobs.spare_bytes` in all
    (the oldest dropped first); a buffer serves a request of ``n`` bytes when it holds
    between ``n`` and ``1.25 n``. Only the writer gives buffers back, after the write that
    read them ended (written or failed), so no live view of a given-back buffer is read again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[np.ndarray] = []  # (oldest first)
        self.kept_bytes = 0
        #: buffers made fresh / taken from the spares (for tests and benches)
        self.fresh = 0
        self.reused = 0

    def take(self, n: int) -> np.ndarray:
        """A buffer of at least ``n`` bytes (uint8): a spare one of at most ``1.25 n``
        bytes when there is one (the smallest), else fresh memory (:func:`_fresh`)."""
        if n >= SPARE_MIN:
            with self._lock:
                fits = [i for i, b in enumerate(self._kept) if n <= len(b) <= n + n // 4]
                if fits:
                    i = min(fits, key=lambda i: len(self._kept[i]))
                    buf = self._kept.pop(i)
                    self.kept_bytes -= len(buf)
                    self.reused += 1
                    return buf
        self.fresh += 1
        return _fresh(n)

    def give_back(self, buffers: Sequence[np.ndarray]) -> None:
        """Keep ``buffers`` (each one :meth:`take` returned, whose bytes nobody reads any
        more) for later saves, dropping the oldest beyond the ``spare_bytes`` knob."""
        cap = knobs.get().spare_bytes
        with self._lock:
            for b in buffers:
                if len(b) >= SPARE_MIN and len(b) <= cap:
                    self._kept.append(b)
                    self.kept_bytes += len(b)
            while self.kept_bytes > cap:
                self.kept_bytes -= len(self._kept.pop(0))

    def clear(self) -> None:
        """Drop every spare buffer (their memory goes back to the system)."""
        with self._lock:
            self._kept.clear()
            self.kept_bytes = 0


#: the process's spare output buffers
SPARES = SpareBuffers()


def _bound(n: int) -> int:
    """zstd's ZSTD_COMPRESSBOUND: the most bytes one frame of ``n`` bytes compresses to."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < 128 << 10 else 0)
