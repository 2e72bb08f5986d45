#!/usr/bin/env python
"""Benchmark the native checkpoint format against raw disk I/O and other formats.

Workloads (built in memory by this script):

  (a) 64 float32 arrays of 32 MiB (2 GiB);
  (b) 20,000 float32 arrays of 1-64 KiB, log-uniform sizes (about 290 MiB);
  (c) partial load of one 32 MiB array of (a);
  (d) partial load of one small array of (b).

Variants, in the same run: raw ``os.write``/``writev`` of the same bytes + fsync and raw
``preadv`` into new arrays (the disk's own speed); epochal native save / load (checksums
verified, and not); safetensors; torch.save / torch.load(weights_only=True); np.savez /
np.load. Every save is followed by fsync (native fsyncs itself). Loads are timed cold (the
file dropped from the page cache with posix_fadvise DONTNEED after fsync) and warm.

The machine may be shared and noisy, so every round runs every variant once, in an order
rotated per round, and each comparison is the median over rounds of the paired ratio
(same round). ``--quick`` runs everything at a tiny size in a few seconds (make test runs it
so the script cannot rot); it asserts nothing about timings.

    .venv/bin/python bench/bench_format.py --rounds 5            # full run, ~10 minutes
    .venv/bin/python bench/bench_format.py --quick               # smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _measure import (  # noqa: E402
    MiB,
    Series,
    evict,
    fsync_path,
    measure,
    paired_ratio,
    preadv_runs,
    recycle_memory,
    touch_memory,
    warm,
)

from epochal.storage.formats.native import NativeBackend, NativeFile  # noqa: E402

Blobs = dict[str, np.ndarray]


# ----------------------------------------------------------------------------- workloads
def build_large(count: int, mib: int) -> Blobs:
    rng = np.random.default_rng(0)
    n = mib * MiB // 4
    return {f"layer{i:02d}.weight": rng.standard_normal(n, dtype=np.float32) for i in range(count)}


def build_small(count: int, lo_kib: float = 1, hi_kib: float = 64) -> Blobs:
    rng = np.random.default_rng(1)
    sizes = np.exp(rng.uniform(np.log(lo_kib * 1024), np.log(hi_kib * 1024), count))
    out: Blobs = {}
    for i, s in enumerate(sizes):
        out[f"block{i // 8}.param{i % 8}"] = rng.standard_normal(max(1, int(s) // 4), dtype=np.float32)
    return out


# ----------------------------------------------------------------------------- formats
def _writev(fd: int, batch: list[Any], nbytes: int) -> None:
    n = os.writev(fd, batch)
    if n != nbytes:
        raise SystemExit(f"short write {n} of {nbytes}")


class Raw:
    """The disk's own speed: the same bytes back to back, written/read in big system calls."""

    name = "raw"

    def __init__(self) -> None:
        self.layout: dict[str, tuple[int, int, np.dtype, tuple[int, ...]]] = {}
        self.source: str | None = None

    def save(self, path: str, blobs: Blobs) -> None:
        self.layout = {}
        self.source = None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            off = 0
            batch: list[Any] = []
            nbytes = 0
            for k, v in blobs.items():
                self.layout[k] = (off, v.nbytes, v.dtype, v.shape)
                off += v.nbytes
                batch.append(v)
                nbytes += v.nbytes
                if len(batch) == 1024 or nbytes >= 64 * MiB:
                    _writev(fd, batch, nbytes)
                    batch, nbytes = [], 0
            if batch:
                _writev(fd, batch, nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)

    def use_file(self, path: str) -> None:
        """Read from now on the same bytes out of another file (the native one): the layout
        comes from its index, so raw and native loads read one file, one disk location."""
        with NativeFile(path) as f:
            segs = f._index.segs
            self.layout = {}
            for name in f.names():
                i = f._index.find(name)
                assert i is not None
                info = f.info(name)
                k = int(f._index.recs["seg_first"][i])
                self.layout[name] = (int(segs["offset"][k]), int(segs["length"][k]),
                                     np.dtype(info.dtype), tuple(info.shape or ()))
        self.source = path

    def load(self, path: str) -> Blobs:
        """``preadv`` into new arrays, coalesced (:func:`_measure.preadv_runs`)."""
        out: Blobs = {k: np.empty(shape, dtype=dt) for k, (_, _, dt, shape) in self.layout.items()}
        fd = os.open(self.source or path, os.O_RDONLY)
        try:
            preadv_runs(fd, [(off, out[k]) for k, (off, _, _, _) in self.layout.items()])
        finally:
            os.close(fd)
        return out

    def partial(self, path: str, name: str) -> np.ndarray:
        off, n, dt, shape = self.layout[name]
        a = np.empty(shape, dtype=dt)
        fd = os.open(self.source or path, os.O_RDONLY)
        try:
            os.preadv(fd, [a], off)
        finally:
            os.close(fd)
        return a


class Native:
    name = "native"

    def __init__(self, verify: bool = True) -> None:
        self.backend = NativeBackend()
        self.verify = verify
        if not verify:
            self.name = "native-noverify"

    def save(self, path: str, blobs: Blobs) -> None:
        self.backend.write(path, blobs)

    def load(self, path: str) -> Blobs:
        return self.backend.read(path, verify=self.verify)

    def partial(self, path: str, name: str) -> Any:
        return self.backend.read(path, [name], verify=self.verify)[name]


class Safetensors:
    name = "safetensors"

    def __init__(self) -> None:
        import safetensors.numpy as stn
        from safetensors import safe_open

        self.stn, self.safe_open = stn, safe_open

    def save(self, path: str, blobs: Blobs) -> None:
        self.stn.save_file(blobs, path)
        fsync_path(path)

    def load(self, path: str) -> Blobs:
        return self.stn.load_file(path)

    def partial(self, path: str, name: str) -> Any:
        with self.safe_open(path, framework="np") as f:
            return f.get_tensor(name)


class Torch:
    name = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def save(self, path: str, blobs: Blobs) -> None:
        self.torch.save({k: self.torch.from_numpy(v) for k, v in blobs.items()}, path)
        fsync_path(path)

    def load(self, path: str) -> Any:
        return self.torch.load(path, weights_only=True)


class Npz:
    name = "npz"

    def save(self, path: str, blobs: Blobs) -> None:
        np.savez(path, **blobs)
        fsync_path(path)

    def load(self, path: str) -> Blobs:
        with np.load(path) as z:
            return {k: z[k] for k in z.files}


def make_formats(names: list[str]) -> list[Any]:
    out: list[Any] = []
    for n in names:
        try:
            out.append(
                {"raw": Raw, "native": Native, "safetensors": Safetensors, "torch": Torch,
                 "npz": Npz}[n]()
            )
        except ImportError as e:
            print(f"# skipping {n}: {e}", file=sys.stderr)
    return out


# ----------------------------------------------------------------------------- running
def rotate(items: list[Any], r: int) -> list[Any]:
    r %= max(1, len(items))
    return items[r:] + items[:r]


class Results:
    def __init__(self) -> None:
        self.series: dict[tuple[str, str, str], Series] = {}

    def add(self, workload: str, op: str, variant: str, nbytes: int, sample: Any) -> None:
        key = (workload, op, variant)
        self.series.setdefault(key, Series(f"{workload}/{op}/{variant}", nbytes)).samples.append(sample)

    def get(self, workload: str, op: str, variant: str) -> Series | None:
        return self.series.get((workload, op, variant))


def check_equal(a: Blobs, b: Any, what: str) -> None:
    for k, v in a.items():
        got = np.asarray(b[k])
        if got.dtype != v.dtype or got.shape != v.shape or not np.array_equal(got, v):
            raise SystemExit(f"{what}: blob {k!r} differs after the round trip")


def run_workload(
    res: Results, label: str, blobs: Blobs, formats: list[Any], rounds: int, work: Path,
    partial_name: str, drop_caches: bool, mem: Results | None = None, recycle: bool = True,
) -> None:
    """Round 0 (when ``mem`` is given) measures peak memory with the default allocator; then
    ``recycle_memory()`` and ``rounds`` timed rounds."""
    if mem is not None:
        _rounds(mem, label, blobs, formats, 1, work, partial_name, drop_caches, start=0)
    if recycle:
        recycle_memory()
    _rounds(res, label, blobs, formats, rounds, work, partial_name, drop_caches, start=1)


def _reads(name: str, raw: Any) -> str:
    """Which variant's file ``name`` loads from."""
    if name == "native-noverify" or (name == "raw" and raw.source is not None):
        return "native"
    return name


def _rounds(
    res: Results, label: str, blobs: Blobs, formats: list[Any], rounds: int, work: Path,
    partial_name: str, drop_caches: bool, start: int,
) -> None:
    nbytes = sum(v.nbytes for v in blobs.values())
    paths = {f.name: str(work / f"{label}.{f.name}") for f in formats}
    native_nv = Native(verify=False)
    raw = next(f for f in formats if f.name == "raw")
    loaders: list[Any] = list(formats) + ([native_nv] if any(f.name == "native" for f in formats) else [])
    checked: set[str] = set()
    for r in range(start, start + rounds):
        for f in rotate(formats, r):
            p = paths[f.name]
            if os.path.exists(p):
                os.unlink(p)
            s, _ = measure(lambda f=f, p=p: f.save(p, blobs))
            res.add(label, "save", f.name, nbytes, s)
        if "native" in paths:  # raw loads read the native file's bytes (same file, same disk)
            raw.use_file(paths["native"])
        for mode in ("cold", "warm"):
            for f in rotate(loaders, r):
                p = paths[_reads(f.name, raw)]
                prep: Callable[[], None] = (
                    (lambda p=p: evict(p, drop_caches)) if mode == "cold" else (lambda p=p: warm(p))
                )
                s, out = measure(lambda f=f, p=p: f.load(p), prep)
                res.add(label, f"load-{mode}", f.name, nbytes, s)
                if f.name not in checked:
                    check_equal(blobs, out, f"{label} {f.name}")
                    checked.add(f.name)
                del out
            for f in rotate([g for g in loaders if hasattr(g, "partial")], r):
                p = paths[_reads(f.name, raw)]
                prep = (lambda p=p: evict(p, drop_caches)) if mode == "cold" else (lambda p=p: warm(p))
                s, out = measure(lambda f=f, p=p: f.partial(p, partial_name), prep)
                res.add(label, f"partial-{mode}", f.name, blobs[partial_name].nbytes, s)
                if not np.array_equal(np.asarray(out), blobs[partial_name]):
                    raise SystemExit(f"{label} partial {f.name}: wrong value")
                del out
        print(f"# {label}: " + ("memory round done" if r == 0 else f"timed round {r} done"),
              file=sys.stderr, flush=True)
    del raw


def fmt_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def report(res: Results, rounds: int, mem: Results) -> list[str]:
    lines = [
        f"Medians of {rounds} timed round(s); ratios are medians of per-round paired ratios "
        "(throughput of the variant / throughput of the reference in the same round). Peak "
        "extra memory is from a separate first round with the default allocator.",
        "",
        fmt_row(["workload", "operation", "variant", "GB/s", "median ms", "peak extra MiB",
                 "x raw", "x safetensors"]),
        fmt_row(["---"] * 8),
    ]
    for (wl, op, var), s in res.series.items():
        raw = res.get(wl, op, "raw")
        st = res.get(wl, op, "safetensors")
        m = mem.get(wl, op, var)
        lines.append(
            fmt_row(
                [
                    wl, op, var, f"{s.gbps():.2f}", f"{s.median_seconds() * 1e3:.1f}",
                    f"{m.peak_extra() / MiB:.1f}" if m is not None else "",
                    f"{paired_ratio(s, raw):.2f}" if raw is not None else "",
                    f"{paired_ratio(s, st):.2f}" if st is not None else "",
                ]
            )
        )
    return lines


def goals(res: Results, mem: Results) -> list[str]:
    out: list[str] = ["", "Goals:"]

    def ratio(wl: str, op: str, a: str, b: str) -> float | None:
        sa, sb = res.get(wl, op, a), res.get(wl, op, b)
        return paired_ratio(sa, sb) if sa is not None and sb is not None else None

    def line(ok: bool, text: str) -> None:
        out.append(f"- [{'met' if ok else 'MISSED'}] {text}")

    r = ratio("a", "save", "native", "raw")
    if r is not None:
        line(r >= 0.90, f"save (a) >= 0.90x raw write+fsync: {r:.2f}x")
    for mode in ("cold", "warm"):
        r = ratio("a", f"load-{mode}", "native", "raw")
        if r is not None:
            line(r >= 0.90, f"load (a) {mode}, checksums verified, >= 0.90x raw read: {r:.2f}x")
        r = ratio("a", f"load-{mode}", "native-noverify", "native")
        if r is not None:
            cost = r - 1
            line(cost < 0.05, f"verification cost, (a) {mode}: {cost * 100:+.1f}%")
    for op in ("save", "load-cold", "load-warm"):
        r = ratio("b", op, "native", "safetensors")
        if r is not None:
            line(r >= 1.5, f"(b) {op} >= 1.5x safetensors: {r:.2f}x")
    for mode in ("cold", "warm"):
        n, rw = res.get("a", f"partial-{mode}", "native"), res.get("a", f"partial-{mode}", "raw")
        if n is not None and rw is not None:
            limit = 1.5 * rw.median_seconds() + 0.002
            line(
                n.median_seconds() <= limit,
                f"(c) {mode}: {n.median_seconds() * 1e3:.1f} ms vs raw pread "
                f"{rw.median_seconds() * 1e3:.1f} ms (limit 1.5x+2ms = {limit * 1e3:.1f} ms)",
            )
    n = res.get("b", "partial-cold", "native")
    if n is not None:
        st = res.get("b", "partial-cold", "safetensors")
        line(
            n.median_seconds() < 0.010,
            f"(d) cold: {n.median_seconds() * 1e3:.2f} ms (< 10 ms)"
            + (f"; safetensors {st.median_seconds() * 1e3:.2f} ms" if st else ""),
        )
    for wl in ("a", "b"):
        s = mem.get(wl, "save", "native")
        if s is not None:
            line(s.peak_extra() < 64 * MiB,
                 f"extra memory while saving ({wl}): {s.peak_extra() / MiB:.1f} MiB (< 64 MiB)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke test)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write data (default: a temp dir under /tmp)")
    ap.add_argument("--formats", default="raw,native,safetensors,torch,npz")
    ap.add_argument("--workloads", default="a,b")
    ap.add_argument("--a-count", type=int, default=64)
    ap.add_argument("--a-mib", type=int, default=32)
    ap.add_argument("--b-count", type=int, default=20000)
    ap.add_argument("--drop-caches", action="store_true",
                    help="also drop the whole page cache for cold reads (root)")
    ap.add_argument("--keep", action="store_true", help="keep the data files")
    ap.add_argument("--no-recycle", action="store_true",
                    help="time loads with the default allocator (fresh, page-faulting memory)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = min(args.rounds, 1) if args.rounds != 5 else 1
        args.a_count, args.a_mib, args.b_count = 4, 1, 300

    base = args.dir or tempfile.mkdtemp(prefix="epochal-bench-", dir="/tmp" if os.path.isdir("/tmp") else None)
    work = Path(base)
    work.mkdir(parents=True, exist_ok=True)
    formats = make_formats(args.formats.split(","))
    if not any(f.name == "raw" for f in formats):
        formats.insert(0, Raw())
    res = Results()
    mem = Results()
    t0 = time.perf_counter()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    try:
        wls = args.workloads.split(",")
        if "a" in wls:
            blobs = build_large(args.a_count, args.a_mib)
            if not args.quick:
                touch_memory(3 * sum(v.nbytes for v in blobs.values()))
            run_workload(res, "a", blobs, formats, args.rounds, work, next(iter(blobs)) if args.quick
                         else list(blobs)[len(blobs) // 2], args.drop_caches, mem, not args.no_recycle)
            del blobs
        if "b" in wls:
            blobs = build_small(args.b_count)
            run_workload(res, "b", blobs, formats, args.rounds, work, list(blobs)[len(blobs) // 3 + 1],
                         args.drop_caches, mem, not args.no_recycle)
            del blobs
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"# command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"# formats: {', '.join(f.name for f in formats)}; elapsed {time.perf_counter() - t0:.0f} s")
    if load_before is not None:
        print(f"# load average before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f} "
              f"on {os.cpu_count()} CPUs (other jobs compete for the checksum thread's core)")
    if args.quick:
        print("# --quick: tiny sizes, one round: a smoke test, the figures mean nothing")
    print("\n".join(report(res, args.rounds, mem) + goals(res, mem)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
