"""CRC combination, vectorized: what the checksum of a run of pieces must be, given each
piece's own checksum and length, without reading a byte.

A native file (format 2.0) checks a run of small segments with one checksum per group; the
segment checksums stored beside it must agree, or the file would load whole (group checked)
and yet not verify (segments checked). :func:`combined` computes, from the index alone, the
group checksum its segments imply, for many groups at once in numpy (a few ms for 20,000
segments), so a load checks that agreement without one checksum call per segment.

For the CRCs used (CRC-32C and zlib's CRC-32: init and final xor all ones) the checksum of a
concatenation is ``C(A || B) = L_|B|(C(A)) ^ C(B)``, with ``L_n`` the linear map that advances
a CRC over ``n`` zero bytes. ``L_n`` is learnt from the checksum function itself (its images
of the 32 unit vectors over one zero byte), composed by squaring, and applied as four
byte-indexed tables per base-256 digit of ``n``.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["combined"]

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
