"""One rank of a small DDP run on a Checkpointer with a local tier per rank (its own
``<base>/node<rank>``, standing for its own machine), started twice by test_tier_dist.py as
torchrun would. Resumes, trains to ``--steps`` saving every step, may die by SIGKILL (both
ranks, after a step's save); prints ``RESUMED <rank> <step> <source>`` and writes the
fingerprint of its final state to ``<out>.<rank>.json``.

    python _tier_dist_job.py STORE BASE OUT --steps 6 --persist 3 --replicas 1 [--async] [--kill-after 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _tier_job import fingerprint  # noqa: E402

from epochal import Checkpointer, RNGState  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("base")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--persist", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--async", dest="async_save", action="store_true")
    ap.add_argument("--kill-after", type=int, default=-1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    random.seed(rank)
    np.random.seed(rank)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)  # each rank its own stream (data, dropout)
    state = {"model": model, "opt": opt, "rng": RNGState(), "position": torch.zeros(1, dtype=torch.int64)}
    with Checkpointer(a.store, local=f"{a.base}/node{rank}", persist_every=a.persist, local_keep=2,
                      replicas=a.replicas, replica_stride=1, async_save=a.async_save) as ck:
        step = ck.restore(state) or 0
        report = ck.last_restore
        os.write(1, f"RESUMED {rank} {step} {report.source if report else None}\n".encode())
        while step < a.steps:
            step += 1
            loss = model(torch.randn(8, 16)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["position"] += 8
            ck.save(step, state)
            if step == a.kill_after:
                ck.wait()
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
    with open(f"{a.out}.{rank}.json", "w") as f:
        json.dump(fingerprint(state), f, sort_keys=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
