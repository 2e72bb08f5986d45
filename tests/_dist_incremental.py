"""Rank functions of tests/test_dist_incremental.py (importable by name, as the start method
needs): a sharded state whose big part never changes, saved with ``incremental=True`` across
ranks, and its steps restored by ranks that never saw them."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def _state(world: int, fill: bool) -> dict[str, Any]:
    """A frozen base of 8 MiB and a small head, both sharded on dim 0 over the ranks."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    base = torch.randn(4096, 512, generator=g) if fill else torch.zeros(4096, 512)
    head = torch.randn(64, 64, generator=g) if fill else torch.zeros(64, 64)
    return {"base": distribute_tensor(base, mesh, [Shard(0)]), "head": distribute_tensor(head, mesh, [Shard(0)]),
            "step": 0}


def _digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for k in ("base", "head"):
        t = state[k]
        assert isinstance(t, DTensor)
        h.update(t.to_local().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_steps(rank: int, world: int, path: str, out: str, async_save: bool) -> None:
    """Steps 1-4, only the head changing between them, keep_last=2; each step's digest of this
    rank's shards to ``out/<rank>.json``."""
    import epochal

    state = _state(world, fill=True)
    seen = {}
    with epochal.Checkpointer(path, incremental=True, keep_last=2, async_save=async_save) as ck:
        for step in (1, 2, 3, 4):
            with torch.no_grad():
                state["head"].to_local().add_(float(step))
            state["step"] = step
            ck.save(step, state)
            seen[step] = _digest(state)
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(seen, f)


def restore_steps(rank: int, world: int, path: str, out: str) -> None:
    """Restore each committed step into zeroed shards: bit-equal to what the saving rank had."""
    import epochal

    with open(os.path.join(out, f"{rank}.json")) as f:
        seen = json.load(f)
    with epochal.Checkpointer(path) as ck:
        steps = ck.steps()
    assert steps == [3, 4], steps
    from epochal.integrations.distributed import DistributedCheckpointer

    for step in steps:
        state = _state(world, fill=False)
        with DistributedCheckpointer(path) as dc:
            dc._load(step, state)
        assert state["step"] == step and _digest(state) == seen[str(step)], (rank, step)
