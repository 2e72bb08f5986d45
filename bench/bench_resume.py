#!/usr/bin/env python
"""Benchmark: a cold resume through ``JobRunner.train()``, the way a restarted
training job takes it, against the limits measured in the same run.

The state is a GPT-style LM (``--mib`` MiB of float32 weights, about 3x that with AdamW's two
moments) in a one-node job whose workspace holds the live model and optimizer. A run with
an epoch limit of 1 commits epochs 0 and 1; each round then resumes it (the limit is reached,
so ``train()`` loads epoch 1 and runs no epoch) with the db evicted from the page cache first.
Variants, alternated with the order rotated every round:

* ``train``: ``JobRunner.train()`` with ``DirectoryMetadataHandler()`` (verify="full"): choose
  the epoch, lock, load in place, every checksum checked (one read of the db);
* ``train_2pass``: the same, with a handler that fully verifies the chosen epoch before the
  load (a two-pass resume: every byte read and checked twice);
* ``bare``: ``get_db_type("native").read(db, existing=live)``, the in-place load alone;
* ``bare_r``: the same load of the Checkpointer's db (the file ``restore`` reads): ``restore``
  is compared with it, since two files of the same bytes read at different speeds on a
  virtual disk (their places on the host's storage, its cache);
* ``torch``: ``torch.load(weights_only=True)`` of a ``torch.save`` of the same state, then
  ``load_state_dict`` on the model and optimizer (no checksums at all);
* ``restore``: ``Checkpointer.restore`` of the same state (saved by a Checkpointer);
* ``dcp``: ``torch.distributed.checkpoint.load`` (``FileSystemReader``, no process group) into
  the live state dicts, then the optimizer's ``load_state_dict``;
* ``odirect``: a 4-thread ``O_DIRECT`` read of the db's bytes into touched memory: the disk's
  limit for any load of them (no checksum, nothing decoded);
* ``bare_map``: ``bare`` verified on the file's map even when it is not cached;
* ``bare_pc``: ``bare`` through the page cache, with ``tuning.DIRECT_READ`` off (no
  O_DIRECT reads: fresh arrays read by buffered ``pread``, live tensors verified by
  buffered reads and then copied from the page cache).

``--workload arrays``: 8 float32 arrays of ``--array-mib`` (32) MiB in the
workspace (``train``, ``restore``, ``bare`` and ``bare_r`` with the names, ``dcp``, ``odirect``). ``--busy``
keeps two processes of numpy matmuls running during the measurement (a training job's cores).

With ``--warm`` the files are read into the page cache before each load instead (a job
restarted on the same machine soon after a crash). Reported: per-variant medians and the medians of the paired per-round ratios, and
for ``train``/``restore``/``bare`` the time spent outside the native format's reads (the
door's own work around the same read: job, lock, manifests, tasks), which the disk's noise
does not blur. Goals:
train/bare <= 1.1, train/torch <= 0.8.

    python bench/bench_resume.py --mib 300 --rounds 5 --dir /var/tmp/epochal_bench_resume
    python bench/bench_resume.py --quick            # tiny, only checks that it runs
    python bench/bench_resume.py --workload arrays --rounds 7         # 8 x 32 MiB arrays
    python bench/bench_resume.py --workload arrays --rounds 7 --busy  # the same, 2 busy processes
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import DirectReader, evict, fsync_path, recycle_memory, warm  # noqa: E402

import epochal  # noqa: E402
from epochal.storage.formats.base import get_db_type  # noqa: E402
from epochal.storage.formats.native.reader import NativeFile  # noqa: E402
from epochal.storage.formats.native.reads import inplace  # noqa: E402
from epochal.storage.io import direct as direct_io  # noqa: E402
from epochal.storage.io import tuning  # noqa: E402

#: seconds spent inside the native format's reads (all of them) during the current variant:
#: what a door adds around the same read is its time minus this (robust to the disk's noise)
IN_READ = [0.0]
_native_read = NativeFile._read


def _timed_read(self: NativeFile, *args: Any, **kw: Any) -> Any:
    t = time.perf_counter()
    try:
        return _native_read(self, *args, **kw)
    finally:
        IN_READ[0] += time.perf_counter() - t


NativeFile._read = _timed_read  # type: ignore[method-assign]


def page_cache(fn: Any) -> Any:
    """``fn`` run with the O_DIRECT reads off (tuning.DIRECT_READ False): the path before."""
    def run() -> Any:
        tuning.DIRECT_READ = False
        try:
            return fn()
        finally:
            tuning.DIRECT_READ = True
    return run


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class LM(nn.Module):
    """Embedding + ``layers`` transformer blocks (weights only matter here)."""

    def __init__(self, mib: float, d: int = 768, vocab: int = 32000) -> None:
        vocab = min(vocab, max(256, int(mib * 2**20 / 4 / d / 4)))  # the embedding: <= 1/4
        super().__init__()
        per_block = 12 * d * d + 13 * d
        layers = max(1, round((mib * 2**20 / 4 - vocab * d) / per_block))
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)


def live_state(mib: float, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = LM(mib)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    grads = [(p, torch.randn_like(p)) for p in model.parameters()]  # one step fills the moments
    for p, g in grads:
        p.grad = g
    opt.step()
    model.zero_grad(set_to_none=True)
    return model, opt


class TwoPass(epochal.DirectoryMetadataHandler):
    """A two-pass resume: the chosen epoch is fully verified, then loaded."""

    def resume_epoch(self, user_epoch: int | None = None) -> int | None:
        return self.last_epoch(user_epoch)


def stop(ws: Any) -> None:
    ws["stop"] = True


def resume(directory: str, blobs: dict[str, Any], handler: Any, out: dict[str, Any] | None = None) -> int:
    """Train (or resume) the one-epoch job whose workspace holds ``blobs`` (live objects);
    ``out`` gets the workspace's values after it (plain arrays are replaced, not filled)."""
    ws = epochal.Workspace()
    ws.update(blobs)
    with epochal.Job(nodes_to_checkpoint=["trainer"]) as j:
        epochal.Task(step=stop, outputs=["stop"])
    j.add_stop_condition("stop")
    mgr = epochal.CheckpointManager(directory, "trainer", db_type="native", metadata_handler=handler)
    epoch = int(epochal.JobRunner(j, mgr, progress=False).train(epochal.LocalSession(ws)))
    if out is not None:
        out.update({k: ws[k] for k in blobs})
    return epoch


def fsync_tree(path: str) -> list[str]:
    """fsync every file under ``path`` (or the file itself); return them."""
    files = [path] if os.path.isfile(path) else [
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for f in files:
        fsync_path(f)
    return files


BUSY = """
import numpy as np
a = np.random.default_rng(0).normal(size=(384, 384))
while True:
    a = np.tanh(a @ a / 384.0)
"""


class Busy:
    """``with Busy(n):`` n processes doing training-like numpy work (matmuls, one BLAS
    thread each) for as long as the block runs."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Busy:
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.procs = [subprocess.Popen([sys.executable, "-c", BUSY], env=env) for _ in range(self.n)]
        time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait()


def workload_lm(args: argparse.Namespace) -> tuple[str, dict[str, tuple[Any, list[str]]], Any, Any, int]:
    """The GPT-style LM + AdamW workload: its variants (name -> (fn, files to evict)), a check
    that the live state holds the checkpoint's values, a scramble, the description, bytes."""
    ck, ckr = os.path.join(args.dir, "ck"), os.path.join(args.dir, "ckr")
    model, opt = live_state(args.mib, 0)
    assert resume(ck, {"model": model, "opt": opt}, epochal.DirectoryMetadataHandler()) == 1
    db = os.path.join(ck, "trainer.1")
    with epochal.Checkpointer(ckr) as c:
        c.save(1, {"model": model, "opt": opt})
    rdb = os.path.join(ckr, "local.1")
    pt = os.path.join(args.dir, "state.pt")
    with open(pt, "wb") as f:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    dcp_dir = os.path.join(args.dir, "dcp")
    dcp.save({"model": model.state_dict(), "opt": opt.state_dict()}, storage_writer=dcp.FileSystemWriter(dcp_dir))
    ref = [p.detach().clone() for p in model.parameters()]
    live_model, live_opt = live_state(args.mib, 1)  # other values: every load must change them
    live = {"model": live_model, "opt": live_opt}
    nbytes = os.path.getsize(db)
    buf = DirectReader(nbytes)

    def dcp_load() -> None:
        sd = {"model": live_model.state_dict(), "opt": live_opt.state_dict()}
        dcp.load(sd, storage_reader=dcp.FileSystemReader(dcp_dir))
        live_opt.load_state_dict(sd["opt"])

    def torch_load() -> None:
        sd = torch.load(pt, weights_only=True)
        live_model.load_state_dict(sd["model"])
        live_opt.load_state_dict(sd["opt"])

    def restore() -> None:
        with epochal.Checkpointer(ckr) as c:
            assert c.restore(live) == 1

    def bare_map() -> None:
        """The in-place load verified on the map even when cold (page faults, not reads)."""
        cached = inplace.cached
        inplace.cached = lambda f, direct: True
        try:
            get_db_type("native").read(db, existing=live)
        finally:
            inplace.cached = cached

    variants = {
        "train": (lambda: resume(ck, live, epochal.DirectoryMetadataHandler()), [db]),
        "train_2pass": (lambda: resume(ck, live, TwoPass()), [db]),
        "restore": (restore, [rdb]),
        "bare": (lambda: get_db_type("native").read(db, existing=live), [db]),
        "bare_r": (lambda: get_db_type("native").read(rdb, existing=live), [rdb]),
        "bare_map": (bare_map, [db]),
        "bare_pc": (page_cache(lambda: get_db_type("native").read(db, existing=live)), [db]),
        "torch": (torch_load, [pt]),
        "dcp": (dcp_load, fsync_tree(dcp_dir)),
        "odirect": (lambda: buf.read(db), [db]),
    }

    def check(name: str) -> None:
        if name != "odirect":
            assert all(torch.equal(a, b) for a, b in zip(ref, live_model.parameters())), name

    def scramble() -> None:
        with torch.no_grad():
            for p in live_model.parameters():
                p.add_(1.0)

    return f"LM {args.mib:g} MiB + AdamW", variants, check, scramble, nbytes


def workload_arrays(args: argparse.Namespace) -> tuple[str, dict[str, tuple[Any, list[str]]], Any, Any, int]:
    """The arrays workload: 8 float32 arrays of ``--array-mib`` MiB in a workspace."""
    n = args.array_mib * (1 << 20) // 4
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.standard_normal(n, dtype=np.float32) for i in range(8)}
    names = sorted(state)
    ck, ckr = os.path.join(args.dir, "ck"), os.path.join(args.dir, "ckr")
    assert resume(ck, dict(state), epochal.DirectoryMetadataHandler()) == 1
    db = os.path.join(ck, "trainer.1")
    with epochal.Checkpointer(ckr) as c:
        c.save(1, state)
    rdb = os.path.join(ckr, "local.1")
    dcp_dir = os.path.join(args.dir, "dcp")
    dcp.save({k: torch.from_numpy(v) for k, v in state.items()}, storage_writer=dcp.FileSystemWriter(dcp_dir))
    # plain arrays are replaced by a load (new arrays), not filled: with glibc keeping freed
    # memory, each load's new arrays reuse memory the process already touched
    recycle_memory()
    live = {k: np.zeros_like(v) for k, v in state.items()}
    live_t = {k: torch.from_numpy(v) for k, v in live.items()}  # dcp.load fills these in place
    nbytes = os.path.getsize(db)
    buf = DirectReader(nbytes)
    got: dict[str, Any] = {}

    def restore() -> None:
        got.clear()
        got.update(live)
        with epochal.Checkpointer(ckr) as c:
            assert c.restore(got) == 1

    def train() -> None:
        got.clear()
        assert resume(ck, live, epochal.DirectoryMetadataHandler(), got) == 1

    def bare() -> None:
        got.clear()
        got.update(get_db_type("native").read(db, names, existing=live))

    def dcp_load() -> None:
        got.clear()
        dcp.load(live_t, storage_reader=dcp.FileSystemReader(dcp_dir))
        got.update(live)

    def bare_r() -> None:
        got.clear()
        got.update(get_db_type("native").read(rdb, names, existing=live))

    variants = {
        "train": (train, [db]),
        "restore": (restore, [rdb]),
        "bare": (bare, [db]),
        "bare_r": (bare_r, [rdb]),
        "bare_pc": (page_cache(bare), [db]),
        "dcp": (dcp_load, fsync_tree(dcp_dir)),
        "odirect": (lambda: buf.read(db), [db]),
    }

    def check(name: str) -> None:
        if name != "odirect":
            for k, v in state.items():
                assert np.array_equal(got[k], v), (name, k)
        got.clear()

    def scramble() -> None:
        for v in live.values():
            v += 1.0

    return f"8 float32 arrays of {args.array_mib} MiB", variants, check, scramble, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("lm", "arrays"), default="lm")
    ap.add_argument("--mib", type=float, default=300, help="lm: MiB of model weights (AdamW adds 2x)")
    ap.add_argument("--array-mib", type=int, default=32, help="arrays: MiB per array (8 arrays)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp/epochal_bench_resume")
    ap.add_argument("--warm", action="store_true", help="files in the page cache (read first), not evicted")
    ap.add_argument("--busy", action="store_true", help="2 processes of numpy matmuls run meanwhile")
    ap.add_argument("--variants", default=None, help="comma-separated subset (default: all)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.array_mib, args.rounds = 8, 2, 2
    logging.getLogger("epochal").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    os.environ["EPOCHAL_QUIET"] = "1"
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    build = workload_lm if args.workload == "lm" else workload_arrays
    what, variants, check, scramble, nbytes = build(args)
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    outside: dict[str, list[float]] = {n: [] for n in names}  # time outside the format's reads
    odirect_bytes: dict[str, int] = {}  # bytes epochal read with O_DIRECT (last round)
    load0 = os.getloadavg()
    with Busy(2 if args.busy else 0):
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order:
                fn, paths = variants[n]
                for path in paths:
                    if args.warm:
                        warm(path)
                    else:
                        evict(path, drop_caches=True)
                gc.collect()
                IN_READ[0] = 0.0
                t = time.perf_counter()
                direct_io.stats.reset()
                fn()
                odirect_bytes[n] = direct_io.stats.read
                times[n].append(time.perf_counter() - t)
                outside[n].append(times[n][-1] - IN_READ[0])
                check(n)
                scramble()  # so the next load has something to restore
    load1 = os.getloadavg()
    print(f"{'warm' if args.warm else 'cold'} resume of {nbytes / 2**20:.0f} MiB ({what}), N={args.rounds} rounds"
          f"{', 2 busy processes' if args.busy else ''}; load average {load0[0]:.1f} before, {load1[0]:.1f} after")
    for n in names:
        print(f"  {n:12s} median {statistics.median(times[n]) * 1e3:8.1f} ms   runs "
              + " ".join(f"{x * 1e3:.0f}" for x in times[n])
              + (f"   (O_DIRECT {odirect_bytes[n] / 2**20:.0f} MiB)" if odirect_bytes.get(n) else ""))
    for n in ("train", "restore", "bare", "bare_r"):  # the doors' own time around the same read
        if n in outside:
            xs = outside[n]
            print(f"  {n:12s} outside the native read: median {statistics.median(xs) * 1e3:.1f} ms"
                  f" ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}), "
                  f"{statistics.median(a / b for a, b in zip(xs, times[n])) * 100:.1f}% of its time")

    def ratio(a: str, b: str) -> str:
        if a not in times or b not in times:
            return ""
        xs = [x / y for x, y in zip(times[a], times[b])]
        return f"  {a + ' / ' + b:22s} {statistics.median(xs):.3f}   ({min(xs):.2f}-{max(xs):.2f})"

    for a, b, goal in (("train", "bare", "goal <= 1.1"), ("restore", "bare_r", "goal <= 1.1"),
                       ("restore", "bare", "(other files)"), ("bare_r", "bare", "(the same load, other files)"),
                       ("train", "odirect", "goal <= 1.1"), ("restore", "odirect", "goal <= 1.1"),
                       ("bare", "odirect", ""), ("bare_pc", "odirect", "(before: through the page cache)"),
                       ("bare", "bare_pc", "(< 1: O_DIRECT reads win)"), ("bare", "bare_map", "(< 1: the cold verify by reads is faster)"),
                       ("restore", "torch", "goal <= 0.8"),
                       ("restore", "dcp", "goal <= 0.8"), ("train", "torch", "goal <= 0.8"), ("train", "dcp", "goal <= 0.8"),
                       ("train_2pass", "train", "(> 1: the second read saved)")):
        line = ratio(a, b)
        if line:
            print(line + (f"   {goal}" if goal else ""))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
