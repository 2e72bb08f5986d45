"""Background (async) saves vs synchronous saves: wall time of a training run.

A job whose epochs do numpy work (matrix products, ``--compute`` seconds each) and
checkpoint ``--mib`` MiB of weights every epoch, run with ``JobRunner(async_save=False)`` and
``async_save=True`` in alternation, ``--rounds`` times. Reported: the median of the paired
ratios sync/async of whole-run wall time (>1: async is faster), and the time the training
loop spent blocked on checkpoints in each mode.

    python bench/bench_async.py --rounds 5            # the figures in bench/RESULTS.md
    python bench/bench_async.py --quick               # a tiny run that only checks it works
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from epochal import (
    CheckpointManager,
    Job,
    JobRunner,
    LocalSession,
    Node,
    RunListener,
    Task,
    epoch_limiter,
)


class Init:
    def __init__(self, mib: int) -> None:
        self.mib = mib

    def __call__(self, ws) -> None:
        n = self.mib * (1 << 20) // 4 // 8
        for i in range(8):
            ws[f"w{i}"] = np.full(n, float(i), dtype=np.float32)
        ws["a"] = np.random.default_rng(0).normal(size=(384, 384))


class Work:
    """Busy numpy work for about ``seconds`` (matrix products), then touch the weights."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, ws) -> None:
        end = time.perf_counter() + self.seconds
        a = ws["a"]
        while time.perf_counter() < end:
            a = np.tanh(a @ a / 384.0)
        for i in range(8):
            ws[f"w{i}"] += 1.0


class Blocked(RunListener):
    """Sums the time the loop spent in checkpoint calls (start to committed event)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t: float | None = None

    def on_checkpoint_start(self, action: str, epoch: int) -> None:
        self._t = time.perf_counter()

    def on_epoch_start(self, epoch: int) -> None:
        if self._t is not None:
            self.seconds += time.perf_counter() - self._t
            self._t = None


def run(directory: str, mib: int, epochs: int, compute: float, async_save: bool) -> tuple[float, float]:
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    with Node("n"):
        with Job() as job:
            with job.init_group:
                Task(step=Init(mib))
            Task(step=Work(compute))
            epoch_limiter(job, epochs)
    blocked = Blocked()
    start = time.perf_counter()
    JobRunner(job, CheckpointManager(directory, "n"), listeners=[blocked], progress=False,
              async_save=async_save).train(LocalSession())
    return time.perf_counter() - start, blocked.seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--compute", type=float, default=1.5, help="seconds of numpy work per epoch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.mib, a.epochs, a.compute, a.rounds = 4, 3, 0.05, 1
    base = a.dir or tempfile.mkdtemp(prefix="epochal-bench-async-", dir="/tmp")
    ratios, rows = [], []
    for r in range(a.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        got = {mode: run(os.path.join(base, "ckpt"), a.mib, a.epochs, a.compute, mode) for mode in order}
        ratios.append(got[False][0] / got[True][0])
        rows.append((r, got[False], got[True]))
        print(f"round {r}: sync {got[False][0]:6.2f} s (blocked {got[False][1]:5.2f} s)   "
              f"async {got[True][0]:6.2f} s (blocked {got[True][1]:5.2f} s)   ratio {ratios[-1]:.2f}", flush=True)
    shutil.rmtree(base, ignore_errors=True)
    print(f"{a.mib} MiB checkpoint, {a.epochs} epochs of {a.compute} s compute, {a.rounds} rounds: "
          f"median sync/async wall-time ratio {statistics.median(ratios):.2f}; blocked on checkpoints: "
          f"sync {statistics.median(r[1][1] for r in rows):.2f} s, async {statistics.median(r[2][1] for r in rows):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
