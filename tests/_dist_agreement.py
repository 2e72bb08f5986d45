"""Workers for tests/test_distributed_agreement.py: what the ranks of one collective save
must agree on (spawned by _dist_workers.run_ranks over gloo on 127.0.0.1)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch


def disagreeing_steps(rank: int, world: int, path: str, out: str) -> None:
    """Each rank saves another step (2 and 3, then 4 and 5): every rank must raise, naming both
    steps, with nothing written; then one agreed step commits."""
    import epochal

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    state = {"model": model, "step": 0}
    seen: list[str] = []
    with epochal.Checkpointer(path) as ck:
        for steps in ((2, 3), (4, 5)):
            try:
                ck.save(steps[rank], state)
                seen.append("SAVED")
            except Exception as ex:  # noqa: BLE001 - the test reads what each rank raised
                seen.append(f"{type(ex).__name__}: {ex}")
        ck.save(6, state)
        seen.append("SAVED 6")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)




def _model_and_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def tensor_bytes(*objs: Any) -> dict[str, str]:
    """Every tensor of the objects' state dicts as hex (a bit-for-bit comparison in JSON)."""
    import hashlib

    out: dict[str, str] = {}
    for i, o in enumerate(objs):
        stack: list[tuple[str, Any]] = [(str(i), o.state_dict())]
        while stack:
            path, v = stack.pop()
            if isinstance(v, dict):
                stack.extend((f"{path}/{k}", x) for k, x in v.items())
            elif isinstance(v, (list, tuple)):
                stack.extend((f"{path}/{k}", x) for k, x in enumerate(v))
            elif isinstance(v, torch.Tensor):
                out[path] = hashlib.sha256(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def save_one_process(path: str, out: str) -> None:
    """A debug run at world size 1: a plain Checkpointer saves step 4."""
    import epochal

    model, opt = _model_and_opt(1)
    with epochal.Checkpointer(path) as ck:
        ck.save(4, {"model": model, "opt": opt, "step": 4})
    with open(os.path.join(out, "saved.json"), "w") as f:
        json.dump(tensor_bytes(model, opt), f)


def resume_on_ranks(rank: int, world: int, path: str, out: str) -> None:
    """The run scaled up: DDP over ``world`` ranks restores the one-process step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import epochal

    model, _ = _model_and_opt(10 + rank)  # other values on each rank before the restore
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    ddp(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = {"model": ddp, "opt": opt, "step": 0}
    with epochal.Checkpointer(path) as ck:
        got = ck.restore(state)
    with open(os.path.join(out, f"resumed{rank}.json"), "w") as f:
        json.dump({"step": got, "plain": state["step"], "tensors": tensor_bytes(model, opt),
                   "same_wrapper": state["model"] is ddp}, f)

