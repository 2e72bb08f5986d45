"""RaySession: a session spanning several processes or machines, one Ray actor per node.

Each node's workspace lives in its own actor; ``run`` sends every node its tasks (name,
workspace type, steps, outputs) and runs the nodes concurrently, so each node's save and load
happen in that node's process, next to its memory and disk. Outputs are fetched from the actor
that holds them. Steps travel with Ray's serializer, so they must be picklable callables
(epochal's checkpoint steps are); checkpoint *data* never does: each node reads and writes its
own db files with the pickle-free backends.

Requires the ``ray`` extra. Checkpoint directories must be visible to the driver when a
``DirectoryMetadataHandler`` commits epochs (a shared or network filesystem across machines).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..execution.task import Task, WorkspaceType
from ..execution.workspace import Workspace
from .base import CompiledRunnable, Session
from .local import run_steps

try:
    import ray
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("RaySession needs Ray: pip install 'epochal[ray]'") from e


class NodeWorker:
    """The process of one node: its workspace and the runner of its tasks."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.ws = Workspace()

    def run(self, payload: Sequence[tuple[str, str, list[Any], list[str]]]) -> None:
        for _name, _wt, _steps, outputs in payload:
            for out in outputs:
                if out not in self.ws:
                    self.ws[out] = None
        for _name, wt, steps, _outputs in payload:
            run_steps(steps, wt, self.ws)

    def fetch(self, name: str) -> Any:
        return self.ws[name]

    def feed(self, name: str, value: Any) -> None:
        self.ws[name] = value

    def blobs(self) -> list[str]:
        return self.ws.blobs

    def info(self) -> dict[str, Any]:
        import os
        import socket

        return {"node": self.node, "pid": os.getpid(), "host": socket.gethostname()}


def _payload(tasks: Sequence[Task]) -> list[tuple[str, str, list[Any], list[str]]]:
    return [
        (t.name, (t.workspace_type or WorkspaceType.PRIVATE).value, t.steps(), t.output_names())
        for t in tasks
    ]


class RaySession(Session):
    """Runs each node's tasks in that node's Ray actor (created on first use).

    ``address`` is passed to ``ray.init`` when Ray is not initialized yet (None: start or join
    a local cluster); ``actor_options`` go to every actor (e.g. ``{"num_cpus": 1}``, or
    ``resources`` to pin a node to a machine); ``node_options`` per node name override them.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        actor_options: dict[str, Any] | None = None,
        node_options: dict[str, dict[str, Any]] | None = None,
        init_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not ray.is_initialized():
            ray.init(address=address, **(init_kwargs or {}))
        self._actor_cls = ray.remote(NodeWorker)
        self._actor_options = {"num_cpus": 0, **(actor_options or {})}
        self._node_options = node_options or {}
        self._actors: dict[str, Any] = {}

    def actor(self, node: str) -> Any:
        """The actor of ``node`` (created on first use)."""
        node = str(node)
        if node not in self._actors:
            opts = {**self._actor_options, **self._node_options.get(node, {})}
            self._actors[node] = self._actor_cls.options(**opts).remote(node)
        return self._actors[node]

    def node_names(self) -> list[str]:
        return list(self._actors)

    @staticmethod
    def _get(refs: Any) -> Any:
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, BaseException):
                raise cause from None
            raise

    def _run_compiled(self, compiled: CompiledRunnable) -> None:
        for node, tasks in compiled.by_node.items():
            for task in tasks:
                for out in task.outputs():
                    out.set(self, node)
        refs = [self.actor(node).run.remote(_payload(tasks)) for node, tasks in compiled.by_node.items()]
        self._get(refs)

    def fetch_blob(self, node: str, name: str) -> Any:
        return self._get(self.actor(node).fetch.remote(name))

    def feed_blob(self, node: str, name: str, value: Any) -> None:
        """Put ``value`` in ``node``'s workspace (e.g. a model, before ``JobRunner.train``)."""
        self._get(self.actor(node).feed.remote(name, value))

    def blobs(self, node: str) -> list[str]:
        return self._get(self.actor(node).blobs.remote())  # type: ignore[no-any-return]

    def node_info(self, node: str) -> dict[str, Any]:
        """``{"node", "pid", "host"}`` of the process that holds ``node``'s workspace."""
        return self._get(self.actor(node).info.remote())  # type: ignore[no-any-return]

    def close(self) -> None:
        for actor in self._actors.values():
            ray.kill(actor)
        self._actors = {}
        super().close()
