"""Background (async) saves against their limits, in one run (figures: bench/RESULTS.md,
"bench_async.py").

A job whose epochs do numpy work (matrix products, ``--compute`` seconds each, then an in-place
update of every weight) and checkpoint ``--mib`` MiB of weights every epoch, run through
``JobRunner`` in three variants, alternated and in rotated order, ``--rounds`` times:

- ``sync``: ``async_save=False``;
- ``async``: ``async_save=True`` as shipped (snapshot arenas reused, switch interval lowered
  while a write is in flight);
- ``async-copy``: ``async`` with the zero-copy write off (the ``zero_copy`` knob, ``epochal.knobs``): the
  O_DIRECT sink copies the arena into its staging buffers, as before the zero-copy write;
- ``async-old``: ``async_save=True`` with the pool bound at 0 (fresh memory for every
  snapshot) and the switch interval left alone;
- ``async-buffered``: ``async`` with arenas below ``tuning.DIRECT_MIN`` written through the
  page cache (``tuning.DIRECT_MIN_PINNED = None``);
- ``memcpy-loop``: no checkpoints; at each epoch's end (where a snapshot is taken) the
  state is copied into allocated, touched arrays: the memcpy the goal compares with, under
  the same conditions (e.g. the BLAS threads of the epoch's matmuls still spinning);
- ``async-stopwarm``: ``async`` with the lease of an arena still being warmed stopping the
  warmer (``SnapshotPool.SHARE_WARMING = False``): a new run's init
  save then faults in the rest of its arena itself instead of alongside the warmer;
- ``async-warm``: ``async`` with the arena prepared and faulted in before ``train``
  (``BackgroundSaver.prepare``, not timed), so that epoch 0's save copies into warm memory.
  (The runner itself prepares the arena as a run with ``async_save`` starts;
  in a new run that is right before the init save, which copies from the
  front while the warmer goes on from the back; a resumed run prepares after its load, an
  epoch before its first save: what ``async-warm`` shows for epoch 0.)

Epoch 0's figure also comes as "train start to epoch 1" (prepare and the init save's
snapshot included) over the sync run's less its own init save.

``--trace`` prints, per epoch of each background run, the wait in the join, the snapshot and
the pool's counters (reused / refitted / allocated / fresh / waited / shared).

Each round also measures, in the same process, a memcpy of the state into memory already
allocated and touched, and into fresh memory (``np.empty`` + copy: first-touch faults).
Reported, as medians of per-round figures (each round's figure is the median over epochs
1..E-1: epoch 0's snapshot allocates the pool, the final epoch is saved synchronously):

- blocked: the time the loop spent between epochs (from an epoch's end to the next epoch's
  start: join of the previous write, commit, snapshot), and its ratio to the two memcpys (goal <= 1.2x
  the allocated one);
- write: the background write alone (``SaveDone.write_ns``), and its ratio to the sync save
  of the same epoch (save and commit; goal <= 1.3x);
- write zero-copy/copy: per round, async's write over async-copy's (< 1: zero copy is faster);
- wall: the whole run's time, sync over async (>1: async is faster);
- RSS: the peak resident memory during ``train`` above the RSS before it, over the state's
  bytes, and the same above the sync run's (what the background save adds; goal <= 1x);
  sampled every 5 ms from /proc/self/statm.

    python bench/bench_async.py --rounds 5            # the figures in bench/RESULTS.md
    python bench/bench_async.py --rounds 5 --torch    # the same with an MLP + AdamW state
    python bench/bench_async.py --gil --rounds 5      # the writer's GIL share (see gil())
    python bench/bench_async.py --quick               # a tiny run that only checks it works
    python bench/bench_async.py --variants sync,async,async-copy   # a subset, rotated
    python bench/bench_async.py --mib 256 --compute 0.3 --epochs 8 --rounds 7 \
        --variants sync,async,async-buffered,async-warm      # writes that outlast the step
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from epochal import (
    CheckpointManager,
    Job,
    JobRunner,
    LocalSession,
    Node,
    RunListener,
    Task,
    Workspace,
    epoch_limiter,
    knobs,
)
from epochal.checkpoint.tasks.background import DEFAULT_SWITCH_INTERVAL, SnapshotPool, process_saver
from epochal.storage.formats.native import image
from epochal.storage.io import tuning

NARRAYS = 8
PINNED_MIN = tuning.DIRECT_MIN_PINNED
VARIANTS = ("sync", "async", "async-copy", "async-old", "async-buffered", "async-stopwarm", "async-warm",
            "memcpy-loop")


class TorchWork:
    """Training steps of the model in ``ws["model"]`` with AdamW ``ws["opt"]`` for about
    ``seconds`` (at least one step)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, ws) -> None:
        import torch

        model, opt = ws["model"], ws["opt"]
        end = time.perf_counter() + self.seconds
        x = torch.ones(8, model[0].in_features)
        while True:
            opt.zero_grad(set_to_none=False)
            model(x).square().mean().backward()
            opt.step()
            if time.perf_counter() >= end:
                break


class Work:
    """Busy numpy work for about ``seconds`` (matrix products), then touch the weights."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, ws) -> None:
        end = time.perf_counter() + self.seconds
        a = ws["a"]
        while time.perf_counter() < end:
            a = np.tanh(a @ a / 384.0)
        for i in range(NARRAYS):
            ws[f"w{i}"] += 1.0


@dataclass
class Times(RunListener):
    """Per epoch: seconds the loop was blocked between epochs (from an epoch's end, or the
    init save's start, to the next epoch's start: the join of the write in flight, commit,
    snapshot), and the checkpoint event's own seconds (for a sync save: save + commit)."""

    blocked: dict[int, float] = field(default_factory=dict)
    saved: dict[int, float] = field(default_factory=dict)
    #: from train's start to epoch 1's (resume lookups, init, prepare, the init save)
    started: float = 0.0
    _at: tuple[int, float] | None = None
    _train: float = 0.0

    def on_train_start(self, resume_from_epoch, nodes) -> None:
        self._train = time.perf_counter()

    def on_checkpoint_start(self, action: str, epoch: int) -> None:
        if action == "checkpoint_save" and epoch == 0:
            self._at = (0, time.perf_counter())

    def on_epoch_end(self, epoch: int, seconds: float) -> None:
        self._at = (epoch, time.perf_counter())

    def on_checkpoint(self, event) -> None:
        if event.action == "checkpoint_save" and event.ok:
            self.saved[event.epoch] = event.seconds

    def on_epoch_start(self, epoch: int) -> None:
        if epoch == 1:
            self.started = time.perf_counter() - self._train
        if self._at is not None:
            self.blocked[self._at[0]] = time.perf_counter() - self._at[1]
            self._at = None


class PeakRSS:
    """The peak resident set size of this process while running (sampled every 5 ms)."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.005)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def make_state(mib: int, use_torch: bool) -> tuple[Workspace, list[np.ndarray], type]:
    """The workspace, numpy views of every byte the checkpoint holds, and the epoch's work.

    numpy: NARRAYS float32 arrays of ``mib`` MiB in all. torch: an MLP of 4 square Linear
    layers with AdamW after one step (weights + two moments: 3x the parameters), ~``mib`` MiB."""
    ws = Workspace()
    if not use_torch:
        n = mib * (1 << 20) // 4 // NARRAYS
        for i in range(NARRAYS):
            ws[f"w{i}"] = np.full(n, float(i), dtype=np.float32)
        ws["a"] = np.random.default_rng(0).normal(size=(384, 384))
        return ws, [ws[f"w{i}"] for i in range(NARRAYS)], Work
    import torch

    width = int((mib * (1 << 20) / 12 / 4) ** 0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ws["model"], ws["opt"] = model, opt
    TorchWork(0.0)(ws)  # the moments exist from here on
    tensors = [*model.state_dict().values()]
    tensors += [t for st in opt.state.values() for t in st.values() if t.dim()]
    return ws, [t.detach().numpy() for t in tensors], TorchWork


class Trace:
    """Per snapshot and join of the process saver: seconds and the pool's counters."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.joins: list[float] = []
        self.snaps: list[float] = []

    def install(self, saver) -> None:
        snapshot, join = type(saver).snapshot, type(saver).join

        def traced_snapshot(owner, blobs):
            t = time.perf_counter()
            snap = snapshot(saver, owner, blobs)
            dt = time.perf_counter() - t
            p = saver.pool
            self.snaps.append(dt)
            self.lines.append(f"snapshot {dt * 1e3:6.1f} ms  pool reused {p.reused} refitted {p.refitted} "
                              f"allocated {p.allocated} fresh {p.fresh} waited {p.waited} shared {p.shared} "
                              f"({p.pooled_bytes >> 20} of {p.limit >> 20} MiB)")
            return snap

        def traced_join(db):
            t = time.perf_counter()
            done = join(saver, db)
            dt = time.perf_counter() - t
            self.joins.append(dt)
            self.lines.append(f"join     {dt * 1e3:6.1f} ms  (its write {done.write_ns / 1e6:.0f} ms)")
            return done

        saver.snapshot, saver.join = traced_snapshot, traced_join

    def remove(self, saver) -> None:
        for name in ("snapshot", "join"):
            saver.__dict__.pop(name, None)


def run(directory: str, ws: Workspace, work: type, epochs: int, compute: float, variant: str,
        trace: bool = False) -> dict[str, float]:
    """One training run of ``variant``; its per-epoch medians (seconds) and the peak extra RSS."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    saver = process_saver()
    old = variant == "async-old"
    saver.pool.max_host_bytes = 0 if old else None
    saver.switch_interval = None if old else DEFAULT_SWITCH_INTERVAL
    saver.recent.clear()
    tuning.DIRECT_MIN_PINNED = None if variant == "async-buffered" else PINNED_MIN
    SnapshotPool.SHARE_WARMING = variant != "async-stopwarm"
    image.stats.reset()
    with Node("n"):
        with Job() as job:
            Task(step=work(compute))
            epoch_limiter(job, epochs)
    if variant == "async-warm":  # the arena the runner's snapshots will take, faulted in now
        names = [k for k in ws.keys() if not k.startswith("__")]
        saver.prepare(f"n@{directory}", {k: ws[k] for k in names})
        saver.pool.wait_warm()  # this arena's own warming (a counter of every run would not
        # wait from the second async-warm run of a process on: epoch 0 would copy mid-warming)
    if variant == "memcpy-loop":
        return loop_memcpy(ws, job, epochs)
    tr = Trace() if trace else None
    if tr is not None:
        tr.install(saver)
    times = Times()
    rss = PeakRSS()
    base = rss.rss()
    start = time.perf_counter()
    try:
        with rss, knobs.override(zero_copy=variant != "async-copy"):
            JobRunner(job, CheckpointManager(directory, "n"), listeners=[times], progress=False,
                      async_save=variant != "sync").train(LocalSession(ws))
    finally:
        if tr is not None:
            tr.remove(saver)
    wall = time.perf_counter() - start
    steady = range(1, epochs)  # epoch 0 allocates the pool; the final epoch is saved in sync
    out = {
        "blocked": statistics.median(times.blocked[e] for e in steady),
        "first": times.blocked[0],
        "started": times.started,
        "save0": times.saved.get(0, 0.0),
        "saved": statistics.median(times.saved[e] for e in steady),
        "rss": float(rss.peak - base),
        "wall": wall,
    }
    if variant != "sync":  # the writes joined: epochs 0..E-1, in order
        done = list(saver.recent)[1:epochs]
        out["write"] = statistics.median(d.write_ns / 1e9 for d in done)
        out["snapshot"] = statistics.median(d.snapshot_ns / 1e9 for d in done)
        out["zero_copy"] = image.stats.taken  # native writes from the arena, of epochs + 1
    if tr is not None:
        print(f"  trace of {variant}:\n    " + "\n    ".join(tr.lines), flush=True)
        out["join"] = statistics.median(tr.joins) if tr.joins else 0.0
    return out


class LoopCopy(RunListener):
    """At each epoch's end, copy the state into allocated, touched arrays (timed)."""

    def __init__(self, ws: Workspace, names: list[str]) -> None:
        self.src = [ws[k] for k in names]
        self.dst = [np.empty_like(a) for a in self.src]
        for d in self.dst:
            d.fill(0)
        self.seconds: list[float] = []

    def on_epoch_end(self, epoch: int, seconds: float) -> None:
        t = time.perf_counter()
        for s, d in zip(self.src, self.dst):
            np.copyto(d, s)
        self.seconds.append(time.perf_counter() - t)


def loop_memcpy(ws: Workspace, job: Job, epochs: int) -> dict[str, float]:
    copy = LoopCopy(ws, [k for k in ws.keys() if not k.startswith("__")])
    JobRunner(job, None, listeners=[copy], progress=False).train(LocalSession(ws))
    return {"alloc": statistics.median(copy.seconds[1:])}


def memcpys(src: list[np.ndarray], reps: int = 3) -> tuple[float, float]:
    """Seconds to copy the state into memory already touched, and into fresh memory."""
    dst = [np.empty_like(a) for a in src]
    for d in dst:
        d.fill(0)
    alloc, fresh = [], []
    for _ in range(reps):
        t = time.perf_counter()
        for s, d in zip(src, dst):
            np.copyto(d, s)
        alloc.append(time.perf_counter() - t)
        t = time.perf_counter()
        new = [np.empty_like(s) for s in src]
        for s, d in zip(src, new):
            np.copyto(d, s)
        fresh.append(time.perf_counter() - t)
        del new
    return statistics.median(alloc), statistics.median(fresh)


# ---------------------------------------------------------------- --gil: the writer's share
def _load(kind: str, stop: threading.Event) -> None:
    """Training-thread stand-ins: a pure-Python loop (holds the GIL) or the numpy loop."""
    a = np.random.default_rng(0).normal(size=(384, 384))
    while not stop.is_set():
        if kind == "numpy":
            a = np.tanh(a @ a / 384.0)
        else:
            x = 0
            for i in range(10_000):
                x += i


def _write_from_shm(name: str, shapes: list[tuple[int, ...]], path: str) -> None:
    """(In a worker process) write the arrays laid out in shared memory ``name``."""
    from multiprocessing import shared_memory

    from epochal.storage.formats.native.write import write_native

    shm = shared_memory.SharedMemory(name=name)
    at, blobs = 0, {}
    for i, shape in enumerate(shapes):
        arr = np.ndarray(shape, dtype=np.float32, buffer=shm.buf, offset=at)
        blobs[f"w{i}"] = arr
        at += arr.nbytes
    write_native(path, blobs)
    del blobs, arr
    shm.close()


def gil(arrays: list[np.ndarray], directory: str, rounds: int) -> None:
    """The background write of the state while another thread runs Python or numpy work:
    from this process's writer thread at the default switch interval (5 ms) and at the
    saver's (0.5 ms), and from a worker process reading shared memory (no GIL shared), each
    over a sync save with the main thread idle; variants rotated, medians of paired ratios."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import shared_memory

    from epochal.checkpoint.tasks.background import BackgroundSaver

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "n.1")
    blobs = {f"w{i}": x for i, x in enumerate(arrays)}
    total = sum(x.nbytes for x in arrays)
    shm = shared_memory.SharedMemory(create=True, size=total)
    at = 0
    for x in arrays:
        np.ndarray(x.shape, dtype=x.dtype, buffer=shm.buf, offset=at)[...] = x
        at += x.nbytes
    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
    pool.submit(time.sleep, 0).result()  # started before the timing
    from epochal.storage.formats.native.write import write_native

    def thread(interval: float) -> float:
        saver = BackgroundSaver(switch_interval=interval)
        snap = saver.snapshot("n", blobs)  # not timed: the process variant's copy is made
        t = time.perf_counter()
        saver.start(path, "native", snap)
        saver.join(path)
        elapsed = time.perf_counter() - t
        saver.close()
        return elapsed

    def process() -> float:
        t = time.perf_counter()
        pool.submit(_write_from_shm, shm.name, [x.shape for x in arrays], path).result()
        return time.perf_counter() - t

    variants = {"thread, 5 ms": lambda: thread(0.005), "thread, 0.5 ms": lambda: thread(0.0005),
                "process, shm": process}
    try:
        for kind in ("python", "numpy"):
            ratios: dict[str, list[float]] = {k: [] for k in variants}
            for r in range(rounds):
                keys = list(variants)
                for k in keys[r % 3:] + keys[: r % 3]:
                    t = time.perf_counter()
                    write_native(path, blobs)
                    sync = time.perf_counter() - t
                    stop = threading.Event()
                    th = threading.Thread(target=_load, args=(kind, stop))
                    th.start()
                    ratios[k].append(variants[k]() / sync)
                    stop.set()
                    th.join()
            print(f"training thread running {kind}: background write / sync save (N={rounds}): "
                  + ", ".join(f"{k} {statistics.median(v):.2f}x" for k, v in ratios.items()), flush=True)
    finally:
        pool.shutdown()
        shm.close()
        shm.unlink()


def _added(x: dict[str, float], g: dict[str, dict[str, float]]) -> float:
    """What a background run's start (train start to epoch 1: prepare and the init save's
    snapshot included) took over the sync run's less its init save (save and commit)."""
    return x["started"] - (g["sync"]["started"] - g["sync"]["save0"])


def describe(rows: list[dict[str, dict[str, float]]], v: str, state_bytes: int) -> str:
    """The summary line of background variant ``v`` (medians of per-round figures)."""

    def med(fn) -> float:
        return statistics.median(fn(g[v], g) for g in rows)

    def spread(fn) -> str:
        xs = [fn(g[v], g) for g in rows]
        return f"{min(xs):.2f}-{max(xs):.2f}"

    return (f"blocked {med(lambda x, g: x['blocked']) * 1e3:.0f} ms/epoch "
            f"(snapshot {med(lambda x, g: x['snapshot']) * 1e3:.0f} ms) = "
            f"{med(lambda x, g: x['blocked'] / g['memcpy']['alloc']):.2f}x memcpy-alloc "
            f"({spread(lambda x, g: x['blocked'] / g['memcpy']['alloc'])}), "
            f"epoch 0 {med(lambda x, g: x['first'] / g['memcpy']['alloc']):.2f}x "
            f"({spread(lambda x, g: x['first'] / g['memcpy']['alloc'])}) "
            f"[train start to epoch 1 {med(lambda x, g: x['started']) * 1e3:.0f} ms, "
            f"{med(lambda x, g: _added(x, g) / g['memcpy']['alloc']):.2f}x memcpy-alloc over sync's "
            f"less its save ({spread(lambda x, g: _added(x, g) / g['memcpy']['alloc'])})], "
            f"{med(lambda x, g: x['blocked'] / g['memcpy']['fresh']):.2f}x memcpy-fresh; "
            + (f"{med(lambda x, g: x['blocked'] / g['memcpy-loop']['alloc']):.2f}x the memcpy in the loop "
               f"({spread(lambda x, g: x['blocked'] / g['memcpy-loop']['alloc'])}), epoch 0 "
               f"{med(lambda x, g: x['first'] / g['memcpy-loop']['alloc']):.2f}x "
               f"({spread(lambda x, g: x['first'] / g['memcpy-loop']['alloc'])}); "
               if "memcpy-loop" in rows[0] else "") +
            f"write {med(lambda x, g: x['write']) * 1e3:.0f} ms = "
            f"{med(lambda x, g: x['write'] / g['sync']['saved']):.2f}x sync save; "
            f"peak extra RSS {med(lambda x, g: x['rss'] / state_bytes):.2f}x the state "
            f"({med(lambda x, g: (x['rss'] - g['sync']['rss']) / state_bytes):.2f}x over the sync run's)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--compute", type=float, default=1.5, help="seconds of numpy work per epoch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None)
    p.add_argument("--torch", action="store_true", help="an MLP + AdamW state instead of arrays")
    p.add_argument("--gil", action="store_true", help="only the writer's GIL share (see gil())")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--trace", action="store_true", help="per epoch: join, snapshot, pool counters")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated subset of " + ", ".join(VARIANTS) + " (sync is always run)")
    a = p.parse_args(argv)
    variants = tuple(v for v in VARIANTS if v == "sync" or v in a.variants.split(","))
    if a.quick:
        a.mib, a.epochs, a.compute, a.rounds = 8, 3, 0.05, 1
    base = a.dir or tempfile.mkdtemp(prefix="epochal-bench-async-", dir="/tmp")
    ws, arrays, work = make_state(a.mib, a.torch)
    state_bytes = sum(x.nbytes for x in arrays)
    if a.gil:
        gil([x.reshape(-1).view(np.float32) if x.dtype == np.float32 else x for x in arrays],
            base, a.rounds)
        shutil.rmtree(base, ignore_errors=True)
        return 0
    rows: list[dict[str, dict[str, float]]] = []
    for r in range(a.rounds):
        nv = len(variants)
        order = list(variants[r % nv:] + variants[: r % nv])
        got: dict[str, dict[str, float]] = {}
        for i, variant in enumerate(order):
            if i == r % 2:  # the memcpys at a rotating place among the runs
                alloc, fresh = memcpys(arrays)
                got["memcpy"] = {"alloc": alloc, "fresh": fresh}
            got[variant] = run(os.path.join(base, "ckpt"), ws, work, a.epochs, a.compute, variant, a.trace)
        rows.append(got)
        m = got["memcpy"]
        print(f"round {r}: memcpy alloc {m['alloc'] * 1e3:.0f} ms fresh {m['fresh'] * 1e3:.0f} ms; "
              + "; ".join(f"{v}: blocked {got[v]['blocked'] * 1e3:.0f} ms (epoch 0 {got[v]['first'] * 1e3:.0f})"
                          + (f" snapshot {got[v]['snapshot'] * 1e3:.0f} ms write {got[v]['write'] * 1e3:.0f} ms"
                             if "write" in got[v] else
                             f" save {got[v]['saved'] * 1e3:.0f} ms")
                          + f" rss +{got[v]['rss'] / 2**20:.0f} MiB"
                          + (f" zero-copy {got[v]['zero_copy']}" if "zero_copy" in got[v] else "")
                          for v in variants if v != "memcpy-loop")
              + (f"; memcpy in the loop {got['memcpy-loop']['alloc'] * 1e3:.0f} ms" if "memcpy-loop" in got else ""),
              flush=True)
    shutil.rmtree(base, ignore_errors=True)

    def med(fn) -> float:
        return statistics.median(fn(g) for g in rows)

    print(f"\n{state_bytes / 2**20:.0f} MiB {'torch MLP + AdamW' if a.torch else 'numpy'} state, {a.epochs} epochs of {a.compute} s compute, "
          f"N={a.rounds} rounds (medians of per-round figures):")
    print(f"  memcpy into allocated memory {med(lambda g: g['memcpy']['alloc']) * 1e3:.0f} ms, "
          f"into fresh memory {med(lambda g: g['memcpy']['fresh']) * 1e3:.0f} ms; "
          f"sync save {med(lambda g: g['sync']['saved']) * 1e3:.0f} ms"
          + (f"; in the loop (memcpy-loop) {med(lambda g: g['memcpy-loop']['alloc']) * 1e3:.0f} ms"
             if "memcpy-loop" in variants else ""))
    bg = [v for v in variants[1:] if v != "memcpy-loop"]
    for v in bg:
        print(f"  {v:10s}: " + describe(rows, v, state_bytes))
    if "async" in variants and "async-copy" in variants:
        print(f"  write zero-copy/copy (async over async-copy, paired per round): "
              f"{med(lambda g: g['async']['write'] / g['async-copy']['write']):.2f}x")
    print("  median sync/async wall-time ratio: " + ", ".join(
        f"{v} {med(lambda g, v=v: g['sync']['wall'] / g[v]['wall']):.2f}" for v in bg))
    print(f"  sync     : peak extra RSS {med(lambda g: g['sync']['rss'] / state_bytes):.2f}x the state")
    return 0


if __name__ == "__main__":
    sys.exit(main())
