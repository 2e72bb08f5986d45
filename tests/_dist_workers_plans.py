"""Rank functions for tests/test_distributed_plans.py (saves that reuse the kept DCP plans),
importable by name as torch.multiprocessing's spawn needs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _dist_workers import train_one
from _dist_workers_more import fsdp_model, gathered

#: collectives of torch.distributed counted by :func:`count_main_thread_collectives`
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "gather", "scatter", "barrier", "all_gather_object",
               "gather_object", "broadcast_object_list", "scatter_object_list", "reduce_scatter")


def count_main_thread_collectives() -> tuple[dict[str, int], Callable[[], None]]:
    """Wrap torch.distributed's collectives so that the calls made from the main thread are
    counted (by name) in the dict returned; other threads' calls are not. The callable puts
    the real ones back."""
    seen: dict[str, int] = {}
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str) -> Callable[..., Any]:
        def wrapped(*a: Any, **kw: Any) -> Any:
            if threading.current_thread() is threading.main_thread():
                seen[name] = seen.get(name, 0) + 1
            return real[name](*a, **kw)
        return wrapped

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))

    def restore() -> None:
        for name, fn in real.items():
            setattr(dist, name, fn)

    return seen, restore


def plans_kept(rank: int, world: int, path: str, async_save: bool) -> None:
    """FSDP2 on 2 ranks: step 1 plans in full; steps 2 and 3 (same structure, new values)
    reuse the plans, and with async_save the save makes no collective on the training thread; at step 4
    rank 1 alone changes the shape of a tensor of its own (a new structure on one rank: every
    rank plans in full again) and step 5 reuses those plans. Every step restores bit-equal to the
    gathered state at its save."""
    import epochal

    model, opt = fsdp_model(world, 0)
    at: dict[int, dict[str, str]] = {}

    def extra(step: int) -> torch.Tensor:  # rank 1's grows a row at step 4
        rows = 3 if step >= 4 and rank == 1 else 2
        return torch.arange(rows * 3.0).reshape(rows, 3) * step + rank

    with epochal.Checkpointer(path, async_save=async_save, per_rank=["extra"]) as ck:
        for step in (1, 2, 3, 4, 5):
            train_one(model, opt, step)
            at[step] = gathered(model, opt)
            state: dict[str, Any] = {"model": model, "opt": opt, "note": f"s{step}", "extra": extra(step)}
            if async_save and step in (2, 3):
                ck.wait()  # (commits the step before: one agreement)
                seen, restore = count_main_thread_collectives()
                try:
                    ck.save(step, state)
                finally:
                    restore()
                assert seen == {}, seen
            else:
                ck.save(step, state)
            train_one(model, opt, 100 + step)  # the live state moves on during an async write
        ck.wait()
        assert (ck.distributed._plans.hits, ck.distributed._plans.misses) == (3, 2), (ck.distributed._plans.hits, ck.distributed._plans.misses)
        assert ck.steps() == [1, 2, 3, 4, 5]
        for step in (1, 3, 4, 5):
            fresh, fopt = fsdp_model(world, 9)
            got_extra = torch.zeros_like(extra(step))
            state = {"model": fresh, "opt": fopt, "note": "", "extra": got_extra}
            ck.distributed._load(step, state)
            got = gathered(fresh, fopt)
            if rank == 0:
                assert got == at[step], (step, sorted(k for k in at[step] if got.get(k) != at[step][k]))
            assert state["note"] == f"s{step}", state["note"]
            assert torch.equal(got_extra, extra(step)), (step, got_extra)


def async_write_fails_on_one_rank(rank: int, world: int, path: str) -> None:
    """async_save on 2 ranks: rank 1's background write of step 2 fails. save() returns on
    both (nothing collective there); wait() raises on both, rank 0's error naming rank 1 and
    its reason; step 2 is never committed; step 3 then saves and restores bit-equal."""
    import epochal
    import epochal.integrations.dcp.storage as storage
    from epochal.checkpoint.location.view import CheckpointDirectory

    torch.manual_seed(0)  # the same (replicated) model on both ranks
    model = torch.nn.Linear(4, 3)
    with epochal.Checkpointer(path, async_save=True) as ck:
        ck.save(1, {"model": model, "step": 1})
        ck.wait()
        real = storage.write_native
        if rank == 1:
            def broken(*a: Any, **k: Any) -> int:
                raise OSError(28, "No space left on device (injected)")
            storage.write_native = broken  # type: ignore[assignment]
        ck.save(2, {"model": model, "step": 2})  # returns: the write fails in the background
        try:
            ck.wait()
            raise AssertionError("a background save with rank 1's write failed was committed")
        except OSError as ex:
            assert rank == 1 and "injected" in str(ex), ex
        except epochal.errors.CheckpointError as ex:
            assert rank == 0 and "rank 1 failed to" in str(ex) and "injected" in str(ex), ex
        storage.write_native = real
        assert CheckpointDirectory(path).committed_epochs() == [1]
        with torch.no_grad():
            model.weight.add_(1.0)
        at3 = {k: v.clone() for k, v in model.state_dict().items()}
        ck.save(3, {"model": model, "step": 3})
        ck.wait()
        assert CheckpointDirectory(path).committed_epochs() == [1, 3]
        fresh = torch.nn.Linear(4, 3)
        state: dict[str, Any] = {"model": fresh, "step": 0}
        assert ck.restore(state) == 3 and state["step"] == 3
        assert all(torch.equal(v, at3[k]) for k, v in fresh.state_dict().items())


def url_saves(rank: int, world: int, url: str, opts: dict[str, Any]) -> None:
    """A DistributedCheckpointer on an s3:// URL (2 ranks): two synchronous saves and one
    background save of DTensors (w sharded on dim 0) and plain values, then a restore into
    another sharding (w on dim 1), bit-equal, with unpickling made to raise."""
    from _dist_workers import check_loaded, dtensor_state, forbid_pickle, full_state
    from torch.distributed.device_mesh import init_device_mesh

    import epochal

    mesh = init_device_mesh("cpu", (world,))
    for async_save, steps in ((False, (1, 2)), (True, (3,))):
        with epochal.Checkpointer(url, storage_options=opts, async_save=async_save) as ck:
            assert type(ck).__name__ == "Checkpointer" and type(ck.distributed).__name__ == "DistributedCheckpointer"
            for step in steps:
                ck.save(step, dtensor_state(mesh, full_state(float(step)), 0))
    forbid_pickle()
    with epochal.Checkpointer(url, storage_options=opts) as ck:
        assert ck.steps() == [1, 2, 3]
        into = dtensor_state(mesh, full_state(), 1, zero=True)
        assert ck.restore(into) == 3
        check_loaded(into, full_state(3.0))
