"""Execution model: workspaces, nodes, tasks, task groups and their outputs."""

from .context import DefaultManaged, Managed
from .task import Cluster, Node, Task, TaskGroup, TaskOutput, WorkspaceType, final_output
from .workspace import Workspace

__all__ = [
    "Cluster", "DefaultManaged", "Managed", "Node", "Task", "TaskGroup", "TaskOutput",
    "Workspace", "WorkspaceType", "final_output",
]
