"""Rank functions of tests/test_dist_bytes.py (importable by name, as the start method needs):
a sharded state saved across ranks with ``incremental=True`` (its big part never changes) or
``compression="zstd"``, and its steps restored by ranks that never saw them, on the same or
another world size."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def _state(world: int, fill: bool) -> dict[str, Any]:
    """A base of 8 MiB (bf16 weights of N(0, 0.02): compressible) and a small fp32 head, both
    sharded on dim 0 over the ranks."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    base = (torch.randn(4096, 1024, generator=g) * 0.02).to(torch.bfloat16) if fill else \
        torch.zeros(4096, 1024, dtype=torch.bfloat16)
    head = torch.randn(64, 64, generator=g) if fill else torch.zeros(64, 64)
    return {"base": distribute_tensor(base, mesh, [Shard(0)]), "head": distribute_tensor(head, mesh, [Shard(0)]),
            "step": 0}


def _digest(state: dict[str, Any]) -> str:
    """The full tensors' bytes (collective: every rank gathers them)."""
    h = hashlib.sha256()
    for k in ("base", "head"):
        t = state[k]
        assert isinstance(t, DTensor)
        h.update(t.full_tensor().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_steps(rank: int, world: int, path: str, out: str, async_save: bool, options: dict[str, Any]) -> None:
    """Steps 1-4, only the head changing between them, keep_last=2, the Checkpointer's
    ``options``; each step's digest of the full state to ``out/saved.json`` (rank 0)."""
    import epochal

    state = _state(world, fill=True)
    seen = {}
    with epochal.Checkpointer(path, keep_last=2, async_save=async_save, **options) as ck:
        for step in (1, 2, 3, 4):
            with torch.no_grad():
                state["head"].to_local().add_(float(step))
            state["step"] = step
            ck.save(step, state)
            seen[step] = _digest(state)
    if rank == 0:
        with open(os.path.join(out, "saved.json"), "w") as f:
            json.dump(seen, f)


def restore_steps(rank: int, world: int, path: str, out: str, options: dict[str, Any] | None = None) -> None:
    """Restore each committed step into zeroed shards of this world: bit-equal to the state
    the saving ranks had (``options``: fsspec's, at a URL)."""
    import epochal
    from epochal.integrations.distributed import DistributedCheckpointer

    with open(os.path.join(out, "saved.json")) as f:
        seen = json.load(f)
    with epochal.Checkpointer(path, storage_options=options) as ck:
        steps = ck.steps()
    assert steps == [3, 4], steps
    for step in steps:
        state = _state(world, fill=False)
        with DistributedCheckpointer(path, storage_options=options) as dc:
            dc._load(step, state)
        assert state["step"] == step and _digest(state) == seen[str(step)], (rank, world, step)
