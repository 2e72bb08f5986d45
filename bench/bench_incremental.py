"""Incremental saves: bytes written per save against bytes changed, save time, and the restore
time of a step whose bytes span many older steps against a full step's.

Two runs through ``Checkpointer(incremental=True)`` on this disk: a LoRA-style state (a
frozen base of >= 95% of the bytes, adapters that change every step) and an embedding table
of which 2% of the rows (at random) change every step. Each is compared with the same saves
written whole, in paired rounds (the order flipped each round); wall times, and the
process's CPU time (all its threads: on a loaded machine, the work done). Usage:
``python bench/bench_incremental.py [--mb 256] [--steps 8] [--rounds 3] [--cold] [--dim 256]
[--only lora|embedding]`` (``--cold``:
each restore reads the directory's files from the disk, not the page cache; best of 3).

``--long 30 [--sources 8 16]``: one run of that many steps of the embedding table per
compaction bound (the ``incremental_sources`` knob; ``incremental_pieces`` scaled with it):
the bytes written per save over the whole run against the bytes that changed, how many saves
rewrote the table whole, and the restore time of every step against a full file's of the
same size (alternated, best of 3 each), its median and its worst.

``--runner``: a JobRunner job (one node, the embedding table, ``--steps`` epochs, incremental
dbs) run whole by ``train()``, its nodes' saves comparing with the bytes they kept against
reading their base (the ``kept_bytes`` knob at 0), alternated over ``--rounds``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

import epochal as ep

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import evict  # noqa: E402

from epochal import knobs  # noqa: E402

#: restores read cold (``--cold``)
COLD = False
#: the embedding table's row width in float32 values (``--dim``; 256: rows of 1 KiB)
DIM = 256


def lora(mb: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal(mb * (1 << 20) // 4).astype(np.float32)
    adapter = np.random.default_rng(step).standard_normal(base.size // 50).astype(np.float32)  # 2%
    return {"base": base, "adapter": adapter}


def embedding(mb: int, step: int, dim: int = 0) -> dict[str, np.ndarray]:
    dim = dim or DIM
    rows = mb * (1 << 20) // (4 * dim)
    emb = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    for s in range(1, step + 1):
        emb[np.random.default_rng(s).choice(rows, rows // 50, replace=False)] += np.float32(s)
    return {"emb": emb}


def changed_bytes(make, mb: int, step: int) -> int:
    a, b = make(mb, step - 1), make(mb, step)
    return sum(int(np.count_nonzero((a[k] != b[k]).reshape(len(a[k]), -1).any(axis=1)))
               * (a[k].nbytes // len(a[k])) if a[k].ndim > 1 else int((a[k] != b[k]).sum()) * a[k].itemsize
               for k in a)


def run(make, mb: int, steps: int, incremental: bool) -> tuple[list[int], list[float], float, str, list[float], float]:
    d = tempfile.mkdtemp(prefix="bench_incr_")
    sizes, times, cpus = [], [], []
    states = [make(mb, s) for s in range(1, steps + 1)]
    with ep.Checkpointer(d, incremental=incremental, progress=False) as ck:
        for s, st in enumerate(states, 1):
            t, c = time.perf_counter(), time.process_time()
            ck.save(s, st)
            times.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
            sizes.append(os.path.getsize(os.path.join(d, f"local.{s}")))
    target = {k: np.zeros_like(v) for k, v in states[-1].items()}
    best, best_cpu = float("inf"), float("inf")
    for _ in range(3):  # warm cache: the cost of following references, not of the disk
        if COLD:  # (--cold: every file of the directory dropped from the page cache first)
            for f in os.listdir(d):
                if os.path.isfile(os.path.join(d, f)):
                    evict(os.path.join(d, f))
        with ep.Checkpointer(d, progress=False) as ck:
            t, c = time.perf_counter(), time.process_time()
            ck.restore(target)
            best = min(best, time.perf_counter() - t)
            best_cpu = min(best_cpu, time.process_time() - c)
    assert all(np.array_equal(target[k], states[-1][k]) for k in target)
    return sizes, times, best, d, cpus, best_cpu


def _restore_ms(d: str, step: int, target: dict[str, np.ndarray]) -> float:
    best = float("inf")
    for _ in range(3):
        with ep.Checkpointer(d, progress=False) as ck:
            t = time.perf_counter()
            ck.restore(target, step=step)
            best = min(best, time.perf_counter() - t)
    return best * 1e3


def long_run(mb: int, steps: int, sources: int) -> None:
    """``steps`` saves of the embedding table under the compaction bound ``sources`` (module doc)."""
    rows = mb * (1 << 20) // (4 * DIM)
    emb = np.random.default_rng(0).standard_normal((rows, DIM)).astype(np.float32)
    d, full = tempfile.mkdtemp(prefix="bench_incr_long_"), tempfile.mkdtemp(prefix="bench_incr_full_")
    written, changed, times, states = [], [], [], {}
    try:
        with knobs.override(incremental_sources=sources, incremental_pieces=2048 * sources // 8), \
                ep.Checkpointer(d, incremental=True, progress=False) as ck:
            for s in range(1, steps + 1):
                if s > 1:
                    pick = np.random.default_rng(s).choice(rows, rows // 50, replace=False)
                    emb[pick] += np.float32(s)
                    changed.append(len(pick) * DIM * 4)
                t = time.perf_counter()
                ck.save(s, {"emb": emb})
                times.append(time.perf_counter() - t)
                written.append(os.path.getsize(os.path.join(d, f"local.{s}")))
                states[s] = hash(emb.tobytes())
        with ep.Checkpointer(full, progress=False) as ck:
            ck.save(steps, {"emb": emb})
        target = {"emb": np.zeros_like(emb)}
        ratios, incr_ms, full_ms = [], [], []
        for s in range(2, steps + 1):  # alternated: incremental step s, then the full file
            incr_ms.append(_restore_ms(d, s, target))
            assert hash(target["emb"].tobytes()) == states[s], s
            full_ms.append(_restore_ms(full, steps, target))
            ratios.append(incr_ms[-1] / full_ms[-1])
        w = np.array(written[1:], dtype=np.float64)
        whole = int((w >= emb.nbytes).sum())
        print(f"embedding 2% rows of {DIM * 4} bytes ({mb} MiB), {steps} saves, incremental_sources={sources}")
        print(f"  written per save (steps 2-{steps}): mean {w.mean() / 2**20:.2f} MiB = "
              f"{w.sum() / sum(changed):.2f}x the bytes changed ({np.mean(changed) / 2**20:.2f} MiB); "
              f"{whole} of {steps - 1} saves rewrote the table whole; median save "
              f"{np.median(times[1:]) * 1e3:.1f} ms, longest {max(times[1:]) * 1e3:.1f} ms")
        print(f"  restore of each step / a full file's: median {np.median(ratios):.2f}x, worst {max(ratios):.2f}x")
        print("  per step (written MiB, restore ms incremental / full): " + ", ".join(
            f"{s}: {w[s - 2] / 2**20:.1f}, {incr_ms[s - 2]:.0f}/{full_ms[s - 2]:.0f}" for s in range(2, steps + 1)))
    finally:
        shutil.rmtree(d)
        shutil.rmtree(full)


def runner_run(mb: int, epochs: int, kept: bool) -> tuple[float, float, float]:
    """Wall and CPU seconds of one ``train()`` of the JobRunner job (module doc), and the
    median of its saves after the first two (the runner's events: incremental ones)."""
    from epochal import (
        Cluster,
        DirectoryMetadataHandler,
        Job,
        JobRunner,
        LocalSession,
        MultiNodeCheckpointManager,
        Node,
        RunListener,
        Task,
        Workspace,
        epoch_limiter,
    )

    saves: list[float] = []

    class Saves(RunListener):
        def on_checkpoint(self, event) -> None:
            if event.action == "checkpoint_save" and event.ok:
                saves.append(event.seconds)

    rows = mb * (1 << 20) // (4 * DIM)
    d = tempfile.mkdtemp(prefix="bench_incr_runner_")

    def init(w):
        w["emb"] = np.random.default_rng(0).standard_normal((rows, DIM)).astype(np.float32)
        w["e"] = np.int64(0)

    def step(w):
        e = int(w["e"]) + 1
        w["emb"][np.random.default_rng(e).choice(rows, rows // 50, replace=False)] += np.float32(e)
        w["e"] = np.int64(e)

    try:
        with Cluster():
            with Job(nodes_to_checkpoint=["n0"]) as job:
                with Node("n0"):
                    with job.init_group:
                        Task(step=init)
                    epoch_limiter(job, epochs)
                    Task(step=step)
            manager = MultiNodeCheckpointManager(d, "native", metadata_handler=DirectoryMetadataHandler(incremental=True))
            with knobs.override(kept_bytes=(2 << 30) if kept else 0):
                t, c = time.perf_counter(), time.process_time()
                JobRunner(job, manager, listeners=[Saves()], progress=False).train(LocalSession(Workspace()))
                return time.perf_counter() - t, time.process_time() - c, float(np.median(saves[2:]))
    finally:
        shutil.rmtree(d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true",
                    help="restore with the directory's files dropped from the page cache (fsync + DONTNEED)")
    ap.add_argument("--dim", type=int, default=256, help="the embedding's row width (float32 values)")
    ap.add_argument("--only", choices=("lora", "embedding"), help="run one of the two states")
    ap.add_argument("--long", type=int, default=0, help="a long run of this many steps instead (module doc)")
    ap.add_argument("--sources", type=int, nargs="+", default=[8], help="compaction bounds of the long run")
    ap.add_argument("--runner", action="store_true", help="a JobRunner job instead (module doc)")
    a = ap.parse_args()
    global COLD, DIM
    COLD, DIM = a.cold, a.dim
    if a.runner:
        got: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
        for r in range(a.rounds):
            for kept in ((True, False) if r % 2 else (False, True)):
                got[kept].append(runner_run(a.mb, a.steps, kept))
        for kept in (True, False):
            print(f"  train(), nodes' saves {'kept' if kept else 'read'} (train wall/CPU, median save, ms): "
                  + " ".join(f"{w * 1e3:.0f}/{c * 1e3:.0f}/{m * 1e3:.1f}" for w, c, m in got[kept]))
        pairs = list(zip(got[True], got[False]))
        print(f"JobRunner, {a.steps} epochs of a {a.mb} MiB table, {a.rounds} rounds, kept / read: median save "
              f"{np.median([k[2] / r[2] for k, r in pairs]):.2f}x; train() wall "
              f"{np.median([k[0] / r[0] for k, r in pairs]):.2f}x, CPU {np.median([k[1] / r[1] for k, r in pairs]):.2f}x")
        return
    if a.long:
        for sources in a.sources:
            long_run(a.mb, a.long, sources)
        return
    for label, make in (("lora", lora), (f"embedding 2% rows of {DIM * 4} bytes", embedding)):
        if a.only and not label.startswith(a.only):
            continue
        ch = [changed_bytes(make, a.mb, s) for s in range(2, a.steps + 1)]
        save_x, rest_x, ratios, fulls, incs, save_cx, rest_cx = [], [], [], [], [], [], []
        for r in range(a.rounds):  # paired rounds, the order flipped from round to round
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {}
            for incremental in order:
                got[incremental] = run(make, a.mb, a.steps, incremental)
                shutil.rmtree(got[incremental][3])
            full, inc = got[False], got[True]
            fulls.append(full)
            incs.append(inc)
            save_x.append(np.median(inc[1][1:]) / np.median(full[1][1:]))
            rest_x.append(inc[2] / full[2])
            save_cx.append(np.median(inc[4][1:]) / np.median(full[4][1:]))
            rest_cx.append(inc[5] / full[5])
            ratios += [w / c for w, c in zip(inc[0][1:], ch)]
            print(f"  round {r}: save full {np.median(full[1][1:]) * 1e3:.1f} ms, incremental "
                  f"{np.median(inc[1][1:]) * 1e3:.1f} ms; restore full {full[2] * 1e3:.1f} ms, "
                  f"incremental {inc[2] * 1e3:.1f} ms; CPU (all threads): save full "
                  f"{np.median(full[4][1:]) * 1e3:.1f} ms, incremental {np.median(inc[4][1:]) * 1e3:.1f} ms; "
                  f"restore full {full[5] * 1e3:.1f} ms, incremental {inc[5] * 1e3:.1f} ms", flush=True)
        print(f"{label} ({a.mb} MiB, {a.steps} steps, {a.rounds} rounds)")
        print(f"  full save: {fulls[0][0][-1] / 2**20:8.2f} MiB  "
              f"{np.median([np.median(f[1][1:]) for f in fulls]) * 1e3:7.1f} ms median")
        print(f"  incremental: {np.mean(incs[0][0][1:]) / 2**20:8.2f} MiB/save, changed {np.mean(ch) / 2**20:.2f} MiB/save,"
              f" written/changed {min(ratios):.2f}-{max(ratios):.2f}x,"
              f" {np.median([np.median(i[1][1:]) for i in incs]) * 1e3:7.1f} ms median")
        print(f"  paired incremental/full: save {np.median(save_x):.2f}x ({min(save_x):.2f}-{max(save_x):.2f}),"
              f" restore of the last step {np.median(rest_x):.2f}x ({min(rest_x):.2f}-{max(rest_x):.2f})")
        print(f"  paired CPU time incremental/full: save {np.median(save_cx):.2f}x ({min(save_cx):.2f}-{max(save_cx):.2f}),"
              f" restore {np.median(rest_cx):.2f}x ({min(rest_cx):.2f}-{max(rest_cx):.2f})")


if __name__ == "__main__":
    main()
