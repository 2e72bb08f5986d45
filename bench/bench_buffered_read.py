"""How fast can a cold file be read *and checksummed* through the page cache, against a
parallel O_DIRECT read of the same bytes into touched memory (the limit of a cold restore)?

A verified load into live memory must hold the bytes somewhere until every checksum of the
load has passed (no live byte is written before): in the page cache (then copied out of it
into the live memory) or in fresh memory (whose first-touch faults cost about 1 ms per MiB
on a VM: bench/bench_resume.py, bench/RESULTS.md "bench_resume.py"). This measures the first pass of the page-cache way,
the one the in-place load takes (``inplace.verify_direct_read``), in its variants:

* ``odirect``: 4 threads of O_DIRECT reads into memory touched beforehand, no checksum (the
  disk's limit, what ``bench_resume.py``'s ``odirect`` measures);
* ``pread``: 4 threads, each 8 MiB ``preadv`` into a reused scratch + CRC-32C (the library's);
* ``advise``: the same after ``POSIX_FADV_WILLNEED`` over the whole file;
* ``pread32``: 32 MiB pieces; ``pread8t``: 8 threads;
* ``map``: 4 threads, CRC-32C on a read-only map, each 8 MiB piece ``MADV_POPULATE_READ`` first
  (no copy out of the page cache).

The file is evicted (``fsync`` + ``POSIX_FADV_DONTNEED``) before each read; variants rotate;
reported: medians and the median of the paired per-round ratio to ``odirect``. (``map`` won
here, 1.12-1.14x against ``pread``'s 1.22-1.28x, but not in the whole in-place load, where
its A/B against the reads was 0.82, 1.18 and 1.10 in three runs: bench/RESULTS.md,
"bench_buffered_read.py"; the library keeps the reads.)

    .venv/bin/python bench/bench_buffered_read.py --mib 880 --rounds 7
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import crc32c
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import DirectReader, evict  # noqa: E402

PIECE = 8 << 20
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def _spans(size: int, nthreads: int) -> list[tuple[int, int]]:
    per = size // nthreads
    return [(t * per, size if t == nthreads - 1 else (t + 1) * per) for t in range(nthreads)]


def pread_crc(path: str, size: int, nthreads: int = 4, piece: int = PIECE, advise: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if advise:
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)

        def run(span: tuple[int, int]) -> int:
            start, end = span
            scratch = memoryview(bytearray(piece))
            crc = 0
            for at in range(start, end, piece):
                n = os.preadv(fd, [scratch[: min(piece, end - at)]], at)
                crc = crc32c.crc32c(scratch[:n], crc)
            return crc

        with ThreadPoolExecutor(nthreads) as pool:
            list(pool.map(run, _spans(size, nthreads)))
    finally:
        os.close(fd)


def map_crc(path: str, size: int, nthreads: int = 4) -> None:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)

        def run(span: tuple[int, int]) -> int:
            start, end = span
            crc = 0
            for at in range(start, end, PIECE):
                n = min(PIECE, end - at)
                mm.madvise(_POPULATE_READ, at, n)
                crc = crc32c.crc32c(view[at : at + n], crc)
            return crc

        with ThreadPoolExecutor(nthreads) as pool:
            list(pool.map(run, _spans(size, nthreads)))
        view.release()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=880)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--variants", default="odirect,pread,advise,pread32,pread8t,map")
    args = ap.parse_args()
    fd, path = tempfile.mkstemp(prefix="epochal-bench-buffered-", dir=args.dir)
    size = args.mib << 20
    try:
        with os.fdopen(fd, "wb") as f:
            for i in range(args.mib):
                f.write(np.random.default_rng(i).bytes(1 << 20))
            f.flush()
            os.fsync(f.fileno())
        buf = DirectReader(size)
        variants: dict[str, Callable[[], object]] = {
            "odirect": lambda: buf.read(path),
            "pread": lambda: pread_crc(path, size),
            "advise": lambda: pread_crc(path, size, advise=True),
            "pread32": lambda: pread_crc(path, size, piece=32 << 20),
            "pread8t": lambda: pread_crc(path, size, nthreads=8),
            "map": lambda: map_crc(path, size),
        }
        names = args.variants.split(",")
        times: dict[str, list[float]] = {n: [] for n in names}
        print(f"{args.mib} MiB, N = {args.rounds}; load average {os.getloadavg()[0]:.2f}")
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                evict(path)
                t = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - t)
        print("| variant | median ms | / odirect (paired) |")
        print("|---|---:|---:|")
        for name in names:
            ratios = [a / b for a, b in zip(times[name], times["odirect"])]
            print(f"| {name} | {statistics.median(times[name]) * 1e3:.0f} | "
                  f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}) |")
        print(f"load average {os.getloadavg()[0]:.2f}")
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
