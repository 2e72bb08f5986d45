#!/usr/bin/env python
"""Benchmark: how long a background save blocks the training loop under torch.distributed:
epochal's ``Checkpointer(async_save=True).save`` vs ``dcp.async_save`` (FileSystemWriter) vs a
plain copy of the rank's local shards (``clone``), on the same ranks and state, in one run.

    PYTHONPATH=src python bench/bench_dist_async.py --ranks 2 --mib 128 --rounds 7 --dir /tmp/epochal_bench_dist_async

``--ranks`` gloo processes on 127.0.0.1 hold ``--mib`` MiB of float32 DTensors in all, sharded
on dim 0. Each round (the order of the three alternates) times, on rank 0, the call only: the
save returning (the write then runs on; it is waited for, untimed, before the next one), and
the copy. Reported: medians of each, and medians of the per-round ratios to the copy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import time
from typing import Any


def _rank(rank: int, world: int, port: int, args: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import epochal

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    n_tensors = 8
    rows = max(world, int(args.mib * (1 << 20) / 4 / n_tensors / 1024) // world * world)
    g = torch.Generator().manual_seed(0)
    src = {f"layer{i}.weight": distribute_tensor(torch.randn(rows, 1024, generator=g), mesh, [Shard(0)])
           for i in range(n_tensors)}
    times: dict[str, list[float]] = {"epochal": [], "dcp": [], "copy": []}
    ck = epochal.Checkpointer(os.path.join(args.dir, "epochal"), async_save=True, keep_last=1)
    pending: Any = None
    for r in range(args.rounds):
        order = ["epochal", "dcp", "copy"]
        order = order[r % 3:] + order[:r % 3]
        for who in order:
            dist.barrier()
            t0 = time.perf_counter()
            if who == "epochal":
                ck.save(r, src)
            elif who == "dcp":
                d = os.path.join(args.dir, f"dcp{r}")
                pending = dcp.async_save(src, storage_writer=dcp.FileSystemWriter(d, sync_files=True))
            else:
                host = [t.to_local().clone() for t in src.values()]
            times[who].append(time.perf_counter() - t0)
            if who == "epochal":
                ck.wait()
            elif who == "dcp":
                pending.result()
            else:
                del host
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(args.dir, f"dcp{r}"), ignore_errors=True)
    ck.close()
    if rank == 0:
        total = rows * 1024 * 4 * n_tensors
        print(f"bench_dist_async: {world} ranks, {total / (1 << 20):.0f} MiB of float32 DTensors "
              f"({total / world / (1 << 20):.0f} MiB per rank), {args.rounds} rounds; rank 0, medians")
        print("| call | blocked s | / copy of the local shards (median of per-round ratios) |")
        print("|---|---:|---:|")
        for who in ("copy", "epochal", "dcp"):
            ratio = statistics.median(a / c for a, c in zip(times[who], times["copy"]))
            print(f"| {who} | {statistics.median(times[who]):.3f} | {ratio:.2f}x |")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mib", type=float, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default="/tmp/epochal_bench_dist_async")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_rank, args=(args.ranks, port, args), nprocs=args.ranks, join=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
