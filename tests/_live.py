"""Live training objects in tests: every tensor they hold, compared bit for bit, and a Session
that gives each node a workspace of its own. It imports no epochal integration, so a fresh
process that uses it loads as a user's does (the integrations' checks found on their own)."""

from __future__ import annotations

from typing import Any

import torch

from epochal.errors import NodeLostError
from epochal.execution.workspace import Workspace
from epochal.sessions.base import Session
from epochal.sessions.local import run_task


def tensors(*objs: Any) -> list[torch.Tensor]:
    """Every tensor of every object (a tensor, a dict, or an object's ``state_dict()``),
    cloned, in a fixed order."""
    out: list[torch.Tensor] = []
    for o in objs:
        stack: list[Any] = [o if isinstance(o, (torch.Tensor, dict)) else o.state_dict()]
        while stack:
            v = stack.pop()
            if isinstance(v, dict):
                stack.extend(v[k] for k in sorted(v, key=str))
            elif isinstance(v, (list, tuple)):
                stack.extend(v)
            elif isinstance(v, torch.Tensor):
                out.append(v.detach().clone())
    return out


def bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """The same tensors: dtype, shape and every byte."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape
        and x.reshape(-1).contiguous().view(torch.uint8).equal(y.reshape(-1).contiguous().view(torch.uint8))
        for x, y in zip(a, b))


class PerNode(Session):
    """Each node its own workspace (as on machines of their own); ``lose``: (node, group
    kind) pairs at which that node is lost once (``epoch_kind`` tells an epoch task);
    ``replacement``: what a node placed again holds (its setup code's fresh live objects)."""

    def __init__(self, wss: dict[str, Workspace], replacement: Any = None, epoch_kind: Any = None) -> None:
        super().__init__()
        self.wss = wss
        self.lose: set[tuple[str, str]] = set()
        self.replacement = replacement
        self.epoch_kind = epoch_kind

    def _run_compiled(self, compiled: Any) -> None:
        tasks = compiled.tasks()
        for task in tasks:
            ws = self.wss[task.node]
            for name in task.output_names():
                if name not in ws:
                    ws[name] = None
            for out in task.outputs():
                out.set(self, task.node)
        for task in tasks:
            epoch = self.epoch_kind is not None and any(isinstance(s, self.epoch_kind) for s in task.steps())
            kind = "epoch" if epoch else task.name.split("/")[-1]
            if (task.node, kind) in self.lose:
                self.lose.discard((task.node, kind))
                self.wss[task.node] = Workspace()
                raise NodeLostError(task.node, "its process died (test)")
            run_task(task, self.wss[task.node])

    def fetch_blob(self, node: str, name: str) -> Any:
        return self.wss[node][name]

    def replace_node(self, node: str, *, timeout: float = 300.0) -> dict[str, Any]:
        self.wss[node] = self.replacement(node) if self.replacement else Workspace()
        return {}
