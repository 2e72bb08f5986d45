"""The seed test suite's pipeline, in epochal terms.

Each node holds a 10-record data set (0..9), a read cursor and an accumulator ``total``
(starting at 100) in its global workspace; each epoch reads at most 3 records and adds them
to ``total``; the stop condition is the reader finding the data exhausted. Totals after each
epoch: 103, 115, 136, 145 (4 epochs).
"""

from __future__ import annotations

import numpy as np

from epochal import Job, Node, Task

EXPECTED_TOTALS = [103, 115, 136, 145]


class InitData:
    def __init__(self, node: str) -> None:
        self.node = node

    def __call__(self, ws) -> None:
        ws[f"{self.node}/data"] = np.arange(10, dtype=np.int64)
        ws[f"{self.node}/cursor"] = np.array(0, dtype=np.int64)
        ws[f"{self.node}/total"] = np.array([100], dtype=np.int64)


class ReadWithLimit:
    """Read up to ``num_iter`` records; ``finished`` when a read found no more data."""

    def __init__(self, node: str, num_iter: int = 3) -> None:
        self.node, self.num_iter = node, num_iter

    def __call__(self, ws) -> None:
        data, cur = ws[f"{self.node}/data"], int(ws[f"{self.node}/cursor"])
        ws["scratch/limit_counter"] = np.array(self.num_iter)  # private scratch: vanishes
        finished = False
        for _ in range(self.num_iter):
            if cur >= len(data):
                finished = True
                break
            ws[f"{self.node}/total"] = ws[f"{self.node}/total"] + data[cur]
            cur += 1
        ws[f"{self.node}/cursor"] = np.array(cur, dtype=np.int64)
        ws[f"{self.node}/finished"] = np.bool_(finished)


def build_pipeline(node_id: int) -> list[str]:
    """Add node ``trainer_<id>``'s init and epoch tasks to the current Job; return its outputs."""
    name = f"trainer_{node_id}"
    job = Job.current()
    with Node(name):
        with job.init_group:
            Task(step=InitData(name), name="init")
        task = Task(step=ReadWithLimit(name), outputs=[f"{name}/finished"], name="reader")
        job.add_stop_condition(task.outputs()[0])
    return [f"{name}/total"]
