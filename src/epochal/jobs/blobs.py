"""The runner's blobs outside the checkpoint: the job's task outputs (recomputed values, never
state), the metrics it records at each save, blobs a resume adds and global blobs a save
leaves out (both warned about)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..checkpoint.tasks.handles import CheckpointManagerLike, CheckpointRun
from ..execution.task import Task, TaskGroup, TaskOutput
from .job import Job

logger = logging.getLogger("epochal")

__all__ = ["metric_output", "metric_values", "output_names", "warn_added_blobs", "warn_untracked"]


def metric_output(job: Job, name: str, output: Any) -> TaskOutput:
    """A metric's TaskOutput; a blob name becomes an output of the epoch group (as a stop
    condition's does)."""
    if isinstance(output, TaskOutput):
        return output
    if isinstance(output, str) and isinstance(job.epoch_group, TaskGroup):
        nodes = job.epoch_group.used_nodes()
        return Task(outputs=[output], group=job.epoch_group, node=nodes[0] if nodes else None).outputs()[0]
    raise TypeError(f"metric {name!r}: give a TaskOutput or a blob name, not {output!r}")


def metric_values(metrics: Mapping[str, TaskOutput]) -> dict[str, Any] | None:
    """The ``metrics`` outputs now (fetched from their nodes; one whose task has not run
    yet, as before the first epoch, is left out)."""
    out = {}
    for name, output in metrics.items():
        try:
            value = output.fetch()
        except RuntimeError:
            continue
        if value is not None:
            out[name] = value.item() if hasattr(value, "item") else value
    return out or None


def output_names(job: Job) -> list[str]:
    """Blob names of every task output of ``job`` (recomputed values, not state)."""
    names: set[str] = set()
    for group in (job.init_group, job.epoch_group, job.download_group, job.exit_group):
        tasks = group.tasks() if hasattr(group, "tasks") and callable(group.tasks) else []
        for task in tasks:
            names.update(getattr(task, "output_names", lambda: [])())
    for out in job.stop_conditions:
        names.update(out.names)
    return sorted(names)


def warn_added_blobs(manager: CheckpointManagerLike, epoch: int) -> None:
    """Warn about each node's blobs that the checkpoint of ``epoch`` lacks (added at resume)."""
    for node, names in manager.added_blobs().items():
        if names:
            logger.warning(
                "Node %r holds blobs that the checkpoint of epoch %d lacks: %s. They keep "
                "their current values and are saved from now on", node, epoch, ", ".join(names),
            )


def warn_untracked(task: CheckpointRun, outputs: set[str], warned: set[tuple[str, str]]) -> None:
    """Warn once per run (``warned``: the (node, blob) said already) about each global blob a
    save left out (not in the blob list), unless it is one of the job's ``outputs``."""
    for node, names in task.untracked().items():
        new = [n for n in names if n not in outputs and (node, n) not in warned]
        if new:
            warned.update((node, n) for n in new)
            logger.warning(
                "Node %r has blobs in its global workspace that are not checkpointed: %s "
                "(the blob list was fixed after init; put state there in init_group, or "
                "before train() when resuming)", node, ", ".join(new),
            )
