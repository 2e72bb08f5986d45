"""Cold loads of workload (a) out of one file: raw reads of the native file's own bytes vs
epochal native loads (checksums verified, and not).

bench_format.py gives every format its own file, and measures 5 rounds among 5 formats. On
this VM a cold read's speed depends on the host (its own cache of the virtual disk, other
tenants), and raw 64 MiB ``preadv`` calls are bimodal (about 1.0 s or 2.5-4 s for 2 GiB).
Here all variants read the *same* file (same disk blocks), in an order rotated per round,
the file dropped from the page cache before each load, for many rounds, and every round's
times are printed, so the spread is visible next to the paired medians.

    .venv/bin/python bench/bench_cold.py --rounds 10
    .venv/bin/python bench/bench_cold.py --quick        # tiny, a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _measure import evict, preadv_runs, recycle_memory  # noqa: E402

from epochal.storage.formats.native import NativeFile, write_native  # noqa: E402

MiB = 1 << 20


def raw_loader(path: str) -> Any:
    """``preadv`` of every blob's bytes into new arrays, coalesced up to 64 MiB per call
    (the native file's alignment padding goes to a scratch buffer)."""
    with NativeFile(path) as f:
        idx = f._index
        layout = []
        for i in range(len(f)):
            k = int(idx.recs["seg_first"][i])
            layout.append((int(idx.segs["offset"][k]), int(idx.segs["length"][k])))

    def load() -> list[np.ndarray]:
        out = [np.empty(n // 4, dtype=np.float32) for _, n in layout]
        fd = os.open(path, os.O_RDONLY)
        try:
            preadv_runs(fd, [(off, a) for (off, _), a in zip(layout, out)])
        finally:
            os.close(fd)
        return out

    return load


def native_loader(path: str, verify: bool) -> Any:
    def load() -> dict[str, Any]:
        with NativeFile(path) as f:
            return f.read(verify=verify)

    return load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--count", type=int, default=64, help="arrays (default 64)")
    ap.add_argument("--mib", type=int, default=32, help="MiB per array (default 32)")
    ap.add_argument("--dir", default=None, help="where the file goes (default: a temp dir in /tmp)")
    ap.add_argument("--quick", action="store_true", help="4 arrays of 1 MiB, 2 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.count, args.mib, args.rounds = 4, 1, 2
    work = Path(tempfile.mkdtemp(prefix="epochal-cold-", dir=args.dir))
    path = str(work / "a.native")
    try:
        rng = np.random.default_rng(0)
        base = rng.standard_normal(args.mib * MiB // 4).astype(np.float32)
        write_native(path, {f"w{i:03d}": base + i for i in range(args.count)})
        recycle_memory()
        variants = {
            "raw": raw_loader(path),
            "native": native_loader(path, True),
            "native-noverify": native_loader(path, False),
        }
        names = list(variants)
        times: dict[str, list[float]] = {k: [] for k in names}
        for r in range(args.rounds):
            for k in names[r % len(names):] + names[: r % len(names)]:
                evict(path)
                t = time.perf_counter()
                out = variants[k]()
                times[k].append(time.perf_counter() - t)
                del out
        nbytes = args.count * args.mib * MiB
        print(f"# command: python bench/bench_cold.py {' '.join(argv if argv is not None else sys.argv[1:])}")
        print(f"# {args.count} x {args.mib} MiB float32, one native file, cold (fsync + DONTNEED) before "
              f"each load; {args.rounds} rounds, order rotated per round")
        print("| variant | ms per round | median ms | GB/s | paired x raw (median) |")
        print("| --- | --- | --- | --- | --- |")
        for k in names:
            med = statistics.median(times[k])
            ratio = statistics.median(a / b for a, b in zip(times["raw"], times[k]))
            per = " ".join(f"{t * 1e3:.0f}" for t in times[k])
            print(f"| {k} | {per} | {med * 1e3:.0f} | {nbytes / med / 1e9:.2f} | {ratio:.2f} |")
    finally:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
