"""Helpers for the torch.distributed tests: start N gloo ranks on 127.0.0.1 with spawn, and the
rank functions they run (importable by name, as spawn needs)."""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, args: tuple[Any, ...]) -> None:
    os.environ.setdefault("EPOCHAL_QUIET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes of one gloo group; an
    exception in any of them is raised here (torch.multiprocessing's ProcessRaisedException)."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(fn, world, free_port(), args), nprocs=world, join=True)


def full_state(scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The same tensors in every process (a seeded generator): the gathered full state."""
    g = torch.Generator().manual_seed(1234)
    return {
        "w": torch.randn(8, 6, generator=g) * scale,
        "b": torch.randn(5, generator=g, dtype=torch.float64) * scale,
        "h": (torch.randn(4, 4, generator=g) * scale).to(torch.bfloat16),
    }


def no_pickle(*_: Any, **__: Any) -> Any:
    raise AssertionError("pickle/torch.load called on a load path")


def forbid_pickle() -> None:
    """Make unpickling raise in this process (pickle.load/loads, torch.load)."""
    pickle.load = no_pickle  # type: ignore[assignment]
    pickle.loads = no_pickle  # type: ignore[assignment]
    torch.load = no_pickle  # type: ignore[assignment]


def dtensor_state(mesh: Any, full: dict[str, torch.Tensor], w_dim: int, zero: bool = False) -> dict[str, Any]:
    """``w`` sharded on ``w_dim``, ``b`` replicated DTensor, ``h`` a plain (replicated) tensor,
    plus non-tensor values; zeros (to be loaded into) with ``zero``."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def z(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if zero else t.clone()

    return {
        "w": distribute_tensor(z(full["w"]), mesh, [Shard(w_dim)]),
        "b": distribute_tensor(z(full["b"]), mesh, [Replicate()]),
        "h": z(full["h"]),
        "step": 0 if zero else 5,
        "cfg": {"lr": 0.0, "names": []} if zero else {"lr": 0.25, "names": ["a", "b"]},
    }


def check_loaded(sd: dict[str, Any], full: dict[str, torch.Tensor]) -> None:
    """``sd`` (DTensors or plain tensors) holds ``full`` bit for bit, and the plain values."""
    from _torch_bits import bits
    from torch.distributed.tensor import DTensor

    for k, t in full.items():
        got = sd[k]
        if isinstance(got, DTensor):
            # this rank's shard equals the same region of the full tensor
            local = got.to_local()
            offs = [0] * t.dim()
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offs = compute_local_shape_and_global_offset(t.shape, got.device_mesh, got.placements)
            region = t
            for dim, (o, n) in enumerate(zip(offs, shape)):
                region = region.narrow(dim, o, n)
            assert bits(local) == bits(region), k
            got = got.full_tensor()
        assert got.dtype == t.dtype and bits(got) == bits(t), k
    assert sd["step"] == 5 and sd["cfg"] == {"lr": 0.25, "names": ["a", "b"]}, (sd["step"], sd["cfg"])


def dcp_two_ranks(rank: int, world: int, path: str) -> None:
    """Save a sharded state from 2 ranks, then load it back (same layout, and resharded to
    Shard(1)) with unpickling made to raise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from epochal.integrations.dcp import EpochalStorageReader, EpochalStorageWriter

    mesh = init_device_mesh("cpu", (world,))
    full = full_state()
    dcp.save(dtensor_state(mesh, full, 0), storage_writer=EpochalStorageWriter(path))
    forbid_pickle()
    for w_dim in (0, 1):
        sd = dtensor_state(mesh, full, w_dim, zero=True)
        dcp.load(sd, storage_reader=EpochalStorageReader(path))
        check_loaded(sd, full)


def dcp_load_two_ranks(rank: int, world: int, path: str, step: int) -> None:
    """Load step ``step`` (saved by one process) into 2 ranks' shards, unpickling forbidden."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from epochal.integrations.dcp import EpochalStorageReader

    forbid_pickle()
    mesh = init_device_mesh("cpu", (world,))
    sd = dtensor_state(mesh, full_state(2.0), 1, zero=True)
    dcp.load(sd, storage_reader=EpochalStorageReader(path, step=step))
    check_loaded(sd, full_state(2.0))
