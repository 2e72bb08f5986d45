"""A two-node job for the recovery tests on the loopback cluster (importable on its machines:
tests/ is on their PYTHONPATH)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

NODES = ("trainer_0", "trainer_1")


class InitShard:
    def __init__(self, i: int) -> None:
        self.i = i

    def __call__(self, ws: Any) -> None:
        ws[f"w{self.i}"] = np.arange(2000, dtype=np.float64) * (self.i + 1)
        ws[f"log{self.i}"] = np.zeros(0, np.int64)


class TrainShard:
    def __init__(self, i: int, seconds: float = 0.0) -> None:
        self.i, self.seconds = i, seconds

    def __call__(self, ws: Any) -> None:
        log = ws[f"log{self.i}"]
        e = len(log) + 1
        ws[f"w{self.i}"] = ws[f"w{self.i}"] * 1.01 + e
        ws[f"log{self.i}"] = np.append(log, np.int64(e))
        if self.seconds:
            time.sleep(self.seconds)


def build(epochs: int, seconds: float = 0.0) -> Any:
    from epochal import Cluster, Job, Node, Task, epoch_limiter

    with Cluster():
        with Job() as job:
            for i, node in enumerate(NODES):
                with Node(node):
                    with job.init_group:
                        Task(step=InitShard(i))
                    Task(step=TrainShard(i, seconds))
            with Node(NODES[0]):
                epoch_limiter(job, epochs)
    return job


def state(fetch: Any) -> dict[str, bytes]:
    """Every shard's bits, read through ``fetch(node, name)``."""
    return {f"{n}/{k}{i}": np.asarray(fetch(n, f"{k}{i}")).tobytes()
            for i, n in enumerate(NODES) for k in ("w", "log")}
