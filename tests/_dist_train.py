"""One rank of a small DDP training run with epochal's Checkpointer (tests/test_distributed.py
starts two, kills them with SIGKILL and reruns them). Args: checkpoint dir, output JSON
prefix, total steps. Env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (as torchrun sets);
EPOCHAL_TEST_FSDP=1: FSDP2 (fully_shard) and a per-rank StatefulDataLoader instead of DDP and
ResumableSampler; EPOCHAL_TEST_STALL="rank:step:before|after": that rank stalls inside the
save of that step, before or after writing its db (tests/test_distributed_more.py kills it there)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import epochal
from epochal.integrations.torch import ResumableSampler


def say(line: str) -> None:
    """One line in one write: the ranks share torchrun's stdout, and print() writes the text
    and its newline apart, so two ranks' lines could run together."""
    os.write(1, (line + "\n").encode())


def batches(sampler: ResumableSampler, size: int):  # type: ignore[no-untyped-def]
    buf = []
    for i in sampler:
        buf.append(i)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf


def bits_hex(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes().hex()


def stall_inside_save(spec: str, rank: int) -> None:
    """Make this rank hang inside one save (its db not yet written, or written but the step
    not committed), printing "stalling" first: the test kills the ranks there."""
    import epochal.integrations.dcp.storage as storage

    who, step, phase = spec.split(":")
    if int(who) != rank:
        return
    real = storage.write_native

    def slow(path, blobs, **kw):  # type: ignore[no-untyped-def]
        mine = os.path.basename(path) == f"rank{rank}.{step}"
        if mine and phase == "before":
            say(f"rank {rank} stalling before writing step {step}")
            time.sleep(120)
        n = real(path, blobs, **kw)
        if mine and phase == "after":
            say(f"rank {rank} stalling after writing step {step}")
            time.sleep(120)
        return n

    storage.write_native = slow


def local_hex(t: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    return bits_hex(t.to_local() if isinstance(t, DTensor) else t)


def main() -> int:
    ckpt, out, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    fsdp = os.environ.get("EPOCHAL_TEST_FSDP") == "1"
    if os.environ.get("EPOCHAL_TEST_STALL"):
        stall_inside_save(os.environ["EPOCHAL_TEST_STALL"], rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    else:
        ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g)
    sampler = ResumableSampler(range(40), seed=0, num_replicas=2, rank=rank)  # each rank its share
    data: Any = sampler
    if fsdp:  # a StatefulDataLoader over the rank's share, 4 per batch (saves fall mid-epoch)
        from torchdata.stateful_dataloader import StatefulDataLoader

        # (with shuffle=True and a generator instead, torchdata 0.11 restores the rest of the
        # epoch but not the next epoch's order: docs/distributed.md)
        # (its own generator: each iter() draws a base seed, from the global RNG without one)
        data = StatefulDataLoader(list(range(40)), batch_size=4, sampler=sampler, generator=torch.Generator())
    torch.manual_seed(100 + rank)  # per-rank dropout masks
    state = {"model": ddp, "opt": opt, "sched": sched, "sampler": data, "rng": epochal.RNGState(),
             "step": 0, "epoch": 0, "losses": []}
    with epochal.Checkpointer(ckpt, keep_last=2) as ck:
        assert type(ck).__name__ == "Checkpointer" and type(ck.distributed).__name__ == "DistributedCheckpointer", type(ck)
        got = ck.restore(state)
        say(f"rank {rank} resumed {got} pid {os.getpid()}")
        while state["step"] < total:
            sampler.set_epoch(state["epoch"])
            for idx in (data if fsdp else batches(sampler, 8)):
                loss = ((ddp(xs[idx]) - ys[idx]) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                state["step"] += 1
                mean = loss.detach().clone()
                dist.all_reduce(mean)  # the logged loss is the same on every rank (a plain value)
                state["losses"] = [*state["losses"], round(float(mean) / 2, 6)]
                time.sleep(0.03)
                if ck.due(state["step"], every=3) or state["step"] == total:
                    ck.save(state["step"], state)
                if ck.preempted:  # every rank saved this step: leave, not finished
                    say(f"rank {rank} preempted at {state['step']}")
                    dist.destroy_process_group()
                    return 143
                if state["step"] == total:
                    break
            else:
                state["epoch"] += 1
    final = {k: local_hex(v) for k, v in model.state_dict().items()}  # (this rank's shards)
    final.update({f"opt.{i}.{k}": local_hex(v) for i, s in opt.state_dict()["state"].items()
                  for k, v in s.items()})
    final["rng"] = bits_hex(torch.get_rng_state())
    final["sampler"] = json.dumps(sampler.state_dict()) if not fsdp else repr(data.state_dict())
    final["lr"] = repr(sched.get_last_lr())
    final["losses"] = json.dumps(state["losses"])
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(final, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("EPOCHAL_QUIET", "1")
    sys.exit(main())
