#!/usr/bin/env python
"""Paired A/B benchmark of two source trees of epochal (e.g. main before a refactor and the
branch after it): same workloads, same disk, alternating subprocesses.

Every round runs one worker subprocess per tree (order alternating by round); each worker
imports epochal from its tree's ``src`` (PYTHONPATH), builds the workloads in memory (not
timed) and times, once each:

* (a) ``--a-count`` float32 arrays of 32 MiB: native save (durable), load warm, load cold
  (file evicted from the page cache), partial load of one array;
* (b) ``--b-count`` float32 arrays of 1-64 KiB (log-uniform): native save, load warm, load
  cold, partial load of one array; safetensors save and warm load;
* (t) a torch model of ``--torch-mib`` MiB float32 + one Adam step (3x that written):
  native save, fresh load, load into the live model + optimizer (in place); skipped
  without torch.

With ``--repeat K`` each step runs K times per worker and the fastest counts (filters the
spikes of a shared machine). Reported per step: the median over rounds of the per-round paired ratio B time / A time
(< 1: B faster), with the medians of the times. Both trees write the same file names in
one data directory, so both read the same disk locations.

    .venv/bin/python bench/bench_ab.py --a /work/wt-storage-base --b . --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20


REPEAT = 1


def _timed(fn: Any, before: Any = None) -> float:
    """The fastest of REPEAT runs of ``fn`` (``before`` runs untimed ahead of each)."""
    best = float("inf")
    for _ in range(REPEAT):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _native_steps(native: Any, evict: Any, tag: str, path: str, blobs: dict[str, Any], out: dict[str, float]) -> None:
    out[f"{tag} save"] = _timed(lambda: native.write(path, blobs))
    native.read(path)  # warm the page cache and the allocator
    out[f"{tag} load warm"] = _timed(lambda: native.read(path))
    out[f"{tag} load cold"] = _timed(lambda: native.read(path), lambda: evict(path))
    one = next(iter(blobs))
    out[f"{tag} partial"] = _timed(lambda: native.read(path, [one]))


def worker(args: argparse.Namespace) -> None:
    """Run every step once with the epochal found on sys.path; print {step: seconds}."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _measure import evict, recycle_memory

    from epochal.storage.formats.base import get_db_type

    global REPEAT
    REPEAT = args.repeat
    recycle_memory()
    native, st = get_db_type("native"), get_db_type("safetensors")
    work = Path(args.dir)
    out: dict[str, float] = {}
    rng = np.random.default_rng(0)
    a = {f"w{i:03d}": rng.standard_normal(8 * MiB, dtype=np.float32) for i in range(args.a_count if "a" in args.only else 0)}
    sizes = np.exp(rng.uniform(np.log(1024), np.log(64 * 1024), args.b_count)).astype(np.int64) // 4
    b = {f"s{i:05d}": rng.standard_normal(int(n), dtype=np.float32) for i, n in enumerate(sizes)}
    for tag, blobs in (("a", a), ("b", b)):
        if tag in args.only:
            _native_steps(native, evict, tag, str(work / f"{tag}.native"), blobs, out)
    path = str(work / "b.safetensors")
    if "b" in args.only:
        out["b safetensors save"] = _timed(lambda: st.write(path, b))
        st.read(path)
        out["b safetensors load"] = _timed(lambda: st.read(path))
    a.clear()
    b.clear()
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or "t" not in args.only:
        print(json.dumps(out))
        return
    torch.manual_seed(0)
    width = 2048
    layers = max(1, args.torch_mib * MiB // (width * width * 4))

    def make() -> tuple[Any, Any]:
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model(torch.randn(4, width)).sum().backward()
        opt.step()
        return model, opt

    model, opt = make()
    path = str(work / "t.native")
    out["t save"] = _timed(lambda: native.write(path, {"model": model, "opt": opt}))
    native.read(path)
    out["t load fresh"] = _timed(lambda: native.read(path))
    live_m, live_o = make()
    native.read(path, existing={"model": live_m, "opt": live_o})
    out["t load in place"] = _timed(lambda: native.read(path, existing={"model": live_m, "opt": live_o}))
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="tree A (the baseline): a checkout with src/epochal")
    ap.add_argument("--b", required=True, help="tree B (the change)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dir", default="/tmp/epochal_bench_ab")
    ap.add_argument("--a-count", type=int, default=16)
    ap.add_argument("--b-count", type=int, default=20000)
    ap.add_argument("--torch-mib", type=int, default=256)
    ap.add_argument("--only", default="abt", help="workloads to run (letters of a, b, t)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each step per worker; the fastest counts")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    trees = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    os.makedirs(args.dir, exist_ok=True)
    times: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    t_start = time.time()
    try:
        for r in range(args.rounds):
            order = ["A", "B"] if r % 2 == 0 else ["B", "A"]
            for tag in order:
                env = dict(os.environ, PYTHONPATH=os.path.join(trees[tag], "src"))
                cmd = [sys.executable, __file__, "--worker", "--a", args.a, "--b", args.b, "--dir", args.dir,
                       "--a-count", str(args.a_count), "--b-count", str(args.b_count),
                       "--torch-mib", str(args.torch_mib), "--only", args.only, "--repeat", str(args.repeat)]
                res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                for step, sec in json.loads(res.stdout.strip().splitlines()[-1]).items():
                    times[tag].setdefault(step, []).append(sec)
            print(f"round {r + 1}/{args.rounds} done ({time.time() - t_start:.0f} s)", file=sys.stderr)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(f"# A = {trees['A']}, B = {trees['B']}; N = {args.rounds} rounds, alternating order; "
          f"(a) {args.a_count} x 32 MiB, (b) {args.b_count} small arrays, (t) {args.torch_mib} MiB model + Adam; "
          f"workloads {args.only}, fastest of {args.repeat} per step and worker")
    print("| step | A median s | B median s | B/A paired median | B/A min..max |")
    print("|---|---:|---:|---:|---|")
    for step in times["A"]:
        ta, tb = times["A"][step], times["B"][step]
        ratios = [y / x for x, y in zip(ta, tb)]
        print(f"| {step} | {statistics.median(ta):.3f} | {statistics.median(tb):.3f} | "
              f"{statistics.median(ratios):.2f} | {min(ratios):.2f}..{max(ratios):.2f} |")


if __name__ == "__main__":
    main()
