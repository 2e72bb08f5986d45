#!/usr/bin/env python
"""Benchmark: how long a background save blocks the training loop under torch.distributed:
epochal's ``Checkpointer(async_save=True).save`` vs ``dcp.async_save`` (FileSystemWriter) vs a
plain copy of the rank's local shards (``clone``), on the same ranks and state, in one run.

    PYTHONPATH=src python bench/bench_dist_async.py --ranks 2 --mib 128 --rounds 7 --dir /tmp/epochal_bench_dist_async

``--ranks`` gloo processes on 127.0.0.1 hold ``--mib`` MiB of float32 DTensors in all, sharded
on dim 0. Each round (the order of the three rotates) times, on rank 0, the call only: the
save returning (the write then runs on; it is waited for, untimed, before the next one), and
the copy. One untimed save of each kind first (epochal's first save plans in full; later
ones reuse the plans while the state's structure holds). Reported: medians of each, and
median, min and max of the per-round ratios to the copy.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dist  # noqa: E402


def _rank(rank: int, world: int, port: int, args: Any) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import epochal

    mesh = _dist.join(rank, world, port)
    rows = _dist.rows_for(args.mib, world)
    src = _dist.dtensor_state(mesh, rows)
    times: dict[str, list[float]] = {"epochal": [], "dcp": [], "copy": []}
    ck = epochal.Checkpointer(os.path.join(args.dir, "epochal"), async_save=True, keep_last=1)
    loads = []
    pending: Any = None
    for r in range(-1, args.rounds):  # round -1: untimed warm-up
        order = ["epochal", "dcp", "copy"]
        order = order[r % 3:] + order[:r % 3]
        for who in order:
            dist.barrier()
            t0 = time.perf_counter()
            if who == "epochal":
                ck.save(r + 1, src)
            elif who == "dcp":
                d = os.path.join(args.dir, f"dcp{r}")
                pending = dcp.async_save(src, storage_writer=dcp.FileSystemWriter(d, sync_files=True))
            else:
                host = [t.to_local().clone() for t in src.values()]
            if r >= 0:
                times[who].append(time.perf_counter() - t0)
            if who == "epochal":
                ck.wait()
            elif who == "dcp":
                pending.result()
            else:
                del host
        loads.append(_dist.load_average())
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(args.dir, f"dcp{r}"), ignore_errors=True)
    hits = ck._plans.hits  # saves that reused the first one's plans
    ck.close()
    if rank == 0:
        total = rows * 1024 * 4 * _dist.N_TENSORS
        print(f"bench_dist_async: {world} ranks, {total / (1 << 20):.0f} MiB of float32 DTensors "
              f"({total / world / (1 << 20):.0f} MiB per rank), {args.rounds} rounds; rank 0, medians; "
              f"epochal saves with kept plans: {hits}; load average per round: {' '.join(loads)}")
        print("| call | blocked s | / copy of the local shards: median (min-max) of per-round ratios |")
        print("|---|---:|---:|")
        for who in ("copy", "epochal", "dcp"):
            med, lo, hi = _dist.ratio(times[who], times["copy"])
            print(f"| {who} | {statistics.median(times[who]):.4f} | {med:.2f}x ({lo:.2f}-{hi:.2f}) |")
    dist.destroy_process_group()


if __name__ == "__main__":
    _dist.launch(__doc__ or "", _rank, mib=128, rounds=7, directory="/tmp/epochal_bench_dist_async")
