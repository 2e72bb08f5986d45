#!/usr/bin/env python
"""Benchmark: save and load a ~1 GiB PyTorch model plus its Adam state with epochal, with
``torch.save``/``torch.load(weights_only=True)`` and with ``torch.distributed.checkpoint``
(DCP, single process, no process group), in one run.

    python bench/bench_torch.py --gib 1 --rounds 5 --dir /tmp/epochal_bench_torch

The model is ``--gib`` GiB of float32 Linear layers; one Adam step fills exp_avg and
exp_avg_sq, so about 3x that is written per checkpoint. Every save ends durable (epochal's
native writer fsyncs itself; torch.save is followed by flush + fsync; DCP's FileSystemWriter
runs with ``sync_files=True``). Variants alternate (the order rotates every round) and the
reported figures are medians, over the rounds, of per-round times and of per-round paired
ratios, which cancels most of the noise of a shared machine.

Loads:

* ``fresh``: a new state dict (epochal ``read`` without live objects vs ``torch.load``);
* ``in place``: into a live model + optimizer (epochal ``read`` with the live objects, which
  calls their ``load_state_dict``; ``torch.load`` + ``load_state_dict``; ``dcp.load``, which
  always loads in place).

With ``--cold``, each file is evicted from the page cache (``posix_fadvise(DONTNEED)``)
before it is loaded. Data goes under ``--dir`` (default /tmp) and is removed at the end.

``--loop`` measures saves the way a training loop makes them, instead of
re-saving one unchanged state over one file: a model + AdamW, one optimizer step before
every epoch's saves (so every value changes), each epoch saved to a *new* file, retention
deleting the old ones. epochal saves through ``epochal.Checkpointer(keep_last=K)`` (its
sync save: temp file, fsync, rename, directory fsync, manifest commit, retention), and once
more with O_DIRECT writes (``tuning.DIRECT_MIN = 0``, storage/io/direct.py);
torch.save writes ``epoch-N.pt`` through a temp file + flush + fsync + rename + directory
fsync and then deletes ``epoch-(N-K).pt``, as a careful loop does. The limits are timed in
the same epochs: a parallel ``O_DIRECT`` write of the same number of bytes to a new file
(+ fsync, then deleted) and a memcpy of the state into allocated and into fresh memory.
``--gap`` seconds (default 3) pass before each save, as the training between two saves: in a
loop the pages of the file retention deleted are long free by the next save (a VM hands
free pages back to its host after ~2 s), while saves back to back (``--gap 0``) reuse
them at once::

    python bench/bench_torch.py --loop --gib 0.3 --rounds 6 --dir /tmp/epochal_bench_loop
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import direct_write, fsync_path, memcpy_times  # noqa: E402

import epochal  # noqa: E402
from epochal.storage.formats.base import get_db_type  # noqa: E402
from epochal.storage.io import tuning  # noqa: E402


def build(gib: float, width: int, optim: type[torch.optim.Optimizer] = torch.optim.Adam,
          ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of ``width`` x ``width`` Linear layers totalling about ``gib`` GiB, with a
    stepped Adam (so its state holds two more copies of every parameter)."""
    per_layer = (width * width + width) * 4
    layers = max(1, round(gib * 2**30 / per_layer))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = optim(model.parameters(), lr=1e-3)
    train_step(model, opt)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """One optimizer step with random gradients: every parameter and moment changes."""
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None


def nbytes_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in opt.state_dict()["state"].values():
        n += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
    return n


def evict(path: str) -> None:
    """Drop ``path`` (a file or every file under a directory) from the page cache."""
    paths = [path] if os.path.isfile(path) else [
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
    ]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = args.dir
        os.makedirs(self.dir, exist_ok=True)
        self.model, self.opt = build(args.gib, args.width)
        self.nbytes = nbytes_of(self.model, self.opt)
        self.native = get_db_type("native")
        self.p_epochal = os.path.join(self.dir, "epochal.db")
        self.p_torch = os.path.join(self.dir, "torch.pt")
        self.p_dcp = os.path.join(self.dir, "dcp")

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    # ---- saves
    def save_epochal(self) -> None:
        self.native.write(self.p_epochal, {"model": self.model, "opt": self.opt})

    def save_torch(self) -> None:
        with open(self.p_torch, "wb") as f:
            torch.save(self.state(), f)
            f.flush()
            os.fsync(f.fileno())

    def save_dcp(self) -> None:
        remove(self.p_dcp)
        dcp.save(self.state(), storage_writer=dcp.FileSystemWriter(self.p_dcp, sync_files=True))
        fsync_path(self.p_dcp)

    # ---- loads
    def load_epochal_fresh(self) -> None:
        out = self.native.read(self.p_epochal)
        assert out["model"]["0.weight"].shape == self.model[0].weight.shape

    def load_torch_fresh(self) -> None:
        with open(self.p_torch, "rb") as f:
            out = torch.load(f, weights_only=True)
        assert out["model"]["0.weight"].shape == self.model[0].weight.shape

    def load_epochal_inplace(self) -> None:
        self.native.read(self.p_epochal, existing={"model": self.model, "opt": self.opt})

    def load_torch_inplace(self) -> None:
        with open(self.p_torch, "rb") as f:
            out = torch.load(f, weights_only=True)
        self.model.load_state_dict(out["model"])
        self.opt.load_state_dict(out["opt"])

    def load_dcp_inplace(self) -> None:
        sd = self.state()
        dcp.load(sd, storage_reader=dcp.FileSystemReader(self.p_dcp))
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["opt"])

    def timed(self, fn: Callable[[], None], cold_path: str | None = None) -> float:
        gc.collect()
        if cold_path is not None and self.args.cold:
            evict(cold_path)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        gc.collect()
        return dt


def rotate(items: list[Any], k: int) -> list[Any]:
    k %= len(items)
    return items[k:] + items[:k]


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(model.state_dict().values())
    for st in opt.state_dict()["state"].values():
        out += [t for t in st.values() if isinstance(t, torch.Tensor) and t.dim()]
    return out


SUBDIRS = ("epochal", "direct", "torch")


class Loop:
    """``--loop``: the saves of a training loop (see the module doc), both variants paired
    per epoch, and the limits (O_DIRECT write, memcpy) timed in the same epochs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = args.dir
        for sub in SUBDIRS:
            remove(os.path.join(self.dir, sub))
            os.makedirs(os.path.join(self.dir, sub))
        self.model, self.opt = build(args.gib, args.width, torch.optim.AdamW)
        self.nbytes = nbytes_of(self.model, self.opt)
        self.ckpt = epochal.Checkpointer(os.path.join(self.dir, "epochal"), keep_last=args.keep)
        self.ckpt_direct = epochal.Checkpointer(os.path.join(self.dir, "direct"), keep_last=args.keep)
        self.tdir = os.path.join(self.dir, "torch")
        self.state = {"model": self.model, "opt": self.opt}
        arrays = [t.numpy() for t in _tensors(self.model, self.opt)]
        self.copies = [np.empty_like(a) for a in arrays]  # allocated once, touched below
        for c in self.copies:
            c.fill(0)

    def save_epochal(self, epoch: int) -> None:
        self.ckpt.save(epoch, self.state)

    def save_epochal_direct(self, epoch: int) -> None:
        """The same save with O_DIRECT writes (tuning.DIRECT_MIN = 0): the write paths' A/B."""
        direct_min, tuning.DIRECT_MIN = tuning.DIRECT_MIN, 0
        try:
            self.ckpt_direct.save(epoch, self.state)
        finally:
            tuning.DIRECT_MIN = direct_min

    def save_torch(self, epoch: int) -> None:
        path = os.path.join(self.tdir, f"epoch-{epoch}.pt")
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(self.tdir)
        old = os.path.join(self.tdir, f"epoch-{epoch - self.args.keep}.pt")
        if os.path.exists(old):
            os.remove(old)

    def limit_direct(self, epoch: int) -> None:
        direct_write(os.path.join(self.dir, f"direct-{epoch}"), self.nbytes)

    def run(self) -> dict[str, list[float]]:
        saves: dict[str, Callable[[int], None]] = {
            "epochal (Checkpointer)": self.save_epochal, "torch.save tmp+fsync+rename": self.save_torch,
            "epochal, O_DIRECT writes": self.save_epochal_direct,
            "O_DIRECT write, 4 threads": self.limit_direct,
        }
        times: dict[str, list[float]] = {k: [] for k in saves}
        times["memcpy into allocated"] = []
        times["memcpy into fresh"] = []
        for epoch in range(1, self.args.rounds + 2):  # epoch 1 warms up (not counted)
            train_step(self.model, self.opt)
            for name in rotate(list(saves), epoch):
                gc.collect()
                time.sleep(self.args.gap)  # the training between two saves
                t0 = time.perf_counter()
                saves[name](epoch)
                if epoch > 1:
                    times[name].append(time.perf_counter() - t0)
            arrays = [t.numpy() for t in _tensors(self.model, self.opt)]
            allocated, fresh = memcpy_times(arrays, self.copies)
            if epoch > 1:
                times["memcpy into allocated"].append(allocated)
                times["memcpy into fresh"].append(fresh)
                print(f"epoch {epoch}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
                      flush=True)
        self.ckpt.close()
        self.ckpt_direct.close()
        return times


def loop_main(args: argparse.Namespace) -> dict[str, Any]:
    lp = Loop(args)
    print(f"loop: state {lp.nbytes / 2**30:.2f} GiB ({len(lp.model)} Linear layers of "
          f"{args.width}^2 + AdamW), {args.rounds} timed epochs (+1 warm-up), keep_last "
          f"{args.keep}, {args.gap:g} s between saves; torch {torch.__version__}", flush=True)
    try:
        times = lp.run()
    finally:
        for sub in SUBDIRS:
            remove(os.path.join(args.dir, sub))
    ep = "epochal (Checkpointer)"

    def ratio(other: str) -> float:
        return statistics.median(o / e for o, e in zip(times[other], times[ep]))

    result = {
        "gib": lp.nbytes / 2**30, "rounds": args.rounds, "loop": True,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "ratios": {f"{k} / epochal": ratio(k) for k in times if k != ep},
        "times_s": times,
    }
    print("\n| variant | median s | GiB/s |\n|---|---:|---:|")
    for k, v in result["median_s"].items():
        print(f"| {k} | {v:.3f} | {lp.nbytes / 2**30 / v:.2f} |")
    print("\n| paired ratio, median over epochs (>1: epochal faster) | x |\n|---|---:|")
    for k, v in result["ratios"].items():
        print(f"| {k} | {v:.2f} |")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="model size in GiB (Adam adds 2x)")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="/tmp/epochal_bench_torch")
    p.add_argument("--cold", action="store_true", help="evict files from the page cache before loads")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--loop", action="store_true", help="saves as a training loop makes them")
    p.add_argument("--keep", type=int, default=2, help="--loop: checkpoints kept (retention)")
    p.add_argument("--gap", type=float, default=3.0,
                   help="--loop: seconds of 'training' (a sleep) before each save; 0 = back to back")
    args = p.parse_args(argv)
    if not args.dir.startswith("/tmp"):
        sys.exit("--dir must be under /tmp (benchmark data never goes into the repository)")
    warnings.filterwarnings("ignore", message=".*process group.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    if args.loop:
        result = loop_main(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return result

    b = Bench(args)
    print(f"state: {b.nbytes / 2**30:.2f} GiB ({len(b.model)} Linear layers of {args.width}^2, "
          f"+ Adam); {args.rounds} rounds; torch {torch.__version__}; "
          f"{'cold' if args.cold else 'warm'} page cache; threads {torch.get_num_threads()}",
          flush=True)
    saves = {"epochal": b.save_epochal, "torch.save": b.save_torch, "dcp.save": b.save_dcp}
    loads = {
        "epochal fresh": (b.load_epochal_fresh, b.p_epochal),
        "torch.load fresh": (b.load_torch_fresh, b.p_torch),
        "epochal in place": (b.load_epochal_inplace, b.p_epochal),
        "torch.load+load_state_dict": (b.load_torch_inplace, b.p_torch),
        "dcp.load in place": (b.load_dcp_inplace, b.p_dcp),
    }
    times: dict[str, list[float]] = {k: [] for k in [*saves, *loads]}
    try:
        for r in range(args.rounds):
            for name in rotate(list(saves), r):
                times[name].append(b.timed(saves[name]))
            for name in rotate(list(loads), r):
                fn, path = loads[name]
                times[name].append(b.timed(fn, path))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
                  flush=True)
    finally:
        for path in (b.p_epochal, b.p_torch, b.p_dcp):
            remove(path)

    def ratio(slow: str, fast: str) -> float:
        return statistics.median(s / f for s, f in zip(times[slow], times[fast]))

    gbps = {k: b.nbytes / 2**30 / statistics.median(v) for k, v in times.items()}
    result = {
        "gib": b.nbytes / 2**30, "rounds": args.rounds, "cold": args.cold,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "gib_per_s": gbps,
        "ratios": {
            "save: torch.save / epochal": ratio("torch.save", "epochal"),
            "save: dcp.save / epochal": ratio("dcp.save", "epochal"),
            "load fresh: torch.load / epochal": ratio("torch.load fresh", "epochal fresh"),
            "load in place: torch.load+lsd / epochal": ratio("torch.load+load_state_dict",
                                                             "epochal in place"),
            "load in place: dcp.load / epochal": ratio("dcp.load in place", "epochal in place"),
        },
        "times_s": times,
    }
    print("\n| variant | median s | GiB/s |\n|---|---:|---:|")
    for k in times:
        print(f"| {k} | {result['median_s'][k]:.2f} | {gbps[k]:.2f} |")
    print("\n| paired ratio (median over rounds) | x |\n|---|---:|")
    for k, v in result["ratios"].items():
        print(f"| {k} | {v:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
