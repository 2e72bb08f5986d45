"""The read plan of a range of an incremental db (storage/io/extents/reads.py) against a plain
reference: on random layouts (a bulk file in place or not, other files' pieces in order or
not, with gaps, long and short, spans cut by MERGE_GAP, MERGE_SPAN and MAX_PIECES_READ, ranges
cut anywhere, sources read with iovec arrays or with buffers) every range reads the same
bytes as copying each extent from its file, in one read per span, not one per piece."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from epochal.storage.io.extents.reads import (
    MAX_PIECES_READ,
    MERGE_GAP,
    MERGE_SPAN,
    gather,
    preadv_iov,
)

pytestmark = pytest.mark.unit

Ext = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class Files:
    """Source files 0..n-1 (random bytes where pieces lie, holes elsewhere) and the reads of
    both planners."""

    def __init__(self, tmp: Path, sizes: list[int], rng: np.random.Generator) -> None:
        self.fds: list[int] = []
        for k, size in enumerate(sizes):
            path = tmp / f"src{k}"
            with open(path, "wb") as f:
                f.truncate(size)
            self.fds.append(os.open(path, os.O_RDWR))
        self.rng = rng
        self.calls = 0

    def fill(self, source: int, off: int, n: int) -> None:
        """Random bytes at ``off`` of ``source`` (the rest of a large file stays a hole)."""
        os.pwrite(self.fds[source], self.rng.integers(0, 256, n, dtype=np.uint8).tobytes(), off)

    def pread(self, source: int, n: int, off: int) -> bytes:
        return os.pread(self.fds[source], n, off)

    def read_iov(self, source: int, iov: np.ndarray, off: int, total: int) -> None:
        self.calls += 1
        assert len(iov) <= MAX_PIECES_READ and int(iov[:, 1].sum()) == total
        assert preadv_iov(self.fds[source], np.ascontiguousarray(iov), off) == total

    def read_parts(self, source: int, parts: list[memoryview], off: int, total: int) -> None:
        self.calls += 1
        assert os.preadv(self.fds[source], parts, off) == total

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def _layout(rng: np.random.Generator, files: Files, nsrc: int, size: int, *, ordered: bool = True,
            bulk_delta: int = 0, big_gaps: bool = False) -> Ext:
    """A random table tiling ``size`` logical bytes: source 0 holds every byte in place (at
    ``bulk_delta``), sources 1.. take runs of it, each in logical order in its file."""
    cuts = np.unique(np.concatenate([[0, size], rng.integers(1, size, rng.integers(10, 3000))]))
    starts, ends = cuts[:-1].astype(np.int64), cuts[1:].astype(np.int64)
    src = rng.integers(0, nsrc, len(starts)).astype(np.int64)
    src[rng.random(len(src)) < 0.4] = 0  # the bulk file holds the most
    soff = starts + bulk_delta
    heads = np.zeros(nsrc, dtype=np.int64)
    for i in range(len(starts)):
        s, n = int(src[i]), int(ends[i] - starts[i])
        if s == 0:
            continue
        gap = int(rng.choice([0, 0, 1, 17, 4096, MERGE_GAP + 1 if big_gaps else 64, 3 * MERGE_SPAN if big_gaps else 9]))
        soff[i] = int(heads[s]) + gap
        heads[s] = soff[i] + n
        files.fill(s, int(soff[i]), n)
    files.fill(0, bulk_delta, size)
    if not ordered:  # one source's pieces swapped in its file
        mine = np.flatnonzero(src == 1)
        if len(mine) >= 2:
            a, b = int(mine[0]), int(mine[-1])
            na, nb = int(ends[a] - starts[a]), int(ends[b] - starts[b])
            soff[a], soff[b] = int(heads[1]) + 5 + nb, int(heads[1]) + 5
            files.fill(1, int(heads[1]) + 5, na + nb)
    return starts, ends, src, soff


def _reference(files: Files, ext: Ext, offset: int, n: int) -> bytes:
    """Each extent's bytes copied from its file, one by one."""
    out = bytearray(n)
    for lo, hi, s, so in zip(*(a.tolist() for a in ext)):
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            out[a - offset : b - offset] = files.pread(s, b - a, so + a - lo)
    return bytes(out)


def _windows(rng: np.random.Generator, size: int) -> list[tuple[int, int]]:
    w = [(0, size), (0, 1), (size - 1, 1)]
    step = int(rng.integers(1000, 300_000))
    w += [(o, min(step, size - o)) for o in range(0, size, step)]  # consecutive windows, cut anywhere
    for _ in range(20):
        o = int(rng.integers(0, size))
        w.append((o, int(rng.integers(1, size - o + 1))))
    return w


def _check(files: Files, ext: Ext, nsrc: int, rng: np.random.Generator, direct: list[bool] | None = None) -> None:
    size = int(ext[1][-1])
    direct = direct or [True] * nsrc
    junk = memoryview(bytearray(MERGE_GAP))
    for offset, n in _windows(rng, size):
        got = bytearray(n)
        gather(memoryview(got), offset, ext, junk, nsrc, direct, files.read_iov, files.read_parts)
        assert bytes(got) == _reference(files, ext, offset, n), (offset, n)


@pytest.mark.parametrize("seed", range(6))
def test_every_range_reads_as_the_extents_say(tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    nsrc = int(rng.integers(2, 7))
    size = int(rng.integers(200_000, 3_000_000))
    files = Files(tmp_path, [size + 8192] + [0] * (nsrc - 1), rng)
    try:
        ext = _layout(rng, files, nsrc, size, bulk_delta=int(rng.choice([0, 4096, 77])), big_gaps=seed % 2 == 1)
        _check(files, ext, nsrc, rng)
    finally:
        files.close()


def test_spans_are_cut_by_gap_length_and_buffer_count(tmp_path: Path) -> None:
    """Thousands of 1 KiB pieces of one file back to back (more than MAX_PIECES_READ buffers
    per span), then past a gap over MERGE_GAP, then a run longer than MERGE_SPAN: the same
    bytes, and one read per span (per MAX_PIECES_READ buffers), not one per piece."""
    rng = np.random.default_rng(11)
    n, size = 3000, 3000 * 2048
    files = Files(tmp_path, [size, 0], rng)
    try:
        starts = np.arange(0, size, 1024, dtype=np.int64)
        ends = starts + 1024
        src = (np.arange(len(starts)) % 2).astype(np.int64)  # every other KiB from file 1
        soff = starts.copy()
        mine = np.flatnonzero(src == 1)
        soff[mine] = np.arange(len(mine), dtype=np.int64) * 1024  # back to back there ...
        soff[mine[n // 2 :]] += MERGE_GAP + 1  # ... then past a gap too long to read through
        far = mine[-100:]  # ... and a hundred far away, MERGE_GAP apart: over MERGE_SPAN in all
        soff[far] = int(soff[mine[-101]]) + 2 * MERGE_SPAN + np.arange(100, dtype=np.int64) * (MERGE_GAP + 1024)
        for k in mine.tolist():
            files.fill(1, int(soff[k]), 1024)
        files.fill(0, 0, size)
        ext = (starts, ends, src, soff)
        _check(files, ext, 2, rng)
        files.calls = 0
        got = bytearray(size)
        gather(memoryview(got), 0, ext, memoryview(bytearray(MERGE_GAP)), 2, [True, True], files.read_iov,
               files.read_parts)
        assert bytes(got) == _reference(files, ext, 0, size)
        # one bulk read, then file 1's spans: 1500 + 1400 back to back (2 + 2 reads of at
        # most MAX_PIECES_READ buffers) and the hundred far away, cut once by MERGE_SPAN
        assert files.calls == 1 + 2 + 2 + 2
    finally:
        files.close()


@pytest.mark.parametrize("case", ["unordered", "bulk_moves", "not_direct"])
def test_layouts_off_the_common_path_read_the_same_bytes(tmp_path: Path, case: str) -> None:
    """Pieces of one file out of order there, a bulk file whose bytes are not all at one
    distance from their logical place, or a source that takes no iovec array (a remote one:
    a memoryview per buffer)."""
    rng = np.random.default_rng(3)
    size = 500_000
    files = Files(tmp_path, [size + 8192, 0], rng)
    try:
        ext = _layout(rng, files, 2, size, ordered=case != "unordered")
        if case == "bulk_moves":
            starts, ends, src, soff = ext
            k = int(np.flatnonzero(src == 0)[-1])
            soff = soff.copy()
            soff[k] += 1
            ext = (starts, ends, src, soff)
        _check(files, ext, 2, rng, [True, case != "not_direct"])
    finally:
        files.close()
