#!/usr/bin/env python
"""Benchmark (issue 17.1): a cold resume through ``JobRunner.train()``, the way a restarted
training job takes it, against the limits measured in the same run.

The state is a GPT-style LM (``--mib`` MiB of float32 weights, about 3x that with AdamW's two
moments) in a one-node job whose workspace holds the live model and optimizer. A run with
an epoch limit of 1 commits epochs 0 and 1; each round then resumes it (the limit is reached,
so ``train()`` loads epoch 1 and runs no epoch) with the db evicted from the page cache first.
Variants, alternated with the order rotated every round:

* ``train``: ``JobRunner.train()`` with ``DirectoryMetadataHandler()`` (verify="full"): choose
  the epoch, lock, load in place, every checksum checked (one read of the db);
* ``train_2pass``: the same, with a handler that fully verifies the chosen epoch before the
  load (what epochal did before issue 17: every byte read and checked twice);
* ``bare``: ``get_db_type("native").read(db, existing=live)``, the in-place load alone;
* ``torch``: ``torch.load(weights_only=True)`` of a ``torch.save`` of the same state, then
  ``load_state_dict`` on the model and optimizer (no checksums at all).

With ``--warm`` the files are read into the page cache before each load instead (a job
restarted on the same machine soon after a crash). Reported: per-variant medians and the medians of the paired per-round ratios. Goals:
train/bare <= 1.1, train/torch <= 0.8.

    python bench/bench_resume.py --mib 300 --rounds 5 --dir /var/tmp/epochal_bench_resume
    python bench/bench_resume.py --quick            # tiny, only checks that it runs
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import evict, warm  # noqa: E402

import epochal  # noqa: E402
from epochal.storage.formats.base import get_db_type  # noqa: E402


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
    """The resume before issue 17: the chosen epoch is fully verified, then loaded."""

    def resume_epoch(self, user_epoch: int | None = None) -> int | None:
        return self.last_epoch(user_epoch)


def stop(ws: Any) -> None:
    ws["stop"] = True


def resume(directory: str, model: nn.Module, opt: torch.optim.Optimizer, handler: Any) -> int:
    """Train (or resume) the one-epoch job whose workspace holds ``model`` and ``opt``."""
    ws = epochal.Workspace()
    ws["model"], ws["opt"] = model, opt
    with epochal.Job(nodes_to_checkpoint=["trainer"]) as j:
        epochal.Task(step=stop, outputs=["stop"])
    j.add_stop_condition("stop")
    mgr = epochal.CheckpointManager(directory, "trainer", db_type="native", metadata_handler=handler)
    return int(epochal.JobRunner(j, mgr, progress=False).train(epochal.LocalSession(ws)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=300, help="MiB of model weights (AdamW adds 2x)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp/epochal_bench_resume")
    ap.add_argument("--warm", action="store_true", help="files in the page cache (read first), not evicted")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.rounds = 8, 2
    logging.getLogger("epochal").setLevel(logging.ERROR)
    os.environ["EPOCHAL_QUIET"] = "1"
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    ck = os.path.join(args.dir, "ck")
    model, opt = live_state(args.mib, 0)
    assert resume(ck, model, opt, epochal.DirectoryMetadataHandler()) == 1
    db = os.path.join(ck, "trainer.1")
    nbytes = os.path.getsize(db)
    pt = os.path.join(args.dir, "state.pt")
    with open(pt, "wb") as f:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    ref = [p.detach().clone() for p in model.parameters()]
    live_model, live_opt = live_state(args.mib, 1)  # other values: every load must change them

    def train() -> None:
        assert resume(ck, live_model, live_opt, epochal.DirectoryMetadataHandler()) == 1

    def train_2pass() -> None:
        assert resume(ck, live_model, live_opt, TwoPass()) == 1

    def bare() -> None:
        get_db_type("native").read(db, existing={"model": live_model, "opt": live_opt})

    def torch_load() -> None:
        sd = torch.load(pt, weights_only=True)
        live_model.load_state_dict(sd["model"])
        live_opt.load_state_dict(sd["opt"])

    variants = {"train": (train, db), "train_2pass": (train_2pass, db), "bare": (bare, db), "torch": (torch_load, pt)}
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            fn, path = variants[n]
            if args.warm:
                warm(path)
            else:
                evict(path, drop_caches=True)
            t = time.perf_counter()
            fn()
            times[n].append(time.perf_counter() - t)
            assert all(torch.equal(a, b) for a, b in zip(ref, live_model.parameters())), n
            with torch.no_grad():  # scramble, so the next load has something to restore
                for p in live_model.parameters():
                    p.add_(1.0)
    print(f"{'warm' if args.warm else 'cold'} resume of {nbytes / 2**20:.0f} MiB (LM {args.mib:g} MiB + AdamW), N={args.rounds} rounds")
    for n in names:
        print(f"  {n:12s} median {statistics.median(times[n]) * 1e3:8.1f} ms   runs "
              + " ".join(f"{x * 1e3:.0f}" for x in times[n]))

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    print(f"  train / bare        {ratio('train', 'bare'):.3f}   (goal <= 1.1)")
    print(f"  train / torch       {ratio('train', 'torch'):.3f}   (goal <= 0.8)")
    print(f"  train_2pass / train {ratio('train_2pass', 'train'):.3f}   (the second read saved)")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
