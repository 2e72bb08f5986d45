#!/usr/bin/env python
"""Benchmark: sharded saves and loads with DCP's FileSystemWriter/Reader vs epochal's DCP
storage (EpochalStorageWriter/Reader: a native db per rank, every byte checksummed on write and
checked on read), on the same ranks and the same state, in one run.

    PYTHONPATH=src python bench/bench_dist.py --ranks 2 --mib 256 --rounds 5 --dir /tmp/epochal_bench_dist

``--ranks`` gloo processes on 127.0.0.1 hold ``--mib`` MiB of float32 DTensors in all, sharded
on dim 0 of a 1-D mesh. Each round saves the state with both (the order alternates), then
loads it back with both into the same layout and into another one (sharded on dim 1: every
rank reads the parts of every saved chunk it overlaps). Saves end durable on both sides
(DCP: ``sync_files=True``; epochal fsyncs and commits a manifest). Times are rank 0's, between
barriers; reported: medians over rounds of each time, and median, min and max of the
per-round ratio epochal/DCP.
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
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from epochal.integrations.dcp import EpochalStorageReader, EpochalStorageWriter

    mesh = _dist.join(rank, world, port)
    rows = _dist.rows_for(args.mib, world)
    src = _dist.dtensor_state(mesh, rows)
    full = {k: v.full_tensor() for k, v in src.items()}
    times: dict[str, list[float]] = {k: [] for k in (
        "save dcp", "save epochal", "load dcp", "load epochal", "reshard dcp", "reshard epochal")}
    loads = []

    def timed(key: str, fn: Any) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times[key].append(time.perf_counter() - t0)

    for r in range(args.rounds):
        dcp_dir, ep_dir = os.path.join(args.dir, f"dcp{r}"), os.path.join(args.dir, "epochal")
        order = ["dcp", "epochal"] if r % 2 == 0 else ["epochal", "dcp"]
        for who in order:
            if who == "dcp":
                timed("save dcp", lambda d=dcp_dir: dcp.save(src, storage_writer=dcp.FileSystemWriter(d, sync_files=True)))
            else:
                timed("save epochal", lambda d=ep_dir, r=r: dcp.save(src, storage_writer=EpochalStorageWriter(d, step=r)))
        for kind, dim in (("load", 0), ("reshard", 1)):
            for who in order:
                dst = _dist.dtensor_state(mesh, rows, dim, zero=True)
                if who == "dcp":
                    timed(f"{kind} dcp", lambda t=dst, d=dcp_dir: dcp.load(t, storage_reader=dcp.FileSystemReader(d)))
                else:
                    timed(f"{kind} epochal", lambda t=dst, d=ep_dir, r=r: dcp.load(t, storage_reader=EpochalStorageReader(d, step=r)))
                for k in dst:  # both loaded the same bits
                    assert torch.equal(dst[k].full_tensor(), full[k])
        loads.append(_dist.load_average())
        dist.barrier()
        if rank == 0:
            shutil.rmtree(dcp_dir, ignore_errors=True)
    if rank == 0:
        total = rows * 1024 * 4 * _dist.N_TENSORS
        print(f"bench_dist: {world} ranks, {total / (1 << 20):.0f} MiB of float32 DTensors "
              f"({_dist.N_TENSORS} tensors), {args.rounds} rounds; medians; load average per round: "
              f"{' '.join(loads)}")
        print("| operation | DCP s | epochal s | epochal/DCP: median (min-max) of per-round ratios |")
        print("|---|---:|---:|---:|")
        for op in ("save", "load", "reshard"):
            d, e = times[f"{op} dcp"], times[f"{op} epochal"]
            med, lo, hi = _dist.ratio(e, d)
            print(f"| {op} | {statistics.median(d):.3f} | {statistics.median(e):.3f} | {med:.2f}x ({lo:.2f}-{hi:.2f}) |")
    dist.destroy_process_group()


if __name__ == "__main__":
    _dist.launch(__doc__ or "", _rank, mib=256, rounds=5, directory="/tmp/epochal_bench_dist")
