"""The harness bench_dist.py and bench_dist_async.py share: ``--ranks`` gloo processes on
127.0.0.1 (torch.multiprocessing spawn), each holding its part of ``--mib`` MiB of float32
DTensors on a 1-D CPU mesh, timed on rank 0 between barriers; medians of per-round ratios."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
from collections.abc import Callable
from typing import Any

N_TENSORS = 8


def launch(doc: str, run: Callable[..., None], mib: float, rounds: int, directory: str) -> None:
    """Parse ``--ranks --mib --rounds --dir`` (defaults: 2 and the given ones), make an empty
    ``--dir`` and run ``run(rank, world, port, args)`` on every rank; ``--dir`` is removed after."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mib", type=float, default=mib)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--dir", default=directory)
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(run, args=(args.ranks, port, args), nprocs=args.ranks, join=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


def join(rank: int, world: int, port: int) -> Any:
    """Join the gloo group (one intra-op thread per rank); the 1-D CPU mesh of every rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def rows_for(mib: float, world: int) -> int:
    """Rows of 1024 float32 of each of the N_TENSORS tensors for ``mib`` MiB in all."""
    return max(world, int(mib * (1 << 20) / 4 / N_TENSORS / 1024) // world * world)


def dtensor_state(mesh: Any, rows: int, dim: int = 0, zero: bool = False) -> dict[str, Any]:
    """N_TENSORS (rows, 1024) float32 DTensors sharded on ``dim`` (seeded: the same full
    tensors on every rank and call; zeros with ``zero``)."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(N_TENSORS):
        t = torch.zeros(rows, 1024) if zero else torch.randn(rows, 1024, generator=g)
        out[f"layer{i}.weight"] = distribute_tensor(t, mesh, [Shard(dim)])
    return out


def ratio(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """Median, min and max of the per-round ratios num/den."""
    r = [a / b for a, b in zip(num, den)]
    return statistics.median(r), min(r), max(r)


def load_average() -> str:
    """The 1-minute load average now (for the record of a run)."""
    return f"{os.getloadavg()[0]:.1f}"
