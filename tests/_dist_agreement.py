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


