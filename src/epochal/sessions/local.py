"""LocalSession: every node's tasks run in this process, on one shared workspace."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..execution.task import Task, WorkspaceType
from ..execution.workspace import Workspace
from .base import CompiledRunnable, Session


def run_steps(steps: Sequence[Any], workspace_type: WorkspaceType | str | None, ws: Workspace) -> None:
    """Run ``steps`` on ``ws`` (GLOBAL) or on a fresh child of it (PRIVATE, the default)."""
    target = ws if workspace_type == WorkspaceType.GLOBAL else Workspace(parent=ws)
    for step in steps:
        step(target)


def run_task(task: Task, ws: Workspace) -> None:
    """Run a task's steps where its workspace type says (see :func:`run_steps`)."""
    run_steps(task.steps(), task.workspace_type, ws)


class LocalSession(Session):
    """Runs everything here, synchronously; all nodes share ``ws`` (a new Workspace if None)."""

    def __init__(self, ws: Workspace | None = None) -> None:
        super().__init__()
        self.ws = ws if ws is not None else Workspace()

    def _run_compiled(self, compiled: CompiledRunnable) -> None:
        tasks = compiled.tasks()
        for task in tasks:
            for name in task.output_names():
                if name not in self.ws:
                    self.ws[name] = None
            for out in task.outputs():
                out.set(self, task.node)
        for task in tasks:
            run_task(task, self.ws)

    def fetch_blob(self, node: str, name: str) -> Any:
        return self.ws[name]

    def workspace(self, node: str | None = None) -> Workspace:
        """The workspace of ``node`` (the one shared workspace here)."""
        return self.ws
