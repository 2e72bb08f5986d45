"""The session interface: what runs task groups, and where their outputs are read back.

A session maps every node to a workspace (one shared workspace for LocalSession; one per
node's process for a multi-machine session) and runs each node's tasks there. Outputs are
bound to the session that ran them and fetched through it (``fetch_blob(node, name)``), so
the runner and managers never touch a workspace directly.
"""

from __future__ import annotations

import abc
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

from ..execution.task import Task, TaskGroup, WorkspaceType


class CompiledRunnable:
    """A TaskGroup made ready for one session class: its tasks grouped per node."""

    def __init__(self, group: TaskGroup, session_class: type[Session]) -> None:
        self.group = group
        self.session_class = session_class
        self.workspace_type = group.workspace_type()
        self.by_node: dict[str, list[Task]] = group.tasks_by_node()

    def used_nodes(self) -> list[str]:
        return list(self.by_node)

    def tasks(self) -> list[Task]:
        return [t for ts in self.by_node.values() for t in ts]

    def __repr__(self) -> str:
        return f"CompiledRunnable({self.group!r})"


Runnable = Any  # TaskGroup | Task | CompiledRunnable | list of them


class Session(abc.ABC):
    """Runs task groups synchronously; errors in steps propagate to the caller."""

    # per session class: runnable -> compiled form (weak, so built groups can be freed)
    _compiled_cache: ClassVar[weakref.WeakKeyDictionary[Any, CompiledRunnable]]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls._compiled_cache = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self._open = True

    @classmethod
    def compile(cls, runnable: Runnable, workspace_type: WorkspaceType | str | None = None) -> CompiledRunnable:
        """Compile (and cache, per runnable object and session class) a TaskGroup or Task.

        A bare Task becomes a group of its own, GLOBAL unless ``workspace_type`` says otherwise.
        """
        if isinstance(runnable, CompiledRunnable):
            if not issubclass(cls, runnable.session_class) and not issubclass(runnable.session_class, cls):
                raise TypeError(
                    f"{runnable!r} was compiled for {runnable.session_class.__name__}, not {cls.__name__}"
                )
            return runnable
        cached = cls._compiled_cache.get(runnable)
        if cached is not None:
            return cached
        if isinstance(runnable, TaskGroup):
            group = runnable
            if workspace_type is not None:
                group.set_workspace_type(workspace_type)
        elif isinstance(runnable, Task):
            group = TaskGroup(workspace_type or WorkspaceType.GLOBAL)
            group.add(runnable)
        else:
            raise TypeError(f"cannot run {runnable!r}: expected a TaskGroup, Task or list of them")
        compiled = CompiledRunnable(group, cls)
        cls._compiled_cache[runnable] = compiled
        return compiled

    def run(self, runnable: Runnable, workspace_type: WorkspaceType | str | None = None) -> None:
        """Run a TaskGroup, a Task (as a GLOBAL group) or a list of them, in order."""
        if not self._open:
            raise RuntimeError("session is closed")
        if runnable is None:
            raise ValueError("nothing to run")
        if isinstance(runnable, (list, tuple)):
            for r in runnable:
                self.run(r, workspace_type)
            return
        self._run_compiled(self.compile(runnable, workspace_type))

    @abc.abstractmethod
    def _run_compiled(self, compiled: CompiledRunnable) -> None:
        """Create missing outputs, bind them to this session, run every node's tasks."""

    @abc.abstractmethod
    def fetch_blob(self, node: str, name: str) -> Any:
        """The current value of blob ``name`` in ``node``'s workspace."""

    def node_names(self) -> Sequence[str]:
        return []

    def replace_node(self, node: str, *, timeout: float = 300.0) -> dict[str, Any]:
        """Place a lost ``node`` again (a fresh, empty workspace), waiting at most ``timeout``
        seconds; NodeLostError naming it when it cannot be. Sessions whose nodes cannot be
        lost (or re-placed) keep this default, which says so."""
        raise NotImplementedError(f"{type(self).__name__} cannot place a lost node again")

    def close(self) -> None:
        self._open = False

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
