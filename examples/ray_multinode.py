"""Three nodes, each in its own Ray process, checkpointing their own state every epoch.

    pip install -e '.[ray]'
    python examples/ray_multinode.py /tmp/ray_ckpt      # kill it (Ctrl-C twice), run it again

Each node keeps its shard of a linear model in its own actor's workspace, trains it on its
own data, and saves it to ``<dir>/node_<i>.<epoch>`` from its own process. The driver commits
each epoch once every node's db is durable; a rerun resumes from the newest committed epoch.
"""

from __future__ import annotations

import sys

import numpy as np

from epochal import (
    Cluster,
    DirectoryMetadataHandler,
    Job,
    JobRunner,
    MultiNodeCheckpointManager,
    Node,
    Preempted,
    Task,
    epoch_limiter,
)
from epochal.sessions.ray import RaySession

NODES = 3


class InitShard:
    def __init__(self, node: int) -> None:
        self.node = node

    def __call__(self, ws) -> None:
        rng = np.random.default_rng(self.node)
        ws[f"x{self.node}"] = rng.normal(size=(20_000, 64)).astype(np.float32)
        ws[f"y{self.node}"] = ws[f"x{self.node}"] @ np.linspace(-1, 1, 64, dtype=np.float32)
        ws[f"w{self.node}"] = np.zeros(64, np.float32)
        ws[f"loss{self.node}"] = float("nan")  # global, so the epoch task's update persists


class TrainShard:
    def __init__(self, node: int) -> None:
        self.node = node

    def __call__(self, ws) -> None:
        x, y, w = ws[f"x{self.node}"], ws[f"y{self.node}"], ws[f"w{self.node}"]
        for _ in range(20):
            w -= 0.1 * (x.T @ (x @ w - y)) / len(x)
        ws[f"loss{self.node}"] = float(np.mean((x @ w - y) ** 2))


def main(directory: str) -> None:
    with Cluster():
        with Job() as job:
            for i in range(NODES):
                with Node(f"node_{i}"):
                    with job.init_group:
                        Task(step=InitShard(i))
                    Task(step=TrainShard(i))
            with Node("node_0"):
                epoch_limiter(job, 10)
        session = RaySession(init_kwargs={"include_dashboard": False})
        manager = MultiNodeCheckpointManager(directory, metadata_handler=DirectoryMetadataHandler(keep_last=3))
        try:
            last = JobRunner(job, manager, progress=True).train(session)
        except Preempted as ex:  # the epoch is committed: exit non-zero so it is rerun
            session.close()
            print(ex, flush=True)
            raise SystemExit(ex.exit_code) from None
        losses = [session.fetch_blob(f"node_{i}", f"loss{i}") for i in range(NODES)]
        print(f"finished at epoch {last}; per-node losses: {', '.join(f'{v:.2e}' for v in losses)}")
        session.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ray_checkpoints")
