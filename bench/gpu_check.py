#!/usr/bin/env python
"""GPU check of epochal under torch.distributed, one short script for a machine
with one CUDA GPU:

    PYTHONPATH=src python bench/gpu_check.py --dir /tmp/epochal_gpu --mib 512 --rounds 5

1. CUDA tensors (a model, its Adam state, a bf16 tensor) saved by a DistributedCheckpointer
   (sync and async_save) and restored bit-exact onto their live device;
2. an FSDP2 model (fully_shard on a 1-GPU NCCL mesh) and its optimizer saved (sync and
   async_save, training on after the save) and restored
   bit-exact (the gathered full state compared);
3. the time ``save`` blocks the caller with async_save (CUDA -> pinned host snapshot) vs a
   plain device-to-host copy of the same bytes (``.to("cpu")``), medians over ``--rounds``,
   alternating order, and their ratio;
4. the local tier of one process (``Checkpointer(path, local=/dev/shm/..., async_save=True)``):
   the time a save blocks against a copy of the same bytes into pinned host memory allocated
   before (the floor: the device-to-host copy itself) and against ``.to("cpu")``, per round;
   then a save every step of ``--step-ms`` of GPU work, the blocked time per step (the default
   ``when_busy="wait"``, then ``"skip"``); and a restore onto the device from the local tier
   and, the tier wiped, from the store, bit-exact.
Prints one line per check; exits non-zero when a bit differs. ``--only`` runs some checks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time


def _bits(t):  # type: ignore[no-untyped-def]
    return t.detach().cpu().contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes()


def check_tensors(root: str) -> None:
    import torch

    from epochal.integrations.distributed import DistributedCheckpointer

    for async_save in (False, True):
        path = os.path.join(root, f"tensors_{int(async_save)}")
        shutil.rmtree(path, ignore_errors=True)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(16, 64, device="cuda")).sum().backward()
        opt.step()
        extra = torch.randn(1000, 33, device="cuda").to(torch.bfloat16)
        want = {k: _bits(v) for k, v in model.state_dict().items()} | {"extra": _bits(extra)}
        with DistributedCheckpointer(path, async_save=async_save) as ck:
            ck.save(1, {"model": model, "opt": opt, "extra": extra})
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
                extra.add_(1)
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
        into = torch.zeros_like(extra)
        with DistributedCheckpointer(path) as ck:
            ck.restore({"model": fresh, "opt": torch.optim.Adam(fresh.parameters()), "extra": into})
        got = {k: _bits(v) for k, v in fresh.state_dict().items()} | {"extra": _bits(into)}
        ok = got == want and into.is_cuda and all(v.is_cuda for v in fresh.state_dict().values())
        print(f"cuda tensors async_save={async_save}: {'bit-exact' if ok else 'DIFFERENT'}", flush=True)
        if not ok:
            raise SystemExit(1)


def check_fsdp(root: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from epochal.integrations.distributed import DistributedCheckpointer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))

    def build(seed: int):  # type: ignore[no-untyped-def]
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).cuda()
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m, torch.optim.Adam(m.parameters())

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for async_save in (False, True):
        path = os.path.join(root, f"fsdp_{int(async_save)}")
        shutil.rmtree(path, ignore_errors=True)
        model, opt = build(0)
        model(torch.randn(4, 64, device="cuda")).sum().backward()
        opt.step()
        want = {k: _bits(v) for k, v in get_model_state_dict(model, options=opts).items()}
        with DistributedCheckpointer(path, async_save=async_save) as ck:
            ck.save(1, {"model": model, "opt": opt})
            model(torch.randn(4, 64, device="cuda")).sum().backward()  # training goes on
            opt.step()
        fresh, fopt = build(1)
        with DistributedCheckpointer(path) as ck:
            ck.restore({"model": fresh, "opt": fopt})
        got = {k: _bits(v) for k, v in get_model_state_dict(fresh, options=opts).items()}
        ok = got == want
        print(f"fsdp2 on 1 GPU (nccl) async_save={async_save}: {'bit-exact' if ok else 'DIFFERENT'}", flush=True)
        if not ok:
            raise SystemExit(1)
    dist.destroy_process_group()


def blocked_time(root: str, mib: int, rounds: int) -> None:
    import torch

    from epochal.integrations.distributed import DistributedCheckpointer

    n = mib * (1 << 20) // 4 // 8
    state = {f"t{i}": torch.randn(n, device="cuda") for i in range(8)}
    path = os.path.join(root, "blocked")
    shutil.rmtree(path, ignore_errors=True)
    saves, copies = [], []
    with DistributedCheckpointer(path, async_save=True, keep_last=1) as ck:
        for r in range(rounds):
            order = ("save", "copy") if r % 2 == 0 else ("copy", "save")
            for what in order:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if what == "save":
                    ck.save(r + 1, state)
                    saves.append(time.perf_counter() - t0)
                    ck.wait()  # (not timed: the background write)
                else:
                    host = [t.to("cpu") for t in state.values()]
                    torch.cuda.synchronize()
                    copies.append(time.perf_counter() - t0)
                    del host
    ratios = [s / c for s, c in zip(saves, copies)]
    print(f"blocked: async save {statistics.median(saves) * 1e3:.1f} ms, device-to-host copy "
          f"{statistics.median(copies) * 1e3:.1f} ms of {mib} MiB; median ratio {statistics.median(ratios):.2f}x "
          f"over {rounds} rounds", flush=True)


def tier_case(root: str, mib: int, rounds: int, step_ms: float) -> None:
    import torch

    from epochal import Checkpointer

    n = mib * (1 << 20) // 4 // 8
    state = {f"t{i}": torch.randn(n, device="cuda") for i in range(8)}
    store, local = os.path.join(root, "tier_store"), "/dev/shm/epochal_gpu_tier"
    for d in (store, local):
        shutil.rmtree(d, ignore_errors=True)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in state.values()]
    med = statistics.median
    times: dict[str, list[float]] = {"save": [], "pinned": [], "to_cpu": []}
    step = 0
    with Checkpointer(store, local=local, persist_every=4, local_keep=2, async_save=True) as ck:
        for r in range(rounds + 1):  # round 0 is a warm-up (the staging memory is made there)
            order = ("save", "pinned", "to_cpu")[r % 3:] + ("save", "pinned", "to_cpu")[:r % 3]
            for what in order:
                ck.wait()  # (the previous write, not timed)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if what == "save":
                    step += 1
                    ck.save(step, state)
                elif what == "pinned":
                    for src, dst in zip(state.values(), pinned):
                        dst.copy_(src, non_blocking=True)
                    torch.cuda.synchronize()
                else:
                    host = [t.to("cpu") for t in state.values()]
                    del host
                dt = time.perf_counter() - t0
                if r:
                    times[what].append(dt)
        r_pin = [a / b for a, b in zip(times["save"], times["pinned"])]
        r_cpu = [a / b for a, b in zip(times["save"], times["to_cpu"])]
        print(f"tier (one process, {mib} MiB): blocked per save {med(times['save']) * 1e3:.1f} ms, "
              f"pinned copy {med(times['pinned']) * 1e3:.1f} ms, .to('cpu') {med(times['to_cpu']) * 1e3:.1f} ms; "
              f"save/pinned {med(r_pin):.2f}x, save/to_cpu {med(r_cpu):.2f}x; rounds (ms save/pinned/to_cpu): "
              + " ".join(f"{a * 1e3:.0f}/{b * 1e3:.0f}/{c * 1e3:.0f}"
                         for a, b, c in zip(times["save"], times["pinned"], times["to_cpu"])), flush=True)
        # a save every step of step_ms of GPU work: the whole time save() holds the step
        a = torch.randn(4096, 4096, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
        per_mm = (time.perf_counter() - t0) / 20
        k = max(1, int(step_ms / 1e3 / per_mm))

        def every_step(c: Checkpointer, first: int) -> tuple[list[float], int]:
            blocked = []
            for i in range(rounds * 2):
                for _ in range(k):
                    a @ a
                for t in state.values():
                    t.add_(1.0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                c.save(first + i, state)
                blocked.append(time.perf_counter() - t0)
            c.wait()
            return blocked, first + rounds * 2 - 1

        blocked, step = every_step(ck, step + 1)
        want = {name: _bits(t) for name, t in state.items()}
        print(f"tier, a save every step of {k * per_mm * 1e3:.0f} ms of GPU work (when_busy='wait'): blocked per "
              f"save median {med(blocked) * 1e3:.1f} ms (pinned copy {med(times['pinned']) * 1e3:.1f} ms); per step: "
              + " ".join(f"{b * 1e3:.0f}" for b in blocked), flush=True)
    skip_store, skip_local = os.path.join(root, "tier_skip"), "/dev/shm/epochal_gpu_tier_skip"
    with Checkpointer(skip_store, local=skip_local, persist_every=4, local_keep=2, async_save=True,
                      when_busy="skip") as ck:
        blocked, _ = every_step(ck, 1)
        skipped = list(ck.skipped)
    print(f"tier, the same with when_busy='skip': blocked per save median {med(blocked) * 1e3:.1f} ms, in all "
          f"{sum(blocked) / (len(blocked) * med(times['pinned'])):.2f}x the pinned copy; skipped steps {skipped}; "
          "per step: " + " ".join(f"{b * 1e3:.0f}" for b in blocked), flush=True)
    for d in (skip_store, skip_local):
        shutil.rmtree(d, ignore_errors=True)
    for source in ("local", "durable"):
        if source == "durable":
            shutil.rmtree(local)
        into = {name: torch.zeros_like(t) for name, t in state.items()}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with Checkpointer(store, local=local, persist_every=4) as ck:
            got_step = ck.restore(into)
            report = ck.last_restore
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        ok = ({name: _bits(t) for name, t in into.items()} == want and all(t.is_cuda for t in into.values())
              and report is not None and report.source == source and got_step == step)
        print(f"tier restore from {source} ({report.source if report else None}, step {got_step} of {step}): "
              f"{dt * 1e3:.0f} ms, {'bit-exact' if ok else 'DIFFERENT'}", flush=True)
        if not ok:
            raise SystemExit(1)
    shutil.rmtree(local, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/epochal_gpu")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=500.0, help="GPU work per step in the tier's save loop")
    ap.add_argument("--only", default="tensors,fsdp,blocked,tier", help="which checks, comma-separated")
    args = ap.parse_args()
    only = set(args.only.split(","))
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_check.py needs a CUDA device")
    os.makedirs(args.dir, exist_ok=True)
    if "tensors" in only:
        check_tensors(args.dir)
    if "fsdp" in only:
        check_fsdp(args.dir)
    if "blocked" in only:
        blocked_time(args.dir, args.mib, args.rounds)
    if "tier" in only:
        tier_case(args.dir, args.mib, args.rounds, args.step_ms)


if __name__ == "__main__":
    main()
