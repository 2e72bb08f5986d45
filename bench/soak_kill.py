"""Crash-safety soak: SIGKILL a training subprocess hundreds of times, mostly inside saves.

Each trial kills the job (tests/_crash_job.py) ``--kills`` times on one directory, checking
after every kill that the directory holds only complete dbs and intact committed epochs, that
the rerun resumes from the newest committed epoch with exactly the state an uninterrupted run
had there, and at the end that the finished job is bit-identical to an uninterrupted run.
Retention policies rotate across trials. ``make test`` runs 32 kills (tests/test_kill.py).

    .venv/bin/python bench/soak_kill.py --kills-total 300 --workers 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import _crash_job as cj  # noqa: E402

POLICIES = ([], ["--keep-last", "2"], ["--keep-every", "2", "--keep-last", "1"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills-total", type=int, default=300)
    p.add_argument("--kills", type=int, default=3, help="kills per trial")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--mb", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = p.parse_args()
    job_args = ["--epochs", str(args.epochs), "--mb", str(args.mb), "--epoch-ms", "10"]
    root = args.dir or tempfile.mkdtemp(prefix="epochal-soak-")
    os.makedirs(root, exist_ok=True)
    start = time.perf_counter()
    ref = cj.reference_run(os.path.join(root, "reference"), job_args)
    print(f"reference: {len(ref.epochs) - 1} epochs, save ~{ref.save_seconds * 1000:.0f} ms, "
          f"run {ref.run_seconds:.2f} s", flush=True)
    trials = -(-args.kills_total // args.kills)

    def trial(i: int) -> cj.TrialResult:
        d = os.path.join(root, f"trial{i}")
        res = cj.run_trial(d, job_args + POLICIES[i % len(POLICIES)], ref, seed=args.seed * 100003 + i,
                           kills=args.kills)
        shutil.rmtree(d, ignore_errors=True)
        return res

    results = []
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        for n, r in enumerate(pool.map(trial, range(trials)), 1):
            results.append(r)
            for e in r.errors:
                print("ERROR", e, flush=True)
            if n % 10 == 0:
                print(f"{n}/{trials} trials, {sum(x.kills for x in results)} kills", flush=True)
    took = time.perf_counter() - start
    kills = sum(r.kills for r in results)
    in_save = sum(r.kills_in_save for r in results)
    mid_write = sum(r.kills_leaving_temp for r in results)
    resumes = sum(1 for r in results for e in r.resumes if e is not None)
    errors = sum(len(r.errors) for r in results)
    print(f"trials={trials} kills={kills} inside_save={in_save} left_temp_file={mid_write} "
          f"resumes={resumes} errors={errors} seconds={took:.0f}")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
