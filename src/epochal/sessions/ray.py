"""RaySession: a session spanning several processes or machines, one Ray actor per node.

Each node's workspace lives in its own actor; ``run`` sends every node its tasks (name,
workspace type, steps, outputs) and runs the nodes concurrently, so each node's save and load
happen in that node's process, next to its memory and disk. Outputs are fetched from the actor
that holds them. Steps travel with Ray's serializer, so they must be picklable callables
(epochal's checkpoint steps are); checkpoint *data* never does: each node reads and writes its
own db files with the pickle-free backends.

Placement: with ``place_by_resource=True`` the actor of node ``n`` asks for one unit of the
custom resource ``node_resource(n)`` (``"epochal_node:<n>"``), so it runs on the machine started
with ``ray start --resources='{"epochal_node:<n>": 1}'``, and only there.

A lost node (its actor's process or its machine died) is reported as ``NodeLostError`` naming
it, by every call that needed it; ``replace_node`` waits until the cluster can host the node again
and creates a fresh actor for it, with an empty workspace (to be reloaded from a checkpoint).

Requires the ``ray`` extra. Checkpoint directories must be visible to the driver when a
``DirectoryMetadataHandler`` commits epochs (a shared or network filesystem across machines).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..errors import NodeLostError
from ..execution.task import Task, WorkspaceType
from ..execution.workspace import Workspace
from .base import CompiledRunnable, Session
from .local import run_steps

try:
    import ray
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("RaySession needs Ray: pip install 'epochal[ray]'") from e

NODE_RESOURCE_PREFIX = "epochal_node:"

# What Ray raises when an actor (its process, or its machine) is gone, or an object that lived
# only on a dead machine is asked for.
_LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)


def node_resource(node: str) -> str:
    """The custom resource a machine offers to host ``node`` (``place_by_resource=True``)."""
    return f"{NODE_RESOURCE_PREFIX}{node}"


def _why(err: BaseException) -> str:
    """The first line of what Ray says about a loss (its messages run to many lines)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


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

        return {"node": self.node, "pid": os.getpid(), "host": socket.gethostname(),
                "ray_node_id": ray.get_runtime_context().get_node_id()}


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
    ``place_by_resource``: every node's actor also asks for one unit of ``node_resource(node)``.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        actor_options: dict[str, Any] | None = None,
        node_options: dict[str, dict[str, Any]] | None = None,
        init_kwargs: dict[str, Any] | None = None,
        place_by_resource: bool = False,
    ) -> None:
        super().__init__()
        if not ray.is_initialized():
            ray.init(address=address, **(init_kwargs or {}))
        self._actor_cls = ray.remote(NodeWorker)
        self._actor_options = {"num_cpus": 0, **(actor_options or {})}
        self._node_options = node_options or {}
        self._place_by_resource = place_by_resource
        self._actors: dict[str, Any] = {}

    def options(self, node: str) -> dict[str, Any]:
        """The Ray options ``node``'s actor is created with."""
        opts = {**self._actor_options, **self._node_options.get(node, {})}
        if self._place_by_resource:
            opts["resources"] = {**opts.get("resources", {}), node_resource(node): 1}
        return opts

    def actor(self, node: str) -> Any:
        """The actor of ``node`` (created on first use)."""
        node = str(node)
        if node not in self._actors:
            self._actors[node] = self._actor_cls.options(**self.options(node)).remote(node)
        return self._actors[node]

    def node_names(self) -> list[str]:
        return list(self._actors)

    @staticmethod
    def _get_all(refs: dict[str, Any]) -> dict[str, Any]:
        """Wait for every node's ref; the values by node. A lost node (first) wins over a
        step's error, which is raised as itself (not Ray's wrapper)."""
        values: dict[str, Any] = {}
        lost: dict[str, BaseException] = {}
        failed: BaseException | None = None
        for node, ref in refs.items():
            try:
                values[node] = ray.get(ref)
            except _LOST as e:
                lost[node] = e
            except ray.exceptions.RayTaskError as e:
                failed = failed or e
        if lost:
            node, err = next(iter(lost.items()))
            raise NodeLostError(node, f"its Ray actor is gone ({_why(err)})", nodes=list(lost)) from err
        if failed is not None:
            cause = getattr(failed, "cause", None)
            if isinstance(cause, BaseException):
                raise cause from None
            raise failed
        return values

    def _get(self, node: str, ref: Any) -> Any:
        return self._get_all({node: ref})[node]

    def _run_compiled(self, compiled: CompiledRunnable) -> None:
        for node, tasks in compiled.by_node.items():
            for task in tasks:
                for out in task.outputs():
                    out.set(self, node)
        self._get_all({node: self.actor(node).run.remote(_payload(tasks))
                       for node, tasks in compiled.by_node.items()})

    def fetch_blob(self, node: str, name: str) -> Any:
        return self._get(node, self.actor(node).fetch.remote(name))

    def feed_blob(self, node: str, name: str, value: Any) -> None:
        """Put ``value`` in ``node``'s workspace (e.g. a model, before ``JobRunner.train``)."""
        self._get(node, self.actor(node).feed.remote(name, value))

    def blobs(self, node: str) -> list[str]:
        return self._get(node, self.actor(node).blobs.remote())  # type: ignore[no-any-return]

    def node_info(self, node: str) -> dict[str, Any]:
        """``{"node", "pid", "host", "ray_node_id"}`` of the process that holds ``node``'s
        workspace."""
        return self._get(node, self.actor(node).info.remote())  # type: ignore[no-any-return]

    # -- lost nodes
    def lost_nodes(self, timeout: float = 30.0) -> list[str]:
        """The nodes whose actor is known to be gone (each is pinged; a node busy for longer
        than ``timeout`` seconds counts as alive)."""
        refs = {node: actor.info.remote() for node, actor in self._actors.items()}
        deadline = time.monotonic() + timeout
        lost = []
        for node, ref in refs.items():
            try:
                ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
            except _LOST:
                lost.append(node)
            except ray.exceptions.GetTimeoutError:
                pass
        return lost

    def _offered(self, opts: dict[str, Any]) -> bool:
        """Whether some alive machine has, in total, the resources ``opts`` ask for (one still
        held by an old actor is waited for by the actor's creation)."""
        need = {**opts.get("resources", {})}
        for key, name in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
            if opts.get(key):
                need[name] = opts[key]
        if not need:
            return True
        for info in ray.nodes():
            have = info.get("Resources", {}) if info.get("Alive") else {}
            if all(have.get(k, 0) >= v for k, v in need.items()):
                return True
        return False

    def replace_node(self, node: str, *, timeout: float = 300.0, poll: float = 0.2) -> dict[str, Any]:
        """Give ``node`` a fresh actor: wait (at most ``timeout`` seconds) until an alive
        machine offers what its actor needs (with ``place_by_resource``, the node's resource:
        a replacement machine started with it), create the actor there and wait until it
        answers; return its ``node_info``. The new workspace is empty: the runner reloads it
        from the last committed epoch. The old actor, if still reachable, is killed first.

        Raises NodeLostError naming the node when no machine can host it within ``timeout``."""
        node = str(node)
        old = self._actors.pop(node, None)
        if old is not None:
            ray.kill(old, no_restart=True)
        opts = self.options(node)
        deadline = time.monotonic() + timeout
        while True:
            while not self._offered(opts):
                if time.monotonic() >= deadline:
                    raise NodeLostError(node, f"no machine of the cluster offers {opts.get('resources', {})} "
                                        f"for its actor (waited {timeout:g} s)")
                time.sleep(poll)
            actor = self.actor(node)
            try:
                return ray.get(actor.info.remote(), timeout=max(deadline - time.monotonic(), poll))  # type: ignore[no-any-return]
            except (ray.exceptions.GetTimeoutError, *_LOST) as e:
                self._actors.pop(node, None)
                ray.kill(actor, no_restart=True)
                if isinstance(e, ray.exceptions.GetTimeoutError) or time.monotonic() >= deadline:
                    raise NodeLostError(node, f"its new actor did not start within {timeout:g} s ({_why(e)})") from e
                # placed on the lost machine before the cluster found it dead: try again
                time.sleep(poll)

    def close(self) -> None:
        for actor in self._actors.values():
            ray.kill(actor)
        self._actors = {}
        super().close()
