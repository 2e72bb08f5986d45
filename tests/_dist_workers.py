"""What the torch.distributed tests share: start N gloo ranks on 127.0.0.1, and the rank
functions they run (importable by name, as the start method needs).

Ranks start from multiprocessing's fork server (tests/_fresh.py), which imports torch, DCP and
epochal once per test process: each rank is a fresh process that has imported those modules
and done nothing else, and starts in milliseconds instead of the seconds a new interpreter
spends importing them."""

from __future__ import annotations

import gc
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


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, args: tuple[Any, ...],
           env: dict[str, str]) -> None:
    os.environ.clear()  # the environment of the run_ranks call, not the fork server's
    os.environ.update(env)
    os.environ.setdefault("EPOCHAL_QUIET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        gc.collect()  # (as a job's end should: cyclic garbage of DCP freed while the group lives)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes of one gloo group (forked by
    the fork server, see the module doc); an exception in any of them is raised here
    (torch.multiprocessing's ProcessRaisedException)."""
    import torch.multiprocessing as mp
    from _fresh import context

    context()  # the fork server's preload (read when the server first starts)
    mp.start_processes(_entry, args=(fn, world, free_port(), args, dict(os.environ)), nprocs=world,
                       join=True, start_method="forkserver")


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


def dcp_load_two_ranks(rank: int, world: int, path: str, step: int, scale: float = 2.0, w_dim: int = 1) -> None:
    """Load step ``step`` into ``world`` ranks' shards (w sharded on ``w_dim``), unpickling
    forbidden."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from epochal.integrations.dcp import EpochalStorageReader

    forbid_pickle()
    mesh = init_device_mesh("cpu", (world,))
    sd = dtensor_state(mesh, full_state(scale), w_dim, zero=True)
    dcp.load(sd, storage_reader=EpochalStorageReader(path, step=step))
    check_loaded(sd, full_state(scale))


# -- the Checkpointer under torch.distributed (tests/test_distributed.py)

def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6))


def train_one(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def missing_rank_data(rank: int, world: int, path: str) -> None:
    """Step 2 fails on rank 1 (never committed); step 3 commits, then loses rank 1's db: the
    restore resumes step 1 on both ranks."""
    import epochal
    import epochal.integrations.dcp.storage as storage
    from epochal.checkpoint.location.view import CheckpointDirectory

    model = tiny_model(0)
    opt = torch.optim.Adam(model.parameters())
    state = {"model": model, "opt": opt, "step": 1}
    ck = epochal.Checkpointer(path)
    assert type(ck).__name__ == "Checkpointer" and type(ck.distributed).__name__ == "DistributedCheckpointer"
    try:  # a plain value that differs per rank would be saved as one rank's: refused on both
        ck.save(0, {**state, "who": [rank]})
        raise AssertionError("a per-rank plain value was saved as one rank's")
    except ValueError as ex:
        assert "['who']" in str(ex) and "per_rank" in str(ex), ex
    assert CheckpointDirectory(path).committed_epochs() == []
    train_one(model, opt, 1)
    ck.save(1, state)
    at1 = {k: v.clone() for k, v in model.state_dict().items()}
    train_one(model, opt, 2)
    real = storage.write_native
    if rank == 1:
        def broken(*a: Any, **k: Any) -> int:
            raise OSError(28, "No space left on device (injected)")
        storage.write_native = broken  # type: ignore[assignment]
    state["step"] = 2
    try:
        ck.save(2, state)
        raise AssertionError("a save with rank 1's data missing returned")
    except OSError as ex:
        assert rank == 1 and "injected" in str(ex), ex
    except Exception as ex:  # rank 0 is told which rank failed, and why
        assert rank == 0 and "rank 1 failed to save step 2" in str(ex) and "injected" in str(ex), ex
    storage.write_native = real
    assert CheckpointDirectory(path).committed_epochs() == [1]
    state["step"] = 3
    ck.save(3, state)
    assert CheckpointDirectory(path).committed_epochs() == [1, 3]
    dist.barrier()
    if rank == 0:
        os.unlink(os.path.join(path, "rank1.3"))
    dist.barrier()
    fresh = tiny_model(9)
    fopt = torch.optim.Adam(fresh.parameters())
    state2: dict[str, Any] = {"model": fresh, "opt": fopt, "step": 0}
    assert ck.restore(state2) == 1
    assert state2["step"] == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at1[k]), k
    # step 4 committed, then one data byte of rank 1's db flipped: rank 1's load finds it and
    # every rank falls back to step 1 together
    train_one(model, opt, 4)
    state["step"] = 4
    ck.save(4, state)
    dist.barrier()
    if rank == 1:
        from epochal.storage.formats.native.reader import NativeFile

        db = os.path.join(path, "rank1.4")
        with NativeFile(db) as f:
            name = next(n for n in f.names() if f.info(n).kind == "torch.tensor" and f.info(n).nbytes >= 16)
            raw = f[name].contiguous().view(torch.uint8).numpy().tobytes()
        data = bytearray(open(db, "rb").read())
        at = data.find(raw)
        assert at > 0
        data[at + 3] ^= 0x01
        with open(db, "r+b") as fh:
            fh.write(bytes(data))
    dist.barrier()
    fresh = tiny_model(9)
    state3: dict[str, Any] = {"model": fresh, "opt": torch.optim.Adam(fresh.parameters()), "step": 0}
    assert ck.restore(state3) == 1
    assert state3["step"] == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at1[k]), k
    ck.close()


def fsdp_save(rank: int, world: int, path: str, out: str) -> None:
    """FSDP2 (fully_shard on a 1-D CPU mesh): one step, a save, and the gathered full state."""
    from _torch_bits import bits
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import epochal

    mesh = init_device_mesh("cpu", (world,))
    model = tiny_model(0)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train_one(model, opt, 1)
    with epochal.Checkpointer(path) as ck:
        ck.save(4, {"model": model, "opt": opt, "note": "fsdp", "rng": epochal.RNGState()})
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=opts)
    fopt = get_optimizer_state_dict(model, opt, options=opts)
    if rank == 0:
        flat = {f"model.{k}": bits(v).hex() for k, v in full.items()}
        flat.update({f"opt.{p}.{k}": bits(v).hex() for p, s in fopt["state"].items() for k, v in s.items()})
        import json

        with open(out, "w") as f:
            json.dump(flat, f)


def fsdp_restore(rank: int, world: int, path: str, expect: str, step: int = 5, note: str = "plain") -> None:
    """Restore ``step`` (saved by one process, or by fsdp_save at any world size: ``note``
    says which) into an FSDP2 model on ``world`` ranks, one included; the gathered full
    state equals the saved one bit for bit."""
    import json

    from _torch_bits import bits
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import epochal

    mesh = init_device_mesh("cpu", (world,))
    model = tiny_model(7)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    state = {"model": model, "opt": opt, "note": ""}
    with epochal.Checkpointer(path) as ck:
        assert ck.restore(state) == step
    assert state["note"] == note
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
    full = get_model_state_dict(model, options=opts)
    fopt = get_optimizer_state_dict(model, opt, options=opts)
    if rank == 0:
        with open(expect) as f:
            want = json.load(f)
        got = {f"model.{k}": bits(v).hex() for k, v in full.items()}
        got.update({f"opt.{p}.{k}": bits(v).hex() for p, s in fopt["state"].items() for k, v in s.items()})
        assert got == want, sorted(k for k in want if got.get(k) != want[k])
