"""One rank of a small DDP run on a Checkpointer with a local tier per rank (its own
``<base>/node<rank>``, standing for its own machine), started twice by test_tier_dist.py as
torchrun would. Resumes, trains to ``--steps`` saving every step, may die by SIGKILL (both
ranks, after a step's save); prints ``RESUMED <rank> <step> <source>`` and writes the
fingerprint of its final state to ``<out>.<rank>.json``.

``--kill-ranks 1`` kills only rank 1 after ``--kill-after`` (its peer then fails or is stopped
by torchrun), and only in a first attempt (``TORCHELASTIC_RESTART_COUNT`` 0): a torchrun
restart runs to the end. ``--die-in-copy STEP:RANKS:FILES``: each rank of RANKS dies by SIGKILL
in the middle of the copies between ranks of STEP, after committing FILES of the files of its
peer's copy it receives (a small chunk size, so that a file takes several messages).

    python _tier_dist_job.py STORE BASE OUT --steps 6 --persist 3 --replicas 1 [--async] [--kill-after 4]
        [--kill-ranks 0,1] [--die-in-copy 5:0,1:1] [--unsnapshotted]

``--when-busy skip --slow-rank R``: saves that would wait for the previous one are skipped,
and rank R's local writes take 1.5 s longer (each rank writes the steps it skipped to
``<out>.<rank>.skipped.json`` before the kill, or at the end).

``--unsnapshotted``: the state is staged as one the staging does not snapshot whole (planned on the training thread,
each tensor copied into the staging buffer as written, the db written in the background).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _tier_job import fingerprint  # noqa: E402

from epochal import Checkpointer, RNGState  # noqa: E402
from epochal.integrations.distributed import tier as rank_tier  # noqa: E402

#: the step being saved (read by the kill point inside the copies between ranks)
SAVING = [0]


def die_in_copy(spec: str, rank: int) -> None:
    """Arm the kill point of ``--die-in-copy``: wrap the commit of each received file."""
    step, who, files = spec.split(":")
    rank_tier.CHUNK = 512  # (every rank) several messages a file: the copy is cut between chunks too
    if str(rank) not in who.split(","):
        return
    commit, seen = rank_tier.committed, [0]

    def counted(sink):  # type: ignore[no-untyped-def]
        if SAVING[0] == int(step):
            seen[0] += 1
            if seen[0] > int(files):
                os.kill(os.getpid(), signal.SIGKILL)
        return commit(sink)

    rank_tier.committed = counted


def init_group() -> None:
    """The gloo group; under a torchrun restart on a store prefixed by the attempt: with this
    torch, the restarted workers otherwise read the dead workers' addresses, which the agent's
    store still holds under the same keys, and fail to connect."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group("gloo")
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


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
    ap.add_argument("--kill-ranks", default="0,1")
    ap.add_argument("--die-in-copy", default="")
    ap.add_argument("--unsnapshotted", action="store_true")
    ap.add_argument("--when-busy", default="wait")
    ap.add_argument("--slow-rank", type=int, default=-1)
    a = ap.parse_args()
    if a.unsnapshotted:  # what a tensor of another device gets (CUDA without OFF_DEVICE)
        from epochal.integrations.dcp.staging import HostStaging

        HostStaging.snapshot_state = lambda self, state_dict: None  # type: ignore[method-assign]
    torch.set_num_threads(1)
    init_group()
    rank = dist.get_rank()
    if a.die_in_copy:
        die_in_copy(a.die_in_copy, rank)
    if rank == a.slow_rank:
        write = rank_tier.RankTier._write

        def slow(*args, **kw):  # type: ignore[no-untyped-def]
            time.sleep(1.5)
            return write(*args, **kw)

        rank_tier.RankTier._write = slow  # type: ignore[method-assign]
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    torch.manual_seed(0)
    random.seed(rank)
    np.random.seed(rank)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)  # each rank its own stream (data, dropout)
    state = {"model": model, "opt": opt, "rng": RNGState(), "position": torch.zeros(1, dtype=torch.int64)}
    with Checkpointer(a.store, local=f"{a.base}/node{rank}", persist_every=a.persist, local_keep=2,
                      replicas=a.replicas, replica_stride=1, async_save=a.async_save, when_busy=a.when_busy) as ck:
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
            if a.when_busy == "wait":
                ck.wait()  # (the copies of the step before are done: the kill point sees this step)
            SAVING[0] = step
            ck.save(step, state)
            if step == a.kill_after and first_attempt:
                ck.wait()
                with open(f"{a.out}.{rank}.skipped.json", "w") as f:
                    json.dump(ck.skipped, f)
                dist.barrier()
                if str(rank) in a.kill_ranks.split(","):
                    os.kill(os.getpid(), signal.SIGKILL)
        skipped = list(ck.skipped)
    with open(f"{a.out}.{rank}.json", "w") as f:
        json.dump(fingerprint(state), f, sort_keys=True)
    with open(f"{a.out}.{rank}.skipped.json", "w") as f:
        json.dump(skipped, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
