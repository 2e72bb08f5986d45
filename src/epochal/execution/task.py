"""The task model: Cluster, Node, WorkspaceType, Task, TaskGroup, TaskOutput, final_output.

A Task is a list of steps (``step(ws)`` callables) that runs on one node, in the node's
workspace (GLOBAL) or in a fresh child of it (PRIVATE). Steps should be picklable objects or
module-level functions so that a multi-machine session can ship them to the node's process.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol, Union

from .context import DefaultManaged, Managed


class Session(Protocol):
    """What a task output needs of the session that ran its task (the full interface is
    :class:`epochal.sessions.base.Session`, a layer above: this one does not import it)."""

    def fetch_blob(self, node: str, name: str) -> Any: ...

Step = Callable[[Any], Any]


class WorkspaceType(str, enum.Enum):
    """Where a task's steps run: the node's workspace itself, or a throwaway child of it."""

    PRIVATE = "private"
    GLOBAL = "global"

    def __str__(self) -> str:
        return self.value


class Cluster(DefaultManaged):
    """Records, in order, the names of the nodes created while it is active."""

    def __init__(self) -> None:
        self._nodes: list[str] = []
        self._node_kwargs: dict[str, dict[str, Any]] = {}

    def add_node(self, node: Node) -> None:
        if str(node) not in self._nodes:
            self._nodes.append(str(node))
        self._node_kwargs.setdefault(str(node), {}).update(node.kwargs)

    def nodes(self) -> list[str]:
        return list(self._nodes)

    def node_kwargs(self) -> dict[str, dict[str, Any]]:
        return {k: dict(v) for k, v in self._node_kwargs.items()}


class Node(DefaultManaged):
    """A named machine (or process); tasks created inside ``with Node(name):`` run on it.

    Nodes are the unit of checkpointing: one db per node per epoch.
    """

    def __init__(self, node: Any = "local", **kwargs: Any) -> None:
        self._name = str(node)
        self.kwargs = kwargs
        Cluster.current().add_node(self)

    def __str__(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"Node({self._name!r})"


class TaskOutput:
    """A value a task returns: one blob name (scalar) or a list of them.

    ``fetch()`` reads the current value through the session that last ran the task.
    """

    def __init__(self, names: str | Sequence[str], task: Task | None = None) -> None:
        self.is_scalar = isinstance(names, str)
        self.names: list[str] = [names] if isinstance(names, str) else [str(n) for n in names]
        self.task = task
        self._session: Session | None = None
        self._node: str | None = None

    def set(self, session: Session, node: str) -> None:
        """Bind to the session about to run the task (called by the session)."""
        self._session, self._node = session, node

    def get(self) -> str | list[str]:
        return self.names[0] if self.is_scalar else list(self.names)

    def fetch(self) -> Any:
        if self._session is None or self._node is None:
            who = f" of task {self.task.name!r}" if self.task is not None else ""
            raise RuntimeError(f"output {self.get()!r}{who} cannot be fetched: the task never ran")
        values = [self._session.fetch_blob(self._node, n) for n in self.names]
        return values[0] if self.is_scalar else values

    def __repr__(self) -> str:
        return f"TaskOutput({self.get()!r})"


OutputSpec = Union[str, TaskOutput, Sequence[Union[str, TaskOutput]], None]  # noqa: UP007


def _step_name(step: Any) -> str | None:
    if isinstance(step, (list, tuple)):
        return _step_name(step[0]) if step else None
    return getattr(step, "name", None) or getattr(step, "__name__", None)


class Task(Managed):
    """Steps to run on one node. See the module docstring and shared/API.md."""

    def __init__(
        self,
        step: Step | Sequence[Step] | None = None,
        outputs: OutputSpec = None,
        workspace_type: WorkspaceType | str | None = None,
        group: TaskGroup | None = None,
        node: Any = None,
        name: str | None = None,
    ) -> None:
        if node is None:
            self.node = str(Node.current())
        else:
            self.node = str(node if isinstance(node, Node) else Node(node))
        self.group = group if group is not None else TaskGroup.current(required=False)
        self._steps: list[Step] = []
        if step is not None:
            self._steps = list(step) if isinstance(step, (list, tuple)) else [step]  # type: ignore[list-item]
            for s in self._steps:
                if not callable(s):
                    raise TypeError(f"task step {s!r} is not callable")
        self._outputs: list[TaskOutput] = []
        self.workspace_type = WorkspaceType(workspace_type) if workspace_type is not None else None
        self._frozen = False
        base = name or _step_name(step) or "task"
        full = f"{self.node}/{base}"
        if self.group is not None:
            taken = {str(t.name) for t in self.group._all_tasks()}
            i, candidate = 0, full
            while candidate in taken:
                i += 1
                candidate = f"{full}:{i}"
            full = candidate
        self.name: str = full
        if outputs is not None:
            self.add_outputs(outputs)
        if self.group is not None:
            self.group._pending.append(self)

    # -- building
    def _check_mutable(self) -> None:
        if self._frozen:
            raise RuntimeError("Cannot modify task since it is already been used.")

    def add_step(self, step: Step) -> None:
        """Append a step; allowed until the task's group is used."""
        self._check_mutable()
        if not callable(step):
            raise TypeError(f"task step {step!r} is not callable")
        self._steps.append(step)

    def add_output(self, output: str | TaskOutput) -> TaskOutput:
        self._check_mutable()
        out = output if isinstance(output, TaskOutput) else TaskOutput(output, self)
        if out.task is None:
            out.task = self
        self._outputs.append(out)
        return out

    def add_outputs(self, outputs: OutputSpec) -> TaskOutput | list[TaskOutput]:
        if isinstance(outputs, (str, TaskOutput)):
            return self.add_output(outputs)
        return [self.add_output(o) for o in (outputs or [])]

    def outputs(self) -> list[TaskOutput]:
        return list(self._outputs)

    def steps(self) -> list[Step]:
        return list(self._steps)

    def output_names(self) -> list[str]:
        return [n for o in self._outputs for n in o.names]

    def __enter__(self) -> Task:
        if self._frozen:
            raise RuntimeError("Cannot modify task since it is already been used.")
        if self.group is not None and self in self.group._pending:
            self.group._pending.remove(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        exc_type = exc[0] if exc else None
        super().__exit__(*exc)
        if exc_type is None and self.group is not None and self not in self.group._pending:
            # re-appended: tasks stay ordered by when they finished being defined
            self.group._pending.append(self)

    def __repr__(self) -> str:
        return f"Task({self.name!r}, {self.workspace_type}, outputs={self.output_names()})"


def final_output(output: str | TaskOutput) -> TaskOutput:
    """Add an output to the active Task (a new empty Task if none) and return it."""
    task = Task.current(required=False)
    if task is None:
        task = Task()
    return task.add_output(output)


class TaskGroup(Managed):
    """Tasks that run together, each on its node. Once ``tasks()`` is called it is *used*
    and frozen."""

    def __init__(self, workspace_type: WorkspaceType | str | None = None) -> None:
        self._workspace_type = WorkspaceType(workspace_type) if workspace_type is not None else None
        self._pending: list[Task] = []
        self._tasks: list[Task] = []
        self._used = False

    def _all_tasks(self) -> list[Task]:
        return self._tasks + self._pending

    def add(self, task: Task) -> None:
        if self._used:
            raise RuntimeError("Cannot add Task to an already used TaskGroup.")
        wt = task.workspace_type
        if wt is not None and self._workspace_type is not None and wt != self._workspace_type:
            raise ValueError(
                f"task {task.name!r} is {wt} but its group is {self._workspace_type}"
            )
        if wt is None:
            task.workspace_type = self._workspace_type or WorkspaceType.PRIVATE
        if self._workspace_type is None:
            self._workspace_type = task.workspace_type
        if task in self._pending:
            self._pending.remove(task)
        task.group = self
        self._tasks.append(task)

    def tasks(self) -> list[Task]:
        """All tasks, in order; marks the group used (no more tasks can join)."""
        for t in list(self._pending):
            self.add(t)
        self._pending = []
        self._used = True
        for t in self._tasks:
            t._frozen = True
        return list(self._tasks)

    def used_nodes(self) -> list[str]:
        seen: list[str] = []
        for t in self._all_tasks():
            if t.node not in seen:
                seen.append(t.node)
        return seen

    def workspace_type(self) -> WorkspaceType | None:
        return self._workspace_type

    def set_workspace_type(self, workspace_type: WorkspaceType | str) -> None:
        wt = WorkspaceType(workspace_type)
        if self._workspace_type is not None and self._workspace_type != wt:
            raise ValueError(f"group is {self._workspace_type}, not {wt}")
        self._workspace_type = wt

    def tasks_by_node(self) -> dict[str, list[Task]]:
        """The tasks of each node, in task order (marks the group used)."""
        out: dict[str, list[Task]] = {}
        for t in self.tasks():
            out.setdefault(t.node, []).append(t)
        return out

    def __repr__(self) -> str:
        return f"TaskGroup({self._workspace_type}, {[t.name for t in self._all_tasks()]})"
