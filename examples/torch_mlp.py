#!/usr/bin/env python
"""Train a small PyTorch MLP as an epochal Job; kill it, run it again, and it resumes exactly.

    python examples/torch_mlp.py --ckpt-dir /tmp/mlp_ckpt --epochs 20
    # kill it midway (Ctrl-C, kill -9, a preempted machine), then run the same command again:
    # it resumes from the newest checkpoint and ends with the very same weights (compare the
    # "final state sha256" line with an uninterrupted run's, in a fresh --ckpt-dir).

What makes the resume bit-exact:

* the model, the optimizer, the LR scheduler and an :class:`epochal.RNGState` live in the
  session workspace *before* ``JobRunner.train``: epochal checkpoints them every epoch (as raw
  tensors plus plain data, never pickle) and, on a resume, restores them **in place** into
  the freshly built objects, even though the init group does not run again;
* the data set is built from its own seeded generator, while shuffling and dropout draw from
  the global generators that RNGState records, so epoch N+1 after a resume sees the same
  order and the same dropout masks as in the uninterrupted run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import time
from typing import Any

import numpy as np
import torch
from torch import nn

import epochal
from epochal import (
    CheckpointManager,
    Job,
    JobRunner,
    LocalSession,
    Preempted,
    Task,
    Workspace,
    epoch_limiter,
)


def make_data(n: int = 1024, dim: int = 20, classes: int = 4, seed: int = 1234) -> tuple[Any, Any]:
    """A synthetic classification set: inputs, and labels from a random 'teacher' network."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    teacher = torch.randn(dim, classes, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return x, y


class MLP(nn.Module):
    """Two hidden layers with dropout: dropout makes the run depend on the RNG state."""

    def __init__(self, dim: int = 20, hidden: int = 64, classes: int = 4, p: float = 0.2):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(p),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(p),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


class TrainEpoch:
    """The epoch step: one shuffled pass over the data set, then one scheduler step.

    The data lives in the step, not in the workspace, so it is not checkpointed: it is
    rebuilt identically from its seed by every run.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, sleep: float = 0.0):
        self.x, self.y, self.batch_size, self.sleep = x, y, batch_size, sleep

    def __call__(self, ws: Workspace) -> None:
        model, opt, sched = ws["model"], ws["opt"], ws["sched"]
        model.train()
        order = torch.randperm(len(self.x))  # the global generator: part of RNGState
        total = 0.0
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            loss = nn.functional.cross_entropy(model(self.x[idx]), self.y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        sched.step()
        ws["epochs_done"] = int(ws["epochs_done"]) + 1
        ws["loss"] = total / len(order)
        print(f"epoch {ws['epochs_done']:3d}  loss {ws['loss']:.4f}  lr {sched.get_last_lr()[0]:.5f}",
              flush=True)
        if self.sleep:
            time.sleep(self.sleep)


def state_digest(*objs: Any) -> str:
    """sha256 over the state dicts of ``objs``: every tensor's raw bytes and every scalar."""
    h = hashlib.sha256()

    def feed(v: Any) -> None:
        if isinstance(v, dict):
            for k in sorted(v, key=repr):
                h.update(repr(k).encode())
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            for item in v:
                feed(item)
        elif isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(v).encode())

    for obj in objs:
        feed(obj.state_dict())
    return h.hexdigest()


def build(args: argparse.Namespace) -> tuple[Job, CheckpointManager, LocalSession, Workspace]:
    """The model, optimizer, scheduler, RNG state, session, job and checkpoint manager."""
    # Seed every generator RNGState records (model init uses torch's); on a resume the
    # checkpoint then overrides them all.
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    x, y = make_data()
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)

    ws = Workspace()
    ws["model"], ws["opt"], ws["sched"] = model, opt, sched
    ws["rng"] = epochal.RNGState()
    ws["epochs_done"] = 0
    session = LocalSession(ws)

    with Job() as job:
        Task(step=TrainEpoch(x, y, args.batch_size, args.epoch_sleep), name="train_epoch")
    epoch_limiter(job, args.epochs)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    manager = CheckpointManager(
        db_prefix=args.ckpt_dir, node_name="local", db_type="native",
        metadata_handler=epochal.DirectoryMetadataHandler(),  # reruns resume by themselves
    )
    return job, manager, session, ws


def main(argv: list[str] | None = None) -> str:
    """Train (or resume) and print the final state digest, which it also returns."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-dir", default="/tmp/epochal_torch_mlp")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epoch-sleep", type=float, default=0.0, help="seconds to sleep per epoch")
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny model: 1 is fastest)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    job, manager, session, ws = build(args)
    with session:
        try:
            last = JobRunner(job, manager).train(session)
        except Preempted as ex:  # SIGTERM/Ctrl-C: the epoch is committed; exit non-zero
            print(ex, flush=True)  # so a scheduler restarts the job, which then resumes
            raise SystemExit(ex.exit_code) from None
    digest = state_digest(ws["model"], ws["opt"])
    print(f"finished at epoch {last}; final state sha256 {digest}", flush=True)
    return digest


if __name__ == "__main__":
    main()
