"""Job: the four task groups of a training job and its stop conditions; epoch_limiter."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..execution.context import Managed
from ..execution.task import Node, Task, TaskGroup, TaskOutput, WorkspaceType


class Job(Managed):
    """init / epoch / download / exit task groups plus stop conditions.

    Inside ``with job:`` new tasks go to the epoch group. ``init_group`` defaults to GLOBAL,
    the others to an untyped group (so their tasks are PRIVATE).
    """

    def __init__(
        self,
        init_group: Any = None,
        epoch_group: Any = None,
        download_group: Any = None,
        exit_group: Any = None,
        stop_conditions: list[TaskOutput] | None = None,
        nodes_to_checkpoint: list[str] | None = None,
    ) -> None:
        self.init_group = init_group or TaskGroup(workspace_type=WorkspaceType.GLOBAL)
        self.epoch_group = epoch_group or TaskGroup()
        self.download_group = download_group or TaskGroup()
        self.exit_group = exit_group or TaskGroup()
        self.stop_conditions: list[TaskOutput] = list(stop_conditions or [])
        self._nodes_to_checkpoint = nodes_to_checkpoint
        self._limiters = 0  # epoch_limiters added so far (they name their counters by it)

    def nodes_to_checkpoint(self) -> list[str]:
        """The given node list, else the nodes of the init group's tasks, in order."""
        if self._nodes_to_checkpoint:
            return [str(n) for n in self._nodes_to_checkpoint]
        return list(self.init_group.used_nodes())

    def compile(self, session_class: Any) -> None:
        """Compile the four groups in place for ``session_class`` (optional: runs compile lazily)."""
        self._nodes_to_checkpoint = self.nodes_to_checkpoint()
        self.init_group = session_class.compile(self.init_group)
        self.epoch_group = session_class.compile(self.epoch_group)
        self.download_group = session_class.compile(self.download_group)
        self.exit_group = session_class.compile(self.exit_group)

    def add_stop_condition(self, output: TaskOutput | str) -> TaskOutput:
        """Stop after the epoch in which ``output`` (a TaskOutput or a blob name) is truthy."""
        if isinstance(output, str):
            if not isinstance(self.epoch_group, TaskGroup):
                raise RuntimeError("cannot add a stop condition to a compiled job")
            output = Task(outputs=[output], group=self.epoch_group).outputs()[0]
        if not isinstance(output, TaskOutput):
            raise TypeError(f"a stop condition is a TaskOutput or a blob name, not {output!r}")
        self.stop_conditions.append(output)
        return output

    # historical name
    add_stop_signal = add_stop_condition

    @property
    def stop_signals(self) -> list[TaskOutput]:
        return self.stop_conditions

    def __enter__(self) -> Job:
        super().__enter__()
        self.epoch_group.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.epoch_group.__exit__(*exc)
        super().__exit__(*exc)


class _CreateCounter:
    """Step: create an int64 counter blob (checkpointed as its current count)."""

    def __init__(self, name: str, init_count: int) -> None:
        self.name, self.init_count = name, init_count

    def __call__(self, ws: Any) -> None:
        ws[self.name] = np.array(self.init_count, dtype=np.int64)


class _CountDown:
    """Step: decrement the counter; the output is True when the count before was <= 0."""

    def __init__(self, counter: str, output: str) -> None:
        self.counter, self.output = counter, output

    def __call__(self, ws: Any) -> None:
        before = int(ws[self.counter])
        ws[self.counter] = np.array(before - 1, dtype=np.int64)
        ws[self.output] = np.bool_(before <= 0)


def epoch_limiter(job: Job, num_epochs: int) -> TaskOutput:
    """Stop ``job`` after ``num_epochs`` epochs in all (the count is checkpointed, so a resumed
    run does not restart it)."""
    if num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
    # Names depend only on the job's structure, so a job rebuilt by a new process (or the
    # same one) finds its saved counter again when it resumes.
    n = job._limiters
    job._limiters += 1
    node = Node.current()
    suffix = f":{n}" if n else ""
    counter, flag = f"epoch_limiter{suffix}/{node}/counter", f"epoch_limiter{suffix}/{node}/stop"
    with job.init_group:
        Task(step=_CreateCounter(counter, num_epochs - 1), node=node, name="epoch_limiter_init")
    with job.epoch_group:
        task = Task(step=_CountDown(counter, flag), outputs=[flag], node=node, name="epoch_limiter")
    return job.add_stop_condition(task.outputs()[0])
