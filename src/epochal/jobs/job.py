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
        #: the smallest ``num_epochs`` of the job's epoch_limiters (None without one): the
        #: limit in force is the one the code gives now, also when the job resumes
        self.epoch_limit: int | None = None

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
    """Step: create the limiter's counter: epochs run so far, as a 1-element int64 array."""

    def __init__(self, name: str, init_count: int) -> None:
        self.name, self.init_count = name, init_count

    def __call__(self, ws: Any) -> None:
        ws[self.name] = np.array([0], dtype=np.int64)


class _CountDown:
    """Step: count one more epoch; the output is True once ``limit`` epochs have run.

    The counter counts epochs run (a 1-element array), so the limit is the one in the code
    now, whatever it was when the checkpoint was saved. A counter from an older epochal (a
    0-d count down from ``limit - 1``) is read as if the limit had not changed.
    """

    def __init__(self, counter: str, output: str, limit: int | None = None) -> None:
        self.counter, self.output = counter, output
        self.limit = limit

    def __call__(self, ws: Any) -> None:
        saved = np.asarray(ws[self.counter])
        limit = self.limit if self.limit is not None else 0
        done = int(saved.reshape(-1)[0]) if saved.ndim == 1 else limit - 1 - int(saved)
        done += 1
        ws[self.counter] = np.array([done], dtype=np.int64)
        ws[self.output] = np.bool_(done >= limit)


def epoch_limiter(job: Job, num_epochs: int) -> TaskOutput:
    """Stop ``job`` once its absolute epoch reaches ``num_epochs``.

    The number of epochs run is checkpointed, the limit is not: a job resumed with a higher
    limit trains on to it; with a limit it has already reached, it runs no further epoch
    (load, download, exit). (The seed checkpointed a countdown, so the first limit stayed.)
    """
    if num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
    # Names depend only on the job's structure, so a job rebuilt by a new process (or the
    # same one) finds its saved counter again when it resumes.
    n = job._limiters
    job._limiters += 1
    job.epoch_limit = num_epochs if job.epoch_limit is None else min(job.epoch_limit, num_epochs)
    node = Node.current()
    suffix = f":{n}" if n else ""
    counter, flag = f"epoch_limiter{suffix}/{node}/counter", f"epoch_limiter{suffix}/{node}/stop"
    with job.init_group:
        Task(step=_CreateCounter(counter, num_epochs - 1), node=node, name="epoch_limiter_init")
    with job.epoch_group:
        task = Task(step=_CountDown(counter, flag, num_epochs), outputs=[flag], node=node, name="epoch_limiter")
    return job.add_stop_condition(task.outputs()[0])
