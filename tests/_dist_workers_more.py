"""Rank functions for tests/test_distributed_more.py (4 ranks, 2-D meshes) and
tests/test_when_busy.py (skipped saves across ranks), importable by name as
torch.multiprocessing's spawn needs."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from _dist_workers import full_state, tiny_model, train_one
from _torch_bits import bits


def fsdp_model(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = tiny_model(seed)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def gathered(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """The full (unsharded) model and optimizer state, as hex bits by name (collective; only
    rank 0 gets it, the others an empty dict)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
    full = get_model_state_dict(model, options=opts)
    fopt = get_optimizer_state_dict(model, opt, options=opts)
    flat = {f"model.{k}": bits(v).hex() for k, v in full.items()}
    flat.update({f"opt.{p}.{k}": bits(v).hex() for p, s in fopt.get("state", {}).items()
                 for k, v in s.items()})
    return flat if dist.get_rank() == 0 else {}


def fsdp_reshard(rank: int, world: int, path: str, expect: str, step: int, note: str, save_to: str) -> None:
    """Restore ``step`` (saved by another world size) into an FSDP2 model on ``world`` ranks:
    the gathered full state equals ``expect`` bit for bit. With ``save_to``: one more training
    step, a save as step + 2, and its gathered full state written there."""
    import epochal

    model, opt = fsdp_model(world, 7)
    state: dict[str, Any] = {"model": model, "opt": opt, "note": ""}
    with epochal.Checkpointer(path) as ck:
        assert ck.restore(state) == step
        assert state["note"] == note
        got = gathered(model, opt)
        if rank == 0:
            with open(expect) as f:
                want = json.load(f)
            assert got == want, sorted(k for k in want if got.get(k) != want[k])
        if save_to:
            train_one(model, opt, 11)
            ck.save(step + 2, {"model": model, "opt": opt, "note": f"fsdp{world}"})
            full = gathered(model, opt)
            if rank == 0:
                with open(save_to, "w") as f:
                    json.dump(full, f)


def mesh_state(shape: tuple[int, ...], placements: dict[str, tuple[str, ...]], zero: bool) -> dict[str, Any]:
    """full_state()'s tensors as DTensors on a CPU mesh of ``shape`` with the placements
    named ("S0", "S1", "R"), plus a plain value; zeros with ``zero``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    names = ("dp", "tp")[: len(shape)]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    kinds = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    full = full_state()
    out: dict[str, Any] = {
        k: distribute_tensor(torch.zeros_like(t) if zero else t.clone(), mesh, [kinds[p] for p in placements[k]])
        for k, t in full.items()
    }
    out["cfg"] = {"mesh": []} if zero else {"mesh": list(shape)}
    return out


def check_mesh_state(state: dict[str, Any], saved_shape: list[int]) -> None:
    """Each rank's shard equals its region of the full tensor, and the gathered tensor the
    full one, bit for bit."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for k, t in full_state().items():
        got = state[k]
        shape, offs = compute_local_shape_and_global_offset(t.shape, got.device_mesh, got.placements)
        region = t
        for d, (o, n) in enumerate(zip(offs, shape)):
            region = region.narrow(d, o, n)
        assert bits(got.to_local()) == bits(region), (k, got.placements)
        assert bits(got.full_tensor()) == bits(t), k
    assert state["cfg"] == {"mesh": saved_shape}, state["cfg"]


#: placements saved on the (2, 2) mesh, and those loaded into on each other mesh
SAVED_2D = {"w": ("S0", "S1"), "b": ("R", "S0"), "h": ("S1", "R")}
LOAD_INTO: dict[tuple[int, ...], dict[str, tuple[str, ...]]] = {
    (2, 2): {"w": ("S1", "S0"), "b": ("S0", "R"), "h": ("R", "S0")},
    (4,): {"w": ("S1",), "b": ("S0",), "h": ("R",)},
    (1, 2): {"w": ("R", "S0"), "b": ("S0", "S0"), "h": ("S0", "S1")},
    (2, 1): {"w": ("S1", "R"), "b": ("R", "R"), "h": ("S0", "S1")},
}


def four_ranks(rank: int, world: int, fsdp_path: str, expect: str, save_to: str, mesh_path: str) -> None:
    """4 ranks: FSDP2 2 -> 4 (then a 4-rank save), and DTensors saved on a (2, 2) mesh then
    restored into the same mesh with other placements and into a 1-D mesh of 4."""
    import epochal

    fsdp_reshard(rank, world, fsdp_path, expect, 4, "fsdp", save_to)
    with epochal.Checkpointer(mesh_path) as ck:
        ck.save(1, mesh_state((2, 2), SAVED_2D, zero=False))
        for shape in ((2, 2), (4,)):
            state = mesh_state(shape, LOAD_INTO[shape], zero=True)
            assert ck.restore(state) == 1
            check_mesh_state(state, [2, 2])
    dist.barrier()


def two_ranks(rank: int, world: int, fsdp_path: str, expect: str, mesh_path: str) -> None:
    """2 ranks: FSDP2 4 -> 2, and the (2, 2)-mesh step restored into (1, 2) and (2, 1) meshes."""
    import epochal

    fsdp_reshard(rank, world, fsdp_path, expect, 6, "fsdp4", "")
    with epochal.Checkpointer(mesh_path) as ck:
        for shape in ((1, 2), (2, 1)):
            state = mesh_state(shape, LOAD_INTO[shape], zero=True)
            assert ck.restore(state) == 1
            check_mesh_state(state, [2, 2])


def async_saves(rank: int, world: int, path: str) -> None:
    """async_save=True on 2 ranks (FSDP2): save returns with the rank's part snapshotted; the
    live model trains on (in place) while the thread writes; the step is committed at the next
    save / wait; a restore is bit-equal to the gathered state at the save."""
    import epochal
    from epochal.checkpoint.location.view import CheckpointDirectory

    model, opt = fsdp_model(world, 0)
    at: dict[int, dict[str, str]] = {}
    with epochal.Checkpointer(path, async_save=True) as ck:
        assert ck.async_save
        for step in (1, 2):
            train_one(model, opt, step)
            at[step] = gathered(model, opt)
            ck.save(step, {"model": model, "opt": opt, "step": step})
            # step - 1 is committed by now (this save waited for it), step not yet
            assert CheckpointDirectory(path).committed_epochs() == list(range(1, step)), step
            train_one(model, opt, 10 + step)  # changes the live tensors the save took
        ck.wait()
        assert CheckpointDirectory(path).committed_epochs() == [1, 2]
        fresh, fopt = fsdp_model(world, 5)
        state: dict[str, Any] = {"model": fresh, "opt": fopt, "step": 0}
        assert ck.restore(state) == 2 and state["step"] == 2
        got = gathered(fresh, fopt)
        if rank == 0:
            assert got == at[2], sorted(k for k in at[2] if got.get(k) != at[2][k])
            assert got != at[1]
        ck.save(3, {"model": model, "opt": opt, "step": 3})
    # close() committed step 3
    assert CheckpointDirectory(path).committed_epochs() == [1, 2, 3]


def skipped_saves(rank: int, world: int, path: str, out: str) -> None:
    """``when_busy="skip"`` without a local tier: rank 1's background writes take 1.5 s longer;
    saves 2-5, made while step 1's write runs, are skipped on both ranks; step 6, after a wait,
    is written. The gathered state at step 6 goes to ``out`` (rank 0)."""
    import threading
    import time

    import epochal
    from epochal.integrations.dcp import storage

    if rank == 1:
        write = storage.EpochalStorageWriter.write_data

        def slow(self, *args, **kw):  # type: ignore[no-untyped-def]
            if threading.current_thread() is not threading.main_thread():
                time.sleep(1.5)
            return write(self, *args, **kw)

        storage.EpochalStorageWriter.write_data = slow  # type: ignore[method-assign]
    model, opt = fsdp_model(world, 0)
    with epochal.Checkpointer(path, async_save=True, when_busy="skip") as ck:
        for step in range(1, 6):
            train_one(model, opt, step)
            ck.save(step, {"model": model, "opt": opt, "step": step})
        ck.wait()
        assert ck.skipped == [2, 3, 4, 5], (rank, ck.skipped)
        train_one(model, opt, 6)
        ck.save(6, {"model": model, "opt": opt, "step": 6})
        at = gathered(model, opt)
    assert ck.steps() == [1, 6], ck.steps()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(at, f)


def restore_gathered(rank: int, world: int, path: str, out: str) -> None:
    """The newest step restored into a fresh model: its gathered state equals ``out``'s."""
    import epochal

    model, opt = fsdp_model(world, 5)
    state: dict[str, Any] = {"model": model, "opt": opt, "step": 0}
    with epochal.Checkpointer(path) as ck:
        assert ck.restore(state) == 6 and state["step"] == 6
    got = gathered(model, opt)
    if rank == 0:
        with open(out) as f:
            assert got == json.load(f)
