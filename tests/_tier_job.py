"""A small training loop on a Checkpointer with a local tier, run as its own process by
test_tier.py: resume, train to ``--steps`` saving every step, optionally die by SIGKILL at a
chosen point; prints one ``RESUMED <step> <source>`` line and writes a fingerprint of its final
state (every tensor's bytes, the RNG, the data position) as JSON.

    python _tier_job.py DIR LOCAL OUT --steps 6 --persist 3 [--async] [--kill-after 4]
        [--kill-in local|durable --kill-step 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _faults import FaultyStore  # noqa: E402

from epochal import Checkpointer, RNGState  # noqa: E402
from epochal.storage.io.seam import local_store  # noqa: E402


def fingerprint(state: dict[str, Any]) -> dict[str, str]:
    """A digest of every entry's bytes (tensors by raw bytes, the rest by repr)."""
    out: dict[str, str] = {}

    def walk(prefix: str, v: Any) -> None:
        if hasattr(v, "state_dict"):
            v = v.state_dict()
        if isinstance(v, dict):
            for k in v:
                walk(f"{prefix}/{k}", v[k])
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{prefix}/{i}", x)
        elif isinstance(v, torch.Tensor):
            t = v.detach().contiguous().reshape(-1)
            out[prefix] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()
        else:
            out[prefix] = repr(v)

    for name, value in state.items():
        walk(name, value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("local")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--persist", type=int, default=3)
    ap.add_argument("--async", dest="async_save", action="store_true")
    ap.add_argument("--kill-after", type=int, default=-1, help="SIGKILL once this step is saved")
    ap.add_argument("--kill-in", choices=["local", "durable"], help="SIGKILL inside this write")
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--width", type=int, default=16)
    a = ap.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.Dropout(0.2),
                                torch.nn.Linear(a.width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state: dict[str, Any] = {"model": model, "opt": opt, "rng": RNGState(), "position": 0, "history": []}

    faults = FaultyStore()
    if a.kill_in is not None:
        where = a.local if a.kill_in == "local" else a.path
        tail = f"local.{a.kill_step}"
        faults.on("write", lambda p: os.kill(os.getpid(), signal.SIGKILL),
                  when=lambda p: p.startswith(where) and tail in os.path.basename(p))
    with local_store(faults), Checkpointer(a.path, local=a.local, persist_every=a.persist, local_keep=2,
                                           async_save=a.async_save) as ck:
        step = ck.restore(state) or 0
        report = ck.last_restore
        print("RESUMED", step, report.source if report is not None else None, flush=True)
        while step < a.steps:
            step += 1
            x = torch.randn(8, a.width)
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["position"] += 8
            state["history"].append(round(loss.item(), 6))
            ck.save(step, state)
            if step == a.kill_after:
                ck.wait()
                os.kill(os.getpid(), signal.SIGKILL)
    with open(a.out, "w") as f:
        json.dump(fingerprint(state), f, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
