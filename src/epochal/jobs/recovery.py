"""Lost nodes inside one ``train()``: wait for the session to place the node again, reload
every node from the last committed epoch, carry on (``JobRunner(..., max_failures=N)``).

A node is lost when its process or machine dies (``NodeLostError`` from the session). Its
workspace is gone with it, and the other nodes are somewhere in the middle of an epoch, so
the only consistent state is the last committed checkpoint: every node reloads it, and the
epochs after it run again. That is what Ray Train's ``FailureConfig(max_failures)`` does,
without restarting the driver. With the default ``max_failures=0`` a lost node raises at once,
naming the node and the last committed epoch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, NodeLostError

logger = logging.getLogger("epochal")


@dataclass
class RecoveryPolicy:
    """How many lost nodes one ``train()`` survives, and how long it waits for each to be
    placed again (seconds)."""

    max_failures: int = 0
    timeout: float = 300.0
    failures: list[str] = field(default_factory=list)  # the nodes lost so far, in order

    def __post_init__(self) -> None:
        if isinstance(self.max_failures, bool) or int(self.max_failures) != self.max_failures or self.max_failures < 0:
            raise ValueError(f"max_failures must be a non-negative integer, got {self.max_failures!r}")
        if not self.timeout > 0:
            raise ValueError(f"recovery_timeout must be positive, got {self.timeout!r}")

    def give_up(self, ex: NodeLostError, committed: int | None) -> NodeLostError:
        """The error to raise when no (further) recovery is allowed: the session's, with the
        last committed epoch."""
        tried = f" (after {len(self.failures)} recovered failure(s))" if self.failures else ""
        if committed is None:
            return NodeLostError(ex.node, f"{ex.reason}{tried}; no epoch is committed", nodes=ex.nodes)
        return NodeLostError(ex.node, f"{ex.reason}{tried}", nodes=ex.nodes, epoch=committed)

    def recover(self, session: Any, manager: Any, ex: NodeLostError, committed: int | None,
                reload: Callable[[Any, int], None]) -> None:
        """Place every lost node again (bounded by ``timeout`` each), then reload every node
        from ``committed`` with ``reload(session, committed)``. A node lost during that
        reload is one more failure, recovered the same way while the budget lasts. Raises the
        final NodeLostError (naming the node and ``committed``) when out of retries or when
        a node cannot be placed in time."""
        if manager is None:
            raise CheckpointError(f"node {ex.node!r} was lost and the job has no checkpoint manager to reload from")
        while True:
            if len(self.failures) >= self.max_failures or committed is None:
                raise self.give_up(ex, committed) from ex
            self.failures.extend(ex.nodes)
            start = time.monotonic()
            for node in ex.nodes:
                logger.warning(
                    "Node %r was lost (failure %d of at most %d): waiting up to %.0f s for the session "
                    "to place it again, then every node reloads epoch %d", node, len(self.failures),
                    self.max_failures, self.timeout, committed,
                )
                try:
                    session.replace_node(node, timeout=self.timeout)
                except NodeLostError as again:
                    raise self.give_up(again, committed) from ex
                except NotImplementedError as why:
                    raise self.give_up(NodeLostError(ex.node, f"{ex.reason}; {why}", nodes=ex.nodes),
                                       committed) from ex
            try:
                reload(session, committed)
            except NodeLostError as again:  # lost (again) while reloading: one more failure
                logger.warning("Node %r was lost while every node reloaded epoch %d: %s", again.node,
                               committed, again.reason)
                ex = again
                continue
            logger.warning("Recovered from the loss of %s in %.1f s: every node reloaded epoch %d",
                           ", ".join(map(repr, ex.nodes)), time.monotonic() - start, committed)
            return
