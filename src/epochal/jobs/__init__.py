"""Jobs and the runner that drives them."""

from .events import CheckpointEvent, RunListener
from .job import Job, epoch_limiter
from .runner import JobRunner

__all__ = ["CheckpointEvent", "Job", "JobRunner", "RunListener", "epoch_limiter"]
