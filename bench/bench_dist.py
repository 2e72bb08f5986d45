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
barriers; reported: medians over rounds of each time and of the per-round ratio epochal/DCP.
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

    from epochal.integrations.dcp import EpochalStorageReader, EpochalStorageWriter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    n_tensors = 8
    rows = max(world, int(args.mib * (1 << 20) / 4 / n_tensors / 1024) // world * world)

    def state(dim: int, zero: bool) -> dict[str, Any]:
        g = torch.Generator().manual_seed(0)
        out = {}
        for i in range(n_tensors):
            t = torch.zeros(rows, 1024) if zero else torch.randn(rows, 1024, generator=g)
            out[f"layer{i}.weight"] = distribute_tensor(t, mesh, [Shard(dim)])
        return out

    src = state(0, False)
    times: dict[str, list[float]] = {k: [] for k in (
        "save dcp", "save epochal", "load dcp", "load epochal", "reshard dcp", "reshard epochal")}

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
                dst = state(dim, True)
                if who == "dcp":
                    timed(f"{kind} dcp", lambda t=dst, d=dcp_dir: dcp.load(t, storage_reader=dcp.FileSystemReader(d)))
                else:
                    timed(f"{kind} epochal", lambda t=dst, d=ep_dir, r=r: dcp.load(t, storage_reader=EpochalStorageReader(d, step=r)))
                for k in dst:  # both loaded the same bits
                    assert torch.equal(dst[k].full_tensor(), src[k].full_tensor())
        dist.barrier()
        if rank == 0:
            shutil.rmtree(dcp_dir, ignore_errors=True)
    if rank == 0:
        total = rows * 1024 * 4 * n_tensors
        print(f"bench_dist: {world} ranks, {total / (1 << 20):.0f} MiB of float32 DTensors "
              f"({n_tensors} tensors), {args.rounds} rounds; medians")
        print("| operation | DCP s | epochal s | epochal/DCP (median of per-round ratios) |")
        print("|---|---:|---:|---:|")
        for op in ("save", "load", "reshard"):
            d, e = times[f"{op} dcp"], times[f"{op} epochal"]
            ratio = statistics.median(b / a for a, b in zip(d, e))
            print(f"| {op} | {statistics.median(d):.3f} | {statistics.median(e):.3f} | {ratio:.2f}x |")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/epochal_bench_dist")
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
